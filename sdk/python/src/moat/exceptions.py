"""Exceptions: one class per error code of moat's JSON error body ``{"error": {"code", "message", "field"}}``."""

from __future__ import annotations

from typing import Any, Optional


class MoatError(Exception):
    """Base class of every error the SDK raises."""

    def __init__(self, message: str, *, code: Optional[str] = None, field: Optional[str] = None,
                 status: Optional[int] = None):
        super().__init__(message if field is None else f"{message} ({field})")
        self.message = message
        self.code = code
        self.field = field
        self.status = status


class InvalidArgumentError(MoatError):
    """400 ``invalid_argument``: a malformed request or a value out of range; ``.field`` names it."""


class AuthenticationError(MoatError):
    """401 ``unauthorized``: the API key is missing or wrong."""


class PermissionDeniedError(MoatError):
    """403 ``permission_denied``: the sandbox's own permissions refuse the operation."""


class NotFoundError(MoatError):
    """404 ``not_found``: unknown sandbox, template, process or path."""


class ConflictError(MoatError):
    """409 ``conflict``: the object is in a state that does not allow the operation."""


class PayloadTooLargeError(MoatError):
    """413 ``payload_too_large``: a JSON body over the daemon's limit."""


class IdempotencyError(MoatError):
    """422 ``unprocessable``: an ``idempotency_key`` was used before for another request."""


class SandboxTimeoutError(MoatError):
    """504 ``timeout``: the operation did not finish in time."""


class UnavailableError(MoatError):
    """503 ``unavailable``: a needed facility (e.g. an isolation tier) is missing on this host."""


class InternalError(MoatError):
    """500 ``internal``: a host failure; the message says what failed."""


class NotSupportedError(MoatError):
    """The moat server does not offer this feature (its route does not exist)."""


class CommandExitException(MoatError):
    """A foreground command ended unsuccessfully (non-zero exit, a signal, or it could not start).

    The full :class:`~moat.models.CommandResult` is kept on the exception: ``.result``, and its fields
    ``.stdout``, ``.stderr``, ``.exit_code``, ``.signal``, ``.timed_out``, ``.error`` are available directly.
    """

    def __init__(self, result: Any):
        self.result = result
        if result.error:
            why = result.error
        elif result.timed_out:
            why = "timed out"
        elif result.signal:
            why = f"killed by {result.signal}"
        else:
            why = f"exit code {result.exit_code}"
        super().__init__(f"command failed: {why}", code="command_exit")

    def __getattr__(self, name: str) -> Any:
        if name in ("stdout", "stderr", "exit_code", "signal", "timed_out", "error"):
            return getattr(self.result, name)
        raise AttributeError(name)


class CommandTimeoutError(CommandExitException, SandboxTimeoutError):
    """A foreground command was killed because its ``timeout`` passed (also a :class:`SandboxTimeoutError`)."""


_BY_CODE = {
    "invalid_argument": InvalidArgumentError,
    "unauthorized": AuthenticationError,
    "permission_denied": PermissionDeniedError,
    "not_found": NotFoundError,
    "conflict": ConflictError,
    "payload_too_large": PayloadTooLargeError,
    "unprocessable": IdempotencyError,
    "timeout": SandboxTimeoutError,
    "unavailable": UnavailableError,
    "internal": InternalError,
}

_BY_STATUS = {400: "invalid_argument", 401: "unauthorized", 403: "permission_denied", 404: "not_found",
              405: "invalid_argument", 409: "conflict", 413: "payload_too_large", 422: "unprocessable",
              503: "unavailable", 504: "timeout"}


def error_from_response(status: int, body: bytes) -> MoatError:
    """Builds the exception for a non-2xx response from its status and JSON error body."""
    import json

    code, message, field = None, None, None
    try:
        detail = json.loads(body)["error"]
        code, message, field = detail.get("code"), detail.get("message"), detail.get("field")
    except Exception:
        message = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
    code = code or _BY_STATUS.get(status, "internal")
    if status == 404 and field is None and (message or "").startswith("no such endpoint"):
        return NotSupportedError(f"this moat server does not support this request: {message}",
                                 code=code, status=status)
    cls = _BY_CODE.get(code, MoatError)
    return cls(message or f"HTTP {status}", code=code, field=field, status=status)
