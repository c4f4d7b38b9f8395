"""Typed views of moat's API objects (shared by the sync and async clients)."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional


@dataclass
class NetworkPolicy:
    """What a sandbox may reach (its egress policy; see docs/network.md).

    Whatever the policy, a sandbox never reaches the host, another sandbox, link-local addresses (cloud
    metadata) or multicast, and has no IPv6. Entries of ``allow_out`` and ``deny_out`` are IPv4 addresses
    or CIDRs (``"10.1.2.3"``, ``"192.168.5.0/24"``), domains (``"pypi.org"``: that name, from the TLS SNI,
    the HTTP ``Host`` or the DNS question), wildcards (``"*.example.com"``: the names below it, not the
    name itself) and groups (``"@pypi"``, ``"@npm"``, ``"@debian"``, ``"@github"``, ``"@crates"``,
    ``"@huggingface"``, ``"@docker"``: the names a registry serves from). Allow beats deny; private ranges
    (RFC 1918, CGNAT) are refused unless named in ``allow_out``.

    ``mode="audit"`` refuses nothing the policy would refuse but logs it with decision ``audit`` (the
    always-blocked destinations and private ranges stay closed): run an agent so, then take
    :meth:`Sandbox.network_proposal` as its policy. A policy read from the daemon and written back
    (``to_json``) keeps every field.
    """

    #: The public internet (everything not private and not in ``deny_out``).
    allow_internet: bool = True
    #: Destinations allowed even when ``allow_internet`` is off or they are private.
    allow_out: List[str] = field(default_factory=list)
    #: Destinations refused (``"0.0.0.0/0"`` refuses every address not in ``allow_out``).
    deny_out: List[str] = field(default_factory=list)
    #: Outgoing bandwidth cap in Mbit/s (packets over it are dropped, so TCP slows down); None: no cap.
    egress_mbps: Optional[int] = None
    #: Most new outgoing connections per second (attempts over it are dropped); None: no limit.
    connections_per_second: Optional[int] = None
    #: ``"enforce"`` (refuse what the policy denies) or ``"audit"`` (let it through and log it as ``audit``).
    mode: str = "enforce"

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NetworkPolicy":
        return cls(allow_internet=bool(d.get("allow_internet", True)), allow_out=list(d.get("allow_out") or []),
                   deny_out=list(d.get("deny_out") or []), egress_mbps=d.get("egress_mbps"),
                   connections_per_second=d.get("connections_per_second"), mode=d.get("mode") or "enforce")

    def to_json(self) -> Dict[str, Any]:
        def entries(v: Any) -> List[str]:
            return [v] if isinstance(v, str) else [str(c) for c in v or ()]

        d: Dict[str, Any] = {"allow_internet": bool(self.allow_internet), "allow_out": entries(self.allow_out),
                             "deny_out": entries(self.deny_out)}
        for k, v in (("egress_mbps", self.egress_mbps), ("connections_per_second", self.connections_per_second)):
            if v is not None:
                d[k] = int(v)
        if self.mode and self.mode != "enforce":
            d["mode"] = self.mode
        return d


@dataclass
class NetworkInfo:
    """A sandbox's network (``GET /v1/sandboxes/{id}/network``): its address, gateway and egress policy."""

    #: The sandbox's IPv4 address (its ``eth0``).
    ip: str
    #: Its gateway on the host (which answers nothing but forwarding and DNS).
    gateway: str
    policy: NetworkPolicy = field(default_factory=NetworkPolicy)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NetworkInfo":
        return cls(ip=d.get("ip", ""), gateway=d.get("gateway", ""),
                   policy=NetworkPolicy.from_json(d.get("policy") or {}))


@dataclass
class NetworkLogEntry:
    """One entry of a sandbox's connection log (``GET /v1/sandboxes/{id}/network/log``): a TCP connection
    through the daemon's proxy or a DNS question, with what the daemon decided and why."""

    #: Increasing with insertion: pass it as ``after`` to page on or to resume a stream.
    id: int
    #: When the attempt started, milliseconds since the Unix epoch.
    at_ms: int
    #: The same time, RFC 3339.
    at: str
    sandbox_id: str
    #: ``"tcp"`` or ``"dns"``.
    protocol: str
    #: ``"allow"``, ``"deny"`` or ``"audit"`` (let through in audit mode although the policy refuses it).
    decision: str
    #: The rule that decided: ``"allow_out[0]"``, ``"deny_out[2]"``, ``"allow_internet"``,
    #: ``"private range"``, ``"always blocked"``, ``"deny list"``, ...
    rule: str
    #: The address and port the sandbox asked for (TCP); None for DNS.
    dst_ip: Optional[str] = None
    dst_port: Optional[int] = None
    #: The name (TLS SNI, HTTP Host or the DNS question) and where it came from (``"sni"``, ``"host"``,
    #: ``"dns:A"``, ...); None when the connection carried none.
    name: Optional[str] = None
    name_source: Optional[str] = None
    #: The address the daemon connected to (for a name it resolves the name itself).
    dialed: Optional[str] = None
    #: Bytes from the sandbox / to the sandbox, and how long the connection lasted.
    bytes_out: int = 0
    bytes_in: int = 0
    duration_ms: int = 0
    #: Why an allowed connection still failed (the name did not resolve, the server refused, ...).
    error: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NetworkLogEntry":
        return cls(id=d["id"], at_ms=d.get("at_ms", 0), at=d.get("at", ""), sandbox_id=d.get("sandbox_id", ""),
                   protocol=d.get("protocol", ""), decision=d.get("decision", ""), rule=d.get("rule", ""),
                   dst_ip=d.get("dst_ip"), dst_port=d.get("dst_port"), name=d.get("name"),
                   name_source=d.get("name_source"), dialed=d.get("dialed"), bytes_out=d.get("bytes_out", 0),
                   bytes_in=d.get("bytes_in", 0), duration_ms=d.get("duration_ms", 0), error=d.get("error"))


@dataclass
class ObservedDestination:
    """One ``allow_out`` entry of a :class:`NetworkProposal` and what it covers."""

    #: The entry proposed: a group (``"@pypi"``), a domain or an address.
    entry: str
    #: Connections and questions of the log it covers.
    count: int = 0
    #: The names or addresses it covers.
    covers: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ObservedDestination":
        return cls(entry=d["entry"], count=d.get("count", 0), covers=list(d.get("covers") or []))


@dataclass
class NetworkProposal:
    """The tightest egress policy that would have allowed everything in a connection log
    (``GET /v1/sandboxes/{id}/network/proposal``, or over a template's sandboxes): internet off, and in
    ``allow_out`` a group, domain or address per destination seen."""

    policy: NetworkPolicy = field(default_factory=NetworkPolicy)
    #: The proposed ``allow_out`` entries with what each covers and how often.
    observed: List[ObservedDestination] = field(default_factory=list)
    #: Log entries the proposal was made from.
    entries: int = 0

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "NetworkProposal":
        return cls(policy=NetworkPolicy.from_json(d.get("policy") or {}),
                   observed=[ObservedDestination.from_json(o) for o in d.get("observed") or []],
                   entries=d.get("entries", 0))


@dataclass
class SandboxInfo:
    """A sandbox as the API shows it (``GET /v1/sandboxes/{id}``)."""

    sandbox_id: str
    template: str
    isolation: str
    state: str
    created_at: str
    expires_at: str
    metadata: Dict[str, str]
    env_keys: List[str]
    cpu: float
    memory_mb: int
    hostname: str
    #: What the sandbox does when its timeout passes: ``"kill"`` (default) or ``"pause"``.
    on_timeout: str = "kill"
    #: The snapshot it was started from (id), if any.
    snapshot: Optional[str] = None
    #: Its address and egress policy; None when the daemon runs without sandbox networking
    #: (``moat serve --network none``: loopback only) or is older than sandbox networking.
    network: Optional[NetworkInfo] = None
    #: The token that opens the sandbox's exposed ports to someone without the API key (sent as the
    #: ``X-Moat-Access-Token`` header or the ``moat_access_token`` query parameter); "" from older servers.
    access_token: str = ""
    #: Whether its ports answer anyone, without the API key or the access token.
    allow_public_traffic: bool = False
    #: Whether a request for it while it is paused resumes it.
    auto_resume: bool = False
    #: Why it ended, when ``state == "ended"`` (its timeout, the OOM killer, its agent lost, ...).
    ended: Optional["Cause"] = None
    #: What degraded it while it ran (a process the OOM killer ended, a refused fork, a full disk).
    conditions: List["Cause"] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SandboxInfo":
        return cls(sandbox_id=d["id"], template=d["template"], isolation=d["isolation"], state=d["state"],
                   created_at=d["created_at"], expires_at=d["expires_at"], metadata=d.get("metadata") or {},
                   env_keys=d.get("env_keys") or [], cpu=d.get("cpu", 0.0), memory_mb=d.get("memory_mb", 0),
                   hostname=d.get("hostname", ""), on_timeout=d.get("on_timeout") or "kill",
                   snapshot=d.get("snapshot"),
                   network=NetworkInfo.from_json(d["network"]) if d.get("network") else None,
                   access_token=d.get("access_token") or "",
                   allow_public_traffic=bool(d.get("allow_public_traffic")),
                   auto_resume=bool(d.get("auto_resume")),
                   ended=Cause.from_json(d["ended"]) if d.get("ended") else None,
                   conditions=[Cause.from_json(c) for c in d.get("conditions") or []])

    @property
    def id(self) -> str:
        return self.sandbox_id


@dataclass
class Cause:
    """Why a sandbox ended (``SandboxInfo.ended``) or what degraded it (``SandboxInfo.conditions``).

    ``reason``: ``oom``, ``pids_exhausted``, ``disk_full``, ``timeout``, ``idle``, ``agent_lost``,
    ``host_restart``, ``node_lost`` or ``killed_by_policy``."""

    reason: str
    at: str
    message: str
    #: For ``oom``: the process the OOM killer ended ("PID (name)").
    process: Optional[str] = None
    #: For a condition: how many times it happened.
    count: int = 0
    #: For an end: the last lines of the sandbox's own log.
    log: List[str] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Cause":
        return cls(reason=d["reason"], at=d["at"], message=d.get("message", ""), process=d.get("process"),
                   count=d.get("count", 0), log=d.get("log") or [])


@dataclass
class SnapshotInfo:
    """A snapshot (``GET /v1/snapshots/{id}``): a saved filesystem state that sandboxes start from."""

    snapshot_id: str
    #: ``"filesystem"`` (files only; sandboxes started from it run fresh processes) or ``"full"``.
    kind: str
    #: The sandbox it was taken from (which may be gone by now).
    sandbox_id: str
    template: str
    isolation: str
    #: Content digests (``sha256:...``) of its layers above the template, bottom first.
    layers: List[str]
    #: Bytes of the layer this snapshot added.
    size_bytes: int
    created_at: str
    #: How long the source sandbox was frozen while the snapshot was taken, milliseconds.
    frozen_ms: int
    #: The source sandbox's limits (``cpu``, ``memory_mb``, ``pids``, ...); forks get them by default.
    limits: Dict[str, Any] = field(default_factory=dict)
    env_keys: List[str] = field(default_factory=list)
    metadata: Dict[str, str] = field(default_factory=dict)
    name: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "SnapshotInfo":
        return cls(snapshot_id=d["id"], kind=d.get("kind", "filesystem"), sandbox_id=d.get("sandbox_id", ""),
                   template=d.get("template", ""), isolation=d.get("isolation", ""), layers=d.get("layers") or [],
                   size_bytes=d.get("size_bytes", 0), created_at=d.get("created_at", ""),
                   frozen_ms=d.get("frozen_ms", 0), limits=d.get("limits") or {}, env_keys=d.get("env_keys") or [],
                   metadata=d.get("metadata") or {}, name=d.get("name"))

    @property
    def id(self) -> str:
        return self.snapshot_id


@dataclass
class EntryInfo:
    """A file, directory or symlink inside a sandbox."""

    name: str
    path: str
    type: str  # "file" | "dir" | "symlink" | "other"
    size: int
    mode: int
    permissions: str
    uid: int
    gid: int
    modified: int
    symlink_target: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "EntryInfo":
        return cls(name=d["name"], path=d["path"], type=d["type"], size=d["size"], mode=d["mode"],
                   permissions=d["permissions"], uid=d["uid"], gid=d["gid"], modified=d["modified"],
                   symlink_target=d.get("symlink_target"))


@dataclass
class WriteEntry:
    """One file for :meth:`Filesystem.write_files`."""

    path: str
    data: Any
    mode: Optional[str] = None


@dataclass
class FilesystemEvent:
    """An inotify event from ``watch_dir``: ``type`` is create, write, remove, rename or chmod."""

    type: str
    path: str
    timestamp_us: int

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "FilesystemEvent":
        return cls(type=d["type"], path=d["path"], timestamp_us=d.get("timestamp_us", 0))


@dataclass
class ExitStatus:
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    timed_out: bool = False
    error: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ExitStatus":
        return cls(exit_code=d.get("exit_code"), signal=d.get("signal"), timed_out=bool(d.get("timed_out")),
                   error=d.get("error"))


@dataclass
class ProcessInfo:
    """A process as ``commands.list()`` shows it."""

    pid: int
    tag: Optional[str]
    cmd: List[str]
    cwd: str
    user: str
    pty: bool
    stdin_open: bool
    running: bool
    exit: Optional[ExitStatus]
    started_at_us: int
    #: The variables its start set (not those inherited from the sandbox).
    env: Dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ProcessInfo":
        return cls(pid=d["pid"], tag=d.get("tag"), cmd=d.get("cmd") or [], cwd=d.get("cwd", ""),
                   user=d.get("user", ""), pty=bool(d.get("pty")), stdin_open=bool(d.get("stdin_open")),
                   running=bool(d.get("running")), exit=ExitStatus.from_json(d["exit"]) if d.get("exit") else None,
                   started_at_us=d.get("started_at_us", 0), env=dict(d.get("env") or {}))


@dataclass
class ProcessEvent:
    """One event of a process stream.

    ``type`` is ``start`` (``pid``, ``tag``), ``stdout``/``stderr``/``pty`` (``data`` bytes, ``text``),
    ``dropped`` (``dropped_bytes`` lost before this reader attached), ``exit`` (``exit``), or, instead of
    ``exit`` when the stream broke before the process's end was known (its sandbox ended), ``error``
    (``message``).
    """

    type: str
    data: bytes = b""
    pid: Optional[int] = None
    tag: Optional[str] = None
    dropped_bytes: int = 0
    exit: Optional[ExitStatus] = None
    timestamp_us: int = 0
    message: Optional[str] = None
    _text: Optional[str] = field(default=None, repr=False)

    @property
    def text(self) -> str:
        """The output as text (undecodable bytes replaced)."""
        return self._text if self._text is not None else self.data.decode("utf-8", "replace")

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ProcessEvent":
        t = d.get("type", "")
        if t in ("stdout", "stderr", "pty"):
            if d.get("data") is not None:
                text = d["data"]
                return cls(type=t, data=text.encode(), _text=text, timestamp_us=d.get("timestamp_us", 0))
            raw = base64.b64decode(d.get("data_b64") or "")
            return cls(type=t, data=raw, timestamp_us=d.get("timestamp_us", 0))
        if t == "start":
            return cls(type=t, pid=d.get("pid"), tag=d.get("tag"))
        if t == "dropped":
            return cls(type=t, dropped_bytes=d.get("bytes", 0))
        if t == "exit":
            return cls(type=t, exit=ExitStatus.from_json(d))
        if t == "error":
            return cls(type=t, message=d.get("message"))
        return cls(type=t)


@dataclass
class CommandResult:
    """How a command ended, with its collected output."""

    stdout: str
    stderr: str
    exit_code: Optional[int]
    signal: Optional[str] = None
    timed_out: bool = False
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.signal and not self.error and not self.timed_out


@dataclass
class TemplateInfo:
    name: str
    source: str
    status: str
    size_bytes: int
    created_at: str
    error: Optional[str] = None

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "TemplateInfo":
        return cls(name=d["name"], source=d["source"], status=d["status"], size_bytes=d.get("size_bytes", 0),
                   created_at=d.get("created_at", ""), error=d.get("error"))


# --- code interpreter -------------------------------------------------------------------------------

@dataclass
class Result:
    """One rich result of ``run_code`` (a displayed value or the cell's final expression)."""

    text: Optional[str] = None
    html: Optional[str] = None
    markdown: Optional[str] = None
    png: Optional[str] = None
    svg: Optional[str] = None
    jpeg: Optional[str] = None
    latex: Optional[str] = None
    json: Optional[Any] = None
    is_main_result: bool = False
    extra: Dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Result":
        known = ("text", "html", "markdown", "png", "svg", "jpeg", "latex", "json", "is_main_result", "type")
        return cls(text=d.get("text"), html=d.get("html"), markdown=d.get("markdown"), png=d.get("png"),
                   svg=d.get("svg"), jpeg=d.get("jpeg"), latex=d.get("latex"), json=d.get("json"), is_main_result=bool(d.get("is_main_result")),
                   extra={k: v for k, v in d.items() if k not in known})


@dataclass
class Context:
    """A code interpreter context (one kernel; state persists between its cells)."""

    id: str
    language: str
    cwd: str

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "Context":
        return cls(id=d["id"], language=d.get("language", ""), cwd=d.get("cwd", ""))


@dataclass
class Logs:
    stdout: List[str] = field(default_factory=list)
    stderr: List[str] = field(default_factory=list)


@dataclass
class ExecutionError:
    name: str
    value: str
    traceback: str

    @classmethod
    def from_json(cls, d: Dict[str, Any]) -> "ExecutionError":
        tb = d.get("traceback", "")
        if isinstance(tb, list):
            tb = "\n".join(tb)
        return cls(name=d.get("name", ""), value=d.get("value", ""), traceback=tb)


@dataclass
class Execution:
    """What ``run_code`` returns: results, logs, the error if the code raised, the execution counter."""

    results: List[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: Optional[ExecutionError] = None
    execution_count: Optional[int] = None

    @property
    def text(self) -> Optional[str]:
        """Text of the main result (the cell's last expression), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None
