import threading

from moat import Sandbox


def _read_until(h, needle: bytes, buf: bytearray) -> bool:
    for chunk in h:
        buf += chunk
        if needle in buf:
            return True
    return False


def test_pty_size_and_resize(sbx: Sandbox):
    h = sbx.pty.create(cols=80, rows=24)
    timer = threading.Timer(20, h.kill)  # never hang the suite
    timer.start()
    try:
        buf = bytearray()
        h.send_input(b"stty size; echo MARK1\n")
        assert _read_until(h, b"24 80", buf), bytes(buf)
        h.resize(cols=100, rows=40)
        h.send_input("stty size\n")
        assert _read_until(h, b"40 100", buf), bytes(buf)
        h.send_input("exit 3\n")
        r = h.wait()
    finally:
        timer.cancel()
    assert r.exit_code == 3


def test_pty_kill_and_custom_cmd(sbx: Sandbox):
    out = bytearray()
    h = sbx.pty.create(cols=40, rows=10, cmd="tty; sleep 30")
    timer = threading.Timer(20, h.kill)
    timer.start()
    try:
        assert _read_until(h, b"/dev/pts/", out), bytes(out)
        assert h.kill() is True
        r = h.wait()
    finally:
        timer.cancel()
    assert r.signal == "SIGKILL"
