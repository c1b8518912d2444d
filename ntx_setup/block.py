"""Block devices from sysfs/procfs: NVMe namespaces, partitions, holders, mounts, swap, openers.

Everything is read through `root`, so fake trees in tests exercise the same code. Mounts come
from psutil with its procfs path pointed at `root/proc`, plus the major:minor numbers of
`/proc/self/mountinfo` (names can lie, e.g. `/dev/root`; device numbers do not).
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ntx_setup.pci import device_dir
from ntx_setup.sysfs import link_name, list_names, read_int, read_text, under

NAMESPACE_RE = re.compile(r"^nvme\d+n\d+$")


@dataclass(frozen=True)
class Mount:
    name: str            # kernel block device name the mount is on (`nvme0n1p1`, `dm-0`), or ""
    source: str          # as the kernel lists it (`/dev/nvme0n1p1`)
    mountpoint: str
    fstype: str


def class_block(root: Path, name: str) -> Path:
    return under(root, f"/sys/class/block/{name}")


def controllers_of(root: Path, bdf: str) -> list[str]:
    """Kernel nvme controller names (`nvme0`) attached to a PCI function (empty when unbound)."""
    return [n for n in list_names(device_dir(root, bdf) / "nvme") if re.match(r"^nvme\d+$", n)]


def namespaces_of(root: Path, bdf: str) -> list[str]:
    """Block devices (`nvme0n1`) whose namespace is reached through this controller.

    A namespace's parent is its controller, or, with native multipath, an nvme-subsystem
    whose controllers include ours.
    """
    ctrls = set(controllers_of(root, bdf))
    found = []
    for name in list_names(under(root, "/sys/class/block")):
        if not NAMESPACE_RE.match(name):
            continue
        parent = link_name(class_block(root, name) / "device")
        if parent in ctrls:
            found.append(name)
        elif parent and parent.startswith("nvme-subsys"):
            members = set(list_names(under(root, f"/sys/class/nvme-subsystem/{parent}")))
            if members & ctrls:
                found.append(name)
    return found


def partitions_of(root: Path, disk: str) -> list[str]:
    d = class_block(root, disk)
    return [n for n in list_names(d) if (d / n / "partition").exists()]


def disk_of(root: Path, name: str) -> str:
    """The whole disk a partition belongs to (itself for a disk)."""
    d = class_block(root, name)
    if (d / "partition").exists():
        parent = os.path.basename(os.path.dirname(os.path.realpath(d)))
        return parent if parent else name
    return name


def holders_closure(root: Path, names: list[str]) -> list[str]:
    """`names` plus every device stacked on them (dm, md, LUKS, LVM), transitively."""
    seen, todo = [], list(names)
    while todo:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.append(n)
        todo += list_names(class_block(root, n) / "holders")
    return seen


def direct_holders(root: Path, name: str) -> list[str]:
    return list_names(class_block(root, name) / "holders")


def dev_numbers(root: Path) -> dict[str, str]:
    """`"259:0"` -> `nvme0n1` for every block device."""
    numbers = {}
    for name in list_names(under(root, "/sys/class/block")):
        num = read_text(class_block(root, name) / "dev")
        if num:
            numbers[num] = name
    return numbers


def dm_names(root: Path) -> dict[str, str]:
    """device-mapper name (`vg-root`, `luks-…`) -> kernel name (`dm-0`)."""
    names = {}
    for name in list_names(under(root, "/sys/class/block")):
        dm = read_text(class_block(root, name) / "dm" / "name")
        if dm:
            names[dm] = name
    return names


def resolve_source(root: Path, source: str, dms: dict[str, str]) -> str:
    """A mount/swap source path -> kernel block device name ("" for non-block sources)."""
    if not source.startswith("/dev/"):
        return ""
    real = os.path.realpath(under(root, source))
    base = os.path.basename(real)
    if source.startswith("/dev/mapper/"):
        return dms.get(source[len("/dev/mapper/"):], base)
    return dms.get(base, base)


@contextlib.contextmanager
def _psutil_procfs(root: Path):
    import psutil

    saved = psutil.PROCFS_PATH
    psutil.PROCFS_PATH = str(under(root, "/proc"))
    try:
        yield psutil
    finally:
        psutil.PROCFS_PATH = saved


def mounts(root: Path) -> list[Mount]:
    dms = dm_names(root)
    with _psutil_procfs(root) as psutil:
        try:
            parts = psutil.disk_partitions(all=True)
        except OSError:
            parts = []
    found = [Mount(resolve_source(root, p.device, dms), p.device, p.mountpoint, p.fstype) for p in parts]
    return found + _mountinfo_mounts(root)


def _mountinfo_mounts(root: Path) -> list[Mount]:
    """Mounts identified by device number (catches `/dev/root` and renamed sources)."""
    numbers = dev_numbers(root)
    found = []
    for line in (read_text(under(root, "/proc/self/mountinfo"), "") or "").splitlines():
        fields = line.split()
        if len(fields) < 10 or "-" not in fields:
            continue
        sep = fields.index("-")
        name = numbers.get(fields[2])
        if name:
            found.append(Mount(name, fields[sep + 2], fields[4], fields[sep + 1]))
    return found


def swaps(root: Path) -> list[tuple[str, str]]:
    """(kernel name or "", filename) of every active swap area."""
    dms = dm_names(root)
    lines = (read_text(under(root, "/proc/swaps"), "") or "").splitlines()[1:]
    out = []
    for line in lines:
        fields = line.split()
        if fields:
            # /proc/swaps escapes spaces as \040; block sources never contain them.
            out.append((resolve_source(root, fields[0], dms), fields[0]))
    return out


def openers(root: Path, names: list[str]) -> list[tuple[str, str, str]]:
    """(pid, command, device) for every process holding one of `/dev/<names>` open."""
    wanted = {f"/dev/{n}" for n in names}
    proc = under(root, "/proc")
    found = []
    for pid in list_names(proc):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        for fd in list_names(proc / pid / "fd"):
            try:
                target = os.readlink(proc / pid / "fd" / fd)
            except OSError:
                continue
            if target in wanted:
                comm = read_text(proc / pid / "comm", "?") or "?"
                found.append((pid, comm, target))
    return found


def size_bytes(root: Path, name: str) -> int | None:
    sectors = read_int(class_block(root, name) / "size")
    return None if sectors is None else sectors * 512


def logical_block_size(root: Path, name: str) -> int | None:
    return read_int(class_block(root, disk_of(root, name)) / "queue" / "logical_block_size")


def signatures(root: Path, name: str) -> list[str]:
    """Signatures on `/dev/<name>`; OSError when it cannot be read (needs root on a real machine)."""
    from ntx_setup.signatures import probe

    found = probe(under(root, f"/dev/{name}"), size_bytes(root, name))
    return found + [s for s in udev_signatures(root, name) if s not in found]


def udev_signatures(root: Path, name: str) -> list[str]:
    """What udev's blkid run recorded (ID_FS_TYPE, ID_PART_TABLE_TYPE); empty without a udev db."""
    if str(root) != "/":
        return []
    try:
        import pyudev

        dev = pyudev.Devices.from_name(pyudev.Context(), "block", name)
        props = dev.properties
        return [v for v in (props.get("ID_PART_TABLE_TYPE"), props.get("ID_FS_TYPE")) if v]
    except Exception:  # no libudev or no udev database (containers): blkid-like probe only
        return []
