"""``sbx.pty`` for :class:`moat.AsyncSandbox`."""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable, Dict, Optional, Union

from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from .. import _core
from .._http import AsyncApi
from ..models import CommandResult, ExitStatus, ProcessInfo
from ..pty import ws_error
from .commands import _signal


class AsyncPtyHandle:
    """Async counterpart of :class:`moat.pty.PtyHandle` (create it with ``await sbx.pty.create(...)``)."""

    def __init__(self, api: AsyncApi, sandbox_id: str, pid, on_data: Optional[Callable[[bytes], None]] = None):
        self._api, self._sandbox_id, self.pid = api, sandbox_id, pid
        self._on_data = on_data
        self.exit: Optional[ExitStatus] = None
        self._ws = None

    async def _connect(self) -> "AsyncPtyHandle":
        url = self._api.config.ws_url + _core.process_path(self._sandbox_id, self.pid, "ws")
        try:
            self._ws = await ws_connect(url, additional_headers=self._api.config.headers, max_size=None)
        except InvalidStatus as e:
            raise ws_error(e) from None
        return self

    async def __aiter__(self) -> AsyncIterator[bytes]:
        while self.exit is None:
            try:
                msg = await self._ws.recv()
            except ConnectionClosed:
                return
            if isinstance(msg, bytes):
                if self._on_data:
                    self._on_data(msg)
                yield msg
            else:
                ev = _core.ws_event(msg)
                if ev is not None and ev.type == "exit":
                    self.exit = ev.exit

    async def send_input(self, data: Union[str, bytes]) -> None:
        await self._ws.send(_core.stdin_bytes(data))

    async def resize(self, cols: int, rows: int) -> None:
        await self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    async def kill(self) -> bool:
        return await _signal(self._api, self._sandbox_id, self.pid, "SIGKILL")

    async def wait(self, on_data: Optional[Callable[[bytes], None]] = None) -> CommandResult:
        if on_data is not None:
            self._on_data = on_data
        async for _ in self:
            pass
        await self.close()
        ex = self.exit or ExitStatus(error="the connection closed before the process exited")
        return CommandResult(stdout="", stderr="", exit_code=ex.exit_code, signal=ex.signal,
                             timed_out=ex.timed_out, error=ex.error)

    async def close(self) -> None:
        await self._ws.close()


class AsyncPty:
    def __init__(self, api: AsyncApi, sandbox_id: str):
        self._api, self._sandbox_id = api, sandbox_id

    async def create(self, cols: int = 80, rows: int = 24, cmd: Optional[_core.Cmd] = None,
                     user: Optional[str] = None, cwd: Optional[str] = None, envs: Optional[Dict[str, str]] = None,
                     timeout: Optional[float] = None, tag: Optional[str] = None,
                     on_data: Optional[Callable[[bytes], None]] = None) -> AsyncPtyHandle:
        body = _core.pty_body(cols, rows, cmd, user, cwd, envs, timeout, tag)
        d = await self._api.json("POST", f"/v1/sandboxes/{self._sandbox_id}/processes", json=body)
        return await AsyncPtyHandle(self._api, self._sandbox_id, ProcessInfo.from_json(d).pid, on_data)._connect()

    async def connect(self, pid_or_tag: Union[int, str], on_data=None) -> AsyncPtyHandle:
        return await AsyncPtyHandle(self._api, self._sandbox_id, pid_or_tag, on_data)._connect()

    async def resize(self, pid_or_tag: Union[int, str], cols: int, rows: int) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "resize"),
                                json={"cols": cols, "rows": rows})

    async def kill(self, pid_or_tag: Union[int, str]) -> bool:
        return await _signal(self._api, self._sandbox_id, pid_or_tag, "SIGKILL")
