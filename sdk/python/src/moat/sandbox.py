"""``moat.Sandbox``: the sync client (E2B-style)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from . import _core
from ._config import LONG_REQUEST_TIMEOUT, ConnectionConfig
from ._core import SnapshotRef
from ._http import SyncApi
from .commands import Commands
from .exceptions import ConflictError, NotFoundError
from .files import Filesystem
from .models import Context, Execution, SandboxInfo, SnapshotInfo
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
               snapshot: Optional[SnapshotRef] = None, on_timeout: Optional[str] = None) -> "Sandbox":
        """Creates a sandbox. ``timeout``: seconds until it is killed (daemon default 300).

        ``snapshot``: start from a snapshot (id, name or :class:`SnapshotInfo`); its template, tier, limits and
        environment apply unless given here. ``on_timeout``: ``"kill"`` (default) or ``"pause"`` (the
        timeout pauses the sandbox instead; :meth:`connect` resumes it).
        """
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("POST", "/v1/sandboxes",
                         json=_core.create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation,
                                                snapshot, on_timeout))
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

    # -- snapshots and forks ----------------------------------------------------------------------------

    def create_snapshot(self, name: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
                        kind: Optional[str] = None) -> SnapshotInfo:
        """Saves the sandbox's filesystem as a snapshot that new sandboxes start from (:meth:`create` with
        ``snapshot=``, :meth:`fork`, :meth:`reset`). Its processes are frozen while the changes are copied
        (``frozen_ms``); it keeps running. ``name``: a unique name usable instead of the id.

        ``kind="full"`` (memory too) raises :class:`UnavailableError` (``field == "kind"``) where the host
        cannot checkpoint processes; its message says why.
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
