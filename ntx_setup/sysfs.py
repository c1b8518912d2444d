"""Reading the kernel's files through an injectable root.

Every `/sys`, `/proc`, `/etc`, `/dev`, `/run` and `/var/lib` path ntx-setup touches goes
through `under(root, ...)`, so the whole toolkit runs against a fake tree in tests
(`--root DIR`) and against the real machine with `root=/`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

BDF_RE = re.compile(r"^([0-9a-f]{4}):([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")
SHORT_BDF_RE = re.compile(r"^([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


def under(root: Path, path: str | os.PathLike) -> Path:
    """`/sys/x` seen from `root` (identity when root is `/`)."""
    path = str(path)
    if not path.startswith("/"):
        raise ValueError(f"not an absolute path: {path!r}")
    return Path(root) / path.lstrip("/") if str(root) != "/" else Path(path)


def read_text(path: Path, default: str | None = None) -> str | None:
    """A sysfs/procfs attribute without its trailing newline, or `default` when unreadable."""
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return default


def read_int(path: Path, default: int | None = None, base: int = 0) -> int | None:
    text = read_text(path)
    if text is None:
        return default
    try:
        return int(text, base)
    except ValueError:
        return default


def link_name(path: Path) -> str | None:
    """Basename of a symlink's target (`driver` -> `nvme`), None when there is no link."""
    try:
        return os.path.basename(os.readlink(path))
    except OSError:
        return None


def list_names(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return []


def normalize_bdf(text: str) -> str:
    """`01:00.0` or `0000:01:00.0` (any case) -> `0000:01:00.0`; ValueError otherwise."""
    t = text.strip().lower()
    if SHORT_BDF_RE.match(t):
        t = "0000:" + t
    if not BDF_RE.match(t):
        raise ValueError(f"{text!r} is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:01:00.0)")
    return t


def block_name(dev: str) -> str:
    """`/dev/nvme0n1` or `nvme0n1` -> the kernel name (`nvme0n1`)."""
    name = dev.strip()
    if name.startswith("/dev/"):
        name = name[len("/dev/"):]
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{dev!r} is not a block device name (expected e.g. nvme0n1 or /dev/nvme0n1)")
    return name


def cmdline(root: Path) -> list[str]:
    text = read_text(under(root, "/proc/cmdline"), "") or ""
    return text.split()


def kernel_release(root: Path) -> str:
    return read_text(under(root, "/proc/sys/kernel/osrelease"), "") or os.uname().release


def kernel_version_tuple(release: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", release)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def cpu_vendor(root: Path) -> str:
    """`intel`, `amd` or `unknown`, from /proc/cpuinfo's vendor_id."""
    text = read_text(under(root, "/proc/cpuinfo"), "") or ""
    m = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    vendor = m.group(1) if m else ""
    return {"GenuineIntel": "intel", "AuthenticAMD": "amd", "HygonGenuine": "amd"}.get(vendor, "unknown")


def proc_status_field(root: Path, field: str, pid: str = "self") -> str | None:
    text = read_text(under(root, f"/proc/{pid}/status"), "") or ""
    m = re.search(rf"^{re.escape(field)}:\s*(.*)$", text, re.M)
    return m.group(1).strip() if m else None


def memlock_limit(root: Path) -> tuple[int | None, int | None]:
    """(soft, hard) RLIMIT_MEMLOCK in bytes from /proc/self/limits; None = unlimited."""
    text = read_text(under(root, "/proc/self/limits"), "") or ""
    m = re.search(r"^Max locked memory\s+(\S+)\s+(\S+)", text, re.M)
    if not m:
        return (0, 0)
    conv = [None if v == "unlimited" else int(v) for v in m.groups()]
    return conv[0], conv[1]
