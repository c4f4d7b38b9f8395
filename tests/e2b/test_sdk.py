"""E2B's official Python SDKs (`e2b`, `e2b-code-interpreter` from PyPI, unmodified) against moat's
E2B-compatible API, following E2B's documented examples: lifecycle, commands, files, the code
interpreter, connect, pause/resume, metrics, snapshots and what moat refuses."""

from __future__ import annotations

import base64
import io
import time

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FileType,
    NotFoundException,
    Sandbox,
    SandboxQuery,
    SandboxState,
    TemplateException,
)
from e2b.exceptions import SandboxException
from e2b.sandbox.commands.command_handle import PtySize


def test_create_list_set_timeout_kill(daemon):
    sbx = Sandbox.create(timeout=120, metadata={"suite": "e2b", "case": "lifecycle"}, envs={"FOO": "bar"})
    assert sbx.is_running()
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.metadata == {"suite": "e2b", "case": "lifecycle"}
    assert info.template_id == "base"
    assert info.state == SandboxState.RUNNING
    ends = info.end_at
    # Listed, and found by metadata (E2B's filter, percent-encoded by the SDK).
    listed = Sandbox.list(query=SandboxQuery(metadata={"case": "lifecycle"})).next_items()
    assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
    assert Sandbox.list(query=SandboxQuery(metadata={"case": "nothing-like-it"})).next_items() == []
    sbx.set_timeout(600)
    assert sbx.get_info().end_at > ends
    assert sbx.commands.run("echo $FOO").stdout == "bar\n"
    assert sbx.kill() is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    assert not sbx.is_running()
    with pytest.raises(SandboxException):
        Sandbox.connect(sbx.sandbox_id)


def test_list_pages_with_next_token(daemon):
    made = [Sandbox.create(timeout=120, metadata={"case": "paging"}) for _ in range(3)]
    try:
        pager = Sandbox.list(query=SandboxQuery(metadata={"case": "paging"}), limit=2)
        first = pager.next_items()
        assert len(first) == 2 and pager.has_next
        second = pager.next_items()
        assert len(second) == 1 and not pager.has_next
        seen = {s.sandbox_id for s in first + second}
        assert seen == {s.sandbox_id for s in made}
    finally:
        for s in made:
            s.kill()


def test_commands_stream_and_exit_codes(sbx):
    out, err = [], []
    r = sbx.commands.run("echo one; echo two >&2; echo three", on_stdout=out.append, on_stderr=err.append)
    assert r.exit_code == 0
    assert r.stdout == "one\nthree\n" and r.stderr == "two\n"
    assert "".join(out) == "one\nthree\n" and "".join(err) == "two\n"
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("echo partial; exit 3")
    assert e.value.exit_code == 3 and e.value.stdout == "partial\n"
    # E2B's default user and working directory; another user by name; cwd and envs.
    assert sbx.commands.run("id -un; pwd").stdout == "user\n/home/user\n"
    assert sbx.commands.run("id -un", user="root").stdout == "root\n"
    assert sbx.commands.run("pwd; echo $X", cwd="/tmp", envs={"X": "y"}).stdout == "/tmp\ny\n"


def test_background_command_killed_and_reattached(sbx):
    h = sbx.commands.run("for i in $(seq 1 1000); do echo tick $i; sleep 0.1; done", background=True)
    assert h.pid > 0
    time.sleep(0.5)
    running = [p.pid for p in sbx.commands.list()]
    assert h.pid in running
    # Re-attach from another handle: it receives what the process writes from now on.
    again = sbx.commands.connect(h.pid)
    assert again.pid == h.pid
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException) as e:
        again.wait()
    assert e.value.exit_code == -1 and "killed" in (e.value.error or "")
    assert h.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(h.pid) is False


def test_stdin_and_close(sbx):
    h = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "hello stdin\n")
    sbx.commands.close_stdin(h.pid)
    r = h.wait()
    assert r.stdout == "hello stdin\n"


def test_pty(sbx):
    data = []
    h = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(h.pid, PtySize(rows=40, cols=120))
    sbx.pty.send_stdin(h.pid, b"stty size; exit\n")
    r = h.wait(on_pty=data.append)
    text = b"".join(data).decode(errors="replace")
    assert "40 120" in text, text
    assert r.exit_code == 0


def test_files_write_read_list(sbx):
    info = sbx.files.write("/home/user/notes.txt", "hello files")
    assert info.path == "/home/user/notes.txt" and info.name == "notes.txt"
    assert sbx.files.read("/home/user/notes.txt") == "hello files"
    # Relative paths are the user's home's, and the files are the user's.
    assert sbx.files.read("notes.txt") == "hello files"
    assert sbx.commands.run("stat -c %U /home/user/notes.txt").stdout == "user\n"
    # Bytes, a file object (octet-stream upload) and several files at once.
    sbx.files.write("/tmp/bin.dat", bytes(range(256)))
    assert sbx.files.read("/tmp/bin.dat", format="bytes") == bytes(range(256))
    sbx.files.write("/tmp/obj.txt", io.BytesIO(b"from a file object"))
    assert sbx.files.read("/tmp/obj.txt") == "from a file object"
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    written = sbx.files.write_files([WriteEntry(path="/tmp/many/a.txt", data="A"),
                                     WriteEntry(path="/tmp/many/b.txt", data="B")])
    assert sorted(w.path for w in written) == ["/tmp/many/a.txt", "/tmp/many/b.txt"]
    entries = sbx.files.list("/tmp/many")
    assert sorted(e.name for e in entries) == ["a.txt", "b.txt"]
    assert all(e.type == FileType.FILE for e in entries)
    assert sbx.files.exists("/tmp/many/a.txt") and not sbx.files.exists("/tmp/many/nope")
    st = sbx.files.get_info("/tmp/many/a.txt")
    assert st.size == 1 and st.type == FileType.FILE and st.owner == "user"
    assert sbx.files.make_dir("/tmp/many/sub") is True
    assert sbx.files.make_dir("/tmp/many/sub") is False
    assert sbx.files.get_info("/tmp/many/sub").type == FileType.DIR
    sbx.files.rename("/tmp/many/a.txt", "/tmp/many/sub/c.txt")
    assert sbx.files.read("/tmp/many/sub/c.txt") == "A"
    sbx.files.remove("/tmp/many/sub")
    assert not sbx.files.exists("/tmp/many/sub")
    sbx.files.remove("/tmp/never-there")  # like envd: no error
    deep = sbx.files.list("/tmp/many", depth=2)
    assert [e.name for e in deep] == ["b.txt"]
    with pytest.raises(NotFoundException):
        sbx.files.read("/tmp/does-not-exist")


def test_file_metadata_is_refused_by_the_sdk(sbx):
    # moat answers as envd 0.5.7: the SDK itself says the template lacks the feature.
    with pytest.raises(TemplateException):
        sbx.files.write("/tmp/m.txt", "x", metadata={"k": "v"})


def test_signed_download_url(sbx):
    sbx.files.write("/home/user/shared.txt", "signed and sealed")
    url = sbx.download_url("/home/user/shared.txt")
    assert "signature=" in url
    # A plain client with no E2B headers (a browser): the signature finds the sandbox.
    r = httpx.get(url)
    assert r.status_code == 200 and r.text == "signed and sealed"
    r = httpx.get(url.replace("signature=v1_", "signature=v1_x"))
    assert r.status_code == 401


def test_watch_dir(sbx):
    sbx.files.make_dir("/tmp/watched")
    w = sbx.files.watch_dir("/tmp/watched")
    sbx.files.write("/tmp/watched/new.txt", "x")
    events = []
    for _ in range(50):
        events += w.get_new_events()
        if any(e.name == "new.txt" for e in events):
            break
        time.sleep(0.1)
    w.stop()
    assert any(e.name == "new.txt" for e in events), events


def test_connect_pause_resume_and_metrics(daemon):
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.commands.run("echo kept > /tmp/state")
        same = Sandbox.connect(sbx.sandbox_id)
        assert same.sandbox_id == sbx.sandbox_id
        assert same.commands.run("cat /tmp/state").stdout == "kept\n"
        metrics = sbx.get_metrics()
        assert metrics and metrics[0].mem_total > 0 and metrics[0].cpu_count >= 1
        assert sbx.pause() is True
        assert sbx.get_info().state == SandboxState.PAUSED
        listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in listed]
        resumed = Sandbox.connect(sbx.sandbox_id)
        assert resumed.get_info().state == SandboxState.RUNNING
        assert resumed.commands.run("cat /tmp/state").stdout == "kept\n"
    finally:
        sbx.kill()


def test_snapshot_and_create_from_it(daemon):
    sbx = Sandbox.create(timeout=300)
    try:
        sbx.files.write("/home/user/from-snapshot.txt", "snapshot data")
        snap = sbx.create_snapshot()
        copy = Sandbox.create(template=snap.snapshot_id, timeout=120)
        try:
            assert copy.files.read("/home/user/from-snapshot.txt") == "snapshot data"
        finally:
            copy.kill()
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots().next_items()]
        assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    finally:
        sbx.kill()


def test_unknown_template_and_unsupported_features(daemon):
    with pytest.raises(SandboxException) as e:
        Sandbox.create(template="no-such-template")
    assert "not found" in str(e.value)
    with pytest.raises(SandboxException) as e:
        Sandbox.create(network={"dns_servers": ["10.0.0.1"]})
    assert "network.dnsServers is not supported" in str(e.value)


def test_wrong_api_key(daemon):
    from e2b import AuthenticationException

    with pytest.raises(AuthenticationException):
        Sandbox.create(api_key="wrong-key")


def test_envd_needs_the_access_token(sbx):
    # Without the envd access token from the create answer, the sandbox's envd refuses.
    r = httpx.post(
        f"{daemon_url()}/process.Process/List",
        headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json"},
        content=b"{}",
    )
    assert r.status_code == 401


def daemon_url() -> str:
    import os

    return os.environ["E2B_SANDBOX_URL"]


def test_async_sandbox(daemon):
    import asyncio

    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            out = []
            r = await sbx.commands.run("echo async", on_stdout=out.append)
            assert r.stdout == "async\n" and out == ["async\n"]
            await sbx.files.write("/tmp/a.txt", "async file")
            assert await sbx.files.read("/tmp/a.txt") == "async file"
            # The async SDK watches with a stream (WatchDir), not by polling.
            events = []
            await sbx.files.make_dir("/tmp/aw")
            handle = await sbx.files.watch_dir("/tmp/aw", on_event=events.append)
            await sbx.files.write("/tmp/aw/f.txt", "x")
            for _ in range(50):
                if any(e.name == "f.txt" for e in events):
                    break
                await asyncio.sleep(0.1)
            await handle.stop()
            assert any(e.name == "f.txt" for e in events), events
        finally:
            await sbx.kill()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_code_interpreter_state_and_chart(code_interpreter):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(timeout=300)
    try:
        ex = sbx.run_code("x = 41\nprint('hi')\nx + 1")
        assert ex.error is None, ex.error
        assert ex.logs.stdout == ["hi\n"]
        assert ex.text == "42"
        # State persists across calls.
        assert sbx.run_code("x * 2").text == "82"
        err = sbx.run_code("1/0").error
        assert err.name == "ZeroDivisionError" and "division by zero" in err.value
        chart = sbx.run_code(
            "import matplotlib\nmatplotlib.use('Agg')\nimport matplotlib.pyplot as plt\n"
            "plt.plot([1, 2, 3], [4, 1, 9])\nplt.show()"
        )
        pngs = [r.png for r in chart.results if r.png]
        assert pngs, chart
        assert base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")
        # Contexts: their own state; listed, restarted, removed.
        ctx = sbx.create_code_context()
        assert sbx.run_code("y = 5", context=ctx).error is None
        assert sbx.run_code("y", context=ctx).text == "5"
        assert sbx.run_code("'y' in globals()").text == "False"
        assert ctx.id in [c.id for c in sbx.list_code_contexts()]
        sbx.restart_code_context(ctx)
        assert sbx.run_code("y", context=ctx).error.name == "NameError"
        sbx.remove_code_context(ctx)
        assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
        js = sbx.run_code("const a = 20; a + 22", language="js")
        assert js.text == "42", js
    finally:
        sbx.kill()
