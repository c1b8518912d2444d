"""Partition-table and filesystem signatures in a disk's first and last bytes.

A small, dependency-free subset of what blkid probes, enough to tell "this namespace holds
somebody's data" before it is handed to vfio-pci. Offsets are the on-disk format's own.
"""

from __future__ import annotations

HEAD_BYTES = 0x12000   # 72 KiB: covers btrfs's superblock at 64 KiB + 64
TAIL_BYTES = 0x20000   # 128 KiB: md 0.90/1.0 superblocks and the backup GPT header live at the end

MD_MAGIC = (0xA92B4EFC).to_bytes(4, "little")


def _at(buf: bytes, offset: int, magic: bytes) -> bool:
    return buf[offset:offset + len(magic)] == magic


def _dos_partition_table(head: bytes) -> bool:
    if not _at(head, 510, b"\x55\xaa"):
        return False
    entries = [head[446 + 16 * i:462 + 16 * i] for i in range(4)]
    # A real MBR has boot flags of 0x00/0x80 and at least one non-empty partition type.
    return all(e[0] in (0x00, 0x80) for e in entries) and any(e[4] != 0 for e in entries)


def _boot_sector_fs(head: bytes) -> str | None:
    if _at(head, 3, b"NTFS    "):
        return "ntfs"
    if _at(head, 3, b"EXFAT   "):
        return "exfat"
    if _at(head, 510, b"\x55\xaa") and (_at(head, 54, b"FAT1") or _at(head, 82, b"FAT32")):
        return "vfat"
    return None


def _head_signatures(head: bytes) -> list[str]:
    found = []
    if _at(head, 512, b"EFI PART") or _at(head, 4096, b"EFI PART"):
        found.append("gpt")
    boot_fs = _boot_sector_fs(head)
    if boot_fs:
        found.append(boot_fs)
    elif _dos_partition_table(head) and "gpt" not in found:
        found.append("dos")
    checks = [
        (1080, b"\x53\xef", "ext4"),               # ext2/3/4: s_magic 0xEF53 at 1024 + 56
        (0, b"XFSB", "xfs"),
        (0x10040, b"_BHRfS_M", "btrfs"),
        (4086, b"SWAPSPACE2", "swap"),             # last 10 bytes of the first 4 KiB page
        (4086, b"SWAP-SPACE", "swap"),
        (0, b"LUKS\xba\xbe", "crypto_LUKS"),
        (0x8001, b"CD001", "iso9660"),
        (1024, (0xF2F52010).to_bytes(4, "little"), "f2fs"),
        (0, MD_MAGIC, "linux_raid_member"),         # md 1.1
        (4096, MD_MAGIC, "linux_raid_member"),      # md 1.2
    ]
    found += [name for off, magic, name in checks if _at(head, off, magic)]
    for sector in range(4):                        # LVM2 label in one of the first 4 sectors
        if _at(head, sector * 512, b"LABELONE") and _at(head, sector * 512 + 24, b"LVM2 001"):
            found.append("LVM2_member")
    return found


def _tail_signatures(tail: bytes, size: int) -> list[str]:
    found = []
    if size >= 512 and len(tail) >= 512 and _at(tail, len(tail) - 512, b"EFI PART"):
        found.append("gpt")
    # md 0.90 superblock: 64 KiB-aligned, in the last 64..128 KiB of the device.
    if size >= 0x20000:
        sb = (size & ~0xFFFF) - 0x10000
        offset_in_tail = sb - (size - len(tail))
        if 0 <= offset_in_tail and _at(tail, offset_in_tail, MD_MAGIC):
            found.append("linux_raid_member")
    return found


def detect(head: bytes, tail: bytes = b"", size: int = 0) -> list[str]:
    """Names (blkid's spelling) of the signatures found, without duplicates, in probe order."""
    names = _head_signatures(head) + _tail_signatures(tail, size)
    return list(dict.fromkeys(names))


def probe(path, size: int | None = None) -> list[str]:
    """Read a block device (or image file) and detect signatures; OSError when unreadable."""
    import os

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        total = size if size is not None else os.lseek(fd, 0, os.SEEK_END)
        head = os.pread(fd, HEAD_BYTES, 0)
        tail_len = min(TAIL_BYTES, total)
        tail = os.pread(fd, tail_len, total - tail_len) if total else b""
    finally:
        os.close(fd)
    return detect(head, tail, total)
