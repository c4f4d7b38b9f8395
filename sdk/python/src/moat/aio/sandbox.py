"""``moat.AsyncSandbox``: the async client, same surface as :class:`moat.Sandbox` with coroutines."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from .. import _core
from .._config import LONG_REQUEST_TIMEOUT, ConnectionConfig
from .._core import PolicyLike, SnapshotRef
from .._http import AsyncApi
from ..exceptions import ConflictError, NotFoundError
from ..models import Context, Execution, NetworkInfo, NetworkLogEntry, NetworkProposal, SandboxInfo, SnapshotInfo
from .commands import AsyncCommands
from .files import AsyncFilesystem
from .network import AsyncNetworkLogStream
from .pty import AsyncPty


class AsyncSandbox:
    """``sbx = await AsyncSandbox.create()``; ``async with`` kills it on exit."""

    def __init__(self, info: SandboxInfo, api: AsyncApi):
        self._info, self._api = info, api
        self.commands = AsyncCommands(api, info.sandbox_id)
        self.files = AsyncFilesystem(api, info.sandbox_id)
        self.pty = AsyncPty(api, info.sandbox_id)

    @property
    def id(self) -> str:
        return self._info.sandbox_id

    sandbox_id = id

    @property
    def info(self) -> SandboxInfo:
        return self._info

    @classmethod
    async def create(cls, template: Optional[str] = None, timeout: Optional[int] = None,
                     envs: Optional[Dict[str, str]] = None, metadata: Optional[Dict[str, str]] = None,
                     cpu: Optional[float] = None, memory_mb: Optional[int] = None, isolation: Optional[str] = None,
                     api_key: Optional[str] = None, api_url: Optional[str] = None,
                     snapshot: Optional[SnapshotRef] = None, on_timeout: Optional[str] = None,
                     network: Optional[PolicyLike] = None,
                     allow_public_traffic: Optional[bool] = None,
                     idempotency_key: Optional[str] = None,
                     secrets: Optional[List[Dict[str, Any]]] = None,
                     auto_resume: Optional[bool] = None, idle_timeout: Optional[int] = None) -> "AsyncSandbox":
        """Creates a sandbox (see :meth:`Sandbox.create`)."""
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("POST", "/v1/sandboxes",
                               json=_core.create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation,
                                                      snapshot, on_timeout, network, allow_public_traffic, secrets,
                                                      auto_resume, idle_timeout),
                               headers=_core.idempotency_headers(idempotency_key))
        except BaseException:
            await api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @classmethod
    async def connect(cls, sandbox_id: str, api_key: Optional[str] = None,
                      api_url: Optional[str] = None, timeout: Optional[int] = None) -> "AsyncSandbox":
        """Attaches to an existing sandbox, resuming it first when it is paused (see :meth:`Sandbox.connect`)."""
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("GET", f"/v1/sandboxes/{sandbox_id}")
            gone = _core.ended_error(d)
            if gone is not None:
                raise gone
            if d.get("state") == "paused":
                try:
                    d = (await api.json("POST", f"/v1/sandboxes/{sandbox_id}/resume",
                                        json=_core.resume_body(timeout)))["sandbox"]
                except ConflictError:  # resumed by someone else meanwhile: fine if it runs now
                    d = await api.json("GET", f"/v1/sandboxes/{sandbox_id}")
                    if d.get("state") == "paused":
                        raise
        except BaseException:
            await api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @staticmethod
    async def list(metadata: Optional[Dict[str, str]] = None, state: Optional[str] = None,
                   api_key: Optional[str] = None, api_url: Optional[str] = None) -> List[SandboxInfo]:
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("GET", "/v1/sandboxes", params=_core.list_params(metadata, state))
        finally:
            await api.close()
        return [SandboxInfo.from_json(s) for s in d["sandboxes"]]

    async def kill(self) -> bool:
        try:
            await self._api.request("DELETE", f"/v1/sandboxes/{self.id}")
            return True
        except NotFoundError:
            return False

    async def set_timeout(self, timeout: int) -> None:
        d = await self._api.json("POST", f"/v1/sandboxes/{self.id}/timeout", json={"timeout": int(timeout)})
        self._info = SandboxInfo.from_json(d)

    async def get_info(self) -> SandboxInfo:
        self._info = SandboxInfo.from_json(await self._api.json("GET", f"/v1/sandboxes/{self.id}"))
        return self._info

    async def is_running(self) -> bool:
        try:
            return (await self.get_info()).state == "running"
        except NotFoundError:
            return False

    # -- pause, resume, reset (see Sandbox for the details) ---------------------------------------------

    async def pause(self) -> None:
        d = await self._api.json("POST", f"/v1/sandboxes/{self.id}/pause")
        self._info = SandboxInfo.from_json(d["sandbox"])

    async def resume(self, timeout: Optional[int] = None) -> bool:
        """Thaws a paused sandbox; returns whether its processes were kept."""
        d = await self._api.json("POST", f"/v1/sandboxes/{self.id}/resume", json=_core.resume_body(timeout))
        self._info = SandboxInfo.from_json(d["sandbox"])
        return bool(d.get("processes_kept"))

    async def reset(self, snapshot: Optional[SnapshotRef] = None) -> None:
        d = await self._api.json("POST", f"/v1/sandboxes/{self.id}/reset", json=_core.reset_body(snapshot),
                                 timeout=LONG_REQUEST_TIMEOUT)
        self._info = SandboxInfo.from_json(d)

    # -- network and exposed ports (see Sandbox for the details) ----------------------------------------

    async def get_network(self) -> NetworkInfo:
        """The sandbox's address, gateway and egress policy (:class:`ConflictError` with ``--network none``)."""
        info = NetworkInfo.from_json(await self._api.json("GET", f"/v1/sandboxes/{self.id}/network"))
        self._info.network = info
        return info

    async def set_network(self, allow_internet: Union[bool, PolicyLike] = True,
                          allow_out: Optional[List[str]] = None,
                          deny_out: Optional[List[str]] = None) -> NetworkInfo:
        """Replaces the egress policy live: the three fields, or a :class:`NetworkPolicy` (or dict)."""
        d = await self._api.json("PUT", f"/v1/sandboxes/{self.id}/network",
                                 json=_core.set_network_body(allow_internet, allow_out, deny_out))
        info = NetworkInfo.from_json(d)
        self._info.network = info
        return info

    async def network_log(self, decision: Optional[str] = None, after: Optional[int] = None,
                          limit: Optional[int] = None) -> List[NetworkLogEntry]:
        """The connection log, oldest first (see :meth:`Sandbox.network_log`)."""
        d = await self._api.json("GET", f"/v1/sandboxes/{self.id}/network/log",
                                 params=_core.network_log_params(decision, after, limit))
        return [NetworkLogEntry.from_json(e) for e in d["entries"]]

    async def follow_network_log(self, decision: Optional[str] = None,
                                 after: Optional[int] = None) -> AsyncNetworkLogStream:
        """The connection log live: ``async for entry in await sbx.follow_network_log()``; it ends when the
        sandbox is gone, or at ``await stream.stop()``."""
        r = await self._api.open_stream("GET", f"/v1/sandboxes/{self.id}/network/log",
                                        params=_core.network_log_params(decision, after, None, follow=True))
        return AsyncNetworkLogStream(r)

    async def network_proposal(self) -> NetworkProposal:
        """The tightest policy that would have allowed the sandbox's log (see :meth:`Sandbox.network_proposal`)."""
        return NetworkProposal.from_json(await self._api.json("GET", f"/v1/sandboxes/{self.id}/network/proposal"))

    @staticmethod
    async def template_network_proposal(template: str, api_key: Optional[str] = None,
                                        api_url: Optional[str] = None) -> NetworkProposal:
        """:meth:`network_proposal` over every sandbox started from ``template``."""
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            return NetworkProposal.from_json(await api.json("GET", _core.template_path(template, "network/proposal")))
        finally:
            await api.close()

    @property
    def access_token(self) -> str:
        """The token that opens this sandbox's exposed ports without the API key."""
        return self._info.access_token

    def get_host(self, port: int, domain: Optional[str] = None) -> str:
        """Base URL of ``port`` inside the sandbox (no I/O; see :meth:`Sandbox.get_host`)."""
        return _core.port_base_url(self._api.config.api_url, self.id, port, domain)

    def port_url(self, port: int, path: str = "/", with_token: bool = True, domain: Optional[str] = None) -> str:
        """:meth:`get_host` + ``path``, with ``?moat_access_token=...`` when ``with_token``."""
        return _core.port_url(self.get_host(port, domain), path, self.access_token if with_token else None)

    # -- snapshots and forks ----------------------------------------------------------------------------

    async def create_snapshot(self, name: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
                              kind: Optional[str] = None) -> SnapshotInfo:
        d = await self._api.json("POST", f"/v1/sandboxes/{self.id}/snapshots",
                                 json=_core.snapshot_body(name, metadata, kind), timeout=LONG_REQUEST_TIMEOUT)
        return SnapshotInfo.from_json(d)

    @classmethod
    async def fork(cls, snapshot: SnapshotRef, count: int, timeout: Optional[int] = None,
                   metadata: Optional[Dict[str, str]] = None, envs: Optional[Dict[str, str]] = None,
                   api_key: Optional[str] = None, api_url: Optional[str] = None,
                   on_timeout: Optional[str] = None) -> List["AsyncSandbox"]:
        """``count`` sandboxes from a snapshot, in order, each with its own connection."""
        config = ConnectionConfig.resolve(api_key, api_url)
        api = AsyncApi(config)
        try:
            d = await api.json("POST", _core.snapshot_path(snapshot, "fork"),
                               json=_core.fork_body(count, timeout, metadata, envs, on_timeout),
                               timeout=LONG_REQUEST_TIMEOUT)
        finally:
            await api.close()
        return [cls(SandboxInfo.from_json(s), AsyncApi(config)) for s in d["sandboxes"]]

    @staticmethod
    async def list_snapshots(sandbox_id: Optional[str] = None, metadata: Optional[Dict[str, str]] = None,
                             api_key: Optional[str] = None, api_url: Optional[str] = None) -> List[SnapshotInfo]:
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("GET", "/v1/snapshots")
        finally:
            await api.close()
        snaps = [SnapshotInfo.from_json(s) for s in d["snapshots"]]
        return [s for s in snaps if _core.snapshot_matches(s, sandbox_id, metadata)]

    @staticmethod
    async def get_snapshot(snapshot_id: SnapshotRef, api_key: Optional[str] = None,
                           api_url: Optional[str] = None) -> SnapshotInfo:
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            return SnapshotInfo.from_json(await api.json("GET", _core.snapshot_path(snapshot_id)))
        finally:
            await api.close()

    @staticmethod
    async def delete_snapshot(snapshot_id: SnapshotRef, api_key: Optional[str] = None,
                              api_url: Optional[str] = None) -> bool:
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            await api.request("DELETE", _core.snapshot_path(snapshot_id))
            return True
        except NotFoundError:
            return False
        finally:
            await api.close()

    async def run_code(self, code: str, language: Optional[str] = None, context: Optional[str] = None,
                       on_stdout: Optional[Callable[[str], Any]] = None,
                       on_stderr: Optional[Callable[[str], Any]] = None,
                       on_result: Optional[Callable[[Any], Any]] = None,
                       on_error: Optional[Callable[[Any], Any]] = None,
                       envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = None) -> Execution:
        col = _core.ExecutionCollector(on_stdout, on_stderr, on_result, on_error)
        async with self._api.stream("POST", f"/v1/sandboxes/{self.id}/code",
                                    json=_core.code_body(code, language, context, timeout, envs)) as r:
            async for line in r.aiter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    col.feed(d)
        return col.execution

    async def create_code_context(self, language: Optional[str] = None, cwd: Optional[str] = None) -> Context:
        """Starts a new code interpreter context (its own kernel)."""
        body = {k: v for k, v in (("language", language), ("cwd", cwd)) if v is not None}
        return Context.from_json(await self._api.json("POST", f"/v1/sandboxes/{self.id}/code/contexts", json=body))

    async def list_code_contexts(self) -> List[Context]:
        d = await self._api.json("GET", f"/v1/sandboxes/{self.id}/code/contexts")
        return [Context.from_json(c) for c in d.get("contexts", [])]

    async def restart_code_context(self, context) -> None:
        """A fresh kernel with the same id, language and cwd; its state is gone."""
        await self._api.request("POST", f"/v1/sandboxes/{self.id}/code/contexts/{getattr(context, 'id', context)}/restart")

    async def remove_code_context(self, context) -> None:
        await self._api.request("DELETE", f"/v1/sandboxes/{self.id}/code/contexts/{getattr(context, 'id', context)}")

    async def close(self) -> None:
        await self._api.close()

    async def __aenter__(self) -> "AsyncSandbox":
        return self

    async def __aexit__(self, *exc) -> None:
        try:
            await self.kill()
        finally:
            await self.close()

    def __repr__(self) -> str:
        return f"AsyncSandbox(id={self.id!r})"
