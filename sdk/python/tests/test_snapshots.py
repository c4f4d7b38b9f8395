"""Snapshots, forks, reset, pause/resume against the real daemon (sync client)."""

import time
import uuid

import pytest

import moat
from moat import Sandbox, SnapshotInfo

# A shell counter that lives in the shell's memory and publishes each value atomically: after a
# resume it must continue from where it was (a restarted process would start again at 1).
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /opt/c.tmp; mv /opt/c.tmp /opt/counter; sleep 0.1; done"


def _read_counter(sbx) -> int:
    return int(sbx.files.read("/opt/counter").strip())


def _wait_counter(sbx, above: int, within: float = 30.0) -> int:
    deadline = time.time() + within
    while time.time() < deadline:
        if sbx.files.exists("/opt/counter"):
            v = _read_counter(sbx)
            if v > above:
                return v
        time.sleep(0.1)
    raise AssertionError(f"the counter did not get past {above} in {within} s")


def _kill_all(sandboxes) -> None:
    for s in sandboxes:
        try:
            s.kill()
        finally:
            s.close()


def test_snapshot_fork_diverge(daemon):
    tag = uuid.uuid4().hex
    name = f"sdk-{tag[:12]}"
    made, snap = [], None
    src = Sandbox.create(timeout=600, envs={"GREETING": "hi"}, metadata={"suite": tag})
    made.append(src)
    try:
        src.files.write("/opt/state/a.txt", "from the source")
        src.files.write("/opt/state/b.bin", bytes(range(256)))
        src.commands.run("rm /etc/issue.net")  # a deletion is part of the snapshot too (a whiteout)
        snap = src.create_snapshot(name=name, metadata={"suite": tag})
        assert isinstance(snap, SnapshotInfo)
        assert snap.id.startswith("snap_") and snap.id == snap.snapshot_id
        assert (snap.name, snap.kind, snap.sandbox_id, snap.template, snap.isolation) == (
            name, "filesystem", src.id, "base", "container")
        assert len(snap.layers) == 1 and snap.layers[0].startswith("sha256:")
        assert snap.size_bytes > 0 and snap.frozen_ms >= 0 and snap.created_at
        assert (snap.env_keys, snap.metadata, snap.limits["memory_mb"]) == (["GREETING"], {"suite": tag}, 512)
        assert Sandbox.get_snapshot(name) == snap
        assert Sandbox.get_snapshot(snap.id) == snap
        assert [s.id for s in Sandbox.list_snapshots(metadata={"suite": tag})] == [snap.id]
        assert [s.id for s in Sandbox.list_snapshots(sandbox_id=src.id)] == [snap.id]
        assert snap.id in [s.id for s in Sandbox.list_snapshots()]
        assert src.is_running()  # the source keeps running
        src.files.write("/opt/state/a.txt", "changed after the snapshot")

        forks = Sandbox.fork(name, 3, timeout=600, metadata={"suite": tag}, envs={"EXTRA": "x"})
        made += forks
        assert len(forks) == 3 and len({f.id for f in forks}) == 3
        for i, f in enumerate(forks):
            assert f.info.metadata == {"suite": tag, "moat.fork-index": str(i)}
            assert (f.info.snapshot, f.info.template, f.info.state) == (snap.id, "base", "running")
            assert f.files.read("/opt/state/a.txt") == "from the source"
            assert f.files.read("/opt/state/b.bin", format="bytes") == bytes(range(256))
            assert not f.files.exists("/etc/issue.net")
            assert f.commands.run("echo $GREETING $EXTRA").stdout == "hi x\n"
        for i, f in enumerate(forks):  # diverge: each writes its own state
            f.files.write("/opt/state/a.txt", f"fork {i}")
            f.commands.run(f"touch /opt/state/only-{i}")
        for i, f in enumerate(forks):
            assert f.files.read("/opt/state/a.txt") == f"fork {i}"
            assert sorted(e.name for e in f.files.list("/opt/state")) == ["a.txt", "b.bin", f"only-{i}"]
        assert src.files.read("/opt/state/a.txt") == "changed after the snapshot"
        assert sorted(s.sandbox_id for s in Sandbox.list(metadata={"suite": tag})) == sorted(s.id for s in made)

        one = Sandbox.create(snapshot=snap, timeout=600)  # a SnapshotInfo works as well as its id or name
        made.append(one)
        assert one.info.snapshot == snap.id and one.info.env_keys == ["GREETING"]
        assert one.files.read("/opt/state/a.txt") == "from the source"
    finally:
        _kill_all(made)
        if snap is not None:
            assert Sandbox.delete_snapshot(snap.id) is True
    assert Sandbox.delete_snapshot(snap.id) is False
    with pytest.raises(moat.NotFoundError):
        Sandbox.get_snapshot(name)
    assert Sandbox.list_snapshots(metadata={"suite": tag}) == []


def test_reset_to_snapshot_and_to_origin(daemon):
    made, snaps = [], []
    sbx = Sandbox.create(timeout=600)
    made.append(sbx)
    try:
        sbx.files.write("/opt/r/keep.txt", "v1")
        snaps.append(sbx.create_snapshot())
        snap = snaps[0]
        assert snap.name is None
        sbx.files.write("/opt/r/keep.txt", "v2")
        sbx.files.write("/opt/r/new.txt", "new")
        sbx.commands.run("rm /etc/issue.net")
        h = sbx.commands.run("sleep 600", background=True, tag="sleeper")
        assert h.pid > 0

        sbx.reset()  # no snapshot: back to what it was created from (here the clean template)
        assert (sbx.info.state, sbx.info.id, sbx.info.snapshot) == ("running", sbx.id, None)
        assert not sbx.files.exists("/opt/r")
        assert sbx.files.exists("/etc/issue.net")
        assert not any(p.running for p in sbx.commands.list()), "reset must kill every process"
        assert sbx.commands.run("echo ok").stdout == "ok\n"  # and the sandbox works afterwards

        sbx.commands.run("sleep 600", background=True)
        sbx.reset(snap.id)
        assert (sbx.info.state, sbx.info.snapshot) == ("running", snap.id)
        assert sbx.files.read("/opt/r/keep.txt") == "v1"
        assert not sbx.files.exists("/opt/r/new.txt")
        assert not any(p.running for p in sbx.commands.list())

        sbx.files.write("/opt/r/keep.txt", "v3")
        sbx.reset()  # after reset(snapshot) the sandbox counts as started from that snapshot
        assert sbx.files.read("/opt/r/keep.txt") == "v1"

        fork = Sandbox.fork(snap, 1, timeout=600)[0]
        made.append(fork)
        fork.files.write("/opt/r/keep.txt", "fork changed it")
        fork.reset()  # a sandbox started from a snapshot goes back to that snapshot
        assert fork.info.snapshot == snap.id
        assert fork.files.read("/opt/r/keep.txt") == "v1"

        sbx.pause()
        sbx.reset()  # a paused sandbox can be reset; it comes back running
        assert sbx.info.state == "running"
        assert sbx.files.read("/opt/r/keep.txt") == "v1"

        with pytest.raises(moat.NotFoundError) as e:
            sbx.reset("no-such-snapshot")
        assert e.value.field == "snapshot"
    finally:
        _kill_all(made)
        for s in snaps:
            Sandbox.delete_snapshot(s)


def test_pause_resume_keeps_processes(daemon):
    with Sandbox.create(timeout=600) as sbx:
        sbx.commands.run(COUNTER, background=True, tag="counter")
        before = _wait_counter(sbx, 5)
        sbx.pause()
        assert sbx.info.state == "paused" and sbx.get_info().state == "paused"
        assert sbx.id in [s.sandbox_id for s in Sandbox.list(state="paused")]
        assert sbx.is_running() is False
        with pytest.raises(moat.ConflictError) as e:
            sbx.commands.run("true")
        assert "paused" in e.value.message
        with pytest.raises(moat.ConflictError):
            sbx.files.read("/opt/counter")
        with pytest.raises(moat.ConflictError):
            sbx.pause()  # already paused
        time.sleep(2)  # frozen: the counter would have moved ~20 steps if it ran

        old_expiry = sbx.info.expires_at
        assert sbx.resume(timeout=3600) is True
        assert sbx.info.state == "running" and sbx.info.expires_at > old_expiry
        after = _read_counter(sbx)
        assert before <= after < before + 15, (before, after)
        assert _wait_counter(sbx, after) > after  # the same process counts on
        with pytest.raises(moat.ConflictError):
            sbx.resume()  # not paused


def test_connect_resumes_a_paused_sandbox(daemon):
    with Sandbox.create(timeout=600) as sbx:
        sbx.commands.run(COUNTER, background=True)
        before = _wait_counter(sbx, 3)
        sbx.pause()
        again = Sandbox.connect(sbx.id)
        try:
            assert again.info.state == "running"
            assert again.commands.run("echo back").stdout == "back\n"
            assert _wait_counter(again, before) > before
        finally:
            again.close()
        assert sbx.get_info().state == "running"


def test_on_timeout_pause_then_connect(daemon):
    with Sandbox.create(timeout=1, on_timeout="pause") as sbx:
        assert sbx.info.on_timeout == "pause"
        sbx.files.write("/opt/kept.txt", "still here")
        deadline = time.time() + 30
        while sbx.get_info().state != "paused" and time.time() < deadline:
            time.sleep(0.3)
        assert sbx.info.state == "paused", "on_timeout=pause did not pause the sandbox at its timeout"
        again = Sandbox.connect(sbx.id, timeout=600)
        try:
            assert again.info.state == "running"
            assert again.files.read("/opt/kept.txt") == "still here"
        finally:
            again.close()


def test_full_snapshot_is_unavailable(sbx):
    with pytest.raises(moat.UnavailableError) as e:
        sbx.create_snapshot(kind="full")
    assert (e.value.field, e.value.status, e.value.code) == ("kind", 503, "unavailable")
    assert "full-state snapshots" in e.value.message and 'kind "filesystem"' in e.value.message
    assert Sandbox.list_snapshots(sandbox_id=sbx.id) == []  # nothing was left behind


def test_snapshot_argument_errors(sbx):
    name = f"sdk-{uuid.uuid4().hex[:12]}"
    snap = sbx.create_snapshot(name=name)
    try:
        for bad in (0, 101):
            with pytest.raises(moat.InvalidArgumentError) as e:
                Sandbox.fork(snap, bad)
            assert e.value.field == "count" and "1..=100" in e.value.message
        with pytest.raises(moat.NotFoundError):
            Sandbox.fork("no-such-snapshot", 1)
        with pytest.raises(moat.ConflictError):
            sbx.create_snapshot(name=name)  # names are unique
        with pytest.raises(moat.InvalidArgumentError) as e:
            sbx.create_snapshot(name="Not A Name")
        assert e.value.field == "name"
        with pytest.raises(moat.InvalidArgumentError) as e:
            Sandbox.create(snapshot=name, template="code-interpreter")
        assert e.value.field == "template"
        with pytest.raises(moat.InvalidArgumentError) as e:
            Sandbox.create(on_timeout="sometimes")
        assert e.value.field == "on_timeout"
        with pytest.raises(moat.NotFoundError):
            Sandbox.create(snapshot="no-such-snapshot")
        with pytest.raises(moat.NotFoundError):
            Sandbox.get_snapshot("no-such-snapshot")
        with pytest.raises(moat.InvalidArgumentError):
            Sandbox.get_snapshot("")
        assert Sandbox.delete_snapshot("no-such-snapshot") is False
    finally:
        assert Sandbox.delete_snapshot(name) is True


def test_full_snapshot_on_gvisor_continues_processes(daemon):
    """kind="full" on the gvisor tier: a fork continues the counter with its memory; a process holding a
    Unix socket bound to a file makes it a ConflictError naming the path, and the sandbox goes on."""
    made, snaps = [], []
    src = Sandbox.create(timeout=600, isolation="gvisor")
    made.append(src)
    try:
        h = src.commands.run(COUNTER, background=True, tag="counter")
        _wait_counter(src, 5)
        snap = src.create_snapshot(kind="full")
        snaps.append(snap)
        assert (snap.kind, snap.isolation, snap.sandbox_id) == ("full", "gvisor", src.id)
        assert snap.size_bytes > 0
        at_snapshot = _read_counter(src)
        (fork,) = Sandbox.fork(snap, 1, timeout=600)
        made.append(fork)
        # The counter runs in the fork with the snapshot's pid: its memory came back (files hold none).
        assert any(p.pid == h.pid and p.tag == "counter" and p.running for p in fork.commands.list())
        first = _read_counter(fork)
        assert 5 <= first
        _wait_counter(fork, first + 3)
        _wait_counter(src, at_snapshot + 3)  # and the source goes on

        src.files.write("/opt/srv.py", "import socket, time\n"
                        "s = socket.socket(socket.AF_UNIX); s.bind('/opt/app.sock'); s.listen()\n"
                        "print('bound', flush=True); time.sleep(600)\n")
        srv = src.commands.run("python3 /opt/srv.py", background=True, tag="srv")
        deadline = time.time() + 30
        while "/opt/app.sock" not in src.commands.run("cat /proc/net/unix").stdout:
            assert time.time() < deadline, "the server did not bind"
            time.sleep(0.1)
        with pytest.raises(moat.ConflictError) as e:
            src.create_snapshot(kind="full")
        assert e.value.status == 409 and "/opt/app.sock" in e.value.message
        assert src.commands.run("echo ok").stdout == "ok\n"
        assert any(p.pid == srv.pid and p.running for p in src.commands.list())
    finally:
        _kill_all(made)
        for s in snaps:
            Sandbox.delete_snapshot(s.id)


def test_idle_pause_then_auto_resume_on_a_request(daemon):
    # Idle auto-pause: no request, no connection and no command running for 2 s pauses it
    # (on_timeout="pause"); a command then resumes it, with its files and memory as they were.
    with Sandbox.create(timeout=600, idle_timeout=2, on_timeout="pause", auto_resume=True) as sbx:
        assert sbx.info.auto_resume is True
        sbx.files.write("/opt/kept.txt", "still here")
        deadline = time.time() + 30
        while sbx.id not in [s.sandbox_id for s in Sandbox.list(state="paused")] and time.time() < deadline:
            time.sleep(0.5)  # listing is no request for the sandbox itself
        assert sbx.id in [s.sandbox_id for s in Sandbox.list(state="paused")]
        assert sbx.commands.run("cat /opt/kept.txt").stdout == "still here"
        assert sbx.get_info().state == "running"
