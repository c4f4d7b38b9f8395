"""``sbx.files``: read, write, list and watch the sandbox's filesystem (sync)."""

from __future__ import annotations

from typing import IO, Iterator, List, Optional, Sequence, Union

from . import _files_core as fc
from . import _core, _tar
from ._http import SyncApi, interrupt
from .models import EntryInfo, FilesystemEvent, WriteEntry


class FileStream:
    """Iterator over a file's bytes as they arrive; close it (or use ``with``) if you stop early."""

    def __init__(self, response):
        self._r = response

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._r.iter_bytes(fc.CHUNK)
        finally:
            self.close()

    def read(self) -> bytes:
        return b"".join(self)

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> "FileStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class WatchHandle:
    """Iterator of :class:`FilesystemEvent` from ``watch_dir``; ``stop()``/``close()`` ends the watch."""

    def __init__(self, response):
        self._r = response
        self._stopped = False

    def __iter__(self) -> Iterator[FilesystemEvent]:
        try:
            for line in self._r.iter_lines():
                d = _core.parse_line(line)
                if d is not None:
                    yield FilesystemEvent.from_json(d)
        except Exception:
            if not self._stopped:
                raise

    def stop(self) -> None:
        """Ends the watch; safe to call from another thread (a blocked iteration then ends)."""
        self._stopped = True
        interrupt(self._r)

    close = stop

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Filesystem:
    """Paths are absolute inside the sandbox, or relative to ``/root``."""

    def __init__(self, api: SyncApi, sandbox_id: str):
        self._api, self._base = api, f"/v1/sandboxes/{sandbox_id}"

    def read(self, path: str, format: str = "text"):
        """Reads a file: ``format="text"`` → str, ``"bytes"`` → bytes, ``"stream"`` → :class:`FileStream`."""
        fc.check_format(format)
        if format == "stream":
            return FileStream(self._api.open_stream("GET", f"{self._base}/files", params={"path": path}))
        with self._api.stream("GET", f"{self._base}/files", params={"path": path}) as r:
            data = r.read()
        return data.decode("utf-8") if format == "text" else data

    def write(self, path: str, data: Union[str, bytes, IO], mode: Union[str, int, None] = None,
              user: Optional[str] = None) -> EntryInfo:
        """Writes (atomically replaces) a file; creates parents. File-likes are streamed in chunks."""
        if isinstance(data, str):
            content = data.encode()
        elif isinstance(data, (bytes, bytearray, memoryview)):
            content = bytes(data)
        else:
            content = fc.file_chunks(data)
        d = self._api.json("PUT", f"{self._base}/files", params=fc.write_params(path, mode, user),
                           content=content, timeout=None)
        return EntryInfo.from_json(d)

    def write_files(self, files: Sequence[Union[WriteEntry, dict]], user: Optional[str] = None) -> List[EntryInfo]:
        """Writes several files (``WriteEntry`` or ``{"path", "data"}`` dicts)."""
        out = []
        for e in files:
            path, data, mode = fc.entry_fields(e)
            out.append(self.write(path, data, mode=mode, user=user))
        return out

    def list(self, path: str, depth: int = 1) -> List[EntryInfo]:
        d = self._api.json("GET", f"{self._base}/fs/list", params={"path": path, "depth": depth})
        return [EntryInfo.from_json(e) for e in d["entries"]]

    def exists(self, path: str) -> bool:
        return bool(self._api.json("GET", f"{self._base}/fs/exists", params={"path": path})["exists"])

    def get_info(self, path: str) -> EntryInfo:
        return EntryInfo.from_json(self._api.json("GET", f"{self._base}/fs/stat", params={"path": path}))

    def make_dir(self, path: str, user: Optional[str] = None) -> bool:
        """Like ``mkdir -p``; False when the directory existed already."""
        body = {"path": path} if user is None else {"path": path, "user": user}
        return bool(self._api.json("POST", f"{self._base}/fs/mkdir", json=body)["created"])

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        d = self._api.json("POST", f"{self._base}/fs/rename", json={"from": old_path, "to": new_path})
        return EntryInfo.from_json(d)

    def remove(self, path: str, recursive: bool = False) -> None:
        params = {"path": path, "recursive": "true"} if recursive else {"path": path}
        self._api.request("DELETE", f"{self._base}/fs", params=params)

    def watch_dir(self, path: str, recursive: bool = False) -> WatchHandle:
        """Watches a directory; iterate the handle for events, ``stop()`` it when done."""
        params = {"path": path, "recursive": "true" if recursive else "false"}
        return WatchHandle(self._api.open_stream("GET", f"{self._base}/fs/watch", params=params))

    def upload_dir(self, local_dir: str, remote_dir: str) -> None:
        """Copies the contents of ``local_dir`` into ``remote_dir`` (created if missing) as a tar stream."""
        producer = _tar.TarProducer(local_dir)
        self._api.request("PUT", f"{self._base}/fs/tar", params={"path": remote_dir}, content=iter(producer),
                          timeout=None)

    def download_dir(self, remote_dir: str, local_dir: str) -> None:
        """Copies the contents of ``remote_dir`` into ``local_dir`` (created if missing) as a tar stream."""
        with self._api.stream("GET", f"{self._base}/fs/tar", params={"path": remote_dir}) as r:
            _tar.extract_chunks(r.iter_bytes(fc.CHUNK), local_dir)
