"""Thin sync and async wrappers over httpx that turn error responses into :mod:`moat.exceptions`."""

from __future__ import annotations

import contextlib
import socket
from typing import Any, AsyncIterator, Iterator, Optional

import httpx

from ._config import REQUEST_TIMEOUT, STREAM_TIMEOUT, ConnectionConfig
from .exceptions import error_from_response


class SyncApi:
    def __init__(self, config: ConnectionConfig, client: Optional[httpx.Client] = None):
        self.config = config
        self.client = client or httpx.Client(base_url=config.api_url, headers=config.headers,
                                             timeout=REQUEST_TIMEOUT)

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self.client.request(method, path, **kw)
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r

    def json(self, method: str, path: str, **kw: Any) -> Any:
        return self.request(method, path, **kw).json()

    @contextlib.contextmanager
    def stream(self, method: str, path: str, **kw: Any) -> Iterator[httpx.Response]:
        kw.setdefault("timeout", STREAM_TIMEOUT)
        with self.client.stream(method, path, **kw) as r:
            if r.status_code >= 400:
                raise error_from_response(r.status_code, r.read())
            yield r

    def open_stream(self, method: str, path: str, **kw: Any) -> httpx.Response:
        """Like :meth:`stream` but the caller closes the response."""
        kw.setdefault("timeout", STREAM_TIMEOUT)
        r = self.client.send(self.client.build_request(method, path, **kw), stream=True)
        if r.status_code >= 400:
            body = r.read()
            r.close()
            raise error_from_response(r.status_code, body)
        return r

    def close(self) -> None:
        self.client.close()


class AsyncApi:
    def __init__(self, config: ConnectionConfig, client: Optional[httpx.AsyncClient] = None):
        self.config = config
        self.client = client or httpx.AsyncClient(base_url=config.api_url, headers=config.headers,
                                                  timeout=REQUEST_TIMEOUT)

    async def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = await self.client.request(method, path, **kw)
        if r.status_code >= 400:
            raise error_from_response(r.status_code, r.content)
        return r

    async def json(self, method: str, path: str, **kw: Any) -> Any:
        return (await self.request(method, path, **kw)).json()

    @contextlib.asynccontextmanager
    async def stream(self, method: str, path: str, **kw: Any) -> AsyncIterator[httpx.Response]:
        kw.setdefault("timeout", STREAM_TIMEOUT)
        async with self.client.stream(method, path, **kw) as r:
            if r.status_code >= 400:
                raise error_from_response(r.status_code, await r.aread())
            yield r

    async def open_stream(self, method: str, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("timeout", STREAM_TIMEOUT)
        r = await self.client.send(self.client.build_request(method, path, **kw), stream=True)
        if r.status_code >= 400:
            body = await r.aread()
            await r.aclose()
            raise error_from_response(r.status_code, body)
        return r

    async def close(self) -> None:
        await self.client.aclose()


def interrupt(response: httpx.Response) -> None:
    """Closes a streaming response so that a read blocked on it in another thread returns now."""
    stream = response.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
    response.close()
