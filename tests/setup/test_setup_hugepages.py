"""`ntx-setup hugepages` and `memlock` on a fake machine."""

import json

import pytest

from ntx_setup.journal import Journal

POOL2M = "/sys/kernel/mm/hugepages/hugepages-2048kB"
POOL1G = "/sys/kernel/mm/hugepages/hugepages-1048576kB"


@pytest.fixture
def pools(fr):
    for d in (POOL2M, POOL1G, "/sys/devices/system/node/node1/hugepages/hugepages-2048kB"):
        fr.write(f"{d}/nr_hugepages", "0")
        fr.write(f"{d}/free_hugepages", "0")


def test_reserve_twice_and_release(cli, fr, kernel, pools):
    r = cli("hugepages", "512", "--yes")
    assert r.exit_code == 0, r.stderr
    assert fr.read(f"{POOL2M}/nr_hugepages") == "512"
    assert cli("hugepages", "512", "--yes").stdout.count("nothing to do") == 1
    assert len(Journal(fr.base).entries()) == 1 and len(kernel.writes) == 1
    assert cli("restore", "hugepages", "--yes").exit_code == 0
    assert fr.read(f"{POOL2M}/nr_hugepages") == "0"


def test_1g_and_node(cli, fr, pools):
    assert cli("hugepages", "2", "--size", "1G", "--yes").exit_code == 0
    assert fr.read(f"{POOL1G}/nr_hugepages") == "2"
    assert cli("hugepages", "8", "--node", "1", "--yes").exit_code == 0
    assert fr.read("/sys/devices/system/node/node1/hugepages/hugepages-2048kB/nr_hugepages") == "8"
    r = cli("hugepages", "8", "--node", "3", "--yes")
    assert r.exit_code == 1 and "node3" in r.stderr
    assert cli("hugepages", "8", "--size", "4M", "--yes").exit_code == 2


def test_short_allocation_rolls_back(cli, fr, kernel, pools):
    kernel.rewrite = lambda path, text: "100" if text.strip() == "512" else text   # fragmented memory
    r = cli("hugepages", "512", "--yes", "--json")
    assert r.exit_code == 1 and "reserved 100 of 512" in r.stderr and "at boot" in r.stderr
    assert fr.read(f"{POOL2M}/nr_hugepages") == "0"
    assert [e.state for e in Journal(fr.base).entries()] == ["rolled-back"]


def test_refuses_more_than_available_memory(cli, fr, pools):
    r = cli("hugepages", "22", "--size", "1G", "--yes")    # 24.6 GB MemAvailable in the fake meminfo
    assert r.exit_code == 1 and "MemAvailable" in r.stderr
    assert fr.read(f"{POOL1G}/nr_hugepages") == "0"


def test_memlock_guidance(cli, fr):
    doc = json.loads(cli("memlock", "--json").stdout)
    assert doc["soft"] == 8388608 and doc["suggested_kib"] == int(32768000 * 1024 * 0.75) // 1024
    text = cli("memlock").stdout
    assert "/etc/security/limits.d/90-ntx.conf" in text and "LimitMEMLOCK=infinity" in text
    assert "8192 KiB" in text
