"""The NVIDIA open kernel module under DKMS: find it, patch `os-mlock.c`, rebuild, revert.

Why: `cudaHostRegister(..., cudaHostRegisterIoMemory)` on an NVMe BAR mapped by vfio-pci makes
the driver look up the PFNs of a `VM_IO|VM_PFNMAP` mapping. Kernel 6.12 removed `follow_pfn`,
and a BAR range that has not been touched yet has no PTE for `follow_pfnmap_start` to find, so
the lookup fails. vfio-pci (like every remap_pfn_range user) keeps the range's first PFN in
`vma->vm_pgoff`; the patch falls back to computing the PFN from it.

The patch is applied only where the driver's text matches one of the anchors below exactly
(read from NVIDIA's open-gpu-kernel-modules releases); any other layout is refused.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ntx_common.errors import SetupError, UsageError
from ntx_setup import filechange
from ntx_setup.change import Plan
from ntx_setup.journal import Entry, Journal
from ntx_setup.machine import Machine
from ntx_setup.sysfs import kernel_release, kernel_version_tuple, list_names, read_text

MARKER = "ntx-setup: pfn-from-pgoff v1"
_HEADER = ("static inline int nv_follow_pfn(struct vm_area_struct *vma,\n"
           "                                unsigned long address,\n"
           "                                unsigned long *pfn)\n")
# Releases 570.133 .. 595: the #else branch delegates to nv_follow_flavors().
_FLAVORS_ANCHOR = ("#else\n"
                   "    return nv_follow_flavors(vma, address, pfn);\n"
                   "#endif\n"
                   "}\n")
_FLAVORS_NEW = ("#else\n"
                f"    /* {MARKER}: fall back when no PTE can be followed */\n"
                "    if (nv_follow_flavors(vma, address, pfn) == 0)\n"
                "        return 0;\n"
                "    return ntx_pfn_from_pgoff(vma, address, pfn);\n"
                "#endif\n"
                "}\n")
# Releases 550.90 .. 570.86: without follow_pte() the lookup gives up.
_PTE_ANCHOR = ("#else // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte\n"
               "    return -1;\n"
               "#endif // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte\n")
_PTE_NEW = ("#else // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte\n"
            f"    /* {MARKER}: no follow_pte() on this kernel */\n"
            "    return ntx_pfn_from_pgoff(vma, address, pfn);\n"
            "#endif // NV_IS_EXPORT_SYMBOL_PRESENT_follow_pte\n")
_HELPER = (f"/* {MARKER}.\n"
           " * A VM_IO/VM_PFNMAP mapping of a physical range (vfio-pci BARs, remap_pfn_range)\n"
           " * records the range's first PFN in vm_pgoff, so an address's PFN is that plus\n"
           " * its page offset in the VMA. Used only when the page tables cannot tell. */\n"
           "static inline int ntx_pfn_from_pgoff(struct vm_area_struct *vma,\n"
           "                                     unsigned long address,\n"
           "                                     unsigned long *pfn)\n"
           "{\n"
           "    if (!(vma->vm_flags & (VM_IO | VM_PFNMAP)))\n"
           "        return -1;\n"
           "    if (address < vma->vm_start || address >= vma->vm_end)\n"
           "        return -1;\n"
           "    *pfn = vma->vm_pgoff + ((address - vma->vm_start) >> PAGE_SHIFT);\n"
           "    return 0;\n"
           "}\n"
           "\n")
# name -> [(anchor, replacement)]; every anchor must occur exactly once.
LAYOUTS = {
    "follow-flavors": [(_HEADER, _HELPER + _HEADER), (_FLAVORS_ANCHOR, _FLAVORS_NEW)],
    "follow-pte": [(_HEADER, _HELPER + _HEADER), (_PTE_ANCHOR, _PTE_NEW)],
}
MLOCK_PATHS = ("nvidia/os-mlock.c", "kernel-open/nvidia/os-mlock.c")


@dataclass(frozen=True)
class Module:
    name: str            # DKMS module name (`nvidia`)
    version: str
    source: str          # in-machine path of the DKMS source tree
    mlock: str | None    # in-machine path of os-mlock.c, None when absent
    flavor: str          # open | proprietary | unknown
    patched: bool
    layout: str | None   # which anchor set matches (None: unknown or already patched)

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "source": self.source, "os_mlock": self.mlock,
                "flavor": self.flavor, "patched": self.patched, "layout": self.layout}


def apply_layout(text: str, layout: str) -> str:
    for anchor, new in LAYOUTS[layout]:
        if text.count(anchor) != 1:
            raise SetupError(f"anchor of layout {layout} found {text.count(anchor)} times (expected exactly once)")
        text = text.replace(anchor, new, 1)
    return text


def match_layout(text: str) -> str | None:
    for name, pairs in LAYOUTS.items():
        if all(text.count(anchor) == 1 for anchor, _ in pairs):
            return name
    return None


def _flavor(m: Machine, source: str) -> str:
    for rel in ("nvidia/nv.c", "kernel-open/nvidia/nv.c", "kernel/nvidia/nv.c"):
        text = read_text(m.path(f"{source}/{rel}"))
        if text is None:
            continue
        if 'MODULE_LICENSE("Dual MIT/GPL")' in text:
            return "open"
        if 'MODULE_LICENSE("NVIDIA")' in text:
            return "proprietary"
    return "unknown"


def _source_dir(m: Machine, name: str, version: str) -> str:
    link = m.path(f"/var/lib/dkms/{name}/{version}/source")
    if link.is_symlink():
        target = os.readlink(link)
        if target.startswith("/"):
            return target
    return f"/usr/src/{name}-{version}"


def find_modules(m: Machine) -> list[Module]:
    found = []
    for name in list_names(m.path("/var/lib/dkms")):
        if not name.startswith("nvidia"):
            continue
        for version in list_names(m.path(f"/var/lib/dkms/{name}")):
            if not re.match(r"^\d+(\.\d+)+$", version):
                continue
            source = _source_dir(m, name, version)
            mlock = next((f"{source}/{p}" for p in MLOCK_PATHS if m.path(f"{source}/{p}").is_file()), None)
            text = read_text(m.path(mlock), "") if mlock else ""
            patched = MARKER in text
            found.append(Module(name, version, source, mlock, _flavor(m, source), patched,
                                None if patched else match_layout(text)))
    return found


def pick(m: Machine, version: str | None) -> Module:
    mods = [x for x in find_modules(m) if version in (None, x.version)]
    if not mods:
        which = f" version {version}" if version else ""
        raise SetupError(f"no NVIDIA module{which} under DKMS (/var/lib/dkms/nvidia*): install the open kernel "
                         "module's DKMS package (e.g. nvidia-dkms-<ver>-open / nvidia-open-dkms)")
    if len(mods) > 1:
        raise UsageError(f"several NVIDIA DKMS versions ({', '.join(x.version for x in mods)}): pass --version")
    return mods[0]


def dkms_commands(mod: Module, kernel: str) -> list[list[str]]:
    return [["dkms", "build", "-m", mod.name, "-v", mod.version, "-k", kernel, "--force"],
            ["dkms", "install", "-m", mod.name, "-v", mod.version, "-k", kernel, "--force"]]


def plan_patch(m: Machine, version: str | None) -> tuple[Plan, bytes, bytes]:
    mod = pick(m, version)
    if mod.flavor != "open":
        raise SetupError(f"{mod.name} {mod.version} in {mod.source} is the {mod.flavor} kernel module: only the open "
                         "module (MIT/GPL, open-gpu-kernel-modules) can be patched; install its -open DKMS package")
    if mod.mlock is None:
        raise SetupError(f"{mod.source}: no os-mlock.c in {' or '.join(MLOCK_PATHS)}: unknown layout, refusing")
    old = m.path(mod.mlock).read_bytes()
    if mod.patched:
        return Plan("dkms", f"{mod.name}/{mod.version}", notes=[f"{mod.mlock} is already patched: nothing to do"]), old, old
    if mod.layout is None:
        raise SetupError(f"{mod.mlock}: the text around nv_follow_pfn() matches no known release; refusing to patch "
                         "an unknown layout (supported: 550.90 .. 595)")
    kernel = kernel_release(m.root)
    new = apply_layout(old.decode(), mod.layout).encode()
    cmds = dkms_commands(mod, kernel)
    notes = ["the rebuilt module is unsigned: with Secure Boot on it will not load unless you sign it with an "
             "enrolled MOK key", "the patched module is used after `modprobe -r nvidia*` + reload, or a reboot"]
    if kernel_version_tuple(kernel) < (6, 12):
        notes.insert(0, f"kernel {kernel} still has follow_pfn(); the patch is only needed from 6.12 on")
    steps = [f"back up {mod.mlock}", f"patch nv_follow_pfn() ({mod.layout} layout)"] + [" ".join(c) for c in cmds]
    steps.append(f"verify `dkms status -m {mod.name} -v {mod.version} -k {kernel}` says installed")
    before = filechange.before_record(m, mod.mlock, old, new, "os-mlock.c") | {
        "module": mod.name, "version": mod.version, "kernel": kernel}
    diff = filechange.unified_diff(mod.mlock, old.decode(), new.decode())
    return Plan("dkms", f"{mod.name}/{mod.version}", steps, diff, notes, before), old, new


def _rebuild(m: Machine, b: dict) -> None:
    mod = Module(b["module"], b["version"], "", None, "open", False, None)
    for cmd in dkms_commands(mod, b["kernel"]):
        m.run(cmd, timeout=1800)
    status = m.run(["dkms", "status", "-m", b["module"], "-v", b["version"], "-k", b["kernel"]], timeout=120)
    if "installed" not in status:
        raise SetupError(f"dkms does not report {b['module']}/{b['version']} installed for {b['kernel']}: {status!r}")


def do_patch(m: Machine, journal: Journal, entry: Entry, old: bytes, new: bytes) -> dict:
    filechange.write_new(m, journal, entry, old, new)
    _rebuild(m, entry.before)
    if MARKER not in (read_text(m.path(entry.before["path"]), "") or ""):
        raise SetupError(f"{entry.before['path']} lost the patch during the rebuild")
    return {"sha256": entry.before["new_sha256"], "reload_required": True}


def undo_patch(m: Machine, journal: Journal, entry: Entry, force: bool = False) -> None:
    rewritten = filechange.restore_original(m, journal, entry, force)
    if rewritten or entry.state == "done":
        _rebuild(m, entry.before)
