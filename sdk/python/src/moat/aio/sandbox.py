"""``moat.AsyncSandbox``: the async client, same surface as :class:`moat.Sandbox` with coroutines."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from .. import _core
from .._config import ConnectionConfig
from .._http import AsyncApi
from ..exceptions import NotFoundError
from ..models import Context, Execution, SandboxInfo
from .commands import AsyncCommands
from .files import AsyncFilesystem
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
                     api_key: Optional[str] = None, api_url: Optional[str] = None) -> "AsyncSandbox":
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("POST", "/v1/sandboxes",
                               json=_core.create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation))
        except BaseException:
            await api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @classmethod
    async def connect(cls, sandbox_id: str, api_key: Optional[str] = None,
                      api_url: Optional[str] = None) -> "AsyncSandbox":
        api = AsyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = await api.json("GET", f"/v1/sandboxes/{sandbox_id}")
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
