"""What failed when E2B's official Python SDK was first tried against moat as a new user would (issue
27): large uploads, watch events of a written file, `user=` on files, command timeouts, the process
list's envs and re-attaching to an exited process. Each test is E2B's documented usage, unmodified."""

from __future__ import annotations

import asyncio
import hashlib
import os
import time

import httpx
import pytest
from e2b import AsyncSandbox, FilesystemEventType, NotFoundException, Sandbox, TimeoutException
from e2b.sandbox.filesystem.filesystem import WriteEntry


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _remote_sha(sbx, path: str) -> str:
    return sbx.commands.run(f"sha256sum {path}", user="root").stdout.split()[0]


def test_large_writes_of_every_kind(sbx):
    # bytes, then str, of several MiB each (multipart, as the SDK sends them).
    blob = os.urandom(5 << 20)
    sbx.files.write("/home/user/big.bin", blob)
    assert _remote_sha(sbx, "/home/user/big.bin") == _sha(blob)
    text = "moat " * (600 << 10)  # 3 MiB of text
    sbx.files.write("/home/user/big.txt", text)
    assert sbx.files.read("/home/user/big.txt") == text
    assert sbx.files.read("/home/user/big.bin", format="bytes") == blob
    # Many files of a few hundred KiB in one multipart request.
    entries = [WriteEntry(path=f"/home/user/many/f{i}.bin", data=os.urandom(300 << 10)) for i in range(24)]
    infos = sbx.files.write_files(entries)
    assert len(infos) == len(entries)
    listed = sbx.commands.run("cd /home/user/many && sha256sum f*.bin").stdout
    got = {line.split()[1]: line.split()[0] for line in listed.splitlines()}
    assert got == {f"f{i}.bin": _sha(e["data"]) for i, e in enumerate(entries)}


def test_upload_url_takes_a_large_file(sbx):
    blob = os.urandom(5 * 1000 * 1000)
    url = sbx.upload_url("/home/user/upload.bin")
    r = httpx.post(url, files={"file": ("upload.bin", blob)}, timeout=60)
    assert r.status_code == 200, r.text
    assert _remote_sha(sbx, "/home/user/upload.bin") == _sha(blob)
    # A body that is not what it says is a 400 naming the problem, never "agent unreachable".
    bad = httpx.post(url, content=b"--nope\r\nnot a multipart body",
                     headers={"content-type": "multipart/form-data; boundary=nope"}, timeout=30)
    assert bad.status_code == 400, bad.text
    assert "unreachable" not in bad.text


def test_watch_dir_sees_the_written_file_not_a_temp_file(sbx):
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.files.write("/home/user/watched/f.txt", "one")
        sbx.files.write("/home/user/watched/f.txt", "two")
        deadline = time.time() + 10
        events = []
        while time.time() < deadline:
            events += handle.get_new_events()
            kinds = {(e.name, e.type) for e in events}
            if ("f.txt", FilesystemEventType.CREATE) in kinds and ("f.txt", FilesystemEventType.WRITE) in kinds:
                break
            time.sleep(0.2)
        names = {e.name for e in events}
        assert names == {"f.txt"}, events
        assert ("f.txt", FilesystemEventType.CREATE) in {(e.name, e.type) for e in events}, events
        assert ("f.txt", FilesystemEventType.WRITE) in {(e.name, e.type) for e in events}, events
        assert FilesystemEventType.RENAME not in {e.type for e in events}, events
    finally:
        handle.stop()


def test_files_as_another_user(sbx):
    sbx.files.write("/home/user/mine.txt", "user's")
    sbx.files.write("/home/user/roots.txt", "root's", user="root")
    owners = sbx.commands.run("stat -c %U /home/user/mine.txt /home/user/roots.txt").stdout.split()
    assert owners == ["user", "root"]
    # A relative path is the named user's home's (envd resolves it for that user).
    sbx.commands.run("echo in root home > /root/here.txt", user="root")
    assert sbx.files.read("here.txt", user="root") == "in root home\n"
    # A signed upload URL for another user writes as that user.
    url = sbx.upload_url("/home/user/signed-root.txt", user="root")
    assert httpx.post(url, files={"file": ("x", b"signed")}, timeout=30).status_code == 200
    assert sbx.commands.run("stat -c %U /home/user/signed-root.txt").stdout == "root\n"


def test_sync_command_timeout_raises_and_kills(sbx):
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30; echo late", timeout=2)
    time.sleep(0.5)
    assert "sleep 30" not in " ".join(p.cmd + " " + " ".join(p.args) for p in sbx.commands.list())
    assert "sleep 30" not in sbx.commands.run("ps -eo args", user="root").stdout


def test_async_command_timeout_raises_and_kills(daemon):
    async def main():
        sbx = await AsyncSandbox.create(timeout=120)
        try:
            with pytest.raises(TimeoutException):
                await sbx.commands.run("sleep 30; echo late", timeout=2)
            await asyncio.sleep(0.5)
            ps = await sbx.commands.run("ps -eo args", user="root")
            assert "sleep 30" not in ps.stdout
        finally:
            await sbx.kill()

    asyncio.run(main())


def test_list_shows_envs_and_connect_to_an_exited_process_is_not_found(sbx):
    h = sbx.commands.run("sleep 60", background=True, envs={"TASK": "listing"})
    try:
        listed = {p.pid: p for p in sbx.commands.list()}
        assert listed[h.pid].envs.get("TASK") == "listing", listed[h.pid]
    finally:
        sbx.commands.kill(h.pid)
    done = sbx.commands.run("true", background=True)
    done.wait()
    with pytest.raises(NotFoundException):
        sbx.commands.connect(done.pid)


def test_every_form_of_the_key_is_the_same_credential(daemon):
    # E2B's form (what E2B_API_KEY holds in this suite), moat's own key, and moat's key prefixed.
    assert daemon.e2b_api_key.startswith("e2b_") and all(c in "0123456789abcdef" for c in daemon.e2b_api_key[4:])
    for key in (daemon.e2b_api_key, daemon.api_key, "e2b_" + daemon.api_key):
        r = httpx.get(daemon.e2b_url + "/v2/sandboxes", headers={"X-API-KEY": key}, timeout=10)
        assert r.status_code == 200, (key[:4], r.text)
    for wrong in ("e2b_" + "0" * 40, daemon.e2b_api_key[:-1] + "0" if daemon.e2b_api_key[-1] != "0" else daemon.e2b_api_key[:-1] + "1", ""):
        r = httpx.get(daemon.e2b_url + "/v2/sandboxes", headers={"X-API-KEY": wrong}, timeout=10)
        assert r.status_code == 401, r.text


def test_a_cell_the_client_gave_up_on_is_interrupted(code_interpreter):
    from e2b_code_interpreter import Sandbox as CodeSandbox

    sbx = CodeSandbox.create(template="code-interpreter", timeout=300)
    try:
        assert sbx.run_code("kept = 7").error is None
        with pytest.raises(TimeoutException):
            sbx.run_code("import time\nwhile True: time.sleep(0.1)", timeout=3)
        # The next cell of that context runs at once (E2B interrupts the kernel when the client
        # gives up), and the state before the interrupted cell is still there.
        started = time.monotonic()
        assert sbx.run_code("kept * 6", timeout=20).text == "42"
        assert time.monotonic() - started < 15
    finally:
        sbx.kill()


def _e2b_port(daemon) -> int:
    return int(daemon.e2b_url.rsplit(":", 1)[1])


def test_get_host_names_this_daemon_and_its_host_form_is_served(daemon):
    # No name is resolved here: requests go to the listener's address with the Host get_host gave.
    sbx = Sandbox.create(timeout=120)
    closed = Sandbox.create(timeout=120, network={"allow_public_traffic": False})
    try:
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.localhost:{_e2b_port(daemon)}"
        assert Sandbox.get_info(sbx.sandbox_id).sandbox_domain == f"localhost:{_e2b_port(daemon)}"
        for s in (sbx, closed):
            s.commands.run("mkdir -p /tmp/www && echo served > /tmp/www/index.html && "
                           "cd /tmp/www && exec python3 -m http.server 8000", background=True)
        url = daemon.e2b_url + "/index.html"

        def get(s, **headers):
            deadline = time.time() + 20
            while True:
                r = httpx.get(url, headers={"Host": s.get_host(8000), **headers}, timeout=10)
                if r.status_code != 503 or time.time() > deadline:
                    return r
                time.sleep(0.2)

        # Public by default, as E2B's ports are.
        r = get(sbx)
        assert r.status_code == 200 and r.text == "served\n", r.text
        # allow_public_traffic=False: the traffic token is needed.
        r = get(closed)
        assert r.status_code == 401, r.text
        r = get(closed, **{"e2b-traffic-access-token": closed.traffic_access_token})
        assert r.status_code == 200 and r.text == "served\n", r.text
        # envd through its own host form still wants the envd token.
        envd = {"Host": sbx.get_host(49983)}
        assert httpx.get(daemon.e2b_url + "/envs", headers=envd, timeout=10).status_code == 401
        # A host of another domain is not a sandbox's: the control plane answers (401, no key).
        other = httpx.get(url, headers={"Host": f"8000-{sbx.sandbox_id}.example.com"}, timeout=10)
        assert other.status_code == 401, other.text
    finally:
        sbx.kill()
        closed.kill()


def test_auto_resume_wakes_a_paused_sandbox_on_a_request_or_port_traffic(daemon):
    sbx = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create(timeout=120)
    try:
        info = Sandbox.get_info(sbx.sandbox_id)
        assert info.lifecycle["auto_resume"] is True and info.lifecycle["on_timeout"] == "pause"
        assert Sandbox.get_info(plain.sandbox_id).lifecycle["auto_resume"] is False
        sbx.commands.run("echo kept > /tmp/state; cd /tmp && exec python3 -m http.server 8000",
                         background=True)
        deadline = time.time() + 20
        url = daemon.e2b_url + "/state"
        while httpx.get(url, headers={"Host": sbx.get_host(8000)}, timeout=10).status_code != 200:
            assert time.time() < deadline
            time.sleep(0.2)
        # A command wakes it (the process started before the pause still runs).
        sbx.pause()
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "paused"
        assert sbx.commands.run("cat /tmp/state").stdout == "kept\n"
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        # Port traffic wakes it too, and reaches the server that was frozen with it.
        sbx.pause()
        r = httpx.get(url, headers={"Host": sbx.get_host(8000)}, timeout=30)
        assert r.status_code == 200 and r.text == "kept\n", r.text
        assert Sandbox.get_info(sbx.sandbox_id).state.value == "running"
        # Without auto_resume, a paused sandbox refuses the request (and stays paused).
        plain.pause()
        with pytest.raises(Exception) as e:
            plain.commands.run("true")
        assert "paused" in str(e.value), e.value
        assert Sandbox.get_info(plain.sandbox_id).state.value == "paused"
    finally:
        sbx.kill()
        plain.kill()
