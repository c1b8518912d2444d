"""`ntx-setup check` / `report` on a fake workstation: one GPU, a system NVMe and a spare one."""

import json
import os

import pytest

from ntx_setup.check import LEVELS, SCHEMA

GPU, SYS_NVME, SPARE = "0000:41:00.0", "0000:01:00.0", "0000:02:00.0"
MiB = 1 << 20


@pytest.fixture
def rig(fr, kernel):
    fr.write("/proc/cmdline", "BOOT_IMAGE=/vmlinuz root=/dev/nvme0n1p1 ro quiet intel_iommu=on iommu=pt")
    fr.p("/sys/class/iommu/dmar0").mkdir(parents=True)
    fr.add_pci(GPU, vendor=0x10DE, device=0x2335, class_code=0x030200, driver="nvidia", group="20",
               speed="8.0 GT/s PCIe", width=16, max_speed="32.0 GT/s PCIe", max_width=16)
    fr.write("/proc/driver/nvidia/version", "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  "
             "Release Build  (dvs-builder@U16)  Tue Jul 22 2025\nGCC version:  gcc version 12.2.0\n")
    fr.write(f"/proc/driver/nvidia/gpus/{GPU}/information", "Model: \t\t NVIDIA H200\nIRQ:   \t\t 150\n")
    for tool in ("/usr/bin/nvidia-smi", "/usr/lib/x86_64-linux-gnu/libcuda.so.1"):
        fr.write(tool, "")
        os.chmod(fr.p(tool), 0o755)
    kernel.handlers["nvidia-smi"] = lambda argv: (0, "00000000:41:00.0, NVIDIA H200, 9.0, 143771, 580.65.06\n")
    fr.add_nvme(SYS_NVME, ctrl="nvme0", namespaces=("nvme0n1",), group="1")
    fr.add_partition("nvme0n1", "nvme0n1p1")
    fr.add_mount("/dev/nvme0n1p1", "/")
    fr.add_nvme(SPARE, ctrl="nvme1", namespaces=("nvme1n1",), size_mb=64, group="2", width=4, speed="16.0 GT/s PCIe")
    fr.write("/sys/kernel/mm/hugepages/hugepages-2048kB/nr_hugepages", "1024")
    fr.write("/sys/kernel/mm/hugepages/hugepages-2048kB/free_hugepages", "1000")
    fr.write("/etc/default/grub", 'GRUB_CMDLINE_LINUX_DEFAULT="quiet intel_iommu=on iommu=pt"\n')
    fr.write("/sys/firmware/efi/efivars/SecureBoot-8be4df61-93ca-11d2-aa0d-e0c93b0c0aad", b"\x06\x00\x00\x00\x01")
    fr.write("/lib/modules/6.12.9-amd64/modules.dep", "kernel/drivers/vfio/pci/vfio-pci.ko.xz: kernel/drivers/vfio/vfio.ko.xz\n")
    fr.write("/usr/src/nvidia-580.65.06/nvidia/os-mlock.c", "/* unknown */\n")
    fr.write("/usr/src/nvidia-580.65.06/nvidia/nv.c", 'MODULE_LICENSE("Dual MIT/GPL");\n')
    fr.p("/var/lib/dkms/nvidia/580.65.06").mkdir(parents=True)
    return fr


def findings(doc, area):
    return [f for f in doc["findings"] if f["area"] == area]


def test_check_json_schema_and_facts(cli, rig):
    r = cli("check", "--json")
    assert r.exit_code == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["schema"] == SCHEMA and doc["enumeration"] == "sysfs"
    assert set(doc) == {"schema", "root", "enumeration", "facts", "findings", "recommendation"}
    assert set(doc["facts"]) == {"kernel", "user", "cpu", "iommu", "vfio", "hugepages", "memory", "gpus",
                                 "nvidia_driver", "cuda", "dkms", "nvme", "grub", "secure_boot"}
    for f in doc["findings"]:
        assert set(f) == {"level", "area", "message", "fix"} and f["level"] in LEVELS
        assert f["level"] == "ok" or f["fix"], f

    facts = doc["facts"]
    assert facts["kernel"]["release"] == "6.12.9-amd64" and facts["cpu"]["vendor"] == "intel"
    assert facts["iommu"] == {"cmdline": ["intel_iommu=on", "iommu=pt"], "groups": 3, "units": ["dmar0"], "enabled": True}
    assert facts["vfio"]["vfio_pci_available"] is True
    [gpu] = facts["gpus"]
    assert gpu["model"] == "NVIDIA H200" and gpu["compute_capability"] == "9.0" and gpu["vram_bytes"] == 143771 * MiB
    assert gpu["link"]["degraded"] and gpu["link"]["gbps"] == 15.76 and gpu["link"]["max_gbps"] == 63.01
    assert facts["nvidia_driver"] == {"loaded": True, "version": "580.65.06", "flavor": "open"}
    assert facts["cuda"]["libcuda"] == "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
    nv = {n["bdf"]: n for n in facts["nvme"]}
    assert [r["code"] for r in nv[SYS_NVME]["refusals"]] == ["boot-disk"]
    assert nv[SPARE]["refusals"] == [] and nv[SPARE]["controller"] == "nvme1" and nv[SPARE]["serial"] == "FAKE-nvme1"
    assert nv[SPARE]["namespaces"] == [{"name": "nvme1n1", "size_bytes": 64 * MiB, "lba_bytes": 512, "partitions": []}]
    assert facts["hugepages"] == [{"size_kb": 2048, "total": 1024, "free": 1000}]
    assert facts["secure_boot"] == "enabled"
    assert facts["grub"]["GRUB_CMDLINE_LINUX_DEFAULT"] == "quiet intel_iommu=on iommu=pt"

    rec = doc["recommendation"]
    assert rec["nvme"] == SPARE
    b = rec["budgets"]
    assert b == {"vram_bytes": int(143771 * MiB * 0.9), "pinned_ram_bytes": int(24000000 * 1024 * 0.75),
                 "storage_bytes": 64 * MiB, "reader": "vfio", "h2d_gbps": 15.76, "nvme_gbps": 7.88}
    levels = {f["area"]: f["level"] for f in doc["findings"]}
    assert levels["iommu"] == "ok" and levels["secure-boot"] == "warn" and levels["dkms"] == "warn"
    assert any(f"{GPU} link runs at 8.0 GT/s x16, below its 32.0 GT/s x16" in f["message"] for f in findings(doc, "gpu"))


def test_check_text_and_no_safe_nvme(cli, rig):
    rig.dev_write("nvme1n1", b"XFSB")
    r = cli("check")
    assert r.exit_code == 0
    assert "no NVMe is safe to dedicate" in r.stdout and "--force" in r.stdout
    assert "FAIL" not in r.stdout and "tier budgets:" in r.stdout


def test_check_iommu_off_and_non_root(cli, fr):
    fr.add_nvme(group=None)
    cli.euid = 1000
    doc = json.loads(cli("check", "--json").stdout)
    assert findings(doc, "iommu")[0]["level"] == "warn" and "grub enable-iommu" in findings(doc, "iommu")[0]["fix"]
    assert findings(doc, "user")[0]["level"] == "warn"
    assert doc["recommendation"]["nvme"] is None
    assert "IOMMU is off" in doc["recommendation"]["fix"] and "--noiommu" in doc["recommendation"]["fix"]


def test_report_is_self_contained_and_escaped(cli, rig, tmp_path):
    rig.write(f"/sys/devices/pci0000:00/{SPARE}/nvme/nvme1/model", "<script>alert(1)</script>")
    r = cli("report", "--out", str(tmp_path / "rep"), "--json")
    assert r.exit_code == 0, r.stderr
    paths = json.loads(r.stdout)
    doc = json.loads(open(paths["json"]).read())
    assert doc["schema"] == SCHEMA
    html = open(paths["html"]).read()
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    for remote in ("src=", "href=", "@import", "url("):
        assert remote not in html
    assert html.count("<svg") == 2 and "NVIDIA H200" in html and "memory tiers" in html
    assert "dedicate NVMe 0000:02:00.0" in html
