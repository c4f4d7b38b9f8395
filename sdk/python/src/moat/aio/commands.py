"""``sbx.commands`` for :class:`moat.AsyncSandbox`."""

from __future__ import annotations

from typing import AsyncIterator, Dict, List, Optional, Union

from .. import _core
from .._http import AsyncApi
from ..exceptions import ConflictError, NotFoundError
from ..models import CommandResult, ProcessEvent, ProcessInfo


class AsyncCommandHandle:
    """Async counterpart of :class:`moat.CommandHandle`: ``async for ev in handle``, ``await handle.wait()``."""

    def __init__(self, api: AsyncApi, sandbox_id: str, pid: Optional[int], tag: Optional[str] = None,
                 on_stdout=None, on_stderr=None, replay: bool = True):
        self._api, self._sandbox_id = api, sandbox_id
        self._pid, self.tag, self._replay = pid, tag, replay
        self._collector = _core.OutputCollector(on_stdout, on_stderr)
        self._response = None
        self._lines = None
        self._pending: List[ProcessEvent] = []
        self._done = False

    @property
    def pid(self) -> Optional[int]:
        return self._pid

    @property
    def _sel(self):
        return self._pid if self._pid is not None else self.tag

    @property
    def exit_code(self) -> Optional[int]:
        return self._collector.exit.exit_code if self._collector.exit else None

    async def _next_event(self) -> Optional[ProcessEvent]:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            return None
        if self._response is None:
            self._response = await self._api.open_stream(
                "GET", _core.process_path(self._sandbox_id, self._sel, "events"),
                params={"replay": "true" if self._replay else "false"})
            self._lines = self._response.aiter_lines()
        async for line in self._lines:
            d = _core.parse_line(line)
            if d is None:
                continue
            ev = ProcessEvent.from_json(d)
            self._collector.feed(ev)
            if ev.type == "start" and ev.pid is not None:
                self._pid = ev.pid
            if ev.type == "exit":
                self._done = True
                await self.disconnect()
            return ev
        self._done = True
        await self.disconnect()
        return None

    async def __aiter__(self) -> AsyncIterator[ProcessEvent]:
        while True:
            ev = await self._next_event()
            if ev is None:
                return
            yield ev

    async def wait(self) -> CommandResult:
        async for _ in self:
            pass
        return _core.check_result(self._collector.result())

    async def disconnect(self) -> None:
        if self._response is not None:
            await self._response.aclose()
            self._response = None

    async def kill(self) -> bool:
        return await _signal(self._api, self._sandbox_id, self._sel, "SIGKILL")

    async def signal(self, sig) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "signal"),
                                json={"signal": _core.signal_name(sig)})

    async def send_stdin(self, data: Union[str, bytes]) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "stdin"),
                                content=_core.stdin_bytes(data))

    async def close_stdin(self) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "close-stdin"))


async def _signal(api: AsyncApi, sandbox_id: str, sel, sig) -> bool:
    try:
        await api.request("POST", _core.process_path(sandbox_id, sel, "signal"),
                          json={"signal": _core.signal_name(sig)})
        return True
    except (NotFoundError, ConflictError):
        return False


class AsyncCommands:
    def __init__(self, api: AsyncApi, sandbox_id: str):
        self._api, self._sandbox_id = api, sandbox_id

    async def run(self, cmd: _core.Cmd, background: bool = False, on_stdout=None, on_stderr=None,
                  timeout: Optional[float] = None, envs: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
                  user: Optional[str] = None, stdin: bool = False, tag: Optional[str] = None):
        """See :meth:`moat.commands.Commands.run`."""
        body = _core.start_body(cmd, background=background, envs=envs, cwd=cwd, user=user, timeout=timeout,
                                stdin=stdin, tag=tag)
        path = f"/v1/sandboxes/{self._sandbox_id}/processes"
        if background:
            info = ProcessInfo.from_json(await self._api.json("POST", path, json=body))
            return AsyncCommandHandle(self._api, self._sandbox_id, info.pid, info.tag, on_stdout, on_stderr)
        collector = _core.OutputCollector(on_stdout, on_stderr)
        async with self._api.stream("POST", path, json=body) as r:
            async for line in r.aiter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    collector.feed(ProcessEvent.from_json(d))
        return _core.check_result(collector.result())

    async def connect(self, pid_or_tag: Union[int, str], on_stdout=None, on_stderr=None,
                      replay: bool = True) -> AsyncCommandHandle:
        pid = pid_or_tag if isinstance(pid_or_tag, int) else None
        tag = None if pid is not None else str(pid_or_tag)
        h = AsyncCommandHandle(self._api, self._sandbox_id, pid, tag, on_stdout, on_stderr, replay=replay)
        first = await h._next_event()
        if first is not None:
            h._pending.append(first)
        return h

    async def list(self) -> List[ProcessInfo]:
        d = await self._api.json("GET", f"/v1/sandboxes/{self._sandbox_id}/processes")
        return [ProcessInfo.from_json(p) for p in d.get("processes", [])]

    async def kill(self, pid_or_tag: Union[int, str]) -> bool:
        return await _signal(self._api, self._sandbox_id, pid_or_tag, "SIGKILL")

    async def signal(self, pid_or_tag: Union[int, str], sig) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "signal"),
                                json={"signal": _core.signal_name(sig)})

    async def send_stdin(self, pid_or_tag: Union[int, str], data: Union[str, bytes]) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "stdin"),
                                content=_core.stdin_bytes(data))

    async def close_stdin(self, pid_or_tag: Union[int, str]) -> None:
        await self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "close-stdin"))
