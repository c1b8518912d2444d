"""NUMA placement of host buffers: the machine's online nodes and the memory-policy syscalls
(mbind, get_mempolicy) through libc, which Python does not wrap.

The hybrid's CPU-computed layers sit in host buffers that every CPU worker reads. On a machine
with several nodes, first touch would put a whole buffer on the node of the thread that filled
it, and every worker on another node would read it across the interconnect; interleaving the
buffer's pages over all nodes spreads each layer over every memory controller instead.
"""

from __future__ import annotations

import ctypes
import os
import platform

from ntx_common.errors import NtxIOError

MPOL_INTERLEAVE = 3
MPOL_F_NODE, MPOL_F_ADDR = 1, 2
MAX_NODES = 1024  # bits in the node masks we pass
_SYSCALLS = {"x86_64": (237, 239), "aarch64": (235, 236)}  # (mbind, get_mempolicy)
PAGE = os.sysconf("SC_PAGE_SIZE")


def parse_nodelist(text: str) -> list[int]:
    """'0-1,3' -> [0, 1, 3] (the format of /sys/devices/system/node/online)."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


def online_nodes(sysfs: str = "/sys/devices/system/node") -> list[int]:
    """The online NUMA nodes; [0] where the kernel exposes no node directory."""
    try:
        with open(os.path.join(sysfs, "online")) as f:
            return parse_nodelist(f.read()) or [0]
    except OSError:
        return [0]


def placement_nodes(setting: str | None = None) -> list[int] | None:
    """Nodes to interleave the CPU layers' buffers over, or None to leave placement to first
    touch. NTX_NUMA=auto (default): when the machine has more than one node; interleave: always
    (also on one node, where it changes nothing: tests use it); off: never."""
    setting = setting or os.environ.get("NTX_NUMA", "auto")
    if setting not in ("auto", "interleave", "off"):
        raise NtxIOError(f"NTX_NUMA={setting!r}: use auto, interleave or off")
    nodes = online_nodes()
    if setting == "off" or (setting == "auto" and len(nodes) < 2):
        return None
    return nodes


def _libc():
    if platform.machine() not in _SYSCALLS:
        raise NtxIOError(f"NUMA placement is not wired up for {platform.machine()}; set NTX_NUMA=off")
    return ctypes.CDLL(None, use_errno=True), _SYSCALLS[platform.machine()]


def _mask(nodes: list[int]):
    words = (ctypes.c_ulong * (MAX_NODES // 64))()
    for n in nodes:
        if not 0 <= n < MAX_NODES:
            raise NtxIOError(f"NUMA node {n} is out of range [0, {MAX_NODES})")
        words[n // 64] |= 1 << (n % 64)
    return words


def interleave(address: int, length: int, nodes: list[int]) -> int:
    """Interleave the pages of [address, address + length) over `nodes` (only whole pages: the
    range is trimmed to page boundaries). Pages already touched keep their place: call before
    the buffer is filled. Returns the bytes the policy covers."""
    start = -(-address // PAGE) * PAGE
    end = (address + length) // PAGE * PAGE
    if end <= start:
        return 0
    libc, (sys_mbind, _) = _libc()
    rc = libc.syscall(sys_mbind, ctypes.c_void_p(start), ctypes.c_ulong(end - start), MPOL_INTERLEAVE,
                      _mask(nodes), ctypes.c_ulong(MAX_NODES), 0)
    if rc != 0:
        err = ctypes.get_errno()
        raise NtxIOError(f"mbind(MPOL_INTERLEAVE, nodes {nodes}) on {end - start} bytes at 0x{start:x} failed: "
                         f"{os.strerror(err)}; check the nodes are online (/sys/devices/system/node/online), "
                         "or set NTX_NUMA=off")
    return end - start


def policy_of(address: int) -> tuple[int, list[int]]:
    """(mode, nodes) of the memory policy that governs the page at address (MPOL_* mode)."""
    libc, (_, sys_get) = _libc()
    mode, mask = ctypes.c_int(-1), _mask([])
    rc = libc.syscall(sys_get, ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES),
                      ctypes.c_void_p(address // PAGE * PAGE), MPOL_F_ADDR)
    if rc != 0:
        raise NtxIOError(f"get_mempolicy at 0x{address:x} failed: {os.strerror(ctypes.get_errno())}")
    nodes = [i for i in range(MAX_NODES) if mask[i // 64] >> (i % 64) & 1]
    return mode.value, nodes
