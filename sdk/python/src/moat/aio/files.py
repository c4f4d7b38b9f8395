"""``sbx.files`` for :class:`moat.AsyncSandbox`."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, List, Optional, Sequence, Union

from .. import _files_core as fc
from .. import _core, _tar
from .._http import AsyncApi
from ..models import EntryInfo, FilesystemEvent, WriteEntry


class AsyncFileStream:
    """``async for chunk in stream``; ``await stream.close()`` if you stop early."""

    def __init__(self, response):
        self._r = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for c in self._r.aiter_bytes(fc.CHUNK):
                yield c
        finally:
            await self.close()

    async def read(self) -> bytes:
        return b"".join([c async for c in self])

    async def close(self) -> None:
        await self._r.aclose()


class AsyncWatchHandle:
    """``async for event in handle``; ``await handle.stop()`` ends the watch."""

    def __init__(self, response):
        self._r = response

    async def __aiter__(self) -> AsyncIterator[FilesystemEvent]:
        try:
            async for line in self._r.aiter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    yield FilesystemEvent.from_json(d)
        except Exception:
            if not self._r.is_closed:
                raise

    async def stop(self) -> None:
        await self._r.aclose()

    close = stop


async def _async_chunks(data: Any) -> AsyncIterator[bytes]:
    if hasattr(data, "__aiter__"):
        async for c in data:
            yield c.encode() if isinstance(c, str) else c
        return
    while True:
        c = await asyncio.to_thread(data.read, fc.CHUNK)
        if not c:
            return
        yield c.encode() if isinstance(c, str) else c


async def _tar_chunks(producer: _tar.TarProducer) -> AsyncIterator[bytes]:
    while True:
        c = await asyncio.to_thread(producer.get)
        if c is None:
            return
        yield c


class AsyncFilesystem:
    """See :class:`moat.files.Filesystem`; every method is a coroutine."""

    def __init__(self, api: AsyncApi, sandbox_id: str):
        self._api, self._base = api, f"/v1/sandboxes/{sandbox_id}"

    async def read(self, path: str, format: str = "text"):
        fc.check_format(format)
        if format == "stream":
            return AsyncFileStream(await self._api.open_stream("GET", f"{self._base}/files", params={"path": path}))
        async with self._api.stream("GET", f"{self._base}/files", params={"path": path}) as r:
            data = await r.aread()
        return data.decode("utf-8") if format == "text" else data

    async def write(self, path: str, data: Any, mode: Union[str, int, None] = None,
                    user: Optional[str] = None) -> EntryInfo:
        """``data``: str, bytes, a binary file-like (read on a thread) or an async iterable of bytes."""
        if isinstance(data, str):
            content: Any = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            content = bytes(data)
        else:
            content = _async_chunks(data)
        d = await self._api.json("PUT", f"{self._base}/files", params=fc.write_params(path, mode, user),
                                 content=content, timeout=None)
        return EntryInfo.from_json(d)

    async def write_files(self, files: Sequence[Union[WriteEntry, dict]], user: Optional[str] = None) -> List[EntryInfo]:
        out = []
        for e in files:
            path, data, mode = fc.entry_fields(e)
            out.append(await self.write(path, data, mode=mode, user=user))
        return out

    async def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        d = await self._api.json("GET", f"{self._base}/fs/list", params={"path": path, "depth": depth})
        return [EntryInfo.from_json(e) for e in d["entries"]]

    async def exists(self, path: str) -> bool:
        return bool((await self._api.json("GET", f"{self._base}/fs/exists", params={"path": path}))["exists"])

    async def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_json(await self._api.json("GET", f"{self._base}/fs/stat", params={"path": path}))

    async def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        body = {"path": path} if user is None else {"path": path, "user": user}
        return bool((await self._api.json("POST", f"{self._base}/fs/mkdir", json=body))["created"])

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        d = await self._api.json("POST", f"{self._base}/fs/rename", json={"from": old_path, "to": new_path})
        return EntryInfo.from_json(d)

    async def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true"} if recursive else {"path": path}
        await self._api.request("DELETE", f"{self._base}/fs", params=params)

    async def watch_dir(self, path: str, recursive: bool = False) -> AsyncWatchHandle:
        params = {"path": path, "recursive": "true" if recursive else "false"}
        return AsyncWatchHandle(await self._api.open_stream("GET", f"{self._base}/fs/watch", params=params))

    async def upload_dir(self, local_dir: str, remote_dir: str) -> None:
        producer = _tar.TarProducer(local_dir)
        await self._api.request("PUT", f"{self._base}/fs/tar", params={"path": remote_dir},
                                content=_tar_chunks(producer), timeout=None)

    async def download_dir(self, remote_dir: str, local_dir: str) -> None:
        consumer = _tar.TarConsumer(local_dir)
        try:
            async with self._api.stream("GET", f"{self._base}/fs/tar", params={"path": remote_dir}) as r:
                async for c in r.aiter_bytes(fc.CHUNK):
                    await asyncio.to_thread(consumer.put, c)
        finally:
            await asyncio.to_thread(consumer.finish)
