"""`ntx-setup` against a real kernel: check, bind to vfio-pci, restore to nvme, and the mount guard.

The oracles are the guest kernel's own sysfs (driver links, power_state, config space), the
/dev nodes it creates, and the bytes of the host file behind the emulated NVMe.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from .harness import NVME_SERIAL, GuestResult, make_disk, run_guest

# The host's / is read-only in the guest; the journal lives in /var/lib/ntx, so give it a tmpfs.
PRELUDE = """
mount -t tmpfs ntxstate /var/lib || exit 99
D=/sys/bus/pci/devices/$NTX_VM_BDF
drv() { basename "$(readlink $D/driver)"; }
"""


def _fields(result: GuestResult) -> dict[str, str]:
    assert result.returncode == 0, f"guest command failed ({result.returncode}):\n{result.output}\n{result.console[-3000:]}"
    return dict(line.split("=", 1) for line in result.output.splitlines() if "=" in line and " " not in line.split("=")[0])


def _json(out: Path, name: str) -> dict:
    return json.loads((out / name).read_text())


def test_check_bind_restore_on_a_real_kernel(tmp_path: Path) -> None:
    disk = make_disk(tmp_path / "nvme.img", 64)
    payload = os.urandom(1 << 20)
    with open(disk, "r+b") as f:   # past the first 72 KiB that the signature probe reads
        f.seek(1 << 20)
        f.write(payload)
    command = PRELUDE + """
ntx-setup check --json > $NTX_VM_OUT/check.json; echo check_rc=$?
ntx-setup bind $NTX_VM_BDF --yes --json > $NTX_VM_OUT/bind.json 2> $NTX_VM_OUT/bind.err; echo bind_rc=$?
echo bound_driver=$(drv)
echo bound_power=$(cat $D/power_state)
echo bound_command=$(od -An -tx2 -j4 -N2 $D/config | tr -d ' ')
echo bound_group=$(basename "$(readlink $D/iommu_group)")
echo vfio_nodes=$(ls /dev/vfio | tr '\\n' ,)
test -e /dev/nvme0n1 && echo bound_blockdev=present || echo bound_blockdev=absent
ntx-setup bind $NTX_VM_BDF --yes --json > $NTX_VM_OUT/bind2.json; echo bind2_rc=$?
ntx-setup status --json > $NTX_VM_OUT/status.json; echo status_rc=$?
ntx-setup restore $NTX_VM_BDF --yes --json > $NTX_VM_OUT/restore.json 2> $NTX_VM_OUT/restore.err; echo restore_rc=$?
echo restored_driver=$(drv)
echo restored_override=$(cat $D/driver_override)
dd if=/dev/nvme0n1 of=$NTX_VM_OUT/back.bin bs=1M skip=1 count=1 iflag=direct 2>/dev/null; echo dd_rc=$?
ntx-setup restore --all --yes --json > $NTX_VM_OUT/restore2.json; echo restore2_rc=$?
"""
    result = run_guest(command, disk=disk, mode="iommu", bind_vfio=False, timeout=400)
    got, out = _fields(result), result.out_dir
    for step in ("check", "bind", "bind2", "status", "restore", "restore2", "dd"):
        assert got[f"{step}_rc"] == "0", (step, result.output, _read(out, "bind.err"), _read(out, "restore.err"))

    check = _json(out, "check.json")
    bdf = check["recommendation"]["nvme"]
    [nvme] = [n for n in check["facts"]["nvme"] if n["bdf"] == bdf]
    assert nvme["driver"] == "nvme" and nvme["serial"] == NVME_SERIAL and nvme["refusals"] == []
    assert nvme["namespaces"][0]["size_bytes"] == 64 << 20 and nvme["namespaces"][0]["lba_bytes"] == 512
    assert check["facts"]["iommu"]["enabled"] and check["enumeration"] == "pyudev"

    assert got["bound_driver"] == "vfio-pci" and got["bound_blockdev"] == "absent"
    assert got["bound_power"] == "D0"
    assert int(got["bound_command"], 16) & 0x6 == 0x6          # memory space + bus master, read back by od
    assert f"{got['bound_group']}," in got["vfio_nodes"]
    bind = _json(out, "bind.json")
    assert bind["entry"]["before"]["driver"] == "nvme" and bind["entry"]["after"]["vfio"] == f"/dev/vfio/{got['bound_group']}"
    assert _json(out, "bind2.json")["plan"]["noop"] is True      # second bind changes nothing
    [change] = _json(out, "status.json")["changes"]
    assert change["live"].startswith("driver vfio-pci")

    assert got["restored_driver"] == "nvme" and got["restored_override"] == "(null)"
    assert (out / "back.bin").read_bytes() == payload           # the namespace is back, with its data
    assert _json(out, "restore2.json")["restored"] == []        # second restore finds nothing to do


def test_bind_refuses_a_namespace_with_a_mounted_filesystem(tmp_path: Path) -> None:
    disk = make_disk(tmp_path / "ext4.img", 64)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(disk)], check=True)
    command = PRELUDE + """
mkdir -p /tmp/m && mount /dev/nvme0n1 /tmp/m && echo mounted=yes
ntx-setup bind $NTX_VM_BDF --yes --force > $NTX_VM_OUT/bind.out 2> $NTX_VM_OUT/bind.err; echo bind_rc=$?
echo driver_while_mounted=$(drv)
umount /tmp/m
ntx-setup bind $NTX_VM_BDF --yes > /dev/null 2> $NTX_VM_OUT/bind2.err; echo bind2_rc=$?
echo driver_after=$(drv)
"""
    result = run_guest(command, disk=disk, mode="iommu", bind_vfio=False, timeout=300)
    got, out = _fields(result), result.out_dir
    assert got["mounted"] == "yes"
    assert got["bind_rc"] == "1" and got["driver_while_mounted"] == "nvme"
    err = _read(out, "bind.err")
    assert "refused (mounted): /dev/nvme0n1 is mounted at /tmp/m" in err, err
    # unmounted, the ext4 superblock is still there: refused as a signature (overridable)
    assert got["bind2_rc"] == "1" and got["driver_after"] == "nvme"
    assert "refused (signature)" in _read(out, "bind2.err") and "ext4" in _read(out, "bind2.err")


def test_noiommu_bind_and_restore(tmp_path: Path, vm_noiommu_assets: Path) -> None:
    """No vIOMMU; vfio.ko rebuilt with CONFIG_VFIO_NOIOMMU is loaded with the unsafe mode on."""
    disk = make_disk(tmp_path / "nvme.img", 16)
    command = PRELUDE + """
ntx-setup bind $NTX_VM_BDF --yes 2> $NTX_VM_OUT/refused.err; echo plain_rc=$?
ntx-setup bind $NTX_VM_BDF --yes --noiommu --json > $NTX_VM_OUT/bind.json 2> $NTX_VM_OUT/bind.err; echo bind_rc=$?
echo bound_driver=$(drv)
echo vfio_nodes=$(ls /dev/vfio | tr '\\n' ,)
ntx-setup restore --all --yes 2> $NTX_VM_OUT/restore.err; echo restore_rc=$?
echo restored_driver=$(drv)
test -b /dev/nvme0n1 && echo blockdev=back
"""
    result = run_guest(command, disk=disk, mode="noiommu", bind_vfio=False, timeout=300)
    got, out = _fields(result), result.out_dir
    assert got["plain_rc"] == "1" and "refused (noiommu)" in _read(out, "refused.err")
    assert got["bind_rc"] == "0", _read(out, "bind.err")
    assert got["bound_driver"] == "vfio-pci"
    vfio = _json(out, "bind.json")["entry"]["after"]["vfio"]
    assert vfio.startswith("/dev/vfio/noiommu-") and f"{vfio.rsplit('/', 1)[1]}," in got["vfio_nodes"]
    assert got["restore_rc"] == "0", _read(out, "restore.err")
    assert got["restored_driver"] == "nvme" and got["blockdev"] == "back"


def _read(out: Path, name: str) -> str:
    try:
        return (out / name).read_text()
    except FileNotFoundError:
        return ""

