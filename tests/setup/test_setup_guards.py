"""Every refusal of the bind/stage guards, on fake trees; and the signature probe against blkid."""

import shutil
import subprocess

import pytest

from ntx_setup.guards import Refusal, block_device_refusals, controller_refusals
from ntx_setup.signatures import probe


def codes(refusals):
    return sorted(r.code for r in refusals)


def test_clean_controller_has_no_refusals(fr):
    fr.add_nvme("0000:01:00.0")
    assert controller_refusals("0000:01:00.0", fr.base) == []
    assert controller_refusals("01:00.0", fr.base) == []          # short form accepted
    assert block_device_refusals("/dev/nvme0n1", fr.base) == []


def test_not_nvme_and_missing(fr):
    fr.add_pci("0000:02:00.0", vendor=0x8086, device=0x1533, class_code=0x020000, driver="igb", group="2")
    [r] = controller_refusals("0000:02:00.0", fr.base)
    assert r.code == "not-nvme" and "0x020000" in r.message
    assert codes(controller_refusals("0000:09:00.0", fr.base)) == ["not-found"]
    assert codes(controller_refusals("nonsense", fr.base)) == ["not-found"]
    assert codes(block_device_refusals("nvme7n1", fr.base)) == ["not-found"]


@pytest.mark.parametrize("mountpoint,code", [("/", "boot-disk"), ("/boot", "boot-disk"), ("/boot/efi", "boot-disk"),
                                             ("/data", "mounted")])
def test_mounted_partition(fr, mountpoint, code):
    fr.add_nvme()
    fr.add_partition("nvme0n1", "nvme0n1p1")
    fr.add_mount("/dev/nvme0n1p1", mountpoint)
    found = controller_refusals("0000:01:00.0", fr.base)
    assert codes(found) == [code]
    assert mountpoint in found[0].message and "nvme0n1p1" in found[0].message
    assert not found[0].overridable


def test_mount_found_by_device_number_when_name_lies(fr):
    fr.add_nvme()
    devnum = fr.read("/sys/class/block/nvme0n1/dev")
    fr.add_mountinfo(devnum, "/", source="/dev/root")
    assert codes(block_device_refusals("nvme0n1", fr.base)) == ["boot-disk"]


def test_swap_and_open(fr):
    fr.add_nvme()
    fr.add_partition("nvme0n1", "nvme0n1p2")
    fr.add_swap("/dev/nvme0n1p2")
    fr.add_opener(4242, "dd", "nvme0n1")
    found = block_device_refusals("nvme0n1", fr.base)
    assert codes(found) == ["open", "swap"]
    assert any("4242 (dd)" in r.message for r in found)


@pytest.mark.parametrize("uuid,holder,kind", [("LVM-abc", "dm-0", "LVM"), ("CRYPT-LUKS2-x", "dm-1", "LUKS"),
                                              ("", "md127", "md RAID")])
def test_holders(fr, uuid, holder, kind):
    fr.add_nvme()
    fr.add_holder("nvme0n1", holder, dm_uuid=uuid, dm_name="vg-root")
    [r] = block_device_refusals("nvme0n1", fr.base)
    assert r.code == "holder" and kind in r.message and holder in r.message


def test_root_on_lvm_is_boot_disk(fr):
    fr.add_nvme()
    fr.add_partition("nvme0n1", "nvme0n1p3")
    fr.add_holder("nvme0n1p3", "dm-0", dm_uuid="LVM-xyz", dm_name="vg-root")
    fr.add_mount("/dev/mapper/vg-root", "/")
    assert codes(block_device_refusals("nvme0n1", fr.base)) == ["boot-disk", "holder"]


def test_signature_is_the_only_overridable_refusal(fr):
    fr.add_nvme()
    fr.dev_write("nvme0n1", b"XFSB")
    [r] = block_device_refusals("nvme0n1", fr.base)
    assert r.code == "signature" and r.overridable and "xfs" in r.message
    with pytest.raises(ValueError):
        Refusal("mounted", "m", "f", True)
    with pytest.raises(ValueError):
        Refusal("bogus", "m", "f", False)


def test_iommu_group_with_gpu_is_refused(fr):
    fr.add_nvme(group="5")
    fr.add_pci("0000:01:00.1", vendor=0x10DE, device=0x2335, class_code=0x030200, driver="nvidia", group="5")
    fr.add_pci("0000:00:01.0", vendor=0x8086, device=0x1234, class_code=0x060400, driver="pcieport", group="5")
    fr.add_pci("0000:01:00.2", vendor=0x8086, device=0x1235, class_code=0x0c0330, driver=None, group="5")
    [r] = controller_refusals("0000:01:00.0", fr.base)
    assert r.code == "iommu-group" and "the GPU 0000:01:00.1" in r.message and "nvidia" in r.message


def test_group_member_on_vfio_is_fine(fr):
    fr.add_nvme(group="5")
    fr.add_pci("0000:01:00.1", vendor=0x1B36, device=0x0010, class_code=0x010802, driver="vfio-pci", group="5")
    assert controller_refusals("0000:01:00.0", fr.base) == []


def test_no_iommu_refused(fr):
    fr.add_nvme(group=None)
    [r] = controller_refusals("0000:01:00.0", fr.base)
    assert r.code == "noiommu" and "--noiommu" in r.fix


def test_multipath_namespace_belongs_to_controller(fr):
    """Native NVMe multipath: the namespace's parent is the subsystem, not the controller."""
    fr.add_nvme(namespaces=())
    fr.add_pci("0000:01:00.0", vendor=0x1B36, device=0x0010, class_code=0x010802, driver="nvme", group="1")
    fr.write("/sys/devices/pci0000:00/0000:01:00.0/nvme/nvme0/model", "x")
    sub = "/sys/devices/virtual/nvme-subsystem/nvme-subsys0"
    fr.link("/sys/class/nvme-subsystem/nvme-subsys0", sub)
    fr.link(f"{sub}/nvme0", "/sys/devices/pci0000:00/0000:01:00.0/nvme/nvme0")
    fr.write(f"{sub}/nvme0n1/size", "2048")
    fr.write(f"{sub}/nvme0n1/dev", "259:9")
    fr.link(f"{sub}/nvme0n1/device", sub)
    fr.link("/sys/class/block/nvme0n1", f"{sub}/nvme0n1")
    fr.write("/dev/nvme0n1", b"")
    fr.add_mount("/dev/nvme0n1", "/srv")
    assert codes(controller_refusals("0000:01:00.0", fr.base)) == ["mounted"]


# --- signature probe: blkid (util-linux) is the oracle -----------------------------------------

def _blkid(path):
    out = subprocess.run(["blkid", "-p", "-o", "export", str(path)], capture_output=True, text=True).stdout
    kv = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return {v for k, v in kv.items() if k in ("TYPE", "PTTYPE")}


def _image(tmp_path, size_mb=16):
    img = tmp_path / "disk.img"
    with open(img, "wb") as f:
        f.truncate(size_mb << 20)
    return img


needs_blkid = pytest.mark.skipif(shutil.which("blkid") is None, reason="blkid (util-linux) not installed")


@needs_blkid
@pytest.mark.parametrize("tool", [["mkfs.ext4", "-q", "-F"], ["mkswap"], ["busybox", "mkdosfs"]])
def test_probe_agrees_with_blkid_on_real_filesystems(tmp_path, tool):
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} not installed")
    if tool[0] == "busybox" and tool[1] not in subprocess.run(["busybox", "--list"], capture_output=True,
                                                              text=True).stdout.split():
        pytest.skip(f"this busybox has no {tool[1]} applet")
    img = _image(tmp_path)
    subprocess.run(tool + [str(img)], check=True, capture_output=True)
    expected = _blkid(img)
    assert expected, "blkid found nothing: the oracle itself failed"
    assert set(probe(img)) == expected


@needs_blkid
def test_probe_agrees_with_blkid_on_mbr_and_blank(tmp_path):
    img = _image(tmp_path)
    assert probe(img) == [] and _blkid(img) == set()
    mbr = bytearray(512)
    mbr[446:462] = bytes([0x00, 0, 2, 0, 0x83, 0, 0, 0]) + (2048).to_bytes(4, "little") + (4096).to_bytes(4, "little")
    mbr[510:512] = b"\x55\xaa"
    with open(img, "r+b") as f:
        f.write(mbr)
    assert _blkid(img) == {"dos"}
    assert probe(img) == ["dos"]
