import httpx
import pytest

import moat


def _server_has_code_route(daemon) -> bool:
    doc = httpx.get(daemon.url + "/openapi.json", timeout=10).json()
    return "/v1/sandboxes/{id}/code" in doc.get("paths", {})


def test_run_code_or_not_supported(daemon, sbx):
    if not _server_has_code_route(daemon):
        with pytest.raises(moat.NotSupportedError):
            sbx.run_code("x = 1")
        with pytest.raises(moat.NotSupportedError):
            sbx.create_code_context()
        # a sandbox that does not exist is still a NotFoundError, not "unsupported"
        with pytest.raises(moat.NotFoundError) as e:
            moat.Sandbox.connect("sbx_doesnotexist")
        assert not isinstance(e.value, moat.NotSupportedError)
        return
    seen = []
    sbx.run_code("x = 1")
    sbx.run_code("x += 1")
    ex = sbx.run_code("print('side'); x", on_stdout=seen.append)
    assert ex.error is None
    assert ex.text == "2"
    assert "side" in "".join(ex.logs.stdout) and "side" in "".join(seen)
    assert ex.execution_count == 3
    err = sbx.run_code("1/0")
    assert err.error is not None and err.error.name == "ZeroDivisionError"
    ctx = sbx.create_code_context()
    sbx.run_code("x = 10", context=ctx)
    assert sbx.run_code("x", context=ctx).text == "10"
    assert sbx.run_code("x").text == "2"  # the default context is separate
    sbx.remove_code_context(ctx)
