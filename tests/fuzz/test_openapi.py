"""schemathesis, driven by moat's own /openapi.json, against a real daemon (issue 32, item 8).

Every phase runs — the document's examples, its coverage cases (each constraint's edges, each
undeclared method), random fuzzing, and the stateful phase (create a sandbox, then drive it through
the links schemathesis infers) — with every check: no 5xx, every status and content type and body
declared, valid requests accepted and invalid ones refused, no answer from a deleted object.
The counts are bounded (MOAT_FUZZ_MAX_EXAMPLES, default 10 per operation) and seeded, so a CI run
takes a few minutes and a failure can be replayed; a longer run raises the bound (docs/testing.md).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _st() -> str:
    st = os.path.join(os.path.dirname(sys.executable), "st")
    assert os.path.exists(st), f"schemathesis is not installed beside {sys.executable}"
    return st


def _keep_alive(daemon, sid: str, stop: threading.Event) -> None:
    """Renews the shared sandbox's timeout while the run lasts (renewed to 120 s each time). A
    renewal that fails (a slow answer on a loaded machine) is tried again at the next tick: an
    exception here would end the thread, and the sandbox 120 s after its start."""
    while not stop.wait(10):
        try:
            daemon.http.post(f"/v1/sandboxes/{sid}/timeout", json={"timeout": 120}, timeout=30)
        except Exception as e:  # noqa: BLE001 - any failure: try again at the next tick
            print(f"keep-alive of {sid}: {e!r}", file=sys.stderr)


def test_the_api_holds_to_its_document(daemon):
    r = daemon.http.post("/v1/sandboxes", json={"template": "base", "timeout": 120})
    assert r.status_code == 201, r.text
    sid = r.json()["id"]
    stop = threading.Event()
    keeper = threading.Thread(target=_keep_alive, args=(daemon, sid, stop), daemon=True)
    keeper.start()
    env = dict(os.environ)
    env["MOAT_FUZZ_SANDBOX"] = sid
    env["SCHEMATHESIS_HOOKS"] = "moat_fuzz_hooks"
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [
        _st(), "run", f"{daemon.url}/openapi.json",
        "--header", f"Authorization: Bearer {daemon.api_key}",
        "--phases", "examples,coverage,fuzzing,stateful",
        # Every check runs (schemathesis' default); `--checks all` here would also override the
        # per-operation exceptions of schemathesis.toml.
        "--max-examples", os.environ.get("MOAT_FUZZ_MAX_EXAMPLES", "10"),
        "--seed", os.environ.get("MOAT_FUZZ_SEED", "20261206"),
        # One worker: with two, hypothesis' descriptions of its filters call compile() from two
        # threads, which CPython 3.11 can fail ("AST constructor recursion depth mismatch").
        "--workers", "1",
        "--no-color",
    ]
    # The key never goes to the output: schemathesis prints the command line it was given only
    # with headers masked (its default output sanitising); the log below is the run's own report.
    try:
        run = subprocess.run(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, timeout=1800)
    finally:
        stop.set()
        keeper.join()
    out = run.stdout.replace(daemon.api_key, "<key>")
    print(out[-20000:])
    if run.returncode != 0:
        # What the daemon did to sandboxes, for a failure about one (its log goes with its workdir).
        with open(daemon.log_path, "rb") as f:
            lines = f.read().decode(errors="replace").splitlines()
        told = [l for l in lines if any(w in l for w in ("deleted", "ended", "created", "reset", "paused"))]
        print("--- the daemon's sandbox events ---\n" + "\n".join(told[-300:]))
    assert run.returncode == 0, "schemathesis found failures (above)"
    # The daemon came through: it still answers, and no sandbox was left half-made.
    assert daemon.http.get("/healthz").status_code == 200
    # (An expiry may be stopping one right now: each gets 30 s to finish.)
    deadline = time.time() + 30
    while True:
        stuck = [s for s in daemon.http.get("/v1/sandboxes").json()["sandboxes"]
                 if s["state"] in ("starting", "stopping")]
        if not stuck or time.time() > deadline:
            break
        time.sleep(1)
    assert not stuck, f"sandboxes stuck after the run: {stuck}"
