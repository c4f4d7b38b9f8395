"""Sandbox networking and exposed ports. The test daemon runs with ``--network none``: the egress policy
calls must be refused, the connection log stays empty (its proposal: internet off, nothing allowed), and
ports still work (they tunnel through the agent, never through a network)."""

import asyncio
import threading
import uuid

import httpx
import pytest

import moat
from moat import (AsyncSandbox, NetworkInfo, NetworkLogEntry, NetworkPolicy, NetworkProposal, ObservedDestination,
                  Sandbox)
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


def test_policy_fields_round_trip():
    # What the daemon answers (docs/network.md, "The policy"): every field survives from_json -> to_json.
    daemon_json = {"allow_internet": False,
                   "allow_out": ["@pypi", "api.example.com", "*.internal.example", "10.1.2.3", "192.168.5.0/24"],
                   "deny_out": ["203.0.113.0/24"], "egress_mbps": 50, "connections_per_second": 20, "mode": "audit"}
    p = NetworkPolicy.from_json(daemon_json)
    assert (p.egress_mbps, p.connections_per_second, p.mode) == (50, 20, "audit")
    assert p.to_json() == daemon_json
    assert NetworkPolicy.from_json(p.to_json()) == p
    assert _core.set_network_body(p, None, None) == daemon_json
    assert _core.create_body(None, None, None, None, None, None, None, network=p)["network"] == daemon_json
    # Defaults: no caps, enforce; neither is sent (the daemon omits mode when it is enforce, too).
    d = NetworkPolicy.from_json({"allow_internet": True})
    assert (d.egress_mbps, d.connections_per_second, d.mode) == (None, None, "enforce")
    assert d.to_json() == {"allow_internet": True, "allow_out": [], "deny_out": []}
    assert NetworkPolicy(mode="enforce", egress_mbps=0).to_json() == \
        {"allow_internet": True, "allow_out": [], "deny_out": [], "egress_mbps": 0}
    assert NetworkPolicy(allow_out="@npm", mode="audit").to_json() == \
        {"allow_internet": True, "allow_out": ["@npm"], "deny_out": [], "mode": "audit"}


def test_log_and_proposal_models():
    full = {"id": 42, "at_ms": 1764748800123, "at": "2025-12-03T08:00:00.123Z", "sandbox_id": "sbx_" + "b" * 26,
            "protocol": "tcp", "dst_ip": "151.101.0.223", "dst_port": 443, "name": "pypi.org", "name_source": "sni",
            "decision": "audit", "rule": "allow_internet: false", "dialed": "151.101.0.223:443",
            "bytes_out": 517, "bytes_in": 4096, "duration_ms": 230, "error": "connect: Connection refused"}
    e = NetworkLogEntry.from_json(full)
    assert e == NetworkLogEntry(id=42, at_ms=1764748800123, at="2025-12-03T08:00:00.123Z",
                                sandbox_id="sbx_" + "b" * 26, protocol="tcp", decision="audit",
                                rule="allow_internet: false", dst_ip="151.101.0.223", dst_port=443, name="pypi.org",
                                name_source="sni", dialed="151.101.0.223:443", bytes_out=517, bytes_in=4096,
                                duration_ms=230, error="connect: Connection refused")
    # A DNS question: the optional fields are absent from the JSON.
    dns = NetworkLogEntry.from_json({"id": 1, "at_ms": 1, "at": "x", "sandbox_id": "s", "protocol": "dns",
                                     "name": "example.com", "name_source": "dns:A", "decision": "deny",
                                     "rule": "deny_out[0]", "bytes_out": 0, "bytes_in": 0, "duration_ms": 0})
    assert (dns.dst_ip, dns.dst_port, dns.dialed, dns.error, dns.name_source) == (None, None, None, None, "dns:A")

    prop = NetworkProposal.from_json({"policy": {"allow_internet": False, "allow_out": ["@pypi", "10.9.8.7"]},
                                      "observed": [{"entry": "@pypi", "count": 3,
                                                    "covers": ["pypi.org", "files.pythonhosted.org"]},
                                                   {"entry": "10.9.8.7", "count": 1, "covers": ["10.9.8.7"]}],
                                      "entries": 4})
    assert prop.policy == NetworkPolicy(allow_internet=False, allow_out=["@pypi", "10.9.8.7"])
    assert prop.observed == [ObservedDestination("@pypi", 3, ["pypi.org", "files.pythonhosted.org"]),
                             ObservedDestination("10.9.8.7", 1, ["10.9.8.7"])]
    assert prop.entries == 4
    empty = NetworkProposal.from_json({"policy": {"allow_internet": False}, "observed": [], "entries": 0})
    assert empty == NetworkProposal(NetworkPolicy(allow_internet=False), [], 0)

    assert _core.network_log_params(None, None, None) == {}
    assert _core.network_log_params("deny", 7, 50) == {"decision": "deny", "after": "7", "limit": "50"}
    assert _core.network_log_params(None, 3, None, follow=True) == {"after": "3", "follow": "true"}
    assert _core.template_path("base", "network/proposal") == "/v1/templates/base/network/proposal"
    with pytest.raises(moat.InvalidArgumentError):
        _core.template_path("")


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


def test_network_log_and_proposal(daemon):
    sbx = Sandbox.create()
    try:
        assert sbx.network_log() == []  # no network: nothing to log
        assert sbx.network_log(decision="deny", after=0, limit=10) == []
        for bad in ({"decision": "maybe"}, {"limit": "many"}):
            with pytest.raises(moat.InvalidArgumentError) as e:
                sbx.network_log(**bad)
            assert e.value.status == 400 and e.value.field == next(iter(bad)), e.value
        with pytest.raises(moat.InvalidArgumentError):
            sbx.follow_network_log(decision="maybe")  # refused before any streaming

        prop = sbx.network_proposal()
        assert isinstance(prop, NetworkProposal)
        assert prop.policy.allow_internet is False and prop.policy.allow_out == [] and prop.policy.mode == "enforce"
        assert (prop.observed, prop.entries) == ([], 0)

        tprop = Sandbox.template_network_proposal(sbx.info.template)
        assert tprop.policy.allow_internet is False and tprop.policy.allow_out == [] and tprop.observed == []
        with pytest.raises(moat.NotFoundError):
            Sandbox.template_network_proposal("no-such-template")
    finally:
        assert sbx.kill()
    assert sbx.network_log() == []  # the log outlives the sandbox


def test_follow_network_log_ends_when_the_sandbox_is_gone(daemon):
    sbx = Sandbox.create()
    got, errors = [], []
    stream = sbx.follow_network_log()

    def follow():
        try:
            for e in stream:
                got.append(e)
        except Exception as e:  # reported by the test below
            errors.append(e)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    try:
        t.join(1)
        assert t.is_alive()  # live: open while the sandbox runs
    finally:
        assert sbx.kill()
    t.join(20)  # the daemon checks every 2 s whether the sandbox is gone
    if t.is_alive():
        stream.stop()
        t.join(5)
        pytest.fail("follow_network_log did not end after the sandbox was killed")
    assert (got, errors) == ([], [])

    # stop() ends a stream early, from another thread.
    sbx = Sandbox.create()
    try:
        with sbx.follow_network_log(decision="deny") as stream:
            t = threading.Thread(target=lambda: list(stream), daemon=True)
            t.start()
            t.join(0.5)
            stream.stop()
            t.join(10)
            assert not t.is_alive()
    finally:
        assert sbx.kill()


def test_async_network_log_and_proposal(daemon):
    async def main():
        sbx = await AsyncSandbox.create()
        try:
            assert await sbx.network_log() == []
            with pytest.raises(moat.InvalidArgumentError) as e:
                await sbx.network_log(decision="maybe")
            assert e.value.status == 400
            with pytest.raises(moat.InvalidArgumentError):
                await sbx.follow_network_log(decision="maybe")
            prop = await sbx.network_proposal()
            assert (prop.policy.allow_internet, prop.policy.allow_out, prop.observed, prop.entries) == \
                (False, [], [], 0)
            tprop = await AsyncSandbox.template_network_proposal(sbx.info.template)
            assert (tprop.policy.allow_internet, tprop.policy.allow_out) == (False, [])
            with pytest.raises(moat.NotFoundError):
                await AsyncSandbox.template_network_proposal("no-such-template")

            stream = await sbx.follow_network_log()

            async def follow():
                return [e async for e in stream]

            task = asyncio.ensure_future(follow())
            await asyncio.sleep(0.5)
            assert not task.done()
        finally:
            assert await sbx.kill()
        try:
            assert await asyncio.wait_for(task, 20) == []
        finally:
            await stream.stop()
            await sbx.close()

    asyncio.run(asyncio.wait_for(main(), 120))


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
