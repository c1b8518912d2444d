"""A fake machine under tmp_path: sysfs/procfs/dev/etc trees plus a tiny fake kernel.

`FakeRoot` lays out files the way Linux 6.x does (devices under /sys/devices, symlinks from
/sys/bus and /sys/class). `FakeKernel` is the `Host` the code under test writes through: it
reacts to `unbind`, `driver_override`, `drivers_probe`, module loads and tool runs the way
the kernel does, so the same ntx_setup code path runs here and on the real sysfs in the VM.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ntx_setup.machine import Machine

PCI_ROOT = "/sys/devices/pci0000:00"


def config_space(vendor: int, device: int, class_code: int, *, pm_state: int = 0, command: int = 0) -> bytes:
    """256 bytes of type-0 config space with capabilities MSI-X @0x40 -> PM @0x60 -> PCIe @0x70."""
    cfg = bytearray(256)
    cfg[0:2] = vendor.to_bytes(2, "little")
    cfg[2:4] = device.to_bytes(2, "little")
    cfg[4:6] = command.to_bytes(2, "little")
    cfg[6:8] = (1 << 4).to_bytes(2, "little")           # status: capabilities list present
    cfg[9:12] = class_code.to_bytes(3, "little")
    cfg[0x34] = 0x40
    cfg[0x40:0x42] = bytes([0x11, 0x60])                  # MSI-X, next PM
    cfg[0x60:0x62] = bytes([0x01, 0x70])                  # PM, next PCIe
    cfg[0x64:0x66] = (pm_state & 3).to_bytes(2, "little")  # PMCSR
    cfg[0x70:0x72] = bytes([0x10, 0x00])                  # PCIe, end of list
    return bytes(cfg)


class FakeRoot:
    def __init__(self, base: Path):
        self.base = Path(base)
        self.nvme: dict[str, dict] = {}   # bdf -> {"ctrl": "nvme0", "namespaces": {name: size_mb}}
        self._minor = 0
        for d in ("sys/bus/pci/devices", "sys/bus/pci/drivers/nvme", "sys/bus/pci/drivers/pcieport",
                  "sys/class/block", "sys/class/nvme", "sys/kernel/iommu_groups", "sys/module/nvme",
                  "proc/self/fd", "dev", "etc/default", "var/lib", "run", "boot", ".disks"):
            self.p("/" + d).mkdir(parents=True, exist_ok=True)
        self.write("/sys/bus/pci/drivers_probe", "")
        self.write("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=UUID=1 ro quiet")
        self.write("/proc/sys/kernel/osrelease", "6.12.9-amd64")
        self.write("/proc/cpuinfo", "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Fake CPU\n")
        self.write("/proc/meminfo", "MemTotal:       32768000 kB\nMemFree:        20000000 kB\n"
                   "MemAvailable:   24000000 kB\nBuffers: 0 kB\nCached: 0 kB\nSwapTotal: 0 kB\nSwapFree: 0 kB\n"
                   "Active: 0 kB\nInactive: 0 kB\nShmem: 0 kB\nSlab: 0 kB\nSReclaimable: 0 kB\n")
        self.write("/proc/self/limits", "Limit  Soft Limit Hard Limit Units\n"
                   "Max locked memory         8388608              8388608              bytes\n")
        self.write("/proc/self/status", "Name:\tntx-setup\nCapEff:\t000001ffffffffff\n")
        self.write("/proc/self/mounts", "proc /proc proc rw 0 0\n")
        self.write("/proc/self/mountinfo", "")
        self.write("/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n")

    # --- files -------------------------------------------------------------------------
    def p(self, path: str) -> Path:
        return self.base / path.lstrip("/")

    def write(self, path: str, text: str | bytes) -> Path:
        f = self.p(path)
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(text if isinstance(text, bytes) else text.encode())
        return f

    def read(self, path: str) -> str:
        return self.p(path).read_text().strip()

    def link(self, path: str, target: str) -> None:
        """Symlink `path` -> `target` (both in-machine absolute paths), made relative like sysfs."""
        src, dst = self.p(path), self.p(target)
        src.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink() or src.exists():
            src.unlink()
        rel = os.path.relpath(dst, src.parent)
        if os.path.basename(rel) in ("..", "."):  # name the target like sysfs does (../../nvme0)
            rel = os.path.join(rel, "..", dst.name)
        src.symlink_to(rel)

    def machine(self, kernel: "FakeKernel | None" = None, euid: int = 0) -> Machine:
        return Machine(root=self.base, host=kernel or FakeKernel(self), euid=euid, sleep=lambda s: None)

    # --- PCI -----------------------------------------------------------------------------
    def add_pci(self, bdf: str, *, vendor: int, device: int, class_code: int, driver: str | None = None,
                group: str | None = None, numa: int = 0, speed: str = "16.0 GT/s PCIe", width: int = 4,
                max_speed: str | None = None, max_width: int | None = None) -> str:
        d = f"{PCI_ROOT}/{bdf}"
        for attr, val in (("vendor", f"0x{vendor:04x}"), ("device", f"0x{device:04x}"),
                          ("class", f"0x{class_code:06x}"), ("driver_override", "(null)"), ("numa_node", str(numa)),
                          ("current_link_speed", speed), ("max_link_speed", max_speed or speed),
                          ("current_link_width", str(width)), ("max_link_width", str(max_width or width)),
                          ("power/control", "auto")):
            self.write(f"{d}/{attr}", val)
        self.write(f"{d}/config", config_space(vendor, device, class_code, command=0x6 if driver else 0))
        self.link(f"/sys/bus/pci/devices/{bdf}", d)
        if group is not None:
            self.p(f"/sys/kernel/iommu_groups/{group}/devices").mkdir(parents=True, exist_ok=True)
            self.link(f"{d}/iommu_group", f"/sys/kernel/iommu_groups/{group}")
            self.link(f"/sys/kernel/iommu_groups/{group}/devices/{bdf}", d)
        if driver:
            self.bind_driver(bdf, driver)
        return d

    def bind_driver(self, bdf: str, driver: str) -> None:
        self.p(f"/sys/bus/pci/drivers/{driver}").mkdir(parents=True, exist_ok=True)
        self.link(f"{PCI_ROOT}/{bdf}/driver", f"/sys/bus/pci/drivers/{driver}")
        self.link(f"/sys/bus/pci/drivers/{driver}/{bdf}", f"{PCI_ROOT}/{bdf}")

    def unbind_driver(self, bdf: str) -> str | None:
        drv_link = self.p(f"{PCI_ROOT}/{bdf}/driver")
        if not drv_link.is_symlink():
            return None
        drv = os.path.basename(os.readlink(drv_link))
        drv_link.unlink()
        back = self.p(f"/sys/bus/pci/drivers/{drv}/{bdf}")
        if back.is_symlink():
            back.unlink()
        return drv

    def add_nvme(self, bdf: str = "0000:01:00.0", *, ctrl: str = "nvme0", namespaces=("nvme0n1",),
                 size_mb: int = 8, group: str | None = "1", driver: str | None = "nvme", **kw) -> str:
        self.add_pci(bdf, vendor=0x1B36, device=0x0010, class_code=0x010802, group=group, **kw)
        self.nvme[bdf] = {"ctrl": ctrl, "namespaces": {n: size_mb for n in namespaces}}
        for n in namespaces:
            self.write(f"/.disks/{n}", b"")
            os.truncate(self.p(f"/.disks/{n}"), size_mb << 20)
        if driver:
            self.bind_driver(bdf, driver)
            if driver == "nvme":
                self.attach_namespaces(bdf)
        return bdf

    def attach_namespaces(self, bdf: str) -> None:
        spec = self.nvme[bdf]
        c = f"{PCI_ROOT}/{bdf}/nvme/{spec['ctrl']}"
        for attr, val in (("model", "QEMU NVMe Ctrl"), ("serial", f"FAKE-{spec['ctrl']}"),
                          ("firmware_rev", "8.0.0"), ("dev", "240:0")):
            self.write(f"{c}/{attr}", val)
        self.link(f"{c}/device", f"{PCI_ROOT}/{bdf}")
        self.link(f"/sys/class/nvme/{spec['ctrl']}", c)
        for name, size_mb in spec["namespaces"].items():
            nd = f"{c}/{name}"
            self._minor += 1
            self.write(f"{nd}/size", str(size_mb * 2048))
            self.write(f"{nd}/dev", f"259:{self._minor}")
            self.write(f"{nd}/queue/logical_block_size", "512")
            self.link(f"{nd}/device", c)
            self.link(f"/sys/class/block/{name}", nd)
            shutil.move(self.p(f"/.disks/{name}"), self.p(f"/dev/{name}"))

    def detach_namespaces(self, bdf: str) -> None:
        spec = self.nvme[bdf]
        for name in spec["namespaces"]:
            for part in [p.name for p in self.p(f"/sys/class/block/{name}").glob(f"{name}p*")]:
                self.p(f"/sys/class/block/{part}").unlink()
            self.p(f"/sys/class/block/{name}").unlink()
            shutil.move(self.p(f"/dev/{name}"), self.p(f"/.disks/{name}"))
        self.p(f"/sys/class/nvme/{spec['ctrl']}").unlink()
        shutil.rmtree(self.p(f"{PCI_ROOT}/{bdf}/nvme"))

    # --- block-layer state ----------------------------------------------------------------
    def dev_write(self, name: str, data: bytes, offset: int = 0) -> None:
        with open(self.p(f"/dev/{name}"), "r+b") as f:
            f.seek(offset)
            f.write(data)

    def add_partition(self, disk: str, part: str, size_mb: int = 4) -> None:
        nd = os.path.realpath(self.p(f"/sys/class/block/{disk}"))
        pd = os.path.join(nd, part)
        self._minor += 1
        for attr, val in (("partition", "1"), ("size", str(size_mb * 2048)), ("dev", f"259:{self._minor}")):
            Path(pd, attr).parent.mkdir(parents=True, exist_ok=True)
            Path(pd, attr).write_text(val)
        self.link(f"/sys/class/block/{part}", "/" + os.path.relpath(pd, self.base))
        self.write(f"/dev/{part}", b"")
        os.truncate(self.p(f"/dev/{part}"), size_mb << 20)

    def add_mount(self, source: str, mountpoint: str, fstype: str = "ext4") -> None:
        f = self.p("/proc/self/mounts")
        f.write_text(f.read_text() + f"{source} {mountpoint} {fstype} rw,relatime 0 0\n")

    def add_mountinfo(self, devnum: str, mountpoint: str, source: str = "/dev/root", fstype: str = "ext4") -> None:
        f = self.p("/proc/self/mountinfo")
        f.write_text(f.read_text() + f"22 1 {devnum} / {mountpoint} rw,relatime shared:1 - {fstype} {source} rw\n")

    def add_swap(self, source: str) -> None:
        f = self.p("/proc/swaps")
        f.write_text(f.read_text() + f"{source}\t\tpartition\t1048572\t\t0\t\t-2\n")

    def add_holder(self, dev: str, holder: str, dm_uuid: str = "", dm_name: str = "") -> None:
        hd = f"/sys/devices/virtual/block/{holder}"
        self._minor += 1
        self.write(f"{hd}/dev", f"253:{self._minor}")
        self.write(f"{hd}/size", "2048")
        if holder.startswith("dm-"):
            self.write(f"{hd}/dm/uuid", dm_uuid)
            self.write(f"{hd}/dm/name", dm_name or holder)
        self.link(f"/sys/class/block/{holder}", hd)
        self.link(f"/sys/class/block/{dev}/holders/{holder}", hd)
        self.link(f"{hd}/slaves/{dev}", "/" + os.path.relpath(os.path.realpath(self.p(f"/sys/class/block/{dev}")), self.base))

    def add_opener(self, pid: int, comm: str, dev: str) -> None:
        self.write(f"/proc/{pid}/comm", comm)
        fd = self.p(f"/proc/{pid}/fd/7")
        fd.parent.mkdir(parents=True, exist_ok=True)
        fd.symlink_to(f"/dev/{dev}")


class FakeKernel:
    """The `Host` for a FakeRoot: sysfs writes and programs, with the kernel's side effects."""

    def __init__(self, fr: FakeRoot, *, noiommu_supported: bool = False, vfio_idle_d3: bool = True):
        self.fr = fr
        self.noiommu_supported = noiommu_supported
        self.vfio_idle_d3 = vfio_idle_d3
        self.writes: list[tuple[str, str]] = []
        self.commands: list[list[str]] = []
        self.handlers: dict[str, object] = {}   # argv[0] -> callable(argv) -> (rc, output)
        self.before_write = None                 # optional hook(path, text) for fault injection
        self.rewrite = None                      # optional (path, text) -> text the kernel stores instead

    def _rel(self, path: Path) -> str:
        return "/" + os.path.relpath(os.path.realpath(path), os.path.realpath(self.fr.base))

    def write(self, path: Path, text: str) -> None:
        rel = self._rel(path)
        self.writes.append((rel, text))
        if self.before_write:
            self.before_write(rel, text)
        value = text.strip()
        parts = rel.split("/")
        if rel.endswith("/unbind") and "drivers" in parts:
            if self.fr.p(f"{PCI_ROOT}/{value}/driver").is_symlink():
                self._unbind(value)
                return
            raise OSError(19, "No such device")
        if rel == "/sys/bus/pci/drivers_probe":
            self._probe(value)
            return
        if rel.endswith("/driver_override"):
            self.fr.write(rel, value or "(null)")
            return
        if rel.endswith("enable_unsafe_noiommu_mode"):
            self.fr.write(rel, "Y" if value in ("1", "Y", "y") else "N")
            return
        if not Path(path).exists():
            raise OSError(2, "No such file or directory")
        self.fr.write(rel, self.rewrite(rel, text) if self.rewrite else text)

    def _unbind(self, bdf: str) -> None:
        drv = self.fr.unbind_driver(bdf)
        if drv == "nvme":
            self.fr.detach_namespaces(bdf)
        group = self.fr.p(f"{PCI_ROOT}/{bdf}/iommu_group")
        if drv == "vfio-pci" and group.is_symlink():
            name = os.path.basename(os.readlink(group))
            for node in (name, f"noiommu-{name}"):
                if self.fr.p(f"/dev/vfio/{node}").exists():
                    self.fr.p(f"/dev/vfio/{node}").unlink()

    def _probe(self, bdf: str) -> None:
        d = f"{PCI_ROOT}/{bdf}"
        if self.fr.p(f"{d}/driver").is_symlink():
            return
        override = self.fr.read(f"{d}/driver_override")
        drv = override if override not in ("(null)", "") else ("nvme" if bdf in self.fr.nvme else None)
        if drv is None or not self.fr.p(f"/sys/bus/pci/drivers/{drv}").is_dir():
            return
        if drv == "vfio-pci" and not self._vfio_group(bdf):
            return  # vfio-pci's probe fails without an IOMMU group (-EINVAL)
        self.fr.bind_driver(bdf, drv)
        if drv == "nvme":
            self.fr.attach_namespaces(bdf)
            self._set_cfg(bdf, pm_state=0, command=0x6)
        elif drv == "vfio-pci" and self.vfio_idle_d3:
            self._set_cfg(bdf, pm_state=3, command=0)   # vfio-pci parks idle devices in D3hot

    def _vfio_group(self, bdf: str) -> bool:
        d = f"{PCI_ROOT}/{bdf}"
        link = self.fr.p(f"{d}/iommu_group")
        if link.is_symlink():
            self.fr.write(f"/dev/vfio/{os.path.basename(os.readlink(link))}", "")
            return True
        if self.fr.p("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode").exists() and \
                self.fr.read("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode") == "Y":
            group = str(100 + len(list(self.fr.p("/sys/kernel/iommu_groups").iterdir())))
            self.fr.link(f"{d}/iommu_group", f"/sys/kernel/iommu_groups/{group}")
            self.fr.link(f"/sys/kernel/iommu_groups/{group}/devices/{bdf}", d)
            self.fr.write(f"/dev/vfio/noiommu-{group}", "")
            return True
        return False

    def _set_cfg(self, bdf: str, *, pm_state: int, command: int) -> None:
        path = self.fr.p(f"{PCI_ROOT}/{bdf}/config")
        cfg = bytearray(path.read_bytes())
        cfg[4:6] = command.to_bytes(2, "little")
        cfg[0x64] = (cfg[0x64] & ~3) | pm_state
        path.write_bytes(bytes(cfg))

    def run(self, argv: list[str], timeout: float) -> tuple[int, str]:
        self.commands.append(list(argv))
        handler = self.handlers.get(os.path.basename(argv[0]))
        if handler:
            return handler(argv)
        if os.path.basename(argv[0]) == "modprobe":
            return self._modprobe(argv[1:])
        return 0, ""

    def _modprobe(self, args: list[str]) -> tuple[int, str]:
        module, params = args[0].replace("-", "_"), args[1:]
        if module in ("vfio_pci", "vfio"):
            if not self.fr.p("/sys/module/vfio").is_dir():
                self.fr.p("/sys/module/vfio/parameters").mkdir(parents=True)
                if self.noiommu_supported:
                    on = "enable_unsafe_noiommu_mode=1" in params
                    self.fr.write("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode", "Y" if on else "N")
                self.fr.write("/dev/vfio/vfio", "")
        if module == "vfio_pci":
            self.fr.p("/sys/module/vfio_pci").mkdir(parents=True, exist_ok=True)
            self.fr.p("/sys/bus/pci/drivers/vfio-pci").mkdir(parents=True, exist_ok=True)
        return 0, ""
