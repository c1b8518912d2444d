"""The VM harness against the guest's real sysfs, devices and exit statuses."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from .harness import NVME_SERIAL, REPO, GuestError, GuestResult, VmUnavailable, ensure_assets, make_disk, run_guest


def _fields(result: GuestResult) -> dict[str, str]:
    """Parse the `key=value` lines a guest command printed."""
    assert result.returncode == 0, f"guest command failed ({result.returncode}):\n{result.output}\n{result.console}"
    return dict(line.split("=", 1) for line in result.output.splitlines() if "=" in line)


DEVICE_FACTS = """
d=/sys/bus/pci/devices/$NTX_VM_BDF
echo driver=$(basename "$(readlink $d/driver)")
echo group=$(basename "$(readlink $d/iommu_group)")
echo vfio=$NTX_VM_VFIO
test -c "$NTX_VM_VFIO" && echo vfio_is_chardev=yes
echo iommus=$(ls /sys/class/iommu | wc -l)
echo noiommu_param=$(cat /sys/module/vfio/parameters/enable_unsafe_noiommu_mode 2>/dev/null)
"""


def test_iommu_mode_binds_the_nvme_to_vfio_pci_behind_the_viommu(nvme_disk: Path) -> None:
    facts = _fields(run_guest(DEVICE_FACTS, disk=nvme_disk, mode="iommu", timeout=120))
    assert facts["driver"] == "vfio-pci"
    assert facts["iommus"] == "1"  # the emulated VT-d unit (dmar0)
    assert facts["vfio"] == f"/dev/vfio/{facts['group']}"
    assert facts["vfio_is_chardev"] == "yes"


def test_noiommu_mode_exposes_the_noiommu_group(nvme_disk: Path, vm_noiommu_assets: Path) -> None:
    facts = _fields(run_guest(DEVICE_FACTS, disk=nvme_disk, mode="noiommu", timeout=120))
    assert facts["driver"] == "vfio-pci"
    assert facts["iommus"] == "0"
    assert facts["noiommu_param"] == "Y"
    assert facts["vfio"] == "/dev/vfio/noiommu-0"
    assert facts["vfio_is_chardev"] == "yes"


def test_unbound_nvme_reads_and_writes_the_backing_file_and_vfio_pci_can_be_modprobed(tmp_path: Path) -> None:
    disk = make_disk(tmp_path / "nvme.img", 16)
    head = os.urandom(1 << 20)
    with open(disk, "r+b") as f:
        f.write(head)
    command = """
d=/sys/bus/pci/devices/$NTX_VM_BDF
echo before=$(basename "$(readlink $d/driver)")
echo serial=$(cat /sys/class/nvme/nvme0/serial)
dd if=/dev/nvme0n1 of="$NTX_VM_OUT/head.bin" bs=1M count=1 iflag=direct 2>/dev/null
# buffered write, no fsync: reaching the host file relies on the init's sync before poweroff
dd if="$NTX_VM_OUT/head.bin" of=/dev/nvme0n1 bs=1M seek=2 count=1 2>/dev/null
modprobe vfio-pci && test -d /sys/bus/pci/drivers/vfio-pci && echo modprobe=ok
echo vfio_env=${NTX_VM_VFIO-unset}
"""
    result = run_guest(command, disk=disk, mode="iommu", bind_vfio=False, timeout=120, out_dir=tmp_path / "out")
    facts = _fields(result)
    assert facts["before"] == "nvme"
    assert facts["serial"].strip() == NVME_SERIAL
    assert facts["modprobe"] == "ok"
    assert facts["vfio_env"] == "unset"
    assert (result.out_dir / "head.bin").read_bytes() == head
    with open(disk, "rb") as f:
        f.seek(2 << 20)
        assert f.read(1 << 20) == head


def test_command_runs_in_the_repo_with_env_and_writes_to_the_out_dir(nvme_disk: Path, tmp_path: Path) -> None:
    command = """python -c 'import os, sys; print(f"cwd={os.getcwd()}"); print(f"exe={sys.prefix}")'
echo "tricky=$TRICKY"
echo "from the guest" > "$NTX_VM_OUT/note.txt"
"""
    tricky = "it's \"quoted\" $HOME"
    result = run_guest(command, disk=nvme_disk, mode="none", bind_vfio=False, timeout=120,
                       env={"TRICKY": tricky}, out_dir=tmp_path / "out")
    facts = _fields(result)
    assert facts["cwd"] == str(REPO)
    assert facts["exe"] == str(REPO / ".venv")
    assert facts["tricky"] == tricky
    assert (tmp_path / "out" / "note.txt").read_text() == "from the guest\n"


def test_nonzero_exit_status_and_both_streams_come_back(nvme_disk: Path) -> None:
    command = "echo to-stdout; echo to-stderr >&2; ls /sys/module/vfio >/dev/null 2>&1 && echo vfio-loaded; exit 7"
    result = run_guest(command, disk=nvme_disk, mode="none", bind_vfio=False, timeout=120)
    assert result.returncode == 7
    assert result.output.split() == ["to-stdout", "to-stderr"]  # mode none loads no vfio
    assert "Power down" in result.console


def test_a_hanging_guest_is_killed_at_the_timeout(nvme_disk: Path) -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:  # boot ~3 s, ~10 s on a host loaded by others
        run_guest("echo started; sleep 600", disk=nvme_disk, mode="none", bind_vfio=False, timeout=20)
    assert time.monotonic() - t0 < 30
    assert "started" in str(info.value)  # the command was running, not the boot stuck
    qemus = [p for p in psutil.Process().children(recursive=True) if "qemu" in p.name()]
    assert qemus == []


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"mode": "kvm"}, "mode must be one of"),
    ({"mode": "none"}, "cannot bind"),
    ({"mem_mb": 64}, "at least 256"),
    ({"env": {"NOT A NAME": "x"}}, "shell identifiers"),
])
def test_bad_arguments_are_refused_before_booting(nvme_disk: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_guest("true", disk=nvme_disk, **kwargs)


def test_a_disk_qemu_cannot_back_an_nvme_with_is_refused(tmp_path: Path) -> None:
    odd = tmp_path / "odd.img"
    odd.write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match="multiple of 512"):
        run_guest("true", disk=odd)


def test_qemu_refusing_to_start_is_a_guest_error_with_its_message(nvme_disk: Path) -> None:
    with pytest.raises(GuestError, match="(?s)without running the command.*qemu-system-x86_64"):
        run_guest("true", disk=nvme_disk, mem_mb=1 << 30, timeout=60)  # 1 PiB of guest RAM


def test_missing_assets_say_how_to_build_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NTX_VM_CACHE", str(tmp_path))
    with pytest.raises(VmUnavailable, match="make vm-assets"):
        ensure_assets()
