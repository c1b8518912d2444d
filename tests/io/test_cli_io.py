"""`ntx-io bench` and `identify` on this host (no GPU, no device on vfio-pci)."""

from __future__ import annotations

import importlib.util

import pytest

from ntx_common.errors import NvmeError
from ntx_io import gpu
from ntx_io.bench import parse_size
from ntx_io.nvme import NvmeDevice, normalize_bdf


def test_help_lists_the_commands(cli):
    result = cli("--help")
    assert result.exit_code == 0
    for command in ("identify", "stage", "verify", "bench"):
        assert command in result.stdout


def test_bench_json_measures_both_kernel_readers_and_dd(tmp_path, cli):
    result, doc = cli.json("bench", "--size", "64M", "--chunk", "4M", "--dir", tmp_path)
    assert result.exit_code == 0, result.output
    assert [r["reader"] for r in doc["reads"]] == ["direct", "mmap"]
    for r in doc["reads"]:
        assert r["nbytes"] == 64 << 20 and r["gbps"] > 0 and r["chunk"] == 4 << 20
    assert set(doc["dd_direct_gbps"]) == {"1", "8"} and all(v > 0 for v in doc["dd_direct_gbps"].values())
    assert not list(tmp_path.iterdir()), "the scratch file must be removed"
    if not gpu.cuda_status()[0]:
        assert doc["h2d"]["available"] is False and doc["h2d"]["reason"]


def test_bench_on_a_given_file_with_one_reader(data_file, cli):
    path, data = data_file
    result, doc = cli.json("bench", path, "--reader", "direct", "--size", "1G", "--no-h2d",
                           "--compare-kvikio")
    assert result.exit_code == 0, result.output
    assert [r["reader"] for r in doc["reads"]] == ["direct"] and doc["nbytes"] == len(data)
    assert doc["h2d"] is None
    if importlib.util.find_spec("kvikio") is None:
        assert any("kvikio" in n for n in doc["notes"])


def test_bench_rejects_bad_sizes(cli):
    result = cli("bench", "--size", "lots")
    assert result.exit_code == 2 and "cannot read" in result.output
    assert parse_size("1.5G") == 3 << 29 and parse_size("512MiB") == 512 << 20 and parse_size("4096") == 4096


def test_bdf_forms():
    assert normalize_bdf("01:00.0") == "0000:01:00.0"
    assert normalize_bdf(" 0000:AB:1F.7 ") == "0000:ab:1f.7"
    with pytest.raises(NvmeError, match="not a PCI address"):
        normalize_bdf("0000:01:00")


def test_open_a_controller_that_is_not_on_vfio(cli):
    """On this host no NVMe is bound to vfio-pci: the driver says so and how to fix it."""
    with pytest.raises(NvmeError, match=r"0000:00:1f\.7 is not bound to vfio-pci .*ntx-setup bind") as exc:
        NvmeDevice.open("0000:00:1f.7")
    assert exc.value.errno == 19  # ENODEV, from the C driver
    result = cli("identify", "00:1f.7")
    assert result.exit_code == 1 and "error: cannot open NVMe 0000:00:1f.7" in result.output
