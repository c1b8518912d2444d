#!/bin/bash
# Host packages for the QEMU VM tests (Debian 12). Installs only what is missing, so a second
# run only checks. Needs root when something is missing (CI runs as root).
set -euo pipefail

PKGS=(
  qemu-system-x86   # qemu-system-x86_64 with virtio-9p and the emulated NVMe / intel-iommu
  busybox-static    # the guest's userland; must be static to run in the initramfs
  cpio kmod         # initramfs archive; depmod/modprobe for the guest's module tree
  e2fsprogs         # mkfs.ext4 for tests that put a filesystem on the emulated NVMe
  gcc libc6-dev make xz-utils   # out-of-tree build of the no-IOMMU vfio.ko
)
installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }
missing=()
for p in "${PKGS[@]}"; do installed "$p" || missing+=("$p"); done

if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "install_host.sh: need root to apt-get install ${missing[*]}" >&2; exit 1; }
  echo "install_host.sh: installing ${missing[*]}"
  # A fresh machine's package lists are often stale or partial: refresh before installing.
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# In the guest, the host's / is the root of a chroot and the guest kernel's module tree is
# bind-mounted over /lib/modules so that `modprobe vfio-pci` works there. A container host may
# have no /lib/modules, and a read-only share offers no way to create the mount point.
[ -d /lib/modules ] || mkdir -p /lib/modules
echo "install_host.sh: host ready ($(qemu-system-x86_64 --version | head -1))"
