#!/usr/bin/env bash
# Runs moat's whole test suite: formatting, lints, and every test (sandbox tests need root).
# Usage (as root): scripts/test.sh [cargo test arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
    echo "error: scripts/test.sh must run as root (the tests create real sandboxes)" >&2
    exit 1
fi

# rustup's default install puts cargo here; a root shell started with sudo may not have it on PATH.
if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck source=/dev/null
    . "$HOME/.cargo/env"
fi
bash scripts/deps.sh
# The microvm tier's guest kernel, for its unit and end-to-end tests.
bash scripts/guest-kernel.sh

echo "== cargo fmt"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

# Every daemon a test starts runs without sandbox networking unless the test builds its own network
# namespaces (tests/e2e/network.rs passes --network nat inside them): no test routes sandbox traffic
# out of this machine.
export MOAT_NETWORK=none
# A test daemon keeps 512 MiB of the disk in reserve, not the default 5% (4 GiB, creates refused
# with 507 below 8 GiB free): a build machine whose disk holds the build and little more still runs
# the suite. The disk-full trial sets its own reserve on a filesystem of its own (tests/e2e/diskfull.rs).
export MOAT_DISK_RESERVE_MB=512

echo "== static agent"
MOAT_AGENT=$(bash scripts/build-agent.sh)
export MOAT_AGENT
echo "MOAT_AGENT=$MOAT_AGENT"

echo "== cargo test"
cargo test --workspace "$@"

# The end-to-end suite again with every sandbox on the gvisor tier (runsc from scripts/deps.sh): the
# same tests, parametrised by MOAT_E2E_ISOLATION (tests/e2e/harness.rs), never copied; where gVisor
# guarantees something else than a container, the test checks that (tests/e2e/GVISOR.md).
echo "== cargo test (e2e, gvisor tier)"
MOAT_E2E_ISOLATION=gvisor cargo test -p moat-cli --test e2e

# The whole end-to-end suite again with every sandbox a QEMU microVM (TCG where KVM cannot boot a
# guest, as on the build machine), escape suite and template builds included (docs/microvm-tier.md).
echo "== cargo test (e2e, microvm tier)"
MOAT_E2E_ISOLATION=microvm cargo test -p moat-cli --test e2e

# The benchmark's quick mode: every scenario's code path against moat and the installed peers, tiny
# counts, no timing judged (docs/benchmarks.md).
echo "== bench (quick)"
cargo build --quiet -p moat-cli -p moat-bench
target/debug/moat-bench --quick --moat-bin target/debug/moat --agent "$MOAT_AGENT"

echo "== python sdk"
# The Python SDK's tests start their own daemon (target/debug/moat, built above as part of moat-cli).
# pytest exits non-zero on any failure and with 5 when it collects no tests; set -e makes both fatal.
cargo build --quiet -p moat-cli  # a no-op when cargo test built it already
python3 -m venv target/pyvenv
target/pyvenv/bin/pip install --quiet ./sdk/python pytest
MOAT_BIN="$PWD/target/debug/moat" MOAT_AGENT="$MOAT_AGENT" target/pyvenv/bin/pytest -q sdk/python/tests

echo "== e2b"
# E2B's official Python SDKs, unmodified and pinned (the newest 2.x on PyPI when this was written),
# against moat's E2B-compatible API (docs/e2b.md): the tests start their own daemon with it on a
# free port and set E2B_API_URL / E2B_SANDBOX_URL / E2B_API_KEY (uid base 3800000000).
# A venv of its own: E2B's dependencies stay out of the moat SDK's.
python3 -m venv target/e2b-venv
target/e2b-venv/bin/pip install --quiet "e2b==2.63.0" "e2b-code-interpreter==2.11.5" pytest
MOAT_BIN="$PWD/target/debug/moat" MOAT_AGENT="$MOAT_AGENT" target/e2b-venv/bin/pytest -q tests/e2b
# An older release that behaves differently: 2.25.0 refuses, before sending it, any API key that is
# not `e2b_` + hex (moat writes that form of its key to <data_dir>/e2b-api-key).
python3 -m venv target/e2b-old-venv
target/e2b-old-venv/bin/pip install --quiet "e2b==2.25.0" pytest
MOAT_BIN="$PWD/target/debug/moat" MOAT_AGENT="$MOAT_AGENT" target/e2b-old-venv/bin/pytest -q tests/e2b_compat

echo "== mcp"
# moat's MCP server over stdio (`moat mcp`) and streamable HTTP (`/mcp`), driven by the official MCP
# Python SDK; the tests start their own daemon (uid base 3900000000) like the SDK tests do.
target/pyvenv/bin/pip install --quiet mcp pytest httpx
MOAT_BIN="$PWD/target/debug/moat" MOAT_AGENT="$MOAT_AGENT" target/pyvenv/bin/pytest -q tests/mcp

echo "== api fuzz"
# schemathesis, driven by the daemon's own /openapi.json, against a real daemon (tests/fuzz; uid base
# 3700000000): every phase (examples, coverage, fuzzing, stateful) and every check, seeded and bounded
# (MOAT_FUZZ_MAX_EXAMPLES per operation, default 10). Any 5xx or answer the document does not
# declare fails the run (docs/testing.md).
# A venv of its own: schemathesis' dependencies stay out of the SDK's and MCP's.
python3 -m venv target/fuzz-venv
target/fuzz-venv/bin/pip install --quiet "schemathesis==4.32.5" pytest httpx
MOAT_BIN="$PWD/target/debug/moat" MOAT_AGENT="$MOAT_AGENT" target/fuzz-venv/bin/pytest -q tests/fuzz
