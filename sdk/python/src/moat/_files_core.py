"""Shared pieces of the sync and async filesystem APIs."""

from __future__ import annotations

from typing import Any, Dict, Optional

CHUNK = 1 << 20


def write_params(path: str, mode, user: Optional[str]) -> Dict[str, str]:
    params = {"path": path}
    if mode is not None:
        params["mode"] = format(mode, "o") if isinstance(mode, int) else str(mode)
    if user is not None:
        params["user"] = user
    return params


def file_chunks(f: Any):
    """Reads a binary (or text) file-like in 1 MiB chunks."""
    while True:
        c = f.read(CHUNK)
        if not c:
            return
        yield c.encode() if isinstance(c, str) else c


def entry_fields(e: Any):
    """(path, data, mode) of a WriteEntry or a dict."""
    if isinstance(e, dict):
        return e["path"], e["data"], e.get("mode")
    return e.path, e.data, getattr(e, "mode", None)


def check_format(format: str) -> None:
    if format not in ("text", "bytes", "stream"):
        raise ValueError(f"format must be 'text', 'bytes' or 'stream', not {format!r}")
