#!/usr/bin/env bash
# Installs the Debian packages moat and its tests need. Idempotent: apt is skipped entirely when every
# package is already installed.
set -euo pipefail

packages=(
    debootstrap       # builds the `base` template
    debian-archive-keyring
    iproute2          # ip netns / veth
    nftables          # egress policy
    util-linux        # unshare, mount, nsenter
    tar gzip xz-utils zstd
    ca-certificates
    procps psmisc
    file              # scripts/build-agent.sh checks the agent is static
    busybox-static    # tiny root filesystems for fast tests
    coreutils
    curl              # tests talk to the daemon's unix socket
    skopeo            # tests: makes docker-archive images and pushes to a test registry
    docker-registry   # tests: a real OCI registry on 127.0.0.1
    apache2-utils     # tests: htpasswd for the registry's basic auth
    dnsmasq-base      # tests: the DNS server of the network test's "internet" namespace
    python3           # tests: HTTP servers inside test namespaces and sandboxes
    openssl           # tests: self-signed certificates of the network test's HTTPS servers
    runsc             # the gvisor isolation tier (and a bench peer)
    bubblewrap runc podman  # bench: the peers moat is measured against
    qemu-system-x86   # the microvm isolation tier
    kmod              # scripts/guest-kernel.sh: depmod and modprobe --show-depends on the guest kernel
    lxcfs             # container sandboxes read their own CPU and memory counts (docs/resources.md)
)

missing=()
for p in "${packages[@]}"; do
    status=$(dpkg-query -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null || true)
    if [[ "$status" != ii* ]]; then
        missing+=("$p")
    fi
done

if ((${#missing[@]} > 0)); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "error: missing packages (${missing[*]}); run as root to install them" >&2
        exit 1
    fi
    echo "deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q
    apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

if ! command -v cargo >/dev/null 2>&1; then
    cat >&2 <<'MSG'
error: cargo not found. Install Rust with rustup (https://rustup.rs), for example:
    curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y
    . "$HOME/.cargo/env"
then run this script again.
MSG
    exit 1
fi
