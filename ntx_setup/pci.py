"""PCI devices from sysfs: identity, driver, IOMMU group, link, and config space.

Config space is read and written through `/sys/bus/pci/devices/BDF/config`, so the
capability walk works the same on the real sysfs and on a fake tree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ntx_setup.sysfs import link_name, list_names, read_int, read_text, under

CLASS_NVME = 0x0108          # mass storage / non-volatile memory controller
CLASS_BRIDGE = 0x0604        # PCI-to-PCI bridge (root ports, switch ports)
VENDOR_NVIDIA = 0x10DE
VFIO_FRIENDLY_DRIVERS = ("vfio-pci", "pci-stub")

# PCI Local Bus 3.0 §6.2.2: Command register, Status register, Capabilities Pointer.
CFG_COMMAND = 0x04
CFG_STATUS = 0x06
CFG_CAP_PTR = 0x34
CMD_MEMORY_SPACE = 1 << 1
CMD_BUS_MASTER = 1 << 2
STATUS_CAP_LIST = 1 << 4
# PCI PM 1.2 §3.2: capability id 0x01; PMCSR at +4, PowerState in bits 1:0, PME_Status (RW1C) bit 15.
CAP_ID_PM = 0x01
PMCSR_OFFSET = 4
PMCSR_STATE_MASK = 0x3
PMCSR_PME_STATUS = 1 << 15
D_STATES = ("D0", "D1", "D2", "D3hot")

# GB/s per lane after line coding (8b/10b up to 5 GT/s, 128b/130b from 8 GT/s; Gen6 FLIT ~242/256).
_LANE_GBPS = {2.5: 0.25, 5.0: 0.5, 8.0: 0.985, 16.0: 1.969, 32.0: 3.938, 64.0: 7.56}


def device_dir(root: Path, bdf: str) -> Path:
    return under(root, f"/sys/bus/pci/devices/{bdf}")


@dataclass(frozen=True)
class Link:
    """PCIe link state of one function (speeds in GT/s, None when the kernel does not say)."""

    cur_speed: float | None
    max_speed: float | None
    cur_width: int | None
    max_width: int | None

    def gbps(self, which: str = "cur") -> float | None:
        speed = self.cur_speed if which == "cur" else self.max_speed
        width = self.cur_width if which == "cur" else self.max_width
        if speed is None or width is None:
            return None
        return round(_LANE_GBPS.get(speed, speed / 8) * width, 2)

    @property
    def degraded(self) -> bool:
        return None not in (self.cur_speed, self.max_speed, self.cur_width, self.max_width) and (
            self.cur_speed < self.max_speed or self.cur_width < self.max_width)

    def describe(self) -> str:
        if self.cur_speed is None:
            return "unknown"
        return (f"{self.cur_speed:g} GT/s x{self.cur_width} (max {self.max_speed:g} GT/s x{self.max_width},"
                f" ~{self.gbps('cur')} GB/s now)")


@dataclass(frozen=True)
class PciDevice:
    bdf: str
    vendor: int
    device: int
    class_code: int          # 24-bit: base, sub, prog-if
    driver: str | None
    driver_override: str | None
    iommu_group: str | None
    numa_node: int | None
    link: Link

    @property
    def class16(self) -> int:
        return self.class_code >> 8

    @property
    def is_nvme(self) -> bool:
        return self.class16 == CLASS_NVME

    @property
    def is_gpu(self) -> bool:
        return (self.class_code >> 16) == 0x03

    @property
    def is_bridge(self) -> bool:
        return self.class16 == CLASS_BRIDGE

    def describe(self) -> str:
        kind = "NVMe" if self.is_nvme else "GPU" if self.is_gpu else "bridge" if self.is_bridge else f"class {self.class_code:06x}"
        return f"{self.bdf} ({kind} {self.vendor:04x}:{self.device:04x}, driver {self.driver or 'none'})"


def _speed(text: str | None) -> float | None:
    m = re.match(r"([\d.]+)\s*GT/s", text or "")
    return float(m.group(1)) if m else None


def read_link(root: Path, bdf: str) -> Link:
    d = device_dir(root, bdf)
    return Link(_speed(read_text(d / "current_link_speed")), _speed(read_text(d / "max_link_speed")),
                read_int(d / "current_link_width"), read_int(d / "max_link_width"))


def read_device(root: Path, bdf: str) -> PciDevice | None:
    d = device_dir(root, bdf)
    class_code = read_int(d / "class")
    if class_code is None:
        return None
    override = read_text(d / "driver_override")
    return PciDevice(
        bdf=bdf, vendor=read_int(d / "vendor", 0) or 0, device=read_int(d / "device", 0) or 0,
        class_code=class_code, driver=link_name(d / "driver"),
        driver_override=None if override in (None, "", "(null)") else override,
        iommu_group=link_name(d / "iommu_group"), numa_node=read_int(d / "numa_node"),
        link=read_link(root, bdf))


def list_addresses(root: Path) -> tuple[list[str], str]:
    """Every PCI address, and the source used: `pyudev` on the real root, `sysfs` otherwise."""
    if str(root) == "/":
        try:
            import pyudev

            names = sorted(d.sys_name for d in pyudev.Context().list_devices(subsystem="pci"))
            if names:
                return names, "pyudev"
        except Exception:  # no libudev (minimal containers): fall back to walking sysfs
            pass
    return list_names(under(root, "/sys/bus/pci/devices")), "sysfs"


def list_devices(root: Path) -> tuple[list[PciDevice], str]:
    addresses, source = list_addresses(root)
    devices = [read_device(root, a) for a in addresses]
    return [d for d in devices if d is not None], source


def iommu_enabled(root: Path) -> bool:
    return bool(list_names(under(root, "/sys/kernel/iommu_groups")))


def group_members(root: Path, group: str) -> list[str]:
    return list_names(under(root, f"/sys/kernel/iommu_groups/{group}/devices"))


def vfio_node(root: Path, group: str | None) -> Path | None:
    """`/dev/vfio/<group>` or `/dev/vfio/noiommu-<group>`, whichever exists."""
    if group is None:
        return None
    for name in (group, f"noiommu-{group}"):
        p = under(root, f"/dev/vfio/{name}")
        if p.exists():
            return p
    return None


class ConfigSpace:
    """Read/modify/write of one function's config space via its sysfs `config` file."""

    def __init__(self, root: Path, bdf: str):
        self.path = device_dir(root, bdf) / "config"

    def read(self, offset: int, size: int) -> int:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{self.path}: short read at 0x{offset:x} (non-root users only see 64 bytes)")
        return int.from_bytes(data, "little")

    def write(self, offset: int, size: int, value: int) -> None:
        fd = os.open(self.path, os.O_WRONLY)
        try:
            if os.pwrite(fd, value.to_bytes(size, "little"), offset) != size:
                raise OSError(f"{self.path}: short write at 0x{offset:x}")
        finally:
            os.close(fd)

    def capabilities(self) -> list[tuple[int, int]]:
        """(cap id, offset) of the standard capability list, loop-safe (at most 48 entries)."""
        if not self.read(CFG_STATUS, 2) & STATUS_CAP_LIST:
            return []
        caps, seen, ptr = [], set(), self.read(CFG_CAP_PTR, 1) & 0xFC
        while ptr >= 0x40 and ptr not in seen and len(caps) < 48:
            seen.add(ptr)
            caps.append((self.read(ptr, 1), ptr))
            ptr = self.read(ptr + 1, 1) & 0xFC
        return caps

    def find(self, cap_id: int) -> int | None:
        return next((off for cid, off in self.capabilities() if cid == cap_id), None)

    def power_state(self) -> str | None:
        pm = self.find(CAP_ID_PM)
        return None if pm is None else D_STATES[self.read(pm + PMCSR_OFFSET, 2) & PMCSR_STATE_MASK]

    def set_d0(self) -> bool:
        """Move to D0 through the PM capability; True when a write was needed."""
        pm = self.find(CAP_ID_PM)
        if pm is None:
            return False
        pmcsr = self.read(pm + PMCSR_OFFSET, 2)
        if pmcsr & PMCSR_STATE_MASK == 0:
            return False
        # Leave PME_Status alone (writing 1 would clear it) and request D0.
        self.write(pm + PMCSR_OFFSET, 2, pmcsr & ~(PMCSR_STATE_MASK | PMCSR_PME_STATUS))
        return True

    def enable_memory_and_bus_master(self) -> bool:
        cmd = self.read(CFG_COMMAND, 2)
        want = cmd | CMD_MEMORY_SPACE | CMD_BUS_MASTER
        if want == cmd:
            return False
        self.write(CFG_COMMAND, 2, want)
        return True

    def command(self) -> int:
        return self.read(CFG_COMMAND, 2)
