"""Where the daemon is and how to authenticate: arguments, then MOAT_URL / MOAT_API_KEY, then the key file."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Optional

import httpx

from .exceptions import AuthenticationError

DEFAULT_URL = "http://127.0.0.1:6628"
DEFAULT_DATA_DIR = "/var/lib/moat"
# Ordinary requests; streams (commands, watch, files) have no read timeout.
REQUEST_TIMEOUT = httpx.Timeout(120.0, connect=10.0)
STREAM_TIMEOUT = httpx.Timeout(None, connect=10.0)
# Requests whose work grows with the sandbox or the count (snapshot, fork, reset): longer than the rest.
LONG_REQUEST_TIMEOUT = httpx.Timeout(900.0, connect=10.0)


@dataclass(frozen=True)
class ConnectionConfig:
    api_url: str
    api_key: str

    @classmethod
    def resolve(cls, api_key: Optional[str] = None, api_url: Optional[str] = None) -> "ConnectionConfig":
        url = (api_url or os.environ.get("MOAT_URL") or DEFAULT_URL).rstrip("/")
        key = api_key or os.environ.get("MOAT_API_KEY")
        if not key:
            data_dir = os.environ.get("MOAT_DATA_DIR") or DEFAULT_DATA_DIR
            path = os.path.join(data_dir, "api-key")
            try:
                with open(path) as f:
                    key = f.read().strip()
            except OSError as e:
                raise AuthenticationError(
                    f"no API key: pass api_key=, set MOAT_API_KEY, or make {path} readable ({e.strerror})",
                    code="unauthorized") from None
        return cls(api_url=url, api_key=key)

    @property
    def headers(self) -> Dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}", "User-Agent": "moat-python/0.1.0"}

    @property
    def ws_url(self) -> str:
        if self.api_url.startswith("https://"):
            return "wss://" + self.api_url[len("https://"):]
        return "ws://" + self.api_url[len("http://"):] if self.api_url.startswith("http://") else self.api_url
