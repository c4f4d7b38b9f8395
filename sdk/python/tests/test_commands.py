import threading
import time

import pytest

import moat


def test_foreground_exit_codes(sbx):
    r = sbx.commands.run("echo out; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code, r.signal, r.timed_out) == ("out\n", "err\n", 0, None, False)
    with pytest.raises(moat.CommandExitException) as e:
        sbx.commands.run("echo partial; exit 7")
    assert e.value.exit_code == 7 and e.value.stdout == "partial\n" and e.value.result.exit_code == 7
    assert sbx.commands.run(["printf", "%s|", "a b", "c"]).stdout == "a b|c|"


def test_options(sbx):
    r = sbx.commands.run("echo $X; pwd; id -un", envs={"X": "1"}, cwd="/tmp", user="nobody")
    assert r.stdout == "1\n/tmp\nnobody\n"


def test_streaming_callbacks_in_order_before_exit(sbx):
    seen = []
    t0 = time.monotonic()
    r = sbx.commands.run("for i in 1 2 3; do echo $i; sleep 0.3; done; echo bad >&2; exit 0",
                         on_stdout=lambda s: seen.append(("out", s, time.monotonic() - t0)),
                         on_stderr=lambda s: seen.append(("err", s, time.monotonic() - t0)))
    total = time.monotonic() - t0
    assert "".join(s for k, s, _ in seen if k == "out") == "1\n2\n3\n" == r.stdout
    assert [k for k, _, _ in seen][-1] == "err"
    assert seen[0][2] < total - 0.5, "stdout must stream while the command runs, not arrive at exit"


def test_timeout(sbx):
    with pytest.raises(moat.CommandTimeoutError) as e:
        sbx.commands.run("sleep 30", timeout=1)
    assert e.value.timed_out and isinstance(e.value, moat.SandboxTimeoutError)


def test_stdin_background(sbx):
    h = sbx.commands.run("cat; echo done", background=True, stdin=True)
    assert isinstance(h.pid, int)
    h.send_stdin("hello\n")
    h.send_stdin(b"bytes\n")
    h.close_stdin()
    r = h.wait()
    assert r.stdout == "hello\nbytes\ndone\n" and r.exit_code == 0


def test_reattach_by_pid_and_tag(sbx):
    h = sbx.commands.run("echo one; sleep 1; echo two", background=True, tag="reattach-me")
    assert h.tag == "reattach-me"
    assert any(p.pid == h.pid and p.running for p in sbx.commands.list())
    by_pid = sbx.commands.connect(h.pid)
    by_tag = sbx.commands.connect("reattach-me")
    assert by_tag.pid == h.pid
    assert by_pid.wait().stdout == "one\ntwo\n"
    assert by_tag.wait().stdout == "one\ntwo\n"
    # after exit, the kept output is still replayed
    assert sbx.commands.connect(h.pid).wait().stdout == "one\ntwo\n"
    with pytest.raises(moat.NotFoundError):
        sbx.commands.connect("no-such-tag")


def test_iterate_events_and_signal(sbx):
    h = sbx.commands.run("trap 'echo got-usr1; exit 4' USR1; echo ready; while true; do sleep 0.1; done",
                         background=True)
    types = []
    timer = threading.Timer(20, h.kill)
    timer.start()
    try:
        for ev in h:
            types.append(ev.type)
            if ev.type == "stdout" and "ready" in ev.text:
                break
        h.signal("USR1")
        with pytest.raises(moat.CommandExitException) as e:
            h.wait()
    finally:
        timer.cancel()
    assert types[0] == "start"
    assert e.value.exit_code == 4 and "got-usr1" in e.value.stdout


def test_kill(sbx):
    h = sbx.commands.run("sleep 30", background=True)
    assert h.kill() is True
    with pytest.raises(moat.CommandExitException) as e:
        h.wait()
    assert e.value.signal == "SIGKILL" and e.value.exit_code is None
    assert h.kill() is False
    h2 = sbx.commands.run("sleep 30", background=True)
    sbx.commands.signal(h2.pid, "TERM")
    with pytest.raises(moat.CommandExitException) as e:
        h2.wait()
    assert e.value.signal == "SIGTERM"
