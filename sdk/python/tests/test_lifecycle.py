import time
import uuid

import pytest

import moat
from moat import Sandbox


def test_create_list_filter_kill(daemon):
    tag = uuid.uuid4().hex
    sbx = Sandbox.create(metadata={"suite": tag, "role": "a"}, envs={"GREETING": "hi"}, cpu=0.5, memory_mb=256)
    try:
        assert sbx.id.startswith("sbx_")
        assert sbx.is_running()
        info = sbx.get_info()
        assert (info.state, info.cpu, info.memory_mb, info.env_keys) == ("running", 0.5, 256, ["GREETING"])
        assert sbx.commands.run("echo $GREETING").stdout == "hi\n"
        assert [s.sandbox_id for s in Sandbox.list(metadata={"suite": tag})] == [sbx.id]
        assert [s.sandbox_id for s in Sandbox.list(metadata={"suite": tag, "role": "a"}, state="running")] == [sbx.id]
        assert Sandbox.list(metadata={"suite": tag, "role": "b"}) == []
        again = Sandbox.connect(sbx.id)
        assert again.get_info().metadata == {"suite": tag, "role": "a"}
        again.close()
    finally:
        assert sbx.kill() is True
    assert sbx.is_running() is False
    assert Sandbox.list(metadata={"suite": tag}) == []
    assert sbx.kill() is False


def test_context_manager_kills(daemon):
    with Sandbox.create() as sbx:
        sid = sbx.id
        assert sbx.commands.run("true").exit_code == 0
    with pytest.raises(moat.NotFoundError):
        Sandbox.connect(sid)


def test_set_timeout(daemon):
    with Sandbox.create(timeout=60) as sbx:
        before = sbx.info.expires_at
        sbx.set_timeout(3600)
        assert sbx.get_info().expires_at > before
        sbx.set_timeout(1)
        deadline = time.time() + 20
        while sbx.is_running() and time.time() < deadline:
            time.sleep(0.3)
        assert not sbx.is_running(), "the sandbox outlived its timeout"
        # It ended on its own: its info says why and when (once torn down: "stopping" before), and
        # connecting says so.
        info = sbx.get_info()
        while info.state == "stopping" and time.time() < deadline:
            time.sleep(0.2)
            info = sbx.get_info()
        assert info.state == "ended" and info.ended is not None, info
        assert info.ended.reason == "timeout" and info.ended.at
        with pytest.raises(moat.NotFoundError) as e:
            Sandbox.connect(sbx.id)
        assert "(timeout)" in str(e.value)


def test_idempotent_create(daemon):
    import uuid
    key = str(uuid.uuid4())
    a = Sandbox.create(timeout=120, metadata={"k": key}, idempotency_key=key)
    try:
        b = Sandbox.create(timeout=120, metadata={"k": key}, idempotency_key=key)
        assert b.id == a.id
        assert len(Sandbox.list(metadata={"k": key})) == 1
        with pytest.raises(moat.IdempotencyError) as e:
            Sandbox.create(timeout=121, metadata={"k": key}, idempotency_key=key)
        assert e.value.status == 422 and e.value.field == "Idempotency-Key"
    finally:
        a.kill()


def test_errors_map_to_exception_classes(daemon):
    with pytest.raises(moat.NotFoundError) as e:
        Sandbox.connect("sbx_doesnotexist")
    assert e.value.field == "id" and e.value.status == 404
    with pytest.raises(moat.InvalidArgumentError) as e:
        Sandbox.create(envs={"A=B": "x"})
    assert e.value.field == "env.A=B"
    with pytest.raises(moat.InvalidArgumentError) as e:
        Sandbox.create(isolation="nope")
    assert e.value.field == "isolation"
    with pytest.raises(moat.NotFoundError) as e:
        Sandbox.create(template="no-such-template")
    assert e.value.field == "template"
    with pytest.raises(moat.AuthenticationError):
        Sandbox.list(api_key="wrong")
    assert issubclass(moat.NotFoundError, moat.MoatError)


def test_errors_inside_a_sandbox(sbx):
    with pytest.raises(moat.NotFoundError) as e:
        sbx.files.read("/no/such/file")
    assert e.value.field == "path"
    h = sbx.commands.run("sleep 5", background=True)  # stdin not open
    with pytest.raises(moat.ConflictError):
        h.send_stdin("x")
    h.kill()
    with pytest.raises(moat.InvalidArgumentError) as e:
        sbx.commands.run(["/no/such/program"])
    assert e.value.field == "cmd"
