"""Request bodies and stream interpretation shared by the sync and async clients (no I/O here)."""

from __future__ import annotations

import json
from typing import Any, Callable, Dict, List, Optional, Sequence, Union
from urllib.parse import quote, urlsplit

from .exceptions import CommandExitException, CommandTimeoutError, InvalidArgumentError, NotFoundError
from .models import CommandResult, Execution, ExecutionError, NetworkPolicy, ProcessEvent, Result, SnapshotInfo

Cmd = Union[str, Sequence[str]]
SnapshotRef = Union[str, SnapshotInfo]  # a snapshot id, its name, or the snapshot
OutputHandler = Optional[Callable[[str], Any]]
PolicyLike = Union[NetworkPolicy, Dict[str, Any]]  # a policy object or its JSON form

DEFAULT_COMMAND_TIMEOUT = 60.0


def idempotency_headers(key: Optional[str]) -> Dict[str, str]:
    """The header that makes a create idempotent: a retry with the same key returns the same sandbox."""
    return {"Idempotency-Key": key} if key else {}


def ended_error(d: Dict[str, Any]) -> Optional[NotFoundError]:
    """The NotFoundError of a sandbox that ended on its own (``state == "ended"``), saying why."""
    if d.get("state") != "ended":
        return None
    e = d.get("ended") or {}
    return NotFoundError(f"sandbox {d.get('id')} ended at {e.get('at')} ({e.get('reason')}): {e.get('message')}",
                         code="not_found", status=404)


def create_body(template, timeout, envs, metadata, cpu, memory_mb, isolation, snapshot=None,
                on_timeout=None, network=None, allow_public_traffic=None, secrets=None,
                auto_resume=None, idle_timeout=None) -> Dict[str, Any]:
    body: Dict[str, Any] = {}
    for k, v in (("template", template), ("timeout", timeout), ("cpu", cpu), ("memory_mb", memory_mb),
                 ("isolation", isolation), ("snapshot", snapshot_ref(snapshot)), ("on_timeout", on_timeout),
                 ("network", policy_json(network) if network is not None else None),
                 ("allow_public_traffic", None if allow_public_traffic is None else bool(allow_public_traffic)),
                 ("auto_resume", None if auto_resume is None else bool(auto_resume)),
                 ("idle_timeout", idle_timeout)):
        if v is not None:
            body[k] = v
    if envs:
        body["env"] = dict(envs)
    if metadata:
        body["metadata"] = dict(metadata)
    if secrets:
        body["secrets"] = [dict(x) for x in secrets]
    return body


def list_params(metadata: Optional[Dict[str, str]], state: Optional[str]) -> List[tuple]:
    params = [("metadata", f"{k}={v}") for k, v in (metadata or {}).items()]
    if state:
        params.append(("state", state))
    return params


# --- network and exposed ports ----------------------------------------------------------------------

def _cidrs(v: Any) -> List[str]:
    if v is None:
        return []
    return [v] if isinstance(v, str) else [str(c) for c in v]


def policy_json(policy: PolicyLike) -> Dict[str, Any]:
    """The JSON of an egress policy given as a :class:`NetworkPolicy` or a dict (passed on as is, so that
    the daemon names any unknown key)."""
    if isinstance(policy, NetworkPolicy):
        return policy.to_json()
    if isinstance(policy, dict):
        d = dict(policy)
        for k in ("allow_out", "deny_out"):
            if k in d:
                d[k] = _cidrs(d[k])
        return d
    raise InvalidArgumentError(f"a network policy is a NetworkPolicy or a dict, not {type(policy).__name__}",
                               code="invalid_argument", field="network")


def set_network_body(allow_internet: Union[bool, PolicyLike], allow_out, deny_out) -> Dict[str, Any]:
    """``PUT /v1/sandboxes/{id}/network`` body: a policy object/dict, or the three fields."""
    if isinstance(allow_internet, (NetworkPolicy, dict)):
        if allow_out is not None or deny_out is not None:
            raise InvalidArgumentError("give either a policy or allow_out/deny_out, not both",
                                       code="invalid_argument", field="network")
        return policy_json(allow_internet)
    return {"allow_internet": bool(allow_internet), "allow_out": _cidrs(allow_out), "deny_out": _cidrs(deny_out)}


def network_log_params(decision: Optional[str], after: Optional[int], limit: Optional[int],
                       follow: bool = False) -> Dict[str, str]:
    """``GET /v1/sandboxes/{id}/network/log`` query (the daemon checks the values: an unknown ``decision``
    is an :class:`InvalidArgumentError` with ``field == "decision"``)."""
    params: Dict[str, str] = {}
    for k, v in (("decision", decision), ("after", after), ("limit", limit)):
        if v is not None:
            params[k] = str(v)
    if follow:
        params["follow"] = "true"
    return params


def template_path(template: Any, action: str = "") -> str:
    name = getattr(template, "name", template)  # a TemplateInfo or its name
    if not name:
        raise InvalidArgumentError("a template name is required", code="invalid_argument", field="template")
    p = f"/v1/templates/{name}"
    return f"{p}/{action}" if action else p


def check_port(port: Any) -> int:
    ok = isinstance(port, int) and not isinstance(port, bool) or isinstance(port, str) and port.isdigit()
    p = int(port) if ok else 0
    if not 1 <= p <= 65535:
        raise InvalidArgumentError(f"port {port!r} must be 1..65535", code="invalid_argument", field="port")
    return p


def port_base_url(api_url: str, sandbox_id: str, port: Any, domain: Optional[str] = None) -> str:
    """Base URL of a sandbox port: path form under ``api_url``, or host form ``{port}-{id}.{domain}`` (with
    ``api_url``'s scheme, or the scheme ``domain`` starts with)."""
    p = check_port(port)
    if domain is None:
        return f"{api_url.rstrip('/')}/v1/sandboxes/{sandbox_id}/ports/{p}"
    domain = domain.rstrip("/")
    if "://" in domain:
        scheme, domain = domain.split("://", 1)
    else:
        scheme = urlsplit(api_url).scheme or "http"
    return f"{scheme}://{p}-{sandbox_id}.{domain}"


def port_url(base: str, path: str, token: Optional[str]) -> str:
    """``base`` + ``path`` (query kept), with ``moat_access_token=token`` added when a token is given."""
    path = path or "/"
    if not path.startswith("/"):
        path = "/" + path
    url = base + path
    if token:
        url += ("&" if "?" in path else "?") + "moat_access_token=" + quote(token, safe="")
    return url


# --- snapshots, forks, reset, pause -----------------------------------------------------------------

def snapshot_ref(snapshot: Any) -> Optional[str]:
    """A snapshot id or name, from a :class:`SnapshotInfo` or the string itself."""
    return getattr(snapshot, "snapshot_id", snapshot)


def snapshot_path(snapshot: Any, action: str = "") -> str:
    ref = snapshot_ref(snapshot)
    if not ref:
        raise InvalidArgumentError("a snapshot id or name is required", code="invalid_argument", field="snapshot")
    p = f"/v1/snapshots/{ref}"
    return f"{p}/{action}" if action else p


def snapshot_body(name, metadata, kind) -> Dict[str, Any]:
    """``POST /v1/sandboxes/{id}/snapshots`` body."""
    body: Dict[str, Any] = {k: v for k, v in (("name", name), ("kind", kind)) if v is not None}
    if metadata:
        body["metadata"] = dict(metadata)
    return body


def fork_body(count, timeout, metadata, envs, on_timeout) -> Dict[str, Any]:
    """``POST /v1/snapshots/{id}/fork`` body (the daemon checks ``count``: 1..100)."""
    body: Dict[str, Any] = {"count": count}
    for k, v in (("timeout", timeout), ("on_timeout", on_timeout)):
        if v is not None:
            body[k] = v
    if metadata:
        body["metadata"] = dict(metadata)
    if envs:
        body["env"] = dict(envs)
    return body


def reset_body(snapshot) -> Dict[str, Any]:
    ref = snapshot_ref(snapshot)
    return {"snapshot": ref} if ref is not None else {}


def resume_body(timeout) -> Dict[str, Any]:
    return {"timeout": int(timeout)} if timeout is not None else {}


def snapshot_matches(s: SnapshotInfo, sandbox_id: Optional[str], metadata: Optional[Dict[str, str]]) -> bool:
    """The client-side filter of ``list_snapshots``."""
    if sandbox_id is not None and s.sandbox_id != sandbox_id:
        return False
    return all(s.metadata.get(k) == v for k, v in (metadata or {}).items())


def start_body(cmd: Cmd, *, background: bool, envs=None, cwd=None, user=None, timeout=None, stdin=False,
               tag=None, pty=None) -> Dict[str, Any]:
    """``POST .../processes`` body. A string runs through the shell, a list is argv."""
    body: Dict[str, Any] = {"background": background}
    if isinstance(cmd, str):
        body["command"] = cmd
    else:
        body["cmd"] = [str(a) for a in cmd]
    if timeout is None and not background:
        timeout = DEFAULT_COMMAND_TIMEOUT
    if timeout:
        body["timeout"] = float(timeout)
    for k, v in (("cwd", cwd), ("user", user), ("tag", tag)):
        if v is not None:
            body[k] = v
    if envs:
        body["env"] = dict(envs)
    if stdin:
        body["stdin"] = True
    if pty is not None:
        body["pty"] = {"cols": pty[0], "rows": pty[1]}
    return body


def parse_line(line: Union[str, bytes]) -> Optional[Dict[str, Any]]:
    line = line.strip() if isinstance(line, str) else line.strip().decode()
    return json.loads(line) if line else None


class OutputCollector:
    """Feeds process events to callbacks and collects stdout/stderr into a :class:`CommandResult`."""

    def __init__(self, on_stdout: OutputHandler = None, on_stderr: OutputHandler = None, collect: bool = True):
        self.on_stdout, self.on_stderr, self.collect = on_stdout, on_stderr, collect
        self.stdout, self.stderr = bytearray(), bytearray()
        self.pid: Optional[int] = None
        self.tag: Optional[str] = None
        self.exit = None
        self.broken: Optional[str] = None

    def feed(self, ev: ProcessEvent) -> None:
        if ev.type == "start":
            self.pid, self.tag = ev.pid, ev.tag
        elif ev.type in ("stdout", "pty"):
            if self.collect:
                self.stdout += ev.data
            if self.on_stdout:
                self.on_stdout(ev.text)
        elif ev.type == "stderr":
            if self.collect:
                self.stderr += ev.data
            if self.on_stderr:
                self.on_stderr(ev.text)
        elif ev.type == "exit":
            self.exit = ev.exit
        elif ev.type == "error":
            self.broken = ev.message

    def result(self) -> CommandResult:
        ex = self.exit
        res = CommandResult(stdout=self.stdout.decode("utf-8", "replace"),
                            stderr=self.stderr.decode("utf-8", "replace"),
                            exit_code=ex.exit_code if ex else None, signal=ex.signal if ex else None,
                            timed_out=ex.timed_out if ex else False,
                            error=ex.error if ex else (self.broken or "the event stream ended before the process exited"))
        return res


def check_result(res: CommandResult) -> CommandResult:
    """E2B-style: raise when the command did not succeed; the result stays on the exception."""
    if res.timed_out:
        raise CommandTimeoutError(res)
    if not res.ok:
        raise CommandExitException(res)
    return res


def code_body(code: str, language, context, timeout, envs) -> Dict[str, Any]:
    body: Dict[str, Any] = {"code": code}
    context_id = getattr(context, "id", context)  # a context object or its id
    for k, v in (("language", language), ("context_id", context_id), ("timeout", timeout)):
        if v is not None:
            body[k] = v
    if envs:
        body["env"] = dict(envs)
    return body


class ExecutionCollector:
    """Builds an :class:`Execution` from the ``/code`` NDJSON events, firing callbacks as they come."""

    def __init__(self, on_stdout=None, on_stderr=None, on_result=None, on_error=None):
        self.on_stdout, self.on_stderr, self.on_result, self.on_error = on_stdout, on_stderr, on_result, on_error
        self.execution = Execution()

    def feed(self, d: Dict[str, Any]) -> None:
        t, ex = d.get("type"), self.execution
        if t in ("stdout", "stderr"):
            text = d.get("text", d.get("data", ""))
            getattr(ex.logs, t).append(text)
            cb = self.on_stdout if t == "stdout" else self.on_stderr
            if cb:
                cb(text)
        elif t == "result":
            r = Result.from_json(d)
            ex.results.append(r)
            if self.on_result:
                self.on_result(r)
        elif t == "error":
            ex.error = ExecutionError.from_json(d)
            if self.on_error:
                self.on_error(ex.error)
        elif t in ("end", "execution_count", "start") and d.get("execution_count") is not None:
            ex.execution_count = d["execution_count"]


def signal_name(sig: Any) -> str:
    """Accepts ``"SIGTERM"``, ``"TERM"``, ``15`` or a :class:`signal.Signals`."""
    name = getattr(sig, "name", None)
    return name if name else str(sig)


def process_path(sandbox_id: str, pid_or_tag: Union[int, str], action: str = "") -> str:
    p = f"/v1/sandboxes/{sandbox_id}/processes/{pid_or_tag}"
    return f"{p}/{action}" if action else p


def stdin_bytes(data: Union[str, bytes]) -> bytes:
    return data.encode() if isinstance(data, str) else bytes(data)


DEFAULT_PTY_CMD = ["/bin/bash", "-i", "-l"]


def pty_body(cols: int, rows: int, cmd, user, cwd, envs, timeout, tag) -> Dict[str, Any]:
    env = {"TERM": "xterm-256color"}
    env.update(envs or {})
    body = start_body(cmd if cmd is not None else DEFAULT_PTY_CMD, background=True, envs=env, cwd=cwd, user=user,
                      timeout=timeout, stdin=True, tag=tag, pty=(cols, rows))
    return body


def ws_event(text: str) -> Optional[ProcessEvent]:
    d = parse_line(text)
    return ProcessEvent.from_json(d) if d else None
