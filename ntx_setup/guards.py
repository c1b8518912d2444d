"""The guards that stand between a user's data and a raw write or a vfio-pci bind.

Pure functions of what the kernel shows under `root`; they change nothing. `ntx-setup bind`
and `ntx-io stage` both call them, so a device is refused for the same reasons everywhere.
The kernel itself lets the nvme driver be unbound under a mounted filesystem: these checks
are the only protection.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ntx_setup import block, pci
from ntx_setup.sysfs import block_name, normalize_bdf, read_text

CODES = ("not-found", "boot-disk", "mounted", "swap", "holder", "open", "signature",
         "iommu-group", "not-nvme", "noiommu")
BOOT_MOUNTPOINTS = ("/", "/boot", "/boot/efi", "/efi", "/usr")


@dataclass(frozen=True)
class Refusal:
    code: str          # one of CODES
    message: str       # what, on which object
    fix: str           # what the user can do about it
    overridable: bool  # True only where --force may override (a signature)

    def __post_init__(self):
        if self.code not in CODES:
            raise ValueError(f"unknown refusal code {self.code!r} (expected one of {', '.join(CODES)})")
        if self.overridable and self.code != "signature":
            raise ValueError(f"refusal {self.code!r} cannot be overridable")

    def as_dict(self) -> dict:
        return {"code": self.code, "message": self.message, "fix": self.fix, "overridable": self.overridable}


def block_device_refusals(dev: str, root: Path = Path("/")) -> list[Refusal]:
    """Why `dev` (a disk or partition) must not be written raw or taken from its driver."""
    try:
        name = block_name(dev)
    except ValueError as exc:
        return [Refusal("not-found", str(exc), "name a block device such as nvme0n1", False)]
    if not block.class_block(root, name).exists():
        return [Refusal("not-found", f"/dev/{name}: no such block device in /sys/class/block",
                        "check the name with `lsblk` or `ntx-setup check`", False)]
    family = [name] + block.partitions_of(root, name)
    stack = block.holders_closure(root, family)
    found = _mount_refusals(root, stack) + _swap_refusals(root, stack)
    found += _holder_refusals(root, family) + _open_refusals(root, family)
    found += _signature_refusals(root, family)
    return found


def controller_refusals(bdf: str, root: Path = Path("/")) -> list[Refusal]:
    """Why the NVMe controller at `bdf` must not be bound to vfio-pci."""
    try:
        bdf = normalize_bdf(bdf)
    except ValueError as exc:
        return [Refusal("not-found", str(exc), "use the address `ntx-setup check` lists", False)]
    dev = pci.read_device(root, bdf)
    if dev is None:
        return [Refusal("not-found", f"no PCI device {bdf} in /sys/bus/pci/devices",
                        "use the address `ntx-setup check` lists", False)]
    if not dev.is_nvme:
        return [Refusal("not-nvme", f"{dev.describe()} is not an NVMe controller (class 0x{dev.class_code:06x},"
                        " expected 0x0108xx)", "pick an NVMe controller from `ntx-setup check`", False)]
    found = []
    for ns in block.namespaces_of(root, bdf):
        found += block_device_refusals(ns, root)
    return found + _iommu_refusals(root, dev)


def _mount_refusals(root: Path, stack: list[str]) -> list[Refusal]:
    found, seen = [], set()
    for m in block.mounts(root):
        if m.name not in stack or (m.name, m.mountpoint) in seen:
            continue
        seen.add((m.name, m.mountpoint))
        if m.mountpoint in BOOT_MOUNTPOINTS:
            found.append(Refusal("boot-disk", f"/dev/{m.name} is mounted at {m.mountpoint}: this disk runs the"
                                 " system", "dedicate a different NVMe; never this one", False))
        else:
            found.append(Refusal("mounted", f"/dev/{m.name} is mounted at {m.mountpoint} ({m.fstype})",
                                 f"unmount it (umount {m.mountpoint}) and remove it from /etc/fstab", False))
    return found


def _swap_refusals(root: Path, stack: list[str]) -> list[Refusal]:
    return [Refusal("swap", f"{source} is active swap", f"swapoff {source} and remove it from /etc/fstab", False)
            for name, source in block.swaps(root) if name in stack]


def _holder_kind(root: Path, holder: str) -> str:
    uuid = read_text(block.class_block(root, holder) / "dm" / "uuid", "") or ""
    if uuid.startswith("LVM-"):
        return "an LVM logical volume (this is an LVM physical volume)"
    if uuid.startswith("CRYPT-"):
        return "a LUKS/dm-crypt mapping"
    if holder.startswith("md"):
        return "an md RAID array"
    return "a device-mapper device" if holder.startswith("dm-") else "another block device"


def _holder_refusals(root: Path, family: list[str]) -> list[Refusal]:
    return [Refusal("holder", f"/dev/{name} is held by {holder}, {_holder_kind(root, holder)}",
                    f"stop what uses {holder} first (vgchange -an / cryptsetup close / mdadm --stop)", False)
            for name in family for holder in block.direct_holders(root, name)]


def _open_refusals(root: Path, family: list[str]) -> list[Refusal]:
    return [Refusal("open", f"{dev} is open by process {pid} ({comm})", f"stop process {pid} first", False)
            for pid, comm, dev in block.openers(root, family)]


def _signature_refusals(root: Path, family: list[str]) -> list[Refusal]:
    found = []
    for name in family:
        try:
            sigs = block.signatures(root, name)
        except OSError as exc:
            found.append(Refusal("signature", f"cannot read /dev/{name} to look for data on it: {exc.strerror or exc}",
                                 "run as root", False))
            continue
        if sigs:
            found.append(Refusal("signature", f"/dev/{name} carries {', '.join(sigs)} signature(s): it may hold data",
                                 f"back it up; if it is disposable, wipe it (wipefs -a /dev/{name}) or pass --force",
                                 True))
    return found


def _iommu_refusals(root: Path, dev: pci.PciDevice) -> list[Refusal]:
    if dev.iommu_group is None or not pci.iommu_enabled(root):
        return [Refusal("noiommu", f"{dev.bdf} has no IOMMU group: the IOMMU is off, so vfio would give the"
                        " device unchecked DMA to all of RAM", "enable the IOMMU (`ntx-setup grub enable-iommu`,"
                        " reboot) or accept the risk with --noiommu", False)]
    found = []
    for other in pci.group_members(root, dev.iommu_group):
        peer = pci.read_device(root, other) if other != dev.bdf else None
        if peer is None or peer.driver in (None, *pci.VFIO_FRIENDLY_DRIVERS):
            continue
        if peer.is_bridge and peer.driver == "pcieport":
            continue
        what = "the GPU " if peer.is_gpu else ""
        found.append(Refusal("iommu-group", f"IOMMU group {dev.iommu_group} of {dev.bdf} also holds {what}"
                             f"{peer.describe()}: vfio needs every device of the group",
                             "move the NVMe to another slot (own IOMMU group) or check ACS settings in the"
                             " firmware", False))
    return found
