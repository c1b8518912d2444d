"""`ntx-setup check`: every fact that decides how this machine can stream a model, with fixes.

`collect` returns one JSON-able dict (schema `ntx-setup.check/1`): `facts` by area, `findings`
(level ok/warn/fail, message, fix) and a `recommendation` (which NVMe to dedicate and the tier
budgets the machine suggests). It only reads; nothing here changes the system.
"""

from __future__ import annotations

import re

from ntx_common.errors import SetupError
from ntx_setup import block, dkms, gpu, grub, hugepages, pci
from ntx_setup.guards import controller_refusals
from ntx_setup.machine import Machine
from ntx_setup.sysfs import (cmdline, cpu_vendor, kernel_release, kernel_version_tuple, list_names,
                             memlock_limit, proc_status_field, read_text)

SCHEMA = "ntx-setup.check/1"
LEVELS = ("ok", "warn", "fail")
CAPS = {"CAP_IPC_LOCK": 14, "CAP_SYS_RAWIO": 17, "CAP_SYS_ADMIN": 21}
SECURE_BOOT_VAR = "/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e0c93b0c0aad"
GiB = 1 << 30


class Findings(list):
    def add(self, level: str, area: str, message: str, fix: str = "") -> None:
        if level not in LEVELS:
            raise ValueError(f"finding level {level!r} not in {LEVELS}")
        self.append({"level": level, "area": area, "message": message, "fix": fix})


def collect(m: Machine) -> dict:
    f = Findings()
    devices, source = pci.list_devices(m.root)
    facts = {"kernel": _kernel(m, f), "user": _user(m, f), "cpu": _cpu(m, f),
             "iommu": _iommu(m, f), "vfio": _vfio(m, f), "hugepages": _hugepages(m, f),
             "memory": _memory(m, f), "gpus": _gpus(m, f, devices), "nvidia_driver": gpu.driver_info(m),
             "cuda": _cuda(m, f),
             "dkms": [x.as_dict() for x in dkms.find_modules(m)], "nvme": _nvmes(m, f, devices),
             "grub": _grub(m, f), "secure_boot": _secure_boot(m, f)}
    _driver_findings(facts, f)
    rec = recommend(facts)
    f.add("ok" if rec["nvme"] else "warn", "recommendation", rec["summary"], rec.get("fix", ""))
    return {"schema": SCHEMA, "root": str(m.root), "enumeration": source, "facts": facts,
            "findings": list(f), "recommendation": rec}


def _kernel(m: Machine, f: Findings) -> dict:
    rel = kernel_release(m.root)
    ver = kernel_version_tuple(rel)
    note = " (no follow_pfn: registering an NVMe BAR with CUDA needs `ntx-setup dkms patch`)" if ver >= (6, 12) else ""
    f.add("ok", "kernel", f"Linux {rel}{note}")
    return {"release": rel, "version": list(ver)}


def human(n: int | None) -> str:
    if n is None:
        return "?"
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def _cpu(m: Machine, f: Findings) -> dict:
    vendor = cpu_vendor(m.root)
    if vendor == "unknown":
        f.add("warn", "cpu", "CPU vendor unknown: `grub enable-iommu` cannot pick intel_iommu/amd_iommu",
              "add the parameters by hand: ntx-setup grub add intel_iommu=on iommu=pt (or amd_iommu=on)")
    else:
        f.add("ok", "cpu", f"{vendor.upper() if vendor == 'amd' else vendor.capitalize()} CPU")
    return {"vendor": vendor}


def _user(m: Machine, f: Findings) -> dict:
    cap_hex = proc_status_field(m.root, "CapEff") or "0"
    caps = {name: bool(int(cap_hex, 16) >> bit & 1) for name, bit in CAPS.items()}
    if m.euid == 0:
        f.add("ok", "user", "running as root")
    else:
        f.add("warn", "user", f"running as uid {m.euid}: drive signatures and PCI config space are hidden, and every "
              "change needs root", "rerun with sudo for the full picture")
    return {"euid": m.euid, "capabilities": caps}


def _iommu(m: Machine, f: Findings) -> dict:
    args = cmdline(m.root)
    groups = len(list_names(m.path("/sys/kernel/iommu_groups")))
    units = list_names(m.path("/sys/class/iommu"))
    asked = [a for a in args if a.split("=")[0] in ("intel_iommu", "amd_iommu", "iommu")]
    if groups:
        f.add("ok", "iommu", f"IOMMU on: {groups} groups, units {', '.join(units) or 'unnamed'} ({' '.join(asked) or 'default'})")
        if "iommu=pt" not in args:
            f.add("warn", "iommu", "iommu=pt is not set: every other device's DMA is translated too",
                  "ntx-setup grub enable-iommu (adds iommu=pt), then reboot")
    elif any(a.endswith("=on") for a in asked):
        f.add("fail", "iommu", f"{' '.join(asked)} is on the kernel command line but no IOMMU groups exist",
              "enable VT-d / AMD-Vi (IOMMU) in the firmware setup")
    else:
        f.add("warn", "iommu", "IOMMU off: VFIO needs it (or the unsafe no-IOMMU mode)",
              "ntx-setup grub enable-iommu, reboot; enable VT-d/AMD-Vi in the firmware if needed")
    return {"cmdline": asked, "groups": groups, "units": units, "enabled": groups > 0}


def _module_available(m: Machine, name: str) -> bool:
    rel = kernel_release(m.root)
    stem = name.replace("_", "[-_]")
    text = (read_text(m.path(f"/lib/modules/{rel}/modules.dep"), "") or "") + \
        (read_text(m.path(f"/lib/modules/{rel}/modules.builtin"), "") or "")
    return bool(re.search(rf"/{stem}\.ko", text))


def _vfio(m: Machine, f: Findings) -> dict:
    loaded = {mod: m.path(f"/sys/module/{mod}").is_dir() for mod in ("vfio", "vfio_pci", "vfio_iommu_type1")}
    available = loaded["vfio_pci"] or _module_available(m, "vfio_pci")
    noiommu = read_text(m.path("/sys/module/vfio/parameters/enable_unsafe_noiommu_mode"))
    if available:
        f.add("ok", "vfio", "vfio-pci " + ("loaded" if loaded["vfio_pci"] else "available (loaded by `ntx-setup bind`)"))
    else:
        f.add("fail", "vfio", "no vfio-pci module for this kernel", "install the kernel's modules package "
              "(e.g. linux-modules-extra-$(uname -r)) or enable CONFIG_VFIO_PCI")
    if noiommu == "Y":
        f.add("warn", "vfio", "vfio no-IOMMU mode is ON: devices bound to vfio-pci have unchecked DMA",
              "ntx-setup restore (or echo 0 > /sys/module/vfio/parameters/enable_unsafe_noiommu_mode)")
    return {"modules_loaded": loaded, "vfio_pci_available": available, "noiommu_param": noiommu}


def _hugepages(m: Machine, f: Findings) -> list[dict]:
    pools = hugepages.pools(m.root)
    two = next((p for p in pools if p["size_kb"] == 2048), None)
    if two and two["total"]:
        f.add("ok", "hugepages", f"2 MiB pool: {two['total']} pages ({two['free']} free)")
    else:
        f.add("warn", "hugepages", "no 2 MiB hugepages reserved: pinned staging buffers fall back to 4 KiB pages",
              "ntx-setup hugepages 1024   (2 GiB)")
    if not any(p["size_kb"] == 1048576 for p in pools):
        f.add("ok", "hugepages", "no 1 GiB page support (fine: 2 MiB pages are enough)")
    return pools


def _memory(m: Machine, f: Findings) -> dict:
    with block._psutil_procfs(m.root) as psutil:
        vm = psutil.virtual_memory()
    soft, hard = memlock_limit(m.root)
    f.add("ok", "memory", f"RAM {human(vm.total)}, {human(vm.available)} available")
    ipc_lock = int(proc_status_field(m.root, "CapEff") or "0", 16) >> CAPS["CAP_IPC_LOCK"] & 1
    if soft is None or ipc_lock:
        f.add("ok", "memlock", "pinned memory is not limited (" + ("unlimited" if soft is None else "CAP_IPC_LOCK") + ")")
    elif soft < vm.total // 2:
        f.add("warn", "memlock", f"RLIMIT_MEMLOCK is {soft / 2**20:.0f} MiB: pinning a RAM tier larger than that fails",
              "ntx-setup memlock (shows the limits.conf / systemd lines to raise it)")
    return {"total": vm.total, "available": vm.available, "memlock_soft": soft, "memlock_hard": hard}


def memlock_advice(m: Machine) -> dict:
    mem = _memory(m, Findings())
    want_kib = int(mem["total"] * 0.75) // 1024
    cur = "unlimited" if mem["memlock_soft"] is None else f"{mem['memlock_soft'] // 1024} KiB"
    lines = [f"current RLIMIT_MEMLOCK (soft): {cur}; RAM {mem['total'] / GiB:.1f} GiB",
             "ntx pins its RAM tier and staging buffers; the limit must cover them (root with CAP_IPC_LOCK is exempt).",
             f"suggested limit: {want_kib} KiB (75 % of RAM) or unlimited",
             "  login sessions: /etc/security/limits.d/90-ntx.conf:",
             f"    <user>  soft  memlock  {want_kib}", f"    <user>  hard  memlock  {want_kib}",
             "    (log out and in again)",
             "  systemd service: LimitMEMLOCK=infinity in the [Service] section",
             "  docker: --ulimit memlock=-1:-1"]
    return {"soft": mem["memlock_soft"], "hard": mem["memlock_hard"], "suggested_kib": want_kib, "lines": lines}


def _gpus(m: Machine, f: Findings, devices: list[pci.PciDevice]) -> list[dict]:
    found, problem = gpu.gpus(m, devices)
    if not found:
        f.add("warn", "gpu", "no NVIDIA GPU on the PCI bus", "ntx runs CPU-only (numpy backend) without one")
    elif problem:
        f.add("warn", "gpu", f"nvidia-smi: {problem}: compute capability and VRAM unknown",
              "install/repair the NVIDIA driver user-space (nvidia-smi)")
    for g in found:
        link = g["link"]
        f.add("ok" if g["driver"] == "nvidia" else "fail", "gpu",
              f"{g['bdf']} {g['model'] or g['device_id']} (cc {g['compute_capability'] or '?'}, "
              f"{human(g['vram_bytes'])}) driver {g['driver'] or 'none'}",
              "" if g["driver"] == "nvidia" else "install and load the NVIDIA driver")
        if link["degraded"]:
            f.add("warn", "gpu", f"{g['bdf']} link runs at {link['speed_gts']} GT/s x{link['width']}, below its "
                  f"{link['max_speed_gts']} GT/s x{link['max_width']}", "reseat the card or use a full-width slot")
    return found


def _driver_findings(facts: dict, f: Findings) -> None:
    drv, mods = facts["nvidia_driver"], facts["dkms"]
    if facts["gpus"] and drv["loaded"]:
        f.add("ok" if drv["flavor"] == "open" else "warn", "gpu",
              f"NVIDIA kernel module {drv['version'] or '?'} ({drv['flavor']})",
              "" if drv["flavor"] == "open" else "the BAR-registration patch needs the open kernel module")
    if facts["gpus"] and tuple(facts["kernel"]["version"]) >= (6, 12):
        if any(x["flavor"] == "open" and x["patched"] for x in mods):
            f.add("ok", "dkms", "NVIDIA open module under DKMS carries the os-mlock.c patch")
        elif any(x["flavor"] == "open" for x in mods):
            f.add("warn", "dkms", "NVIDIA open module is not patched: cudaHostRegister of an NVMe BAR fails on "
                  "kernels >= 6.12", "ntx-setup dkms patch")
        else:
            f.add("warn", "dkms", "no NVIDIA *open* kernel module under DKMS: the NVMe BAR cannot be registered "
                  "with CUDA on this kernel", "install the open module's DKMS package; ntx then stages through RAM")


def _cuda(m: Machine, f: Findings) -> dict:
    stack = gpu.cuda_stack(m)
    f.add("ok" if stack["libcuda"] else "warn", "cuda",
          f"CUDA driver library {stack['libcuda'] or 'not found'}; toolkit (nvcc) {stack['nvcc'] or 'not found'}",
          "" if stack["libcuda"] else "install the NVIDIA driver (libcuda.so.1) for the GPU tiers")
    return stack


def _namespace(m: Machine, name: str) -> dict:
    return {"name": name, "size_bytes": block.size_bytes(m.root, name),
            "lba_bytes": block.logical_block_size(m.root, name), "partitions": block.partitions_of(m.root, name)}


def _nvme(m: Machine, dev: pci.PciDevice) -> dict:
    ctrls = block.controllers_of(m.root, dev.bdf)
    c = m.path(f"/sys/class/nvme/{ctrls[0]}") if ctrls else None
    attr = (lambda n: read_text(c / n)) if c else (lambda n: None)
    peers = [p for p in pci.group_members(m.root, dev.iommu_group) if p != dev.bdf] if dev.iommu_group else []
    refusals = [] if dev.driver == "vfio-pci" else controller_refusals(dev.bdf, m.root)
    return {"bdf": dev.bdf, "model": attr("model"), "serial": attr("serial"), "firmware": attr("firmware_rev"),
            "controller": ctrls[0] if ctrls else None, "driver": dev.driver, "numa_node": dev.numa_node,
            "iommu_group": dev.iommu_group, "group_peers": peers, "link": gpu.link_dict(dev.link),
            "namespaces": [_namespace(m, n) for n in block.namespaces_of(m.root, dev.bdf)],
            "refusals": [r.as_dict() for r in refusals], "dedicated": dev.driver == "vfio-pci"}


def _nvmes(m: Machine, f: Findings, devices: list[pci.PciDevice]) -> list[dict]:
    found = [_nvme(m, d) for d in devices if d.is_nvme]
    for n in found:
        size = human(sum(ns["size_bytes"] or 0 for ns in n["namespaces"])) if n["namespaces"] else "size unknown"
        what = f"NVMe {n['bdf']} {n['model'] or '(model unknown)'} {size}, driver {n['driver'] or 'none'}"
        if n["dedicated"]:
            f.add("ok", "nvme", f"{what}: dedicated (bound to vfio-pci)")
        elif not n["refusals"]:
            f.add("ok", "nvme", f"{what}: free to dedicate (`ntx-setup bind {n['bdf']}`)")
        else:
            f.add("warn", "nvme", f"{what}: " + "; ".join(r["message"] for r in n["refusals"]),
                  " / ".join(dict.fromkeys(r["fix"] for r in n["refusals"])))
    if not found:
        f.add("warn", "nvme", "no NVMe controller on the PCI bus", "models are read with O_DIRECT/mmap instead")
    return found


def _grub(m: Machine, f: Findings) -> dict:
    text = read_text(m.path(grub.GRUB_FILE))
    if text is None:
        f.add("warn", "grub", f"no {grub.GRUB_FILE}: GRUB is not this machine's boot loader (or not installed)",
              "set kernel parameters the way your boot loader wants (e.g. /etc/kernel/cmdline)")
        return {"present": False}
    try:
        found = {var: " ".join(a.params) for var, a in grub.assignments(text).items()}
    except SetupError as exc:  # a file we refuse to edit is still worth reporting
        f.add("warn", "grub", str(exc), "edit it by hand")
        return {"present": True, "error": str(exc)}
    f.add("ok", "grub", f"{grub.GRUB_FILE}: " + "; ".join(f"{k}=\"{v}\"" for k, v in found.items()))
    return {"present": True} | found


def _secure_boot(m: Machine, f: Findings) -> str:
    if not m.path("/sys/firmware/efi").is_dir():
        state = "unsupported (BIOS boot)"
    else:
        try:
            data = m.path(SECURE_BOOT_VAR).read_bytes()
            state = "enabled" if len(data) >= 5 and data[4] == 1 else "disabled"
        except OSError:
            state = "unknown"
    if state == "enabled":
        f.add("warn", "secure-boot", "Secure Boot is on: a DKMS-rebuilt NVIDIA module must be signed with an "
              "enrolled MOK key to load", "sign it (DKMS can with mokutil-enrolled keys) or disable Secure Boot")
    else:
        f.add("ok", "secure-boot", f"Secure Boot {state}")
    return state


def recommend(facts: dict) -> dict:
    """Which NVMe to dedicate and the budgets of each tier (bytes)."""
    nvmes = facts["nvme"]
    free = [n for n in nvmes if n["dedicated"] or not n["refusals"]]
    wipe = [n for n in nvmes if n["refusals"] and all(r["overridable"] for r in n["refusals"])]
    pick = free[0] if free else None
    vram = sum(g.get("vram_bytes") or 0 for g in facts["gpus"])
    mem = facts["memory"]
    ram = int(mem["available"] * 0.75)
    if mem["memlock_soft"] is not None and not facts["user"]["capabilities"]["CAP_IPC_LOCK"]:
        ram = min(ram, mem["memlock_soft"])
    storage = sum(ns["size_bytes"] or 0 for ns in pick["namespaces"]) if pick and not pick["dedicated"] else None
    reader = "vfio" if pick and facts["iommu"]["enabled"] else "odirect"
    budgets = {"vram_bytes": int(vram * 0.9), "pinned_ram_bytes": ram, "storage_bytes": storage, "reader": reader,
               "h2d_gbps": max((g["link"]["gbps"] or 0 for g in facts["gpus"]), default=None),
               "nvme_gbps": pick["link"]["gbps"] if pick else None}
    if pick:
        summary = f"dedicate NVMe {pick['bdf']} ({pick['model'] or 'unknown model'})" if not pick["dedicated"] \
            else f"NVMe {pick['bdf']} is already dedicated to vfio-pci"
        return {"nvme": pick["bdf"], "summary": summary, "budgets": budgets}
    no_iommu = [n for n in nvmes if n["refusals"] and all(r["code"] == "noiommu" for r in n["refusals"])]
    if no_iommu:
        fix = (f"{no_iommu[0]['bdf']} is free but the IOMMU is off: `ntx-setup grub enable-iommu` and reboot, "
               "or bind with --noiommu (unsafe: no DMA protection)")
    elif wipe:
        fix = f"{wipe[0]['bdf']} only carries old signatures: if its data is disposable, wipe it or bind with --force"
    else:
        fix = "add a spare NVMe drive, or let ntx read the model file with O_DIRECT"
    return {"nvme": None, "summary": "no NVMe is safe to dedicate", "fix": fix, "budgets": budgets}
