#!/bin/bash
# Build (once) what tests/vm/harness.py boots, under ${NTX_VM_CACHE:-~/.cache/ntx/vm}/<kver>/:
#   vmlinux            the Debian guest kernel, uncompressed ELF (QEMU boots it through PVH and
#                      skips the in-guest XZ decompression, which is slow under TCG)
#   kmod/lib/modules/  the few modules the tests need (virtio/9p, nvme, vfio*, ext4) + depmod data
#   vfio-noiommu.ko    vfio.ko rebuilt with CONFIG_VFIO_NOIOMMU (Debian builds it without)
#   initramfs.cpio.gz  busybox-static + scripts/vm/init + the module tree + vfio-noiommu.ko
#   initramfs.info     init_sha256=... of the init it holds (the harness refuses a stale one)
# and <cache>/current naming the kernel version in use. Every step is skipped when its output
# exists, and writes into a scratch dir that is moved into place only when complete, so a second
# run is a no-op and a run after a failure resumes at the failed step.
# Needs root for apt (install_host.sh first). Override the kernel with NTX_VM_KPKG=linux-image-...
set -euo pipefail
export PATH=$PATH:/usr/sbin:/sbin
HERE=$(cd "$(dirname "$0")" && pwd)
CACHE=${NTX_VM_CACHE:-$HOME/.cache/ntx/vm}
# vfio-pci needs vfio_iommu_type1 only at VFIO_SET_IOMMU time, hence listed on its own.
MODULES=(virtio_pci 9pnet_virtio 9p nvme vfio vfio_iommu_type1 vfio-pci ext4)

log() { echo "build_assets: $*" >&2; }
die() { log "error: $*"; exit 1; }

# apt-get download, refreshing stale package lists once if the pool moved on.
apt_download() {
  apt-get download -q "$@" 2>/dev/null && return 0
  log "apt-get download $* failed; refreshing package lists and retrying"
  apt-get update -qq && apt-get download -q "$@"
}

pick_kernel() {
  if [ -n "${NTX_VM_KPKG:-}" ]; then echo "$NTX_VM_KPKG"; return; fi
  local k
  k=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  [ -n "$k" ] || { apt-get update -qq; k=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}'); }
  [ -n "$k" ] || die "apt knows no linux-image-amd64; is Debian's main archive in the apt sources?"
  echo "$k"
}

# Decompress the payload of a bzImage into an ELF vmlinux (Debian uses XZ; gzip as a fallback).
extract_vmlinux() {
  python3 - "$1" "$2" <<'PY'
import gzip, lzma, sys
blob = open(sys.argv[1], "rb").read()
for magic, open_stream in ((b"\xfd7zXZ\x00", lzma.LZMADecompressor), (b"\x1f\x8b\x08\x00", None)):
    at = blob.find(magic)
    while at >= 0:
        try:
            data = (open_stream().decompress(blob[at:]) if open_stream
                    else gzip.GzipFile(fileobj=__import__("io").BytesIO(blob[at:])).read())
        except (lzma.LZMAError, OSError, EOFError):
            data = b""
        if data[:4] == b"\x7fELF":
            open(sys.argv[2], "wb").write(data)
            sys.exit(0)
        at = blob.find(magic, at + 1)
sys.exit(f"no ELF kernel found inside {sys.argv[1]}")
PY
}

# Copy the dependency closure of MODULES from the full tree $1 into the trimmed tree $2.
trim_modules() {
  local full=$1 small=$2 m ko rel
  depmod -b "$full" "$KVER"
  mkdir -p "$small/lib/modules/$KVER"
  for m in "${MODULES[@]}"; do
    for ko in $(modprobe -d "$full" -S "$KVER" --show-depends "$m" | awk '$1 == "insmod" {print $2}'); do
      rel=${ko#"$full/lib/modules/$KVER/"}
      mkdir -p "$small/lib/modules/$KVER/$(dirname "$rel")"
      cp -n "$ko" "$small/lib/modules/$KVER/$rel"
    done
  done
  # builtin lists let modprobe answer "built in" instead of "not found" for e.g. intel-iommu
  cp "$full/lib/modules/$KVER"/modules.builtin* "$small/lib/modules/$KVER/"
  (cd "$small/lib/modules/$KVER" && find kernel -name '*.ko' | LC_ALL=C sort > modules.order)
  depmod -b "$small" "$KVER"
}

step_kernel() {
  [ -f "$D/vmlinux" ] && [ -d "$D/kmod" ] && return 0
  log "guest kernel $KPKG: download and unpack"
  local t; t=$(mktemp -d "$D/tmp.kernel.XXXXXX")
  (cd "$t" && apt_download "$KPKG" >/dev/null)
  dpkg-deb -x "$t"/*.deb "$t/x"
  extract_vmlinux "$t/x/boot/vmlinuz-$KVER" "$t/vmlinux"
  cp "$t/x/boot/config-$KVER" "$D/config"
  trim_modules "$t/x" "$t/kmod"
  rm -rf "$D/kmod"; mv "$t/kmod" "$D/kmod"
  mv "$t/vmlinux" "$D/vmlinux"   # last: its presence marks the step done
  rm -rf "$t"
}

# Only vfio.ko is rebuilt: the stock vfio-pci / vfio_iommu_type1 load against it unchanged
# (same exported symbols and CRCs).
step_noiommu() {
  [ -f "$D/vfio-noiommu.ko" ] && return 0
  local kmaj=${KVER%%-*}; kmaj=${kmaj%.*}            # 6.1.0-57-amd64 -> 6.1
  local ver; ver=$(apt-cache show --no-all-versions "$KPKG" | awk '/^Version:/{print $2; exit}')
  [ -d "/usr/src/linux-headers-$KVER" ] || {
    log "installing linux-headers-$KVER"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "linux-headers-$KVER" >/dev/null
  }
  log "no-IOMMU vfio.ko: fetching drivers/vfio from linux-source-$kmaj=$ver"
  local t; t=$(mktemp -d "$D/tmp.noiommu.XXXXXX")
  (cd "$t" && apt_download "linux-source-$kmaj=$ver" >/dev/null)
  dpkg-deb --fsys-tarfile "$t"/linux-source-*.deb \
    | tar -xO "./usr/src/linux-source-$kmaj.tar.xz" \
    | tar -xJ -C "$t" --wildcards "linux-source-$kmaj/drivers/vfio/*.[ch]" "linux-source-$kmaj/drivers/vfio/Makefile"
  rm -f "$t"/linux-source-*.deb
  local src=$t/linux-source-$kmaj/drivers/vfio b=$t/build
  mkdir -p "$b"; cp "$src"/*.[ch] "$b"/
  cp "$src/Makefile" "$b/vfio.mk"
  # The upstream Makefile defines vfio-y (evaluated against the headers' auto.conf); keep its
  # object list but build only vfio.ko, with the option Debian left out.
  printf '%s\n' 'include $(src)/vfio.mk' 'obj-m := vfio.o' 'obj-y :=' \
    'ccflags-y += -DCONFIG_VFIO_NOIOMMU=1' > "$b/Kbuild"
  log "building vfio.ko against /usr/src/linux-headers-$KVER"
  make -s -C "/usr/src/linux-headers-$KVER" M="$b" modules -j"$(nproc)" >&2
  strip --strip-debug "$b/vfio.ko"
  modinfo -p "$b/vfio.ko" | grep -q '^enable_unsafe_noiommu_mode' \
    || die "rebuilt vfio.ko has no enable_unsafe_noiommu_mode parameter"
  mv "$b/vfio.ko" "$D/vfio-noiommu.ko"
  rm -rf "$t"
}

step_initramfs() {
  local sha inputs
  sha=$(sha256sum "$HERE/init" | cut -d' ' -f1)
  inputs=$( (cd "$D" && find kmod vfio-noiommu.ko -type f | LC_ALL=C sort | xargs sha256sum; \
             sha256sum "$(command -v busybox)") | sha256sum | cut -d' ' -f1)
  [ -f "$D/initramfs.cpio.gz" ] && grep -qx "init_sha256=$sha" "$D/initramfs.info" 2>/dev/null \
    && grep -qx "inputs_sha256=$inputs" "$D/initramfs.info" && return 0
  log "initramfs: busybox + init + $(find "$D/kmod" -name '*.ko' | wc -l) modules"
  local bb; bb=$(command -v busybox) || die "busybox missing: run scripts/vm/install_host.sh"
  local t r; t=$(mktemp -d "$D/tmp.initramfs.XXXXXX"); r=$t/root
  mkdir -p "$r"/{bin,sbin,usr/bin,usr/sbin,proc,sys,dev,tmp,job,host,lib/ntx}
  cp "$bb" "$r/bin/busybox"
  # --list-full gives each applet's usual path (sbin/modprobe, ...): the kernel's
  # request_module() runs /sbin/modprobe, so the paths matter.
  local a
  for a in $("$bb" --list-full); do [ -e "$r/$a" ] || ln -s /bin/busybox "$r/$a"; done
  cp -a "$D/kmod/lib/modules" "$r/lib/"
  cp "$D/vfio-noiommu.ko" "$r/lib/ntx/vfio-noiommu.ko"
  install -m 0755 "$HERE/init" "$r/init"
  (cd "$r" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -1) > "$t/initramfs.cpio.gz"
  mv "$t/initramfs.cpio.gz" "$D/initramfs.cpio.gz"
  printf 'init_sha256=%s\ninputs_sha256=%s\nkver=%s\n' "$sha" "$inputs" "$KVER" > "$D/initramfs.info"
  rm -rf "$t"
}

KPKG=$(pick_kernel)
KVER=${KPKG#linux-image-}
D=$CACHE/$KVER
mkdir -p "$D"
rm -rf "$D"/tmp.*                 # scratch left by an interrupted run
step_kernel
step_noiommu
step_initramfs
echo "$KVER" > "$CACHE/current.tmp" && mv "$CACHE/current.tmp" "$CACHE/current"
# Assets of kernels apt no longer points to (about 70 MB each).
for old in "$CACHE"/*/initramfs.info; do
  [ -e "$old" ] && [ "${old%/initramfs.info}" != "$D" ] && rm -rf "${old%/initramfs.info}"
done
log "ready: $D ($(du -sh "$D" | cut -f1))"
