"""``moat.Sandbox``: the sync client (E2B-style)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from . import _core
from ._config import ConnectionConfig
from ._http import SyncApi
from .commands import Commands
from .exceptions import NotFoundError
from .files import Filesystem
from .models import Context, Execution, SandboxInfo
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
        """The info from the last create/connect/get_info/set_timeout."""
        return self._info

    # -- lifecycle --------------------------------------------------------------------------------------

    @classmethod
    def create(cls, template: Optional[str] = None, timeout: Optional[int] = None,
               envs: Optional[Dict[str, str]] = None, metadata: Optional[Dict[str, str]] = None,
               cpu: Optional[float] = None, memory_mb: Optional[int] = None, isolation: Optional[str] = None,
               api_key: Optional[str] = None, api_url: Optional[str] = None) -> "Sandbox":
        """Creates a sandbox. ``timeout``: seconds until it is killed (daemon default 300)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("POST", "/v1/sandboxes",
                         json=_core.create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation))
        except BaseException:
            api.close()
            raise
        return cls(SandboxInfo.from_json(d), api)

    @classmethod
    def connect(cls, sandbox_id: str, api_key: Optional[str] = None, api_url: Optional[str] = None) -> "Sandbox":
        """Attaches to an existing sandbox (NotFoundError when there is none)."""
        api = SyncApi(ConnectionConfig.resolve(api_key, api_url))
        try:
            d = api.json("GET", f"/v1/sandboxes/{sandbox_id}")
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
