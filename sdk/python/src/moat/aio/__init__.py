"""Async client: :class:`AsyncSandbox`."""

from .commands import AsyncCommandHandle, AsyncCommands
from .files import AsyncFilesystem, AsyncWatchHandle
from .network import AsyncNetworkLogStream
from .pty import AsyncPty, AsyncPtyHandle
from .sandbox import AsyncSandbox

__all__ = ["AsyncSandbox", "AsyncCommands", "AsyncCommandHandle", "AsyncFilesystem", "AsyncWatchHandle",
           "AsyncPty", "AsyncPtyHandle", "AsyncNetworkLogStream"]
