"""`ntx-io stage` / `verify` on image files and loop devices, and every guard of stage.

Oracles: hashlib over the model file, the raw bytes of the target, gguf-py's own tensor
offsets, and the kernel (mount, mkfs) for the real-root guards.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ntx_common.errors import NtxIOError
from ntx_io.image import DATA_ALIGN, read_header
from ntx_io.reader import open_reader
from ntx_io.stage import apply_stage, plan_stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "setup"))
from fakeroot import FakeRoot  # noqa: E402  (the setup tests' fake machine: same guards, same trees)


def sha(path: Path, offset: int = 0, length: int | None = None) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return hashlib.sha256(f.read() if length is None else f.read(length)).hexdigest()


@pytest.fixture
def image(smollm, tmp_path, cli):
    img = tmp_path / "disk.img"
    tail = os.urandom(1 << 20)
    with open(img, "wb") as f:
        f.seek(159 << 20)
        f.write(tail)  # the last MiB: must survive staging untouched
    result, doc = cli.json("stage", smollm, "--device", img, "--yes")
    assert result.exit_code == 0, result.output
    return img, doc, tail


def test_stage_file_writes_model_at_the_header_offset(smollm, image):
    img, doc, tail = image
    size = smollm.stat().st_size
    assert doc["applied"] and doc["kind"] == "file"
    h = doc["header"]
    assert h["data_offset"] == DATA_ALIGN and h["source_size"] == size and h["source_name"] == smollm.name
    assert h["sha256"] == sha(smollm)
    assert sha(img, DATA_ALIGN, size) == sha(smollm)
    assert img.stat().st_size == 160 << 20
    with open(img, "rb") as f:
        f.seek(159 << 20)
        assert f.read() == tail


@pytest.fixture(scope="session")
def gguf_tensors(smollm):
    from gguf import GGUFReader  # gguf-py, llama.cpp's reference reader: the oracle

    reader = GGUFReader(smollm)
    picks = [reader.tensors[0], reader.tensors[len(reader.tensors) // 2], reader.tensors[-1]]
    return [(t.name, int(t.data_offset), int(t.n_bytes), t.data.tobytes()) for t in picks]


def test_tensors_are_found_on_the_image_from_its_header_alone(image, gguf_tensors):
    img, _, _ = image
    for kind in ("direct", "mmap"):
        with open_reader(img, kind)[0] as reader:
            header = read_header(reader)
            for name, offset, n, expected in gguf_tensors:
                dest = bytearray(n)
                reader.read_into(header.data_offset + offset, n, dest)
                assert dest == expected, name


def test_verify_sampled_and_full_pass(smollm, image, cli):
    img, _, _ = image
    for extra in ([], ["--full"], ["--reader", "mmap", "--samples", "8"]):
        result, doc = cli.json("verify", smollm, "--device", img, *extra)
        assert result.exit_code == 0, result.output
        assert doc["ok"] and doc["mismatches"] == [] and doc["problems"] == []
    assert doc["reader"] == "mmap" and doc["ranges"] == 8
    result = cli("verify", "--device", img, "--full")  # no model: header hash only
    assert result.exit_code == 0 and "OK" in result.stdout


def test_verify_finds_a_corrupt_byte_and_names_the_range(smollm, image, cli):
    img, _, _ = image
    with open(img, "r+b") as f:
        f.seek(DATA_ALIGN + 1000)
        byte = f.read(1)
        f.seek(DATA_ALIGN + 1000)
        f.write(bytes([byte[0] ^ 0xFF]))
    result, doc = cli.json("verify", smollm, "--device", img)
    assert result.exit_code == 1 and not doc["ok"]
    assert doc["mismatches"][0] == [0, 1 << 20]  # the first MiB of the GGUF is always sampled
    assert "verification failed" in result.output
    result, doc = cli.json("verify", "--device", img, "--full")
    assert result.exit_code == 1 and "SHA-256 of the data on the device differs" in doc["problems"][0]


def test_verify_against_the_wrong_model(image, tmp_path, cli):
    img, _, _ = image
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + os.urandom(5000))
    result, doc = cli.json("verify", other, "--device", img)
    assert result.exit_code == 1 and "5004 bytes; the image holds" in doc["problems"][0]


def test_stage_needs_yes_without_a_tty_and_dry_run_writes_nothing(smollm, tmp_path, cli):
    img = tmp_path / "new.img"
    result = cli("stage", smollm, "--device", img)
    assert result.exit_code == 2 and "without --yes" in result.output and not img.exists()
    result, doc = cli.json("stage", smollm, "--device", img, "--dry-run")
    assert result.exit_code == 0 and not doc["applied"] and doc["kind"] == "new-file" and not img.exists()
    assert "will be created" in doc["overwrite"]


def test_stage_refuses_odd_targets(smollm, tmp_path, cli):
    result = cli("stage", smollm, "--device", tmp_path, "--yes")
    assert result.exit_code == 1 and "neither a block device nor a regular file" in result.output
    result = cli("stage", tmp_path / "missing.gguf", "--device", tmp_path / "x.img", "--yes")
    assert result.exit_code == 1 and "no such model file" in result.output


def test_stage_and_verify_on_a_loop_device(smollm, loop_device, cli):
    dev, backing = loop_device
    result, doc = cli.json("stage", smollm, "--device", dev, "--yes")
    assert result.exit_code == 0, result.output
    assert doc["kind"] == "block" and doc["refusals"] == []
    subprocess.run(["blockdev", "--flushbufs", str(dev)], capture_output=True)
    assert sha(backing, DATA_ALIGN, smollm.stat().st_size) == sha(smollm)
    for reader in ("direct", "mmap"):
        result, doc = cli.json("verify", smollm, "--device", dev, "--reader", reader, "--full")
        assert result.exit_code == 0 and doc["ok"], result.output


def test_mounted_loop_device_is_refused_and_untouched(smollm, loop_device, tmp_path, cli):
    dev, backing = loop_device
    subprocess.run(["mkfs.ext4", "-q", str(dev)], check=True, capture_output=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", str(dev), str(mnt)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a loop device here")
    try:
        before = sha(backing)
        result = cli("stage", smollm, "--device", dev, "--yes", "--force")
        assert result.exit_code == 1 and "refused (mounted)" in result.output and str(mnt) in result.output
        assert sha(backing) == before
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_signature_needs_force(smollm, loop_device, cli):
    dev, backing = loop_device
    subprocess.run(["mkfs.ext4", "-q", str(dev)], check=True, capture_output=True)
    before = sha(backing)
    result = cli("stage", smollm, "--device", dev, "--yes")
    assert result.exit_code == 1 and "refused (signature)" in result.output and "ext4" in result.output
    assert "--force overrides" in result.output and sha(backing) == before
    result, doc = cli.json("stage", smollm, "--device", dev, "--yes", "--force")
    assert result.exit_code == 0 and doc["applied"], result.output
    assert "ext4" in doc["overwrite"]  # the confirmation said what was there


# --- every guard, through the setup tests' fake machine: the fake sysfs says the real loop
# device is the boot disk / mounted / swap / held / open; stage must refuse and write nothing.

def _fake_machine(tmp_path, dev: Path) -> FakeRoot:
    fr = FakeRoot(tmp_path / "root")
    fr.add_nvme("0000:01:00.0", namespaces=(dev.name,), size_mb=160)
    return fr


CONDITIONS = {
    "boot-disk": lambda fr, n: fr.add_mount(f"/dev/{n}", "/"),
    "mounted": lambda fr, n: fr.add_mount(f"/dev/{n}", "/srv/data"),
    "swap": lambda fr, n: fr.add_swap(f"/dev/{n}"),
    "holder": lambda fr, n: fr.add_holder(n, "dm-0", dm_uuid="LVM-abc", dm_name="vg-data"),
    "open": lambda fr, n: fr.add_opener(4242, "postgres", n),
}


@pytest.mark.parametrize("code", sorted(CONDITIONS))
def test_every_guard_refuses_and_nothing_is_written(smollm, loop_device, tmp_path, code):
    dev, backing = loop_device
    fr = _fake_machine(tmp_path, dev)
    CONDITIONS[code](fr, dev.name)
    plan = plan_stage(smollm, dev, root=fr.base)
    assert code in [r.code for r in plan.refusals]
    before = sha(backing)
    for force in (False, True):
        assert plan.blocking(force)
        with pytest.raises(NtxIOError, match="refusing to stage"):
            apply_stage(plan, force=force)
    assert sha(backing) == before


def test_unknown_device_and_fake_signature(smollm, loop_device, tmp_path):
    dev, backing = loop_device
    empty = FakeRoot(tmp_path / "empty")
    assert [r.code for r in plan_stage(smollm, dev, root=empty.base).refusals] == ["not-found"]
    fr = _fake_machine(tmp_path, dev)
    fr.dev_write(dev.name, b"XFSB")
    plan = plan_stage(smollm, dev, root=fr.base)
    assert [r.code for r in plan.refusals] == ["signature"] and "xfs" in plan.overwrite
    with pytest.raises(NtxIOError, match="refusing"):
        apply_stage(plan)
    header = apply_stage(plan, force=True)
    subprocess.run(["blockdev", "--flushbufs", str(dev)], capture_output=True)
    assert header.sha256.hex() == sha(smollm) == sha(backing, header.data_offset, header.source_size)
