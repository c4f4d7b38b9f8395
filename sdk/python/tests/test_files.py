import hashlib
import os
import threading
import time

import pytest

import moat
from moat import WriteEntry


def test_text_bytes_and_ops(sbx):
    info = sbx.files.write("/tmp/ops/a.txt", "héllo")
    assert (info.path, info.type, info.size) == ("/tmp/ops/a.txt", "file", len("héllo".encode()))
    assert sbx.files.read("/tmp/ops/a.txt") == "héllo"
    assert sbx.files.write("/tmp/ops/b.bin", b"\x00\xff", mode=0o600).permissions == "rw-------"
    assert sbx.files.read("/tmp/ops/b.bin", format="bytes") == b"\x00\xff"
    assert sbx.files.exists("/tmp/ops/a.txt") and not sbx.files.exists("/tmp/ops/zzz")
    assert sbx.files.get_info("/tmp/ops").type == "dir"
    assert sbx.files.make_dir("/tmp/ops/sub/deep") is True
    assert sbx.files.make_dir("/tmp/ops/sub/deep") is False
    written = sbx.files.write_files([WriteEntry("/tmp/ops/sub/c", "c"), {"path": "/tmp/ops/sub/deep/d", "data": b"d"}])
    assert [e.name for e in written] == ["c", "d"]
    assert sbx.files.rename("/tmp/ops/a.txt", "/tmp/ops/moved.txt").path == "/tmp/ops/moved.txt"
    assert not sbx.files.exists("/tmp/ops/a.txt")
    top = {e.name for e in sbx.files.list("/tmp/ops")}
    assert top == {"b.bin", "moved.txt", "sub"}
    deep = {e.path for e in sbx.files.list("/tmp/ops", depth=3)}
    assert {"/tmp/ops/sub/c", "/tmp/ops/sub/deep", "/tmp/ops/sub/deep/d"} <= deep
    with pytest.raises(moat.ConflictError):
        sbx.files.remove("/tmp/ops/sub")
    sbx.files.remove("/tmp/ops/sub", recursive=True)
    assert not sbx.files.exists("/tmp/ops/sub")


def test_20mb_streamed_round_trip(sbx, tmp_path):
    src = tmp_path / "big.bin"
    h = hashlib.sha256()
    with open(src, "wb") as f:
        for _ in range(20):
            chunk = os.urandom(1 << 20)
            h.update(chunk)
            f.write(chunk)
    with open(src, "rb") as f:
        assert sbx.files.write("/tmp/big.bin", f).size == 20 << 20
    inside = sbx.commands.run("sha256sum /tmp/big.bin").stdout.split()[0]
    assert inside == h.hexdigest()
    back = hashlib.sha256()
    n = 0
    with sbx.files.read("/tmp/big.bin", format="stream") as stream:
        for chunk in stream:
            assert len(chunk) <= 1 << 20
            back.update(chunk)
            n += len(chunk)
    assert (n, back.hexdigest()) == (20 << 20, h.hexdigest())


def test_watch_dir_sees_created_file(sbx):
    sbx.files.make_dir("/tmp/watched")
    w = sbx.files.watch_dir("/tmp/watched")
    timer = threading.Timer(15, w.stop)  # stop() from another thread ends a blocked iteration
    timer.start()
    events = []
    try:
        sbx.commands.run("touch /tmp/watched/touched")
        sbx.files.write("/tmp/watched/new.txt", "x")  # written beside and renamed: seen as its create
        for ev in w:
            events.append((ev.type, ev.path))
            if ev.path == "/tmp/watched/new.txt":
                break
    finally:
        timer.cancel()
        w.stop()
    assert ("create", "/tmp/watched/touched") in events, events
    assert ("create", "/tmp/watched/new.txt") in events, events
    assert not any(".moat-" in p for _, p in events), events  # the temporary name never shows


def test_watch_stop_unblocks_iteration(sbx):
    sbx.files.make_dir("/tmp/quiet")
    w = sbx.files.watch_dir("/tmp/quiet")
    threading.Timer(0.5, w.stop).start()
    t0 = time.monotonic()
    assert list(w) == []  # returns once stopped, no error
    assert time.monotonic() - t0 < 10


def test_upload_and_download_dir(sbx, tmp_path):
    src = tmp_path / "src"
    (src / "nested" / "deeper").mkdir(parents=True)
    (src / "top.txt").write_text("top")
    (src / "nested" / "n.bin").write_bytes(os.urandom(300_000))
    (src / "nested" / "deeper" / "d.txt").write_text("deep")
    sbx.files.upload_dir(str(src), "/tmp/uploaded")
    assert sbx.files.read("/tmp/uploaded/nested/deeper/d.txt") == "deep"
    paths = {e.path for e in sbx.files.list("/tmp/uploaded", depth=3)}
    assert "/tmp/uploaded/nested/n.bin" in paths
    sbx.commands.run("echo made-inside > /tmp/uploaded/inside.txt")
    dst = tmp_path / "dst"
    sbx.files.download_dir("/tmp/uploaded", str(dst))
    assert (dst / "top.txt").read_text() == "top"
    assert (dst / "nested" / "n.bin").read_bytes() == (src / "nested" / "n.bin").read_bytes()
    assert (dst / "nested" / "deeper" / "d.txt").read_text() == "deep"
    assert (dst / "inside.txt").read_text() == "made-inside\n"
