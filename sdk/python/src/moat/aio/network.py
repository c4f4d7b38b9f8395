"""The stream of :meth:`AsyncSandbox.follow_network_log`."""

from __future__ import annotations

from typing import AsyncIterator

from .. import _core
from ..models import NetworkLogEntry


class AsyncNetworkLogStream:
    """``async for entry in stream``: the stored entries, then new ones as they are logged, until the sandbox
    is gone; ``await stream.stop()`` ends it early."""

    def __init__(self, response):
        self._r = response

    async def __aiter__(self) -> AsyncIterator[NetworkLogEntry]:
        try:
            async for line in self._r.aiter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    yield NetworkLogEntry.from_json(d)
        except Exception:
            if not self._r.is_closed:
                raise
        finally:
            await self._r.aclose()

    async def stop(self) -> None:
        await self._r.aclose()

    close = stop

    async def __aenter__(self) -> "AsyncNetworkLogStream":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.stop()
