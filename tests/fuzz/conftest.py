"""Starts a real moat daemon for the API fuzzer, the same way the Python SDK's tests do.

Environment: MOAT_BIN, MOAT_AGENT, MOAT_TEST_BASE_ROOTFS as for sdk/python/tests; the daemon's uid range
starts at MOAT_FUZZ_TEST_UID_BASE (default 3700000000, disjoint from the other suites').
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
_sdk.UID_BASE = os.environ.get("MOAT_FUZZ_TEST_UID_BASE", "3700000000")


@pytest.fixture(scope="session")
def daemon():
    # Short default lifetimes: the fuzzer creates many and leaves them. The hooks give the container
    # and gVisor ones it drives across phases 300 s (moat_fuzz_hooks.lifetimes_that_outlast_the_run),
    # within --max-timeout.
    d = _sdk.Daemon(["--e2b-listen", "off", "--default-timeout", "20", "--max-timeout", "600"])
    try:
        yield d
    finally:
        d.stop()
