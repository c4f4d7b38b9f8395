"""Starts a real moat daemon for the whole session (root needed) and stops it at the end.

Environment: MOAT_BIN (default target/debug/moat), MOAT_AGENT (default the static debug agent),
MOAT_TEST_UID_BASE (default 3000000000; give concurrent daemons disjoint ranges),
MOAT_TEST_BASE_ROOTFS (prebuilt rootfs to register as template `base`; built with debootstrap when absent).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import httpx
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
BIN = os.environ.get("MOAT_BIN") or os.path.join(ROOT, "target/debug/moat")
AGENT = os.environ.get("MOAT_AGENT") or os.path.join(ROOT, "target/x86_64-unknown-linux-gnu/debug/moat-agent")
BASE_ROOTFS = os.environ.get("MOAT_TEST_BASE_ROOTFS") or os.path.join(ROOT, "target/moat-e2e/templates/base/rootfs")
# The code-interpreter template (base + numpy, pandas, matplotlib): the Rust end-to-end tests build it
# in target/moat-e2e first (scripts/test.sh runs them before these); built here when absent.
CI_ROOTFS = os.environ.get("MOAT_TEST_CODE_INTERPRETER_ROOTFS") or os.path.join(
    ROOT, "target/moat-e2e/templates/code-interpreter/rootfs")
UID_BASE = os.environ.get("MOAT_TEST_UID_BASE", "3000000000")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mounts_under(path: str) -> list:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if ln.split()[4].startswith(path.rstrip("/") + "/")]


class Daemon:
    def __init__(self, extra_args=None):
        for p in (BIN, AGENT):
            if not os.path.exists(p):
                raise RuntimeError(f"{p} is missing: build with `cargo build -p moat-cli && bash scripts/build-agent.sh`")
        if os.geteuid() != 0:
            raise RuntimeError("the SDK tests start a real moat daemon and need root")
        os.makedirs(os.path.join(ROOT, "target"), exist_ok=True)
        self.workdir = tempfile.mkdtemp(prefix="sdk-pytest-", dir=os.path.join(ROOT, "target"))
        os.chmod(self.workdir, 0o755)  # sandboxes run as unprivileged host uids and must traverse it
        self.data_dir = os.path.join(self.workdir, "data")
        self.log_path = os.path.join(self.workdir, "daemon.log")
        self.url = f"http://127.0.0.1:{_free_port()}"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [BIN, "serve", "--listen", self.url[len("http://"):], "--data-dir", self.data_dir, "--agent", AGENT,
             "--uid-base", UID_BASE, "--pool-size", "0", "--default-template", "base",
             # Tests never give sandboxes a way out of the host (network safety rules).
             "--network", "none", *(extra_args or ["--e2b-listen", "off"])],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.api_key = self._wait_ready()
        self.http = httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"},
                                 timeout=httpx.Timeout(600.0, connect=10.0))
        self._register_base()

    def _fail(self, why: str):
        with open(self.log_path, "rb") as f:
            tail = f.read()[-4000:].decode("utf-8", "replace")
        raise RuntimeError(f"{why}\n--- daemon log ({self.log_path}) ---\n{tail}")

    def _wait_ready(self) -> str:
        key_file = os.path.join(self.data_dir, "api-key")
        deadline = time.time() + 60
        while time.time() < deadline:
            if self.proc.poll() is not None:
                self._fail(f"moat serve exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200 and os.path.exists(key_file):
                    with open(key_file) as f:
                        return f.read().strip()
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self._fail("moat serve did not become ready in 60 s")

    def _register_base(self) -> None:
        self.ensure_template("base", BASE_ROOTFS)

    def ensure_template(self, name: str, prebuilt: str) -> None:
        """Registers the prebuilt rootfs as template `name`, or builds it (debootstrap) when absent."""
        r = self.http.get(f"/v1/templates/{name}")
        if r.status_code == 200 and r.json().get("status") == "ready":
            return
        if os.path.isdir(prebuilt):
            r = self.http.post("/v1/templates", json={"name": name, "path": prebuilt})
            if r.status_code >= 300:
                self._fail(f"registering {prebuilt}: {r.status_code} {r.text}")
            return
        last = None  # no prebuilt rootfs (fresh machine): build it (base ~90 s, code-interpreter ~5 min)
        with self.http.stream("POST", f"/v1/templates/{name}/build", timeout=None) as r:
            if r.status_code >= 300:
                self._fail(f"building {name}: {r.status_code} {r.read()!r}")
            for line in r.iter_lines():
                if line.strip():
                    last = json.loads(line)
        if not last or last.get("type") != "done":
            self._fail(f"building {name} failed: {last}")

    def stop(self) -> None:
        try:
            for s in self.http.get("/v1/sandboxes").json().get("sandboxes", []):
                self.http.delete(f"/v1/sandboxes/{s['id']}")
        finally:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.http.close()
            self.log.close()
        if not _mounts_under(self.workdir):  # never rm -rf through a leftover mount
            shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon():
    d = Daemon()
    saved = {k: os.environ.get(k) for k in ("MOAT_URL", "MOAT_API_KEY")}
    os.environ["MOAT_URL"], os.environ["MOAT_API_KEY"] = d.url, d.api_key
    try:
        yield d
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        d.stop()


@pytest.fixture(scope="module")
def sbx(daemon):
    """One sandbox shared by a test module (killed at its end)."""
    from moat import Sandbox

    with Sandbox.create(timeout=600) as s:
        yield s


@pytest.fixture(scope="session")
def code_interpreter(daemon):
    """The daemon with the `code-interpreter` template ready."""
    daemon.ensure_template("code-interpreter", CI_ROOTFS)
    return daemon
