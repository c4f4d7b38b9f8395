"""E2B's Python SDK 2.25.0, the first release that checks the API key's form on the client
(`e2b_` followed by hex digits) before it sends anything: moat's own key is refused by the SDK
itself, the E2B form moat writes to `<data_dir>/e2b-api-key` works (docs/e2b.md)."""

from __future__ import annotations

import os
from importlib.metadata import version

import pytest
from e2b import AuthenticationException, Sandbox


def test_this_is_the_release_that_checks_the_key():
    assert version("e2b") == "2.25.0"


def test_moat_key_as_it_is_is_refused_by_the_sdk_and_the_e2b_form_works(daemon):
    # What a user who followed older docs would see: the SDK's own refusal, before any request.
    with pytest.raises(AuthenticationException) as e:
        Sandbox.create(api_key=daemon.api_key, timeout=60)
    assert "API key format" in str(e.value)
    # The documented key (E2B_API_KEY, set by the fixture from e2b-api-key).
    assert os.environ["E2B_API_KEY"] == daemon.e2b_api_key
    sbx = Sandbox.create(timeout=120)
    try:
        assert sbx.commands.run("echo $((6*7))").stdout == "42\n"
        sbx.files.write("/home/user/old-sdk.txt", "written by e2b 2.25.0")
        assert sbx.files.read("/home/user/old-sdk.txt") == "written by e2b 2.25.0"
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
    finally:
        sbx.kill()
