#!/usr/bin/env bash
# Builds moat-agent as a static binary (it runs inside sandboxes whatever their libc) and prints its path.
# Usage: scripts/build-agent.sh [--release]
set -euo pipefail
cd "$(dirname "$0")/.."

target=x86_64-unknown-linux-gnu
profile=debug
cargo_args=()
for arg in "$@"; do
    case "$arg" in
        --release) profile=release; cargo_args+=(--release) ;;
        *) echo "usage: $0 [--release]" >&2; exit 2 ;;
    esac
done

CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUSTFLAGS="-C target-feature=+crt-static" \
    cargo build -p moat-agent --target "$target" "${cargo_args[@]}" >&2

target_dir=$(realpath "${CARGO_TARGET_DIR:-target}")
agent="$target_dir/$target/$profile/moat-agent"
if [[ ! -x "$agent" ]]; then
    echo "error: $agent was not built" >&2
    exit 1
fi
description=$(file -b "$agent")
if [[ "$description" != *"statically linked"* && "$description" != *"static-pie linked"* ]]; then
    echo "error: $agent is not statically linked: $description" >&2
    exit 1
fi
echo "$agent"
