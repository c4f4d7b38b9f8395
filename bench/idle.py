#!/usr/bin/env python3
"""Idle cost of a moat daemon with N idle sandboxes (docs/benchmarks.md, "12. Idle cost").

Starts a daemon of its own (no pool, no network, a busybox template; no disk quota unless DISK_MB),
creates N sandboxes 8 at a time, waits 10 s, then reads the daemon's own CPU time (/proc/PID/stat)
over a window; then 10 more creates at that N, and the daemon's RSS. Also what each idle sandbox
costs the host: disk allocated in the data dir, and host tasks (threads of every process). Everything
it made is removed. Run as root. Usage: bench/idle.py MOAT_BIN STATIC_AGENT N [WINDOW_S [DISK_MB]]"""
import json, os, subprocess, sys, tempfile, time, urllib.request, concurrent.futures, statistics, shutil

moat, agent, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
window = float(sys.argv[4]) if len(sys.argv) > 4 else 30
disk_mb = sys.argv[5] if len(sys.argv) > 5 else "0"
d = tempfile.mkdtemp(prefix="moat-idle-")
rootfs = os.path.join(d, "bb")
os.makedirs(os.path.join(rootfs, "bin"))
shutil.copy("/bin/busybox", os.path.join(rootfs, "bin/busybox"))
os.symlink("busybox", os.path.join(rootfs, "bin/sh"))
import socket
with socket.socket() as _s:
    _s.bind(("127.0.0.1", 0)); port = _s.getsockname()[1]
proc = subprocess.Popen([moat, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", os.path.join(d, "data"),
                         "--agent", agent, "--network", "none", "--pool-size", "0", "--e2b-listen", "off",
                         "--uid-base", "3500000000", "--default-disk-mb", disk_mb],
                        stdout=open(os.path.join(d, "log"), "w"), stderr=subprocess.STDOUT)
base = f"http://127.0.0.1:{port}"
for _ in range(300):
    try:
        urllib.request.urlopen(base + "/healthz", timeout=1); break
    except Exception:
        time.sleep(0.1)
key = open(os.path.join(d, "data/api-key")).read().strip()
def call(method, path, body=None):
    req = urllib.request.Request(base + path, method=method, data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read() or b"null")
call("POST", "/v1/templates", {"name": "bb", "path": rootfs})
def create():
    t = time.time()
    s = call("POST", "/v1/sandboxes", {"template": "bb", "timeout": 3600})
    return s["id"], time.time() - t
def allocated_kib(path):
    """Blocks allocated under `path`, not descending into mount points (a sandbox's template is
    mounted inside its directory: du would count the template once per sandbox)."""
    mounts = {l.split()[4] for l in open("/proc/self/mountinfo")}
    total = 0
    for root, dirs, files in os.walk(path):
        dirs[:] = [x for x in dirs if os.path.join(root, x) not in mounts]
        for name in files + dirs:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total // 1024
def host_tasks():
    return int(open("/proc/loadavg").read().split()[3].split("/")[1])
disk0, tasks0 = allocated_kib(os.path.join(d, "data")), host_tasks()
ids, lat = [], []
t0 = time.time()
with concurrent.futures.ThreadPoolExecutor(8) as ex:
    for sid, l in ex.map(lambda _: create(), range(n)):
        ids.append(sid); lat.append(l)
made = time.time() - t0
time.sleep(10)
disk_per = (allocated_kib(os.path.join(d, "data")) - disk0) / n
tasks_per = (host_tasks() - tasks0) / n
def cpu_ticks(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return int(f[11]) + int(f[12])
hz = os.sysconf("SC_CLK_TCK")
c0, w0 = cpu_ticks(proc.pid), time.time()
time.sleep(window)
c1, w1 = cpu_ticks(proc.pid), time.time()
idle_cpu = (c1 - c0) / hz / (w1 - w0) * 100
late_made = [create() for _ in range(10)]
ids += [i for i, _ in late_made]
late = [l for _, l in late_made]
rss = int([l for l in open(f"/proc/{proc.pid}/status") if l.startswith("VmRSS")][0].split()[1])
print(json.dumps({"n": n, "create_wall_s": round(made, 1),
                  "create_p50_ms": round(statistics.median(lat) * 1000, 1),
                  "create_p95_ms": round(sorted(lat)[int(len(lat) * 0.95) - 1] * 1000, 1),
                  "idle_daemon_cpu_percent": round(idle_cpu, 1), "window_s": window,
                  "create_p50_ms_at_n": round(statistics.median(late) * 1000, 1),
                  "daemon_rss_mib": round(rss / 1024, 1), "disk_mb": int(disk_mb),
                  "disk_kib_per_sandbox": round(disk_per, 1), "host_tasks_per_sandbox": round(tasks_per, 2)}))
proc.terminate(); proc.wait()
# Sandboxes outlive the daemon: remove them with a daemon again (delete all).
proc = subprocess.Popen([moat, "serve", "--listen", f"127.0.0.1:{port}", "--data-dir", os.path.join(d, "data"),
                         "--agent", agent, "--network", "none", "--pool-size", "0", "--e2b-listen", "off",
                         "--uid-base", "3500000000"], stdout=open(os.path.join(d, "log2"), "w"), stderr=subprocess.STDOUT)
for _ in range(600):
    try:
        urllib.request.urlopen(base + "/healthz", timeout=1); break
    except Exception:
        time.sleep(0.1)
with concurrent.futures.ThreadPoolExecutor(8) as ex:
    list(ex.map(lambda i: call("DELETE", f"/v1/sandboxes/{i}"), ids + []))
proc.terminate(); proc.wait()
shutil.rmtree(d, ignore_errors=True)
