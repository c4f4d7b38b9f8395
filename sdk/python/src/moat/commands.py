"""``sbx.commands``: run commands, background processes, stdin, signals, re-attach (sync)."""

from __future__ import annotations

from typing import Dict, Iterator, List, Optional, Union

from . import _core
from ._http import SyncApi, interrupt
from .exceptions import ConflictError, NotFoundError
from .models import CommandResult, ProcessEvent, ProcessInfo


class CommandHandle:
    """A running (background or re-attached) process.

    Iterate over it for :class:`ProcessEvent` objects as they come; ``wait()`` consumes the rest of the
    stream and returns the :class:`CommandResult` (raising :class:`CommandExitException` on failure).
    Output callbacks given at start fire while the stream is consumed (by iteration or ``wait()``).
    """

    def __init__(self, api: SyncApi, sandbox_id: str, pid: Optional[int], tag: Optional[str] = None,
                 on_stdout=None, on_stderr=None, replay: bool = True):
        self._api, self._sandbox_id = api, sandbox_id
        self._pid, self.tag = pid, tag
        self._replay = replay
        self._collector = _core.OutputCollector(on_stdout, on_stderr)
        self._response = None
        self._lines: Optional[Iterator[str]] = None
        self._pending: List[ProcessEvent] = []
        self._done = False
        self._interrupted = False

    @property
    def pid(self) -> Optional[int]:
        return self._pid

    @property
    def _sel(self) -> Union[int, str]:
        return self._pid if self._pid is not None else self.tag

    @property
    def exit_code(self) -> Optional[int]:
        """The exit code once the stream showed the exit, else None."""
        return self._collector.exit.exit_code if self._collector.exit else None

    def _open(self) -> None:
        if self._response is None:
            self._response = self._api.open_stream(
                "GET", _core.process_path(self._sandbox_id, self._sel, "events"),
                params={"replay": "true" if self._replay else "false"})
            self._lines = self._response.iter_lines()

    def _next_event(self) -> Optional[ProcessEvent]:
        if self._pending:
            return self._pending.pop(0)
        if self._done:
            return None
        self._open()
        try:
            for line in self._lines:
                d = _core.parse_line(line)
                if d is None:
                    continue
                ev = ProcessEvent.from_json(d)
                self._collector.feed(ev)
                if ev.type == "start" and ev.pid is not None:
                    self._pid = ev.pid
                if ev.type == "exit":
                    self._done = True
                    self._close()
                return ev
        except Exception:
            if not self._interrupted:
                raise
        self._done = True
        self._close()
        return None

    def __iter__(self) -> Iterator[ProcessEvent]:
        while True:
            ev = self._next_event()
            if ev is None:
                return
            yield ev

    def wait(self) -> CommandResult:
        """Waits for the process to exit; raises :class:`CommandExitException` unless it succeeded."""
        for _ in self:
            pass
        return _core.check_result(self._collector.result())

    def _close(self) -> None:
        if self._response is not None:
            self._response.close()
            self._response = None

    def disconnect(self) -> None:
        """Stops reading events (safe from another thread); the process keeps running.

        Re-attach with ``commands.connect(pid)``.
        """
        if self._response is not None and not self._done:
            self._interrupted = True
            interrupt(self._response)
        self._close()

    def kill(self) -> bool:
        """SIGKILL to the process group; False when the process was not running."""
        return _signal(self._api, self._sandbox_id, self._sel, "SIGKILL")

    def signal(self, sig) -> None:
        """Sends a signal (``"SIGTERM"``, ``"TERM"``, ``15`` or :class:`signal.Signals`) to the process group."""
        self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "signal"),
                          json={"signal": _core.signal_name(sig)})

    def send_stdin(self, data: Union[str, bytes]) -> None:
        """Writes to the process's stdin (started with ``stdin=True``)."""
        self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "stdin"),
                          content=_core.stdin_bytes(data))

    def close_stdin(self) -> None:
        self._api.request("POST", _core.process_path(self._sandbox_id, self._sel, "close-stdin"))


def _signal(api: SyncApi, sandbox_id: str, sel, sig) -> bool:
    try:
        api.request("POST", _core.process_path(sandbox_id, sel, "signal"), json={"signal": _core.signal_name(sig)})
        return True
    except (NotFoundError, ConflictError):
        return False


class Commands:
    """Runs commands in a sandbox; ``cmd`` is a shell string or an argv list."""

    def __init__(self, api: SyncApi, sandbox_id: str):
        self._api, self._sandbox_id = api, sandbox_id

    def run(self, cmd: _core.Cmd, background: bool = False, on_stdout=None, on_stderr=None,
            timeout: Optional[float] = None, envs: Optional[Dict[str, str]] = None, cwd: Optional[str] = None,
            user: Optional[str] = None, stdin: bool = False, tag: Optional[str] = None):
        """Runs a command.

        Foreground (default): streams output to ``on_stdout``/``on_stderr`` as it comes and returns a
        :class:`CommandResult`; raises :class:`CommandExitException` (with ``.result``) when it fails.
        ``timeout`` kills it after that many seconds (60 by default, 0 = none).
        Background: returns a :class:`CommandHandle` at once (no timeout unless given).
        """
        body = _core.start_body(cmd, background=background, envs=envs, cwd=cwd, user=user, timeout=timeout,
                                stdin=stdin, tag=tag)
        path = f"/v1/sandboxes/{self._sandbox_id}/processes"
        if background:
            info = ProcessInfo.from_json(self._api.json("POST", path, json=body))
            return CommandHandle(self._api, self._sandbox_id, info.pid, info.tag, on_stdout, on_stderr)
        collector = _core.OutputCollector(on_stdout, on_stderr)
        with self._api.stream("POST", path, json=body) as r:
            for line in r.iter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    collector.feed(ProcessEvent.from_json(d))
        return _core.check_result(collector.result())

    def connect(self, pid_or_tag: Union[int, str], on_stdout=None, on_stderr=None,
                replay: bool = True) -> CommandHandle:
        """Re-attaches to a process by pid or tag: its kept output (unless ``replay=False``), then live output."""
        pid = pid_or_tag if isinstance(pid_or_tag, int) else None
        tag = None if pid is not None else str(pid_or_tag)
        h = CommandHandle(self._api, self._sandbox_id, pid, tag, on_stdout, on_stderr, replay=replay)
        first = h._next_event()  # opens the stream (NotFoundError now) and learns the pid from `start`
        if first is not None:
            h._pending.append(first)
        return h

    def list(self) -> List[ProcessInfo]:
        """Running and recently exited processes."""
        d = self._api.json("GET", f"/v1/sandboxes/{self._sandbox_id}/processes")
        return [ProcessInfo.from_json(p) for p in d.get("processes", [])]

    def kill(self, pid_or_tag: Union[int, str]) -> bool:
        """SIGKILL to the process group; False when no such running process."""
        return _signal(self._api, self._sandbox_id, pid_or_tag, "SIGKILL")

    def signal(self, pid_or_tag: Union[int, str], sig) -> None:
        self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "signal"),
                          json={"signal": _core.signal_name(sig)})

    def send_stdin(self, pid_or_tag: Union[int, str], data: Union[str, bytes]) -> None:
        self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "stdin"),
                          content=_core.stdin_bytes(data))

    def close_stdin(self, pid_or_tag: Union[int, str]) -> None:
        self._api.request("POST", _core.process_path(self._sandbox_id, pid_or_tag, "close-stdin"))
