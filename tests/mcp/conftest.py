"""Starts a real moat daemon for the MCP tests, the same way the Python SDK's tests do.

Environment: MOAT_BIN, MOAT_AGENT, MOAT_TEST_BASE_ROOTFS as for sdk/python/tests; the daemon's uid range
starts at MOAT_MCP_TEST_UID_BASE (default 3900000000, disjoint from the SDK tests' 3000000000).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
_spec = importlib.util.spec_from_file_location(
    "moat_sdk_test_daemon", os.path.join(ROOT, "sdk", "python", "tests", "conftest.py"))
_sdk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_sdk)
_sdk.UID_BASE = os.environ.get("MOAT_MCP_TEST_UID_BASE", "3900000000")

BIN = _sdk.BIN


@pytest.fixture(scope="session")
def daemon():
    d = _sdk.Daemon()  # pool size 0, default template `base`
    try:
        yield d
    finally:
        d.stop()
