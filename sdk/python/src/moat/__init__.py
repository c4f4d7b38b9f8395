"""Python SDK for moat, the self-hosted sandbox for AI agents.

    from moat import Sandbox

    with Sandbox.create() as sbx:
        print(sbx.commands.run("echo hello").stdout)
"""

from .aio import AsyncCommandHandle, AsyncNetworkLogStream, AsyncPtyHandle, AsyncSandbox, AsyncWatchHandle
from .commands import CommandHandle, Commands
from .exceptions import (AuthenticationError, CommandExitException, CommandTimeoutError, ConflictError,
                         IdempotencyError, InternalError, InvalidArgumentError, MoatError, NotFoundError, NotSupportedError,
                         PayloadTooLargeError, PermissionDeniedError, SandboxTimeoutError, UnavailableError)
from .files import FileStream, Filesystem, WatchHandle
from .models import (Cause, CommandResult, Context, EntryInfo, Execution, ExecutionError, ExitStatus, FilesystemEvent, Logs,
                     NetworkInfo, NetworkLogEntry, NetworkPolicy, NetworkProposal, ObservedDestination, ProcessEvent,
                     ProcessInfo, Result, SandboxInfo, SnapshotInfo, TemplateInfo, WriteEntry)
from .network import NetworkLogStream
from .pty import Pty, PtyHandle
from .sandbox import Sandbox

__version__ = "0.1.0"

__all__ = [
    "Sandbox", "AsyncSandbox", "Commands", "CommandHandle", "AsyncCommandHandle", "Filesystem", "FileStream",
    "WatchHandle", "AsyncWatchHandle", "Pty", "PtyHandle", "AsyncPtyHandle", "NetworkLogStream",
    "AsyncNetworkLogStream",
    "Cause", "CommandResult", "Context", "EntryInfo", "Execution", "ExecutionError", "ExitStatus", "FilesystemEvent", "Logs",
    "NetworkInfo", "NetworkLogEntry", "NetworkPolicy", "NetworkProposal", "ObservedDestination", "ProcessEvent",
    "ProcessInfo", "Result", "SandboxInfo", "SnapshotInfo", "TemplateInfo", "WriteEntry",
    "MoatError", "InvalidArgumentError", "AuthenticationError", "PermissionDeniedError", "NotFoundError",
    "ConflictError", "IdempotencyError", "PayloadTooLargeError", "SandboxTimeoutError", "UnavailableError", "InternalError",
    "NotSupportedError", "CommandExitException", "CommandTimeoutError",
]
