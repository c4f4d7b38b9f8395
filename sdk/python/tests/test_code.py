import base64
import struct

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


def test_timeout_interrupts_a_cell_and_keeps_the_context(daemon, sbx):
    sbx.run_code("kept = 5")
    ex = sbx.run_code("while True:\n    pass", timeout=2)
    assert ex.error is not None and ex.error.name == "TimeoutError", ex.error
    after = sbx.run_code("kept")
    assert after.error is None and after.text == "5"


def test_matplotlib_chart_comes_back_as_png(code_interpreter):
    from moat import Sandbox

    with Sandbox.create(template="code-interpreter", timeout=300) as s:
        ex = s.run_code(
            "import matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots(figsize=(4, 3), dpi=100)\n"
            "ax.plot([1, 2, 3], [3, 1, 2])\n"
            "plt.show()"
        )
        assert ex.error is None, ex.error
        pngs = [r.png for r in ex.results if r.png]
        assert len(pngs) == 1, ex.results
        data = base64.b64decode(pngs[0])
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert data[12:16] == b"IHDR"
        width, height = struct.unpack(">II", data[16:24])
        # A 4x3 in figure at 100 dpi, saved with a tight bounding box: a little under 400x300.
        assert 200 <= width <= 400 and 150 <= height <= 300, (width, height)
