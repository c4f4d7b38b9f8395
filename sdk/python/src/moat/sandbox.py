"""``moat.Sandbox``: the sync client (E2B-style)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from . import _core
from ._config import LONG_REQUEST_TIMEOUT, ConnectionConfig
from ._core import PolicyLike, SnapshotRef
from ._http import SyncApi
from .commands import Commands
from .exceptions import ConflictError, NotFoundError
from .files import Filesystem
from .models import Context, Execution, NetworkInfo, NetworkLogEntry, NetworkProposal, SandboxInfo, SnapshotInfo
from .network import NetworkLogStream
from .pty import Pty


class Sandbox:
    """A moat sandbox. Create with :meth:`create`, attach with :meth:`connect`; use ``with`` to kill on exit.

    ``sbx.commands``, ``sbx.files`` and ``sbx.pty`` drive it; ``sbx.run_code`` runs code in the server's
    code interpreter where the server has one.
    """

    def __init__(self, info: SandboxInfo, api: SyncApi):
        self._info, self._api = info, api
        self.commands = Commands(api, info.sandbox_id)
        self.files = Filesystem(api, info.sandbox_id)
        self.pty = Pty(api, info.sandbox_id)

    @property
    def id(self) -> str:
        return self._info.sandbox_id

    sandbox_id = id

    @property
    def info(self) -> SandboxInfo:
        """The info from the last create/connect/get_info/set_timeout/pause/resume/reset."""
        return self._info

    # -- lifecycle --------------------------------------------------------------------------------------

    @classmethod
    def create(cls, template: Optional[str] = None, timeout: Optional[int] = None,
               envs: Optional[Dict[str, str]] = None, metadata: Optional[Dict[str, str]] = None,
               cpu: Optional[float] = None, memory_mb: Optional[int] = None, isolation: Optional[str] = None,
               api_key: Optional[str] = None, api_url: Optional[str] = None,
               snapshot: Optional[SnapshotRef] = None, on_timeout: Optional[str] = None,
               network: Optional[PolicyLike] = None, allow_public_traffic: Optional[bool] = None,
               idempotency_key: Optional[str] = None,
               secrets: Optional[List[Dict[str, Any]]] = None,
               auto_resume: Optional[bool] = None, idle_timeout: Optional[int] = None) -> "Sandbox":
        """Creates a sandbox. ``timeout``: seconds until it is killed (daemon default 300).

        ``snapshot``: start from a snapshot (id, name or :class:`SnapshotInfo`); its template, tier, limits and
        environment apply unless given here. ``on_timeout``: ``"kill"`` (default) or ``"pause"`` (the
        timeout pauses the sandbox instead; :meth:`connect` resumes it).

        ``network``: its egress policy, a :class:`NetworkPolicy` or a dict with its fields (``allow_internet``,
        ``allow_out``, ``deny_out``, ``egress_mbps``, ``connections_per_second``, ``mode``; the daemon's
        default when not given; an :class:`InvalidArgumentError`
        with ``field == "network"`` when the daemon runs with ``--network none``). ``allow_public_traffic``:
        its exposed ports answer anyone, without the API key or its access token (default False).

        ``idle_timeout``: seconds without a request for it after which it ends (or pauses, with
        ``on_timeout="pause"``). ``auto_resume``: when paused, a request for it (a command, a file, a port's
        traffic) resumes it instead of failing (default False).

        ``idempotency_key``: a retry of this create with the same key and arguments (after a lost answer)
        returns the sandbox the first one made instead of a second (kept 24 h); other arguments under the
        same key raise :class:`IdempotencyError`.

        ``secrets``: secrets kept out of the sandbox (docs/secrets.md), each a dict ``{"name", "value",
        "hosts", "inject"?, "header"?, "format"?, "body"?}``: inside, ``$NAME`` is a placeholder the egress
        proxy replaces with the value in TLS requests to ``hosts`` only.
        """
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("POST", "/v1/sandboxes",
                         json=_core.create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation,
                                                snapshot, on_timeout, network, allow_public_traffic, secrets,
                                                auto_resume, idle_timeout),
                         headers=_core.idempotency_headers(idempotency_key))
        except BaseException:
            api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @classmethod
    def connect(cls, sandbox_id: str, api_key: Optional[str] = None, api_url: Optional[str] = None,
                timeout: Optional[int] = None) -> "Sandbox":
        """Attaches to an existing sandbox (NotFoundError when there is none).

        A paused sandbox is resumed first (like E2B's ``connect``), with ``timeout`` seconds to live (the
        daemon default when not given); ``sbx.info.state`` is then ``"running"``.
        """
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("GET", f"/v1/sandboxes/{sandbox_id}")
            gone = _core.ended_error(d)
            if gone is not None:
                raise gone
            if d.get("state") == "paused":
                try:
                    d = api.json("POST", f"/v1/sandboxes/{sandbox_id}/resume",
                                 json=_core.resume_body(timeout))["sandbox"]
                except ConflictError:  # resumed by someone else meanwhile: fine if it runs now
                    d = api.json("GET", f"/v1/sandboxes/{sandbox_id}")
                    if d.get("state") == "paused":
                        raise
        except BaseException:
            api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @staticmethod
    def list(metadata: Optional[Dict[str, str]] = None, state: Optional[str] = None,
             api_key: Optional[str] = None, api_url: Optional[str] = None) -> List[SandboxInfo]:
        """Sandboxes on the server, filtered by state and metadata (all given pairs must match)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("GET", "/v1/sandboxes", params=_core.list_params(metadata, state))
        finally:
            api.close()
        return [SandboxInfo.from_json(s) for s in d["sandboxes"]]

    def kill(self) -> bool:
        """Kills the sandbox; False when it was already gone."""
        try:
            self._api.request("DELETE", f"/v1/sandboxes/{self.id}")
            return True
        except NotFoundError:
            return False

    def set_timeout(self, timeout: int) -> None:
        """The sandbox now expires ``timeout`` seconds from now."""
        d = self._api.json("POST", f"/v1/sandboxes/{self.id}/timeout", json={"timeout": int(timeout)})
        self._info = SandboxInfo.from_json(d)

    def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_json(self._api.json("GET", f"/v1/sandboxes/{self.id}"))
        return self._info

    def is_running(self) -> bool:
        try:
            return self.get_info().state == "running"
        except NotFoundError:
            return False

    # -- pause, resume, reset ---------------------------------------------------------------------------

    def pause(self) -> None:
        """Freezes every process (no CPU; memory and files kept). A paused sandbox does not expire, and
        commands and file calls raise :class:`ConflictError` until :meth:`resume` (or :meth:`connect`)."""
        d = self._api.json("POST", f"/v1/sandboxes/{self.id}/pause")
        self._info = SandboxInfo.from_json(d["sandbox"])

    def resume(self, timeout: Optional[int] = None) -> bool:
        """Thaws a paused sandbox: processes continue where they stopped, and it expires ``timeout``
        seconds from now (daemon default when not given). Returns whether its processes were kept (False
        when they were lost while paused, e.g. by a host reboot: it then runs with its files only)."""
        d = self._api.json("POST", f"/v1/sandboxes/{self.id}/resume", json=_core.resume_body(timeout))
        self._info = SandboxInfo.from_json(d["sandbox"])
        return bool(d.get("processes_kept"))

    def reset(self, snapshot: Optional[SnapshotRef] = None) -> None:
        """Puts the sandbox back, in place: every process is killed and its filesystem becomes that of
        ``snapshot`` (id, name or :class:`SnapshotInfo`) or, without one, what it was created from (its
        snapshot or its template's clean state). Id, limits, environment, metadata and timeout stay."""
        d = self._api.json("POST", f"/v1/sandboxes/{self.id}/reset", json=_core.reset_body(snapshot),
                           timeout=LONG_REQUEST_TIMEOUT)
        self._info = SandboxInfo.from_json(d)

    # -- network and exposed ports ----------------------------------------------------------------------

    def get_network(self) -> NetworkInfo:
        """The sandbox's address, gateway and egress policy. :class:`ConflictError` when the daemon runs
        without sandbox networking (``--network none``)."""
        info = NetworkInfo.from_json(self._api.json("GET", f"/v1/sandboxes/{self.id}/network"))
        self._info.network = info
        return info

    def set_network(self, allow_internet: Union[bool, PolicyLike] = True, allow_out: Optional[List[str]] = None,
                    deny_out: Optional[List[str]] = None) -> NetworkInfo:
        """Replaces the egress policy, in force for new connections at once; returns the new network info.

        Give the three fields, or one :class:`NetworkPolicy` (or dict) instead of ``allow_internet`` (for
        ``egress_mbps``, ``connections_per_second`` and ``mode``). Entries are IPv4 addresses or CIDRs,
        domains, wildcards (``*.example.com``) or groups (``@pypi``) (:class:`InvalidArgumentError` naming
        the bad one, e.g. ``field == "network.allow_out[1]"``); :class:`ConflictError` without sandbox
        networking.
        """
        info = NetworkInfo.from_json(self._api.json("PUT", f"/v1/sandboxes/{self.id}/network",
                                                    json=_core.set_network_body(allow_internet, allow_out, deny_out)))
        self._info.network = info
        return info

    def network_log(self, decision: Optional[str] = None, after: Optional[int] = None,
                    limit: Optional[int] = None) -> List[NetworkLogEntry]:
        """The sandbox's connection log, oldest first: its TCP connections and DNS questions with the
        decision and the rule that made it (kept after the sandbox is gone).

        ``decision``: only ``"allow"``, ``"deny"`` or ``"audit"`` entries (another value is an
        :class:`InvalidArgumentError`); ``after``: only entries with a greater id (to page on); ``limit``:
        at most this many (daemon default 100, at most 10000).
        """
        d = self._api.json("GET", f"/v1/sandboxes/{self.id}/network/log",
                           params=_core.network_log_params(decision, after, limit))
        return [NetworkLogEntry.from_json(e) for e in d["entries"]]

    def follow_network_log(self, decision: Optional[str] = None, after: Optional[int] = None) -> NetworkLogStream:
        """The connection log live: iterate the stream for the stored entries (filtered as in
        :meth:`network_log`), then new ones as they are logged. It ends when the sandbox is gone (the
        daemon notices within 2 s); ``stop()`` it (or use ``with``) to end it earlier."""
        return NetworkLogStream(self._api.open_stream("GET", f"/v1/sandboxes/{self.id}/network/log",
                                                      params=_core.network_log_params(decision, after, None,
                                                                                      follow=True)))

    def network_proposal(self) -> NetworkProposal:
        """The tightest egress policy that would have allowed everything in the sandbox's connection log
        (internet off; a group, domain or address in ``allow_out`` per destination seen), with what each
        entry covers. Run the sandbox with ``mode="audit"`` first, then apply ``proposal.policy``."""
        return NetworkProposal.from_json(self._api.json("GET", f"/v1/sandboxes/{self.id}/network/proposal"))

    @staticmethod
    def template_network_proposal(template: str, api_key: Optional[str] = None,
                                  api_url: Optional[str] = None) -> NetworkProposal:
        """:meth:`network_proposal` over every sandbox started from ``template`` (a name or
        :class:`TemplateInfo`; :class:`NotFoundError` when unknown)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            return NetworkProposal.from_json(api.json("GET", _core.template_path(template, "network/proposal")))
        finally:
            api.close()

    @property
    def access_token(self) -> str:
        """The token that opens this sandbox's exposed ports without the API key ("" from older servers)."""
        return self._info.access_token

    def get_host(self, port: int, domain: Optional[str] = None) -> str:
        """Base URL of a server listening on ``port`` inside the sandbox, like E2B's ``get_host``.

        Path form by default, under the client's ``api_url``:
        ``http://127.0.0.1:6628/v1/sandboxes/{id}/ports/{port}``; append the path (``get_host(8000) + "/"``).
        With ``domain`` (a wildcard DNS name pointing at the daemon, e.g. ``"sandbox.example.com"``, optionally
        with a scheme): the host form ``http://{port}-{id}.sandbox.example.com``. Requests need the API key, the
        :attr:`access_token` (``X-Moat-Access-Token`` header or :meth:`port_url`), or
        ``allow_public_traffic``.
        """
        return _core.port_base_url(self._api.config.api_url, self.id, port, domain)

    def port_url(self, port: int, path: str = "/", with_token: bool = True, domain: Optional[str] = None) -> str:
        """:meth:`get_host` + ``path``, with ``?moat_access_token=...`` added when ``with_token`` (a URL to
        hand to someone without the API key, e.g. a browser; the host form then also sets a cookie)."""
        return _core.port_url(self.get_host(port, domain), path, self.access_token if with_token else None)

    # -- snapshots and forks ----------------------------------------------------------------------------

    def create_snapshot(self, name: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
                        kind: Optional[str] = None) -> SnapshotInfo:
        """Saves the sandbox's filesystem as a snapshot that new sandboxes start from (:meth:`create` with
        ``snapshot=``, :meth:`fork`, :meth:`reset`). Its processes are frozen while the changes are copied
        (``frozen_ms``); it keeps running. ``name``: a unique name usable instead of the id.

        ``kind="full"`` saves the processes with their memory too (gvisor tier): sandboxes started from the
        snapshot continue them. It raises :class:`ConflictError` when processes hold Unix sockets bound to
        files (the message names them), and :class:`UnavailableError` (``field == "kind"``) where the
        tier cannot checkpoint processes; its message says why.
        """
        d = self._api.json("POST", f"/v1/sandboxes/{self.id}/snapshots",
                           json=_core.snapshot_body(name, metadata, kind), timeout=LONG_REQUEST_TIMEOUT)
        return SnapshotInfo.from_json(d)

    @classmethod
    def fork(cls, snapshot: SnapshotRef, count: int, timeout: Optional[int] = None,
             metadata: Optional[Dict[str, str]] = None, envs: Optional[Dict[str, str]] = None,
             api_key: Optional[str] = None, api_url: Optional[str] = None,
             on_timeout: Optional[str] = None) -> List["Sandbox"]:
        """Starts ``count`` (1..100) sandboxes from a snapshot in one call, all or none.

        They come back in order; each has the metadata ``moat.fork-index`` ("0".."count-1") besides
        ``metadata``, and its own connection (close or kill each; ``with`` works on each).
        """
        config = ConnectionConfig.resolve(api_key, api_url)
        api = SyncApi(config)
        try:
            d = api.json("POST", _core.snapshot_path(snapshot, "fork"),
                         json=_core.fork_body(count, timeout, metadata, envs, on_timeout),
                         timeout=LONG_REQUEST_TIMEOUT)
        finally:
            api.close()
        return [cls(SandboxInfo.from_json(s), SyncApi(config)) for s in d["sandboxes"]]

    @staticmethod
    def list_snapshots(sandbox_id: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
                       api_key: Optional[str] = None, api_url: Optional[str] = None) -> List[SnapshotInfo]:
        """Snapshots on the server, optionally only those of ``sandbox_id`` and/or whose metadata has all
        the given pairs (filtered here, not by the server)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("GET", "/v1/snapshots")
        finally:
            api.close()
        snaps = [SnapshotInfo.from_json(s) for s in d["snapshots"]]
        return [s for s in snaps if _core.snapshot_matches(s, sandbox_id, metadata)]

    @staticmethod
    def get_snapshot(snapshot_id: SnapshotRef, api_key: Optional[str] = None,
                     api_url: Optional[str] = None) -> SnapshotInfo:
        """A snapshot by id or name (NotFoundError when there is none)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            return SnapshotInfo.from_json(api.json("GET", _core.snapshot_path(snapshot_id)))
        finally:
            api.close()

    @staticmethod
    def delete_snapshot(snapshot_id: SnapshotRef, api_key: Optional[str] = None,
                        api_url: Optional[str] = None) -> bool:
        """Deletes a snapshot by id or name; False when there was none. Sandboxes started from it keep
        running (and can still :meth:`reset` to it)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            api.request("DELETE", _core.snapshot_path(snapshot_id))
            return True
        except NotFoundError:
            return False
        finally:
            api.close()

    # -- code interpreter -------------------------------------------------------------------------------

    def run_code(self, code: str, language: Optional[str] = None, context: Optional[str] = None,
                 on_stdout: Optional[Callable[[str], Any]] = None, on_stderr: Optional[Callable[[str], Any]] = None,
                 on_result: Optional[Callable[[Any], Any]] = None, on_error: Optional[Callable[[Any], Any]] = None,
                 envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> Execution:
        """Runs code in the sandbox's code interpreter (state persists between calls).

        Raises :class:`NotSupportedError` when the server has no code interpreter.
        """
        col = _core.ExecutionCollector(on_stdout, on_stderr, on_result, on_error)
        with self._api.stream("POST", f"/v1/sandboxes/{self.id}/code",
                              json=_core.code_body(code, language, context, timeout, envs)) as r:
            for line in r.iter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    col.feed(d)
        return col.execution

    def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> Context:
        """Starts a new code interpreter context (its own kernel)."""
        body = {k: v for k, v in (("language", language), ("cwd", cwd)) if v is not None}
        return Context.from_json(self._api.json("POST", f"/v1/sandboxes/{self.id}/code/contexts", json=body))

    def list_code_contexts(self) -> List[Context]:
        d = self._api.json("GET", f"/v1/sandboxes/{self.id}/code/contexts")
        return [Context.from_json(c) for c in d.get("contexts", [])]

    def restart_code_context(self, context) -> None:
        """A fresh kernel with the same id, language and cwd; its state is gone."""
        self._api.request("POST", f"/v1/sandboxes/{self.id}/code/contexts/{getattr(context, 'id', context)}/restart")

    def remove_code_context(self, context) -> None:
        self._api.request("DELETE", f"/v1/sandboxes/{self.id}/code/contexts/{getattr(context, 'id', context)}")

    # -- plumbing ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Closes the HTTP connections (the sandbox keeps running)."""
        self._api.close()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.kill()
        finally:
            self.close()

    def __repr__(self) -> str:
        return f"Sandbox(id={self.id!r})"
