#!/bin/bash
# Build the VM tier's disk image: the cached Debian 12 base tree, udev, the .deb's
# dependencies downloaded (not installed: the payload installs the .deb with apt,
# under systemd), the Debian cloud kernel (NVMe, ext4 and the serial console built in,
# so no initramfs), and a unit that runs the payload disk and powers off.
# Usage: mkimage.sh OUTDIR DEB    -> OUTDIR/disk.img, OUTDIR/vmlinuz
set -euo pipefail
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
out=${1:?usage: mkimage.sh OUTDIR DEB}
deb=${2:?usage: mkimage.sh OUTDIR DEB}
here=$(cd "$(dirname "$0")" && pwd)
cache=${PROVIDERD_CI_CACHE:-/var/cache/providerd-ci}
base=$("$here/../system/base-rootfs.sh" "$cache")
mkdir -p "$out"
root=$out/root
rm -rf "$root"
mkdir -p "$root"
tar -C "$root" --numeric-owner --zstd -xf "$base"
cp "$deb" "$root/root/"

# Debian packages, the kernel among them, fetched with the tree's own apt.
systemd-nspawn -q -D "$root" -M "providerd-vmimg-$$" --register=no --keep-unit --pipe \
    -E DEBIAN_FRONTEND=noninteractive -E PATH="$PATH" /bin/bash -euo pipefail -c "
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends udev kmod >/dev/null
    apt-get install -y -qq --download-only --no-install-recommends /root/$(basename "$deb") >/dev/null
    kernel=\$(apt-cache depends linux-image-cloud-amd64 | awk '/Depends: linux-image-[0-9]/ {print \$2; exit}')
    cd /tmp && apt-get download -qq \"\$kernel\" && mv /tmp/linux-image-*.deb /root/kernel.deb
" >"$out/mkimage.log" 2>&1 || { tail -n 30 "$out/mkimage.log" >&2; exit 1; }

# The kernel: vmlinuz beside the image, modules into /usr/lib (a plain `dpkg-deb -x`
# into the tree would replace the merged-/usr /lib symlink with a directory).
kx=$out/kernel
rm -rf "$kx"
dpkg-deb -x "$root/root/kernel.deb" "$kx"
cp "$kx"/boot/vmlinuz-* "$out/vmlinuz"
mkdir -p "$root/usr/lib/modules"
cp -a "$kx"/lib/modules/. "$root/usr/lib/modules/"
rm -rf "$kx" "$root/root/kernel.deb"

# The payload runner: mount the second NVMe disk, run it with results on ttyS1, power off.
mkdir -p "$root/ci"
cat >"$root/etc/systemd/system/ci-payload.service" <<'UNIT'
[Unit]
Description=providerd VM tier payload
After=multi-user.target
[Service]
Type=oneshot
StandardOutput=tty
StandardError=tty
TTYPath=/dev/ttyS1
ExecStart=/bin/bash -c 'mount -o ro /dev/nvme1n1 /ci && exec /ci/run-tests'
ExecStopPost=/bin/systemctl poweroff --no-block
TimeoutStartSec=infinity
[Install]
WantedBy=multi-user.target
UNIT
ln -sf /etc/systemd/system/ci-payload.service "$root/etc/systemd/system/multi-user.target.wants/ci-payload.service"
# No console login; root on the first NVMe disk.
ln -sf /dev/null "$root/etc/systemd/system/serial-getty@ttyS0.service"
ln -sf /dev/null "$root/etc/systemd/system/getty@tty1.service"
echo "/dev/nvme0n1 / ext4 rw,errors=remount-ro 0 1" >"$root/etc/fstab"
echo providerd-vm >"$root/etc/hostname"

rm -f "$out/disk.img"
mkfs.ext4 -q -F -L root -d "$root" "$out/disk.img" 3G
rm -rf "$root"
echo "$out/disk.img"
