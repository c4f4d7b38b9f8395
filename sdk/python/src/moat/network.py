"""The stream of :meth:`Sandbox.follow_network_log` (sync)."""

from __future__ import annotations

from typing import Iterator

from . import _core
from ._http import interrupt
from .models import NetworkLogEntry


class NetworkLogStream:
    """Iterator of :class:`NetworkLogEntry` from ``follow_network_log``: the stored entries, then new ones as
    they are logged; it ends when the sandbox is gone. ``stop()``/``close()`` ends it early."""

    def __init__(self, response):
        self._r = response
        self._stopped = False

    def __iter__(self) -> Iterator[NetworkLogEntry]:
        try:
            for line in self._r.iter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    yield NetworkLogEntry.from_json(d)
        except Exception:
            if not self._stopped:
                raise
        finally:
            self._r.close()

    def stop(self) -> None:
        """Ends the stream; safe to call from another thread (a blocked iteration then ends)."""
        self._stopped = True
        interrupt(self._r)

    close = stop

    def __enter__(self) -> "NetworkLogStream":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
