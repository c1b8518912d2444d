"""NVIDIA GPUs and the CUDA stack, seen without CUDA: sysfs, /proc/driver/nvidia, nvidia-smi.

Nothing here loads libcuda: ntx-setup is what people run when CUDA is broken.
"""

from __future__ import annotations

import re

from ntx_common.errors import SetupError
from ntx_setup import pci
from ntx_setup.machine import Machine
from ntx_setup.sysfs import read_text

LIBCUDA_PATHS = ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", "/usr/lib/libcuda.so.1",
                 "/usr/lib/aarch64-linux-gnu/libcuda.so.1", "/usr/lib/wsl/lib/libcuda.so.1")
SMI_FIELDS = "pci.bus_id,name,compute_cap,memory.total,driver_version"


def driver_info(m: Machine) -> dict:
    """Loaded NVIDIA kernel module: version and open/proprietary flavour (None when not loaded)."""
    text = read_text(m.path("/proc/driver/nvidia/version"))
    if text is None:
        version = read_text(m.path("/sys/module/nvidia/version"))
        return {"loaded": version is not None, "version": version, "flavor": "unknown" if version else None}
    first = text.splitlines()[0]
    ver = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", first + " ")
    flavor = "open" if "Open Kernel Module" in first else "proprietary"
    return {"loaded": True, "version": ver.group(1) if ver else None, "flavor": flavor}


def smi_query(m: Machine) -> tuple[dict[str, dict], str | None]:
    """Per-GPU facts nvidia-smi knows (compute capability, VRAM); (facts, problem)."""
    if not m.tool("nvidia-smi"):
        return {}, "nvidia-smi not found"
    try:
        text = m.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader,nounits"], timeout=30)
    except SetupError as exc:
        return {}, str(exc).splitlines()[0]
    found = {}
    for line in text.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) != 5 or not re.match(r"^[0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.\d$", f[0]):
            continue
        bdf = f[0][-12:].lower()
        mib = int(f[3]) if f[3].isdigit() else None
        found[bdf] = {"model": f[1], "compute_capability": f[2], "vram_bytes": mib << 20 if mib else None,
                      "driver_version": f[4]}
    return found, None


def gpus(m: Machine, devices: list[pci.PciDevice]) -> tuple[list[dict], str | None]:
    smi, problem = smi_query(m)
    found = []
    for dev in devices:
        if dev.vendor != pci.VENDOR_NVIDIA or not dev.is_gpu:
            continue
        info = read_text(m.path(f"/proc/driver/nvidia/gpus/{dev.bdf}/information"), "") or ""
        model = re.search(r"^Model:\s*(.+)$", info, re.M)
        facts = {"bdf": dev.bdf, "device_id": f"{dev.vendor:04x}:{dev.device:04x}", "driver": dev.driver,
                 "model": model.group(1).strip() if model else None, "compute_capability": None,
                 "vram_bytes": None, "numa_node": dev.numa_node, "iommu_group": dev.iommu_group,
                 "link": link_dict(dev.link)}
        facts |= {k: v for k, v in smi.get(dev.bdf, {}).items() if v is not None}
        found.append(facts)
    return found, problem


def link_dict(link: pci.Link) -> dict:
    return {"speed_gts": link.cur_speed, "width": link.cur_width, "max_speed_gts": link.max_speed,
            "max_width": link.max_width, "gbps": link.gbps("cur"), "max_gbps": link.gbps("max"),
            "degraded": link.degraded}


def cuda_stack(m: Machine) -> dict:
    libcuda = next((p for p in LIBCUDA_PATHS if m.path(p).exists()), None)
    nvcc = m.tool("nvcc") or ("/usr/local/cuda/bin/nvcc" if m.path("/usr/local/cuda/bin/nvcc").exists() else None)
    return {"libcuda": libcuda, "nvcc": nvcc, "nvidia_smi": m.tool("nvidia-smi")}
