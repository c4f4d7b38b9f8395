#!/usr/bin/env bash
# Sets moat up on a fresh Debian 12 machine and runs the daemon on its built-in defaults.
# Usage (as root): scripts/setup.sh [moat serve options...]
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ $(id -u) -ne 0 ]]; then
    echo "error: scripts/setup.sh must run as root (moat creates namespaces, mounts and cgroups)" >&2
    exit 1
fi

# rustup's default install puts cargo here; a root shell started with sudo may not have it on PATH.
if ! command -v cargo >/dev/null 2>&1 && [[ -f "$HOME/.cargo/env" ]]; then
    # shellcheck source=/dev/null
    . "$HOME/.cargo/env"
fi
bash scripts/deps.sh
# The microvm tier's guest kernel (Debian's cloud kernel and its virtio modules).
bash scripts/guest-kernel.sh
cargo build --release -p moat-cli
agent=$(bash scripts/build-agent.sh --release)

target_dir=$(realpath "${CARGO_TARGET_DIR:-target}")
install -D -m 0755 "$target_dir/release/moat" /usr/local/bin/moat
install -D -m 0755 "$agent" /usr/local/lib/moat/moat-agent

cat <<'MSG'

moat is installed: /usr/local/bin/moat, /usr/local/lib/moat/moat-agent.
Starting the daemon (Ctrl-C stops it). The first sandbox builds the `base` template (about a minute).
Try it from another shell:

    moat run -- python3 -c 'print(6*7)'

MSG
exec /usr/local/bin/moat serve "$@"
