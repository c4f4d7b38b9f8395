#!/usr/bin/env bash
# Fetches the microvm tier's guest kernel: Debian's cloud kernel (the package linux-image-cloud-amd64
# points at), unpacked with dpkg -x, and the modules the guest needs (virtio over MMIO, disks, the
# agent's serial port, the network, overlayfs) with their load order. Idempotent.
# Usage (as root): scripts/guest-kernel.sh [DEST]   (default /usr/local/lib/moat/guest)
set -euo pipefail

dest=${1:-/usr/local/lib/moat/guest}
modules=(virtio_mmio virtio_blk virtio_console virtio_net overlay)

# The versioned package the meta package depends on, e.g. linux-image-6.1.0-48-cloud-amd64.
pkg=$(apt-cache depends linux-image-cloud-amd64 2>/dev/null |
    awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
if [[ -z "$pkg" ]]; then
    apt-get update -q >/dev/null
    pkg=$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print $2; exit}')
fi
if [[ -z "$pkg" ]]; then
    echo "error: no linux-image-*-cloud-amd64 package in the apt sources" >&2
    exit 1
fi
kver=${pkg#linux-image-}

if [[ -f "$dest/version" && "$(cat "$dest/version")" == "$kver" && -f "$dest/vmlinuz" ]]; then
    echo "guest kernel $kver already in $dest" >&2
    exit 0
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
chmod 755 "$work"
(cd "$work" && apt-get download -q "$pkg" >/dev/null 2>&1)
dpkg -x "$work"/*.deb "$work/x"
depmod -b "$work/x" "$kver"

tmp="$dest.tmp"
rm -rf "$tmp"
mkdir -p "$tmp/modules"
install -m 0644 "$work/x/boot/vmlinuz-$kver" "$tmp/vmlinuz"
# modprobe --show-depends prints the insmod lines of a module and its dependencies, dependencies
# first: their union, in first-seen order, is the load order the agent follows.
: >"$tmp/modules.order"
for m in "${modules[@]}"; do
    modprobe -d "$work/x" -S "$kver" --show-depends "$m" | awk '$1 == "insmod" {print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
    name=$(basename "$ko")
    case "$name" in
    *.ko) install -m 0644 "$ko" "$tmp/modules/$name" ;;
    *.ko.xz) xz -dc "$ko" >"$tmp/modules/${name%.xz}" && name=${name%.xz} ;;
    *.ko.zst) zstd -qdc "$ko" >"$tmp/modules/${name%.zst}" && name=${name%.zst} ;;
    *) echo "error: unexpected module file $ko" >&2 && exit 1 ;;
    esac
    echo "$name" >>"$tmp/modules.order"
done
echo "$kver" >"$tmp/version"
rm -rf "$dest"
mv "$tmp" "$dest"
echo "guest kernel $kver installed in $dest ($(wc -l <"$dest/modules.order") modules)" >&2
