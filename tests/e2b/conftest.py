"""A real moat daemon with its E2B-compatible API on a free port, and E2B's official SDK pointed at it
by the two environment variables E2B's docs name (E2B_API_URL, E2B_SANDBOX_URL) plus the API key.

The daemon is started like the Python SDK's tests start theirs (sdk/python/tests/conftest.py: prebuilt
`base` and `code-interpreter` root filesystems from target/moat-e2e, built when absent); its uid range
starts at MOAT_E2B_TEST_UID_BASE (default 3800000000, disjoint from the other Python suites').
"""

from __future__ import annotations

import importlib.util
import os
import socket

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location(
    "moat_sdk_test_daemon_e2b", os.path.join(ROOT, "sdk", "python", "tests", "conftest.py"))
_sdk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sdk)
_sdk.UID_BASE = os.environ.get("MOAT_E2B_TEST_UID_BASE", "3800000000")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def daemon():
    port = _free_port()
    d = _sdk.Daemon(extra_args=["--e2b-listen", f"127.0.0.1:{port}"])
    d.e2b_url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("E2B_API_KEY", "E2B_API_URL", "E2B_SANDBOX_URL")}
    # The key as docs/e2b.md gives it: the E2B form moat writes beside its own key.
    with open(os.path.join(d.data_dir, "e2b-api-key")) as f:
        d.e2b_api_key = f.read().strip()
    os.environ["E2B_API_KEY"] = d.e2b_api_key
    os.environ["E2B_API_URL"] = d.e2b_url
    os.environ["E2B_SANDBOX_URL"] = d.e2b_url
    try:
        yield d
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        d.stop()


@pytest.fixture(scope="session")
def code_interpreter(daemon):
    daemon.ensure_template("code-interpreter", _sdk.CI_ROOTFS)
    return daemon


@pytest.fixture()
def sbx(daemon):
    from e2b import Sandbox

    s = Sandbox.create(timeout=300)
    try:
        yield s
    finally:
        s.kill()
