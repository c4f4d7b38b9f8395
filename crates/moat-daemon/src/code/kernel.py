# moat's Python kernel: one long-running process per code context, written into the sandbox by the
# daemon and started through the agent. It reads one JSON request per line on stdin
# ({"id", "code", "env"}) and writes JSON messages, one per line, on a private duplicate of the
# original stdout: {"id", "type": "stdout"|"stderr"|"result"|"error"|"end", ...}. File descriptors 1
# and 2 are pipes read by this kernel, so whatever the cell prints (Python, C extensions,
# subprocesses) comes back as stdout/stderr messages and can never corrupt the protocol.
import ast
import base64
import fcntl
import json
import linecache
import os
import select
import signal
import sys
import threading
import time
import traceback

os.environ.setdefault("MPLBACKEND", "Agg")
# SIGINT interrupts a cell (the daemon sends it on timeout), even if our parent ignored it.
signal.signal(signal.SIGINT, signal.default_int_handler)

_proto = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
_proto_lock = threading.Lock()
_current = {"id": None}


def _send(msg):
    line = json.dumps(msg, ensure_ascii=False)
    with _proto_lock:
        _proto.write(line + "\n")
        _proto.flush()


class _Pipe:
    """fd 1 or 2 redirected into a pipe; a thread forwards what arrives as messages."""

    def __init__(self, fd, kind):
        self.kind = kind
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)
        fl = fcntl.fcntl(r, fcntl.F_GETFL)
        fcntl.fcntl(r, fcntl.F_SETFL, fl | os.O_NONBLOCK)
        self.r = r
        self.lock = threading.Lock()
        self.pending = b""
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self):
        while True:
            select.select([self.r], [], [], 0.05)
            self.drain()

    def drain(self):
        with self.lock:
            data = b""
            while True:
                try:
                    chunk = os.read(self.r, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                data += chunk
            if not data:
                return
            data = self.pending + data
            # Keep an incomplete trailing UTF-8 sequence for the next read.
            cut = len(data)
            for back in range(1, min(4, len(data)) + 1):
                b = data[-back]
                if b & 0xC0 == 0x80:
                    continue
                need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
                if need > back:
                    cut = len(data) - back
                break
            self.pending = data[cut:]
            text = data[:cut].decode("utf-8", errors="replace")
            if text and _current["id"] is not None:
                _send({"id": _current["id"], "type": self.kind, "data": text})


sys.stdout.flush()
sys.stderr.flush()
_pipes = [_Pipe(1, "stdout"), _Pipe(2, "stderr")]
sys.stdout = sys.__stdout__ = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.stderr = sys.__stderr__ = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
sys.stdout.reconfigure(write_through=True)
sys.stderr.reconfigure(write_through=True)


def _flush_output():
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    for p in _pipes:
        p.drain()


def _b64(data):
    if isinstance(data, str):
        data = data.encode("latin-1")
    return base64.b64encode(data).decode("ascii")


def _figure_bundle(fig):
    import io

    fmt = "png"
    try:
        import matplotlib

        if str(matplotlib.rcParams.get("savefig.format", "png")).lower() == "svg":
            fmt = "svg"
    except Exception:
        pass
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, bbox_inches="tight")
    data = buf.getvalue()
    out = {"text": repr(fig)}
    if fmt == "svg":
        out["svg"] = data.decode("utf-8", errors="replace")
    else:
        out["png"] = _b64(data)
    return out


def _is_figure(obj):
    mpl = sys.modules.get("matplotlib.figure")
    return mpl is not None and isinstance(obj, mpl.Figure)


def _bundle(obj):
    """The representations of a value, like IPython's display formatter."""
    if _is_figure(obj):
        bundle = _figure_bundle(obj)
        try:
            import matplotlib.pyplot as plt

            plt.close(obj)
        except Exception:
            pass
        return bundle
    out = {}
    try:
        out["text"] = repr(obj)
    except Exception as e:  # a broken __repr__ must not lose the cell
        out["text"] = "<repr failed: %s: %s>" % (type(e).__name__, e)
    for method, key in (
        ("_repr_html_", "html"),
        ("_repr_markdown_", "markdown"),
        ("_repr_svg_", "svg"),
        ("_repr_png_", "png"),
        ("_repr_jpeg_", "jpeg"),
        ("_repr_latex_", "latex"),
        ("_repr_json_", "json"),
    ):
        fn = getattr(obj, method, None)
        if fn is None or isinstance(obj, type):
            continue
        try:
            v = fn()
        except Exception:
            continue
        if v is None:
            continue
        if isinstance(v, tuple):  # (data, metadata)
            v = v[0]
        if key in ("png", "jpeg"):
            v = _b64(v) if isinstance(v, (bytes, bytearray)) else str(v)
        elif key == "json":
            try:
                json.dumps(v)
            except Exception:
                continue
        elif not isinstance(v, str):
            v = str(v)
        out[key] = v
    return out


def _emit_result(obj, main):
    _flush_output()
    msg = _bundle(obj)
    msg.update({"id": _current["id"], "type": "result", "is_main_result": main})
    _send(msg)


def display(*objs):
    """Shows each object as a (non-main) rich result, like IPython's display()."""
    for o in objs:
        _emit_result(o, False)


def _emit_figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return
    for num in list(plt.get_fignums()):
        fig = plt.figure(num)
        try:
            if fig.get_axes() or fig.texts or fig.images:
                msg = _figure_bundle(fig)
                msg.update({"id": _current["id"], "type": "result", "is_main_result": False})
                _flush_output()
                _send(msg)
        finally:
            plt.close(fig)


def _error(exc, skip_frames):
    tb = exc.__traceback__
    for _ in range(skip_frames):
        if tb is not None:
            tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    return {"name": type(exc).__name__, "value": str(exc), "traceback": text}


_globals = {"__name__": "__main__", "__builtins__": __builtins__, "display": display}
_count = 0


def _run_cell(code, cell_name):
    """Runs one cell; returns an error dict or None."""
    linecache.cache[cell_name] = (len(code), None, code.splitlines(True), cell_name)
    try:
        tree = ast.parse(code, filename=cell_name, mode="exec")
    except SyntaxError as e:
        return {"name": type(e).__name__, "value": str(e), "traceback": "".join(traceback.format_exception_only(type(e), e))}
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, cell_name, "exec"), _globals)
        if last is not None:
            value = eval(compile(last, cell_name, "eval"), _globals)
            if value is not None:
                _globals["_"] = value
                _emit_result(value, True)
    except BaseException as e:  # KeyboardInterrupt and SystemExit too: the kernel lives on
        return _error(e, 1)
    return None


def _handle(req):
    global _count
    _count += 1
    _current["id"] = req.get("id")
    env = req.get("env") or {}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({str(k): str(v) for k, v in env.items()})
    err = None
    try:
        err = _run_cell(req.get("code", ""), "<cell-%d>" % _count)
        try:
            _emit_figures()
        except BaseException as e:
            err = err or _error(e, 0)
    except BaseException as e:  # an interrupt that landed between the cell and its results
        err = err or _error(e, 0)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    _flush_output()
    if err is not None:
        err.update({"id": _current["id"], "type": "error"})
        _send(err)
    _send({"id": _current["id"], "type": "end", "execution_count": _count})
    _current["id"] = None


def main():
    stdin = os.fdopen(0, "rb", buffering=0)
    buf = b""
    while True:
        try:
            chunk = stdin.read(65536)
        except KeyboardInterrupt:  # a late interrupt while idle
            continue
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if not line.strip():
                continue
            try:
                req = json.loads(line)
            except ValueError:
                continue
            while True:
                try:
                    _handle(req)
                    break
                except KeyboardInterrupt:
                    # An interrupt during the kernel's own bookkeeping: report the cell as ended.
                    _send({"id": req.get("id"), "type": "end", "execution_count": _count})
                    _current["id"] = None
                    break


if __name__ == "__main__":
    _send({"id": None, "type": "ready", "pid": os.getpid(), "time": time.time()})
    main()
