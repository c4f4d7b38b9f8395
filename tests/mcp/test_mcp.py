"""moat's MCP server driven by the official MCP Python SDK over both transports: stdio (`moat mcp`)
and streamable HTTP (the daemon's `/mcp`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib

import httpx
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from conftest import BIN

TOOLS = {"create_sandbox", "list_sandboxes", "kill_sandbox", "run_command", "run_code", "read_file",
         "write_file", "list_files", "snapshot_sandbox", "fork_snapshot", "reset_sandbox", "pause_sandbox",
         "resume_sandbox", "get_network_policy", "set_network_policy", "network_log"}


@contextlib.asynccontextmanager
async def session(daemon, transport: str):
    if transport == "stdio":
        params = StdioServerParameters(command=BIN, args=["mcp"],
                                       env={"MOAT_URL": daemon.url, "MOAT_API_KEY": daemon.api_key})
        streams = stdio_client(params)
    else:
        http = create_mcp_http_client(headers={"Authorization": f"Bearer {daemon.api_key}"})
        streams = streamable_http_client(daemon.url + "/mcp", http_client=http)
    async with streams as (read, write):
        async with ClientSession(read, write) as s:
            await s.initialize()
            yield s


def text_of(result) -> str:
    return "\n".join(c.text for c in result.content if c.type == "text")


async def call(s, name, **args):
    return await s.call_tool(name, args)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, timeout=300))


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_tools_are_listed(daemon, transport):
    async def go():
        async with session(daemon, transport) as s:
            tools = (await s.list_tools()).tools
            names = {t.name for t in tools}
            assert TOOLS <= names, names
            for t in tools:
                assert t.description, t.name
                assert t.input_schema.get("type") == "object", t.name
            run_cmd = next(t for t in tools if t.name == "run_command")
            assert set(run_cmd.input_schema["required"]) == {"sandbox_id", "command"}
    run(go())


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_sandbox_workflow(daemon, transport):
    async def go():
        async with session(daemon, transport) as s:
            r = await call(s, "create_sandbox", timeout=300, metadata={"mcp_test": transport})
            assert not r.is_error, text_of(r)
            first = text_of(r).splitlines()[0]
            assert first.startswith("sandbox_id: "), text_of(r)
            sid = first.split(": ", 1)[1].strip()
            try:
                r = await call(s, "list_sandboxes", metadata={"mcp_test": transport})
                assert sid in text_of(r)

                r = await call(s, "run_command", sandbox_id=sid, command="echo hi; echo oops >&2; exit 3")
                out = text_of(r)
                assert not r.is_error, out
                assert "hi" in out and "oops" in out and "exit code: 3" in out, out

                r = await call(s, "run_command", sandbox_id=sid, command="pwd", cwd="/tmp")
                assert "/tmp" in text_of(r) and "exit code: 0" in text_of(r)

                r = await call(s, "write_file", sandbox_id=sid, path="/root/mcp/hello.txt", content="héllo\nworld\n")
                assert not r.is_error, text_of(r)
                r = await call(s, "read_file", sandbox_id=sid, path="/root/mcp/hello.txt")
                assert not r.is_error and text_of(r) == "héllo\nworld\n", text_of(r)
                r = await call(s, "list_files", sandbox_id=sid, path="/root/mcp")
                assert "/root/mcp/hello.txt" in text_of(r), text_of(r)

                await call(s, "run_command", sandbox_id=sid, command="printf '\\000\\377\\001' > /root/bin.dat")
                r = await call(s, "read_file", sandbox_id=sid, path="/root/bin.dat")
                assert "base64" in text_of(r) and base64.b64encode(b"\0\xff\x01").decode() in text_of(r)

                r = await call(s, "read_file", sandbox_id=sid, path="/root/nope.txt")
                assert r.is_error and text_of(r), text_of(r)

                r = await call(s, "run_code", sandbox_id=sid, code="x = 1")
                assert not r.is_error, text_of(r)
                r = await call(s, "run_code", sandbox_id=sid, code="x + 1")
                assert not r.is_error and text_of(r).strip() == "2", text_of(r)
                # Rich results with a PNG (what matplotlib charts produce) become MCP image content.
                png = b"\x89PNG\r\n\x1a\nfake"
                r = await call(s, "run_code", sandbox_id=sid,
                               code=f"class Chart:\n    def _repr_png_(self):\n        return {png!r}\nChart()")
                assert not r.is_error, text_of(r)
                images = [c for c in r.content if c.type == "image"]
                assert len(images) == 1 and images[0].mime_type == "image/png", r.content
                assert base64.b64decode(images[0].data) == png
                r = await call(s, "run_code", sandbox_id=sid, code="1/0")
                assert r.is_error and "ZeroDivisionError" in text_of(r), text_of(r)
                r = await call(s, "run_code", sandbox_id=sid, code="1", language="cobol")
                assert r.is_error and "language" in text_of(r)
            finally:
                r = await call(s, "kill_sandbox", sandbox_id=sid)
                assert not r.is_error, text_of(r)
            r = await call(s, "run_command", sandbox_id=sid, command="true")
            assert r.is_error, text_of(r)
            r = await call(s, "kill_sandbox", sandbox_id="sbx_doesnotexist")
            assert r.is_error and text_of(r).startswith("error: "), text_of(r)
    run(go())


def test_http_needs_the_api_key(daemon):
    init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-03-26", "capabilities": {},
                       "clientInfo": {"name": "t", "version": "0"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    r = httpx.post(daemon.url + "/mcp", json=init, headers=headers, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(daemon.url + "/mcp", json=init, headers={**headers, "Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401, r.text
    r = httpx.post(daemon.url + "/mcp", json=init,
                   headers={**headers, "Authorization": f"Bearer {daemon.api_key}"}, timeout=30)
    assert r.status_code == 200, r.text


def test_stdio_without_a_daemon_fails_cleanly(daemon):
    """A tool call against an unreachable daemon is a tool error, not a crash of the server."""
    async def go():
        params = StdioServerParameters(command=BIN, args=["mcp"],
                                       env={"MOAT_URL": "http://127.0.0.1:9", "MOAT_API_KEY": "k"})
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as s:
                await s.initialize()
                r = await call(s, "list_sandboxes")
                assert r.is_error and text_of(r).startswith("error: "), text_of(r)
                assert TOOLS <= {t.name for t in (await s.list_tools()).tools}
    run(go())


def test_png_chart(daemon):
    """Charts come back as MCP image content (the code-interpreter template: registered from the Rust
    end-to-end tests' build when it exists, built otherwise)."""
    daemon.ensure_template("code-interpreter", _sdk_ci_rootfs())

    async def go():
        async with session(daemon, "http") as s:
            r = await call(s, "create_sandbox", template="code-interpreter", timeout=300)
            sid = text_of(r).splitlines()[0].split(": ", 1)[1].strip()
            try:
                r = await call(s, "run_code", sandbox_id=sid,
                               code="import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
                assert not r.is_error, text_of(r)
                images = [c for c in r.content if c.type == "image"]
                assert images and images[0].mime_type == "image/png"
                assert base64.b64decode(images[0].data).startswith(b"\x89PNG")
            finally:
                await call(s, "kill_sandbox", sandbox_id=sid)
    run(go())


def _sdk_ci_rootfs() -> str:
    from conftest import _sdk

    return _sdk.CI_ROOTFS


@pytest.mark.parametrize("transport", ["stdio", "http"])
def test_snapshot_fork_reset_pause_resume(daemon, transport):
    async def go():
        async with session(daemon, transport) as s:
            r = await call(s, "create_sandbox", timeout=300)
            sid = text_of(r).splitlines()[0].split(": ", 1)[1].strip()
            made = [sid]
            try:
                assert not (await call(s, "write_file", sandbox_id=sid, path="/root/state.txt",
                                       content="before")).is_error
                r = await s.call_tool("snapshot_sandbox", {"sandbox_id": sid, "name": f"mcp-{transport}"})
                assert not r.is_error, text_of(r)
                assert text_of(r).startswith("snapshot_id: snap_"), text_of(r)
                await call(s, "write_file", sandbox_id=sid, path="/root/state.txt", content="after")

                r = await call(s, "fork_snapshot", snapshot=f"mcp-{transport}", count=2)
                assert not r.is_error, text_of(r)
                forks = [ln for ln in text_of(r).splitlines()[1:] if ln.startswith("sbx_")]
                assert len(forks) == 2, text_of(r)
                made += forks
                for f in forks:
                    assert text_of(await call(s, "read_file", sandbox_id=f, path="/root/state.txt")) == "before"

                r = await call(s, "reset_sandbox", sandbox_id=sid, snapshot=f"mcp-{transport}")
                assert not r.is_error, text_of(r)
                assert text_of(await call(s, "read_file", sandbox_id=sid, path="/root/state.txt")) == "before"

                r = await call(s, "pause_sandbox", sandbox_id=sid)
                assert not r.is_error and "paused" in text_of(r), text_of(r)
                r = await call(s, "run_command", sandbox_id=sid, command="true")
                assert r.is_error and "paused" in text_of(r), text_of(r)
                r = await call(s, "resume_sandbox", sandbox_id=sid)
                assert not r.is_error and "resumed" in text_of(r), text_of(r)
                r = await call(s, "run_command", sandbox_id=sid, command="echo awake")
                assert "awake" in text_of(r), text_of(r)

                # This daemon runs without sandbox networking: the network tools say so.
                for tool, args in (("get_network_policy", {}), ("set_network_policy", {"allow_internet": False})):
                    r = await s.call_tool(tool, {"sandbox_id": sid, **args})
                    assert r.is_error and "network" in text_of(r).lower(), (tool, text_of(r))
                r = await call(s, "network_log", sandbox_id=sid)
                assert not r.is_error and text_of(r) == "no connections logged", text_of(r)
                r = await call(s, "network_log", sandbox_id=sid, decision="maybe")
                assert r.is_error and "allow, deny or audit" in text_of(r), text_of(r)
            finally:
                for m in made:
                    await call(s, "kill_sandbox", sandbox_id=m)
    run(go())
