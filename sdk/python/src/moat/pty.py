"""``sbx.pty``: interactive terminals over the process WebSocket (sync)."""

from __future__ import annotations

import json
from typing import Callable, Dict, Iterator, Optional, Union

from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect as ws_connect

from . import _core
from ._http import SyncApi
from .commands import _signal
from .exceptions import error_from_response
from .models import CommandResult, ExitStatus, ProcessInfo


def ws_error(e: InvalidStatus) -> Exception:
    """The moat exception for a refused WebSocket upgrade."""
    r = e.response
    return error_from_response(r.status_code, r.body or b"")


class PtyHandle:
    """A process on a pseudo-terminal.

    Output arrives as bytes: iterate the handle, or call ``wait(on_data=...)``. ``send_input`` writes to
    the terminal, ``resize`` changes its size. Closing the handle detaches; the process keeps running.
    """

    def __init__(self, api: SyncApi, sandbox_id: str, pid: int, on_data: Optional[Callable[[bytes], None]] = None):
        self._api, self._sandbox_id, self.pid = api, sandbox_id, pid
        self._on_data = on_data
        self.exit: Optional[ExitStatus] = None
        url = api.config.ws_url + _core.process_path(sandbox_id, pid, "ws")
        try:
            # entered as a context manager: websockets >= 17.1 warns about a bare connect()
            self._ws = ws_connect(url, additional_headers=api.config.headers, max_size=None).__enter__()
        except InvalidStatus as e:
            raise ws_error(e) from None

    def __iter__(self) -> Iterator[bytes]:
        while self.exit is None:
            try:
                msg = self._ws.recv()
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

    def send_input(self, data: Union[str, bytes]) -> None:
        self._ws.send(_core.stdin_bytes(data))

    def resize(self, cols: int, rows: int) -> None:
        self._ws.send(json.dumps({"type": "resize", "cols": cols, "rows": rows}))

    def kill(self) -> bool:
        """SIGKILL to the terminal's process group; False when it was not running."""
        return _signal(self._api, self._sandbox_id, self.pid, "SIGKILL")

    def wait(self, on_data: Optional[Callable[[bytes], None]] = None) -> CommandResult:
        """Reads output (to ``on_data`` if given) until the process exits; returns how it ended (no raise)."""
        if on_data is not None:
            self._on_data = on_data
        for _ in self:
            pass
        self.close()
        ex = self.exit or ExitStatus(error="the connection closed before the process exited")
        return CommandResult(stdout="", stderr="", exit_code=ex.exit_code, signal=ex.signal,
                             timed_out=ex.timed_out, error=ex.error)

    def close(self) -> None:
        """Detaches (the process keeps running)."""
        self._ws.close()

    def __enter__(self) -> "PtyHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Pty:
    def __init__(self, api: SyncApi, sandbox_id: str):
        self._api, self._sandbox_id = api, sandbox_id

    def create(self, cols: int = 80, rows: int = 24, cmd: Optional[_core.Cmd] = None, user: Optional[str] = None,
               cwd: Optional[str] = None, envs: Optional[Dict[str, str]] = None, timeout: Optional[float] = None,
               tag: Optional[str] = None, on_data: Optional[Callable[[bytes], None]] = None) -> PtyHandle:
        """Starts ``cmd`` (a login bash by default, ``TERM=xterm-256color``) on a ``cols``×``rows`` terminal."""
        body = _core.pty_body(cols, rows, cmd, user, cwd, envs, timeout, tag)
        info = ProcessInfo.from_json(self._api.json("POST", f"/v1/sandboxes/{self._sandbox_id}/processes", json=body))
        return PtyHandle(self._api, self._sandbox_id, info.pid, on_data)

    def connect(self, pid_or_tag: Union[int, str], on_data: Optional[Callable[[bytes], None]] = None) -> PtyHandle:
        """Re-attaches to a terminal (its kept output is replayed first)."""
        return PtyHandle(self._api, self._sandbox_id, pid_or_tag, on_data)

    def resize(self, pid_or_tag: Union[int, str], cols: int, rows: int) -> None:
        self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "resize"),
                          json={"cols": cols, "rows": rows})

    def kill(self, pid_or_tag: Union[int, str]) -> bool:
        return _signal(self._api, self._sandbox_id, pid_or_tag, "SIGKILL")
