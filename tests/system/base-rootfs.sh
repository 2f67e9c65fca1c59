#!/bin/bash
# Build (or reuse) the cached Debian 12 base tree shared by the container and VM tiers.
# Usage: base-rootfs.sh [CACHE_DIR]   -> prints the path of bookworm-base.tar.zst
# The tarball is rebuilt when it is missing or older than a week.
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
cache=${1:-${PROVIDERD_CI_CACHE:-/var/cache/providerd-ci}}
tarball=$cache/bookworm-base.tar.zst
mirror=${PROVIDERD_CI_MIRROR:-http://deb.debian.org/debian}
# Packages the tiers use on top of minbase; the .deb's own dependencies are NOT here:
# apt pulls them when the tests install the package.
include=systemd,systemd-sysv,dbus,python3,curl,iproute2,procps,udev,kmod

mkdir -p "$cache"
if [[ -s $tarball ]] && [[ -z $(find "$tarball" -mtime +6 -print) ]]; then
    echo "$tarball"
    exit 0
fi
work=$(mktemp -d "$cache/build.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "base-rootfs: debootstrap bookworm into $work (cached in $tarball)" >&2
debootstrap --variant=minbase --include="$include" bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
    tail -n 30 "$work/debootstrap.log" >&2
    exit 1
}
# A clean, small tree: no downloaded .debs, a machine-id set at first boot.
rm -f "$work"/root/var/cache/apt/archives/*.deb
: >"$work/root/etc/machine-id"
echo providerd-ci >"$work/root/etc/hostname"
tar -C "$work/root" --numeric-owner -cf - . | zstd -q -T0 -3 -o "$work/base.tar.zst"
mv -f "$work/base.tar.zst" "$tarball"
echo "$tarball"
