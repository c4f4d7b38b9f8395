"""Sandbox networking and exposed ports. The test daemon runs with ``--network none``: the egress policy
calls must be refused, and ports still work (they tunnel through the agent, never through a network)."""

import asyncio
import uuid

import httpx
import pytest

import moat
from moat import AsyncSandbox, NetworkInfo, NetworkPolicy, Sandbox
from moat import _core

PAGE = "hello from inside the sandbox\n"
# Serves /tmp/www on 127.0.0.1:8000 inside the sandbox; its request log goes to /tmp/http.log.
SERVER = "mkdir -p /tmp/www && exec python3 -m http.server 8000 --bind 127.0.0.1 --directory /tmp/www 2>/tmp/http.log"
WAIT_UP = ("for i in $(seq 1 200); do curl -s -o /dev/null http://127.0.0.1:8000/ && exit 0; sleep 0.1; done; "
           "echo 'nothing answers on 8000' >&2; cat /tmp/http.log >&2; exit 1")


def _serve(sbx: Sandbox) -> None:
    sbx.files.write("/tmp/www/index.html", PAGE)
    sbx.commands.run(SERVER, background=True, tag="http8000")
    sbx.commands.run(WAIT_UP, timeout=60)


# --- no daemon needed: request bodies and URLs ------------------------------------------------------

def test_policy_bodies():
    assert NetworkPolicy().to_json() == {"allow_internet": True, "allow_out": [], "deny_out": []}
    p = NetworkPolicy(allow_internet=False, allow_out=["10.1.2.3"], deny_out=["0.0.0.0/0"])
    assert NetworkPolicy.from_json(p.to_json()) == p
    assert NetworkPolicy(allow_out="10.0.0.1").to_json()["allow_out"] == ["10.0.0.1"]
    body = _core.create_body(None, None, None, None, None, None, None, network=p, allow_public_traffic=True)
    assert body == {"network": p.to_json(), "allow_public_traffic": True}
    assert _core.create_body(None, None, None, None, None, None, None, network={"allow_out": "10.0.0.1"}) == \
        {"network": {"allow_out": ["10.0.0.1"]}}
    assert "network" not in _core.create_body(None, None, None, None, None, None, None)
    assert _core.set_network_body(False, ["192.168.5.0/24"], None) == \
        {"allow_internet": False, "allow_out": ["192.168.5.0/24"], "deny_out": []}
    assert _core.set_network_body(p, None, None) == p.to_json()
    with pytest.raises(moat.InvalidArgumentError):
        _core.set_network_body(p, ["10.0.0.1"], None)
    info = NetworkInfo.from_json({"ip": "10.200.0.2", "gateway": "10.200.0.1",
                                  "policy": {"allow_internet": False, "allow_out": ["1.2.3.4"]}})
    assert info == NetworkInfo("10.200.0.2", "10.200.0.1", NetworkPolicy(False, ["1.2.3.4"], []))
    # An older server's sandbox JSON (no network, token or public flag) still parses.
    old = moat.SandboxInfo.from_json({"id": "sbx_x", "template": "base", "isolation": "container",
                                      "state": "running", "created_at": "", "expires_at": "", "metadata": {}})
    assert (old.network, old.access_token, old.allow_public_traffic) == (None, "", False)


def test_port_urls():
    sid = "sbx_" + "a" * 26
    assert _core.port_base_url("http://127.0.0.1:6628", sid, 8000) == \
        f"http://127.0.0.1:6628/v1/sandboxes/{sid}/ports/8000"
    assert _core.port_base_url("https://moat.example.com", sid, 3000, "sandbox.example.com") == \
        f"https://3000-{sid}.sandbox.example.com"
    assert _core.port_base_url("https://moat.example.com", sid, 3000, "http://sbx.test/") == \
        f"http://3000-{sid}.sbx.test"
    for bad in (0, 65536, -1, "x", None, True, 80.5):
        with pytest.raises(moat.InvalidArgumentError) as e:
            _core.port_base_url("http://h", sid, bad)
        assert e.value.field == "port"
    assert _core.port_url("http://h/p", "/", "TOK") == "http://h/p/?moat_access_token=TOK"
    assert _core.port_url("http://h/p", "a/b?x=1", "TOK") == "http://h/p/a/b?x=1&moat_access_token=TOK"
    assert _core.port_url("http://h/p", "/a", None) == "http://h/p/a"


# --- against the daemon (--network none) ------------------------------------------------------------

def test_network_policy_refused_without_sandbox_networking(daemon):
    tag = {"suite": uuid.uuid4().hex}
    for policy in ({"allow_internet": False}, NetworkPolicy(allow_out=["10.1.2.3"])):
        with pytest.raises(moat.InvalidArgumentError) as e:
            Sandbox.create(network=policy, metadata=tag)
        assert e.value.field == "network" and e.value.status == 400
    assert Sandbox.list(metadata=tag) == []  # refused before anything was made

    sbx = Sandbox.create()
    try:
        assert sbx.info.network is None  # loopback only
        with pytest.raises(moat.ConflictError) as e:
            sbx.get_network()
        assert e.value.status == 409 and "network" in e.value.message
        with pytest.raises(moat.ConflictError):
            sbx.set_network(allow_internet=False, deny_out=["0.0.0.0/0"])
        with pytest.raises(moat.ConflictError):
            sbx.set_network(NetworkPolicy(allow_internet=False))
        assert sbx.get_info().network is None
    finally:
        assert sbx.kill()


def test_exposed_port_credentials(daemon):
    sbx = Sandbox.create(timeout=300)
    try:
        token = sbx.access_token
        assert isinstance(token, str) and len(token) == 32 and token == sbx.get_info().access_token
        assert sbx.info.allow_public_traffic is False
        base = sbx.get_host(8000)
        assert base == f"{daemon.url}/v1/sandboxes/{sbx.id}/ports/8000"

        with httpx.Client(timeout=30) as http:  # no API key
            # Nothing listens yet: the daemon answers for the port (with credentials).
            r = http.get(base + "/", headers={"X-Moat-Access-Token": token})
            assert r.status_code == 503, r.text

            _serve(sbx)
            r = http.get(base + "/")
            assert r.status_code == 401, r.text
            r = http.get(base + "/", headers={"X-Moat-Access-Token": "x" * 32})
            assert r.status_code == 401, r.text
            r = http.get(base + "/", headers={"X-Moat-Access-Token": token})
            assert (r.status_code, r.text) == (200, PAGE)
            url = sbx.port_url(8000)
            assert url == f"{base}/?moat_access_token={token}"
            r = http.get(url)
            assert (r.status_code, r.text) == (200, PAGE)
            r = http.get(sbx.port_url(8000, "/index.html?x=1"))
            assert (r.status_code, r.text) == (200, PAGE)
            assert http.get(sbx.port_url(8000, with_token=False)).status_code == 401
            r = http.get(base + "/", headers={"Authorization": f"Bearer {daemon.api_key}"})
            assert (r.status_code, r.text) == (200, PAGE)
            r = http.get(base + "/nope.txt", headers={"X-Moat-Access-Token": token})
            assert r.status_code == 404  # the server's own 404, relayed

        # The server saw the requests, without the token (header nor query parameter) or the API key.
        log = sbx.files.read("/tmp/http.log")
        assert "GET / HTTP/1.1" in log and "GET /index.html?x=1 HTTP/1.1" in log, log
        assert token not in log and "moat_access_token" not in log and daemon.api_key not in log
    finally:
        assert sbx.kill()


def test_public_traffic(daemon):
    sbx = Sandbox.create(allow_public_traffic=True)
    try:
        assert sbx.info.allow_public_traffic is True and sbx.get_info().allow_public_traffic is True
        _serve(sbx)
        r = httpx.get(sbx.get_host(8000) + "/", timeout=30)
        assert (r.status_code, r.text) == (200, PAGE)
    finally:
        assert sbx.kill()


def test_async_network_and_ports(daemon):
    async def main():
        with pytest.raises(moat.InvalidArgumentError) as e:
            await AsyncSandbox.create(network=NetworkPolicy(allow_internet=False))
        assert e.value.field == "network"

        sbx = await AsyncSandbox.create(timeout=300)
        public = await AsyncSandbox.create(allow_public_traffic=True)
        try:
            with pytest.raises(moat.ConflictError):
                await sbx.get_network()
            with pytest.raises(moat.ConflictError):
                await sbx.set_network(allow_internet=False)
            assert len(sbx.access_token) == 32 and sbx.access_token != public.access_token
            assert (sbx.info.allow_public_traffic, public.info.allow_public_traffic) == (False, True)
            for s in (sbx, public):
                await s.files.write("/tmp/www/index.html", PAGE)
                await s.commands.run(SERVER, background=True)
                await s.commands.run(WAIT_UP, timeout=60)
            base = sbx.get_host(8000)
            assert base.endswith(f"/v1/sandboxes/{sbx.id}/ports/8000")
            async with httpx.AsyncClient(timeout=30) as http:
                assert (await http.get(base + "/")).status_code == 401
                r = await http.get(base + "/", headers={"X-Moat-Access-Token": sbx.access_token})
                assert (r.status_code, r.text) == (200, PAGE)
                r = await http.get(sbx.port_url(8000))
                assert (r.status_code, r.text) == (200, PAGE)
                # A token opens only its own sandbox.
                r = await http.get(base + "/", headers={"X-Moat-Access-Token": public.access_token})
                assert r.status_code == 401
                r = await http.get(public.get_host(8000) + "/")
                assert (r.status_code, r.text) == (200, PAGE)
        finally:
            assert await sbx.kill()
            assert await public.kill()
            await sbx.close()
            await public.close()

    asyncio.run(asyncio.wait_for(main(), 120))
