"""Streaming tar helpers for ``upload_dir``/``download_dir``: a thread runs :mod:`tarfile` against a
bounded queue, so neither direction holds a whole archive in memory (shared by sync and async)."""

from __future__ import annotations

import io
import os
import queue
import tarfile
import threading
from typing import Iterator, Optional

CHUNK = 1 << 20
_END = object()


class _QueueWriter(io.RawIOBase):
    def __init__(self, q: "queue.Queue"):
        self.q = q

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        self.q.put(bytes(b))
        return len(b)


class TarProducer:
    """Packs ``local_dir`` (its contents, not the directory itself) into tar chunks on a thread."""

    def __init__(self, local_dir: str):
        if not os.path.isdir(local_dir):
            raise NotADirectoryError(local_dir)
        self.q: "queue.Queue" = queue.Queue(maxsize=16)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(local_dir,), daemon=True)
        self.thread.start()

    def _run(self, local_dir: str) -> None:
        try:
            w = io.BufferedWriter(_QueueWriter(self.q), buffer_size=CHUNK)
            with tarfile.open(fileobj=w, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for name in sorted(os.listdir(local_dir)):
                    tar.add(os.path.join(local_dir, name), arcname=name)
            w.flush()
        except BaseException as e:  # surfaced to the consumer
            self.error = e
        finally:
            self.q.put(_END)

    def get(self) -> Optional[bytes]:
        """Next chunk, or None at the end (raises the packing error, if any)."""
        item = self.q.get()
        if item is _END:
            if self.error:
                raise self.error
            return None
        return item

    def __iter__(self) -> Iterator[bytes]:
        while True:
            c = self.get()
            if c is None:
                return
            yield c


class _QueueReader(io.RawIOBase):
    def __init__(self, q: "queue.Queue"):
        self.q, self.buf, self.eof = q, b"", False

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.buf and not self.eof:
            item = self.q.get()
            if item is _END:
                self.eof = True
            else:
                self.buf = item
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def _extract(fileobj, local_dir: str) -> None:
    os.makedirs(local_dir, exist_ok=True)
    with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
        if hasattr(tarfile, "data_filter"):
            tar.extractall(local_dir, filter="data")
        else:  # Python < 3.11.4: no extraction filters; refuse escapes, skip links and devices
            root = os.path.realpath(local_dir)
            for m in tar:
                if not (m.isfile() or m.isdir()):
                    continue
                target = os.path.realpath(os.path.join(local_dir, m.name))
                if target != root and not target.startswith(root + os.sep):
                    raise ValueError(f"tar member {m.name!r} leaves {local_dir}")
                tar.extract(m, local_dir)


class IterReader(io.RawIOBase):
    """A readable file over an iterator of byte chunks (sync download)."""

    def __init__(self, chunks: Iterator[bytes]):
        self.chunks, self.buf = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self.buf:
            try:
                self.buf = next(self.chunks)
            except StopIteration:
                return 0
        n = min(len(b), len(self.buf))
        b[:n] = self.buf[:n]
        self.buf = self.buf[n:]
        return n


def extract_chunks(chunks: Iterator[bytes], local_dir: str) -> None:
    _extract(io.BufferedReader(IterReader(chunks), buffer_size=CHUNK), local_dir)


class TarConsumer:
    """Extracts into ``local_dir`` on a thread while the caller ``put``s chunks (async download)."""

    def __init__(self, local_dir: str):
        self.q: "queue.Queue" = queue.Queue(maxsize=16)
        self.error: Optional[BaseException] = None
        self.thread = threading.Thread(target=self._run, args=(local_dir,), daemon=True)
        self.thread.start()

    def _run(self, local_dir: str) -> None:
        try:
            reader = _QueueReader(self.q)
            _extract(io.BufferedReader(reader, buffer_size=CHUNK), local_dir)
            while not reader.eof:  # drain so the producer never blocks
                reader.readinto(bytearray(CHUNK))
        except BaseException as e:
            self.error = e
            while not reader.eof:  # keep draining so put() never blocks forever
                if self.q.get() is _END:
                    break

    def put(self, chunk: bytes) -> None:
        self.q.put(chunk)

    def finish(self) -> None:
        self.q.put(_END)
        self.thread.join()
        if self.error:
            raise self.error
