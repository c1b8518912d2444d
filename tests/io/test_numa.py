"""ntx_io.numa: node lists, the NTX_NUMA setting, and the memory policy the kernel really
applied to a buffer (read back with get_mempolicy, the independent oracle)."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_common.errors import NtxIOError
from ntx_io import numa
from ntx_io.buffers import PinnedBuffer


def test_parse_nodelist():
    assert numa.parse_nodelist("0\n") == [0]
    assert numa.parse_nodelist("0-1,3") == [0, 1, 3]
    assert numa.parse_nodelist("0-3,8-9") == [0, 1, 2, 3, 8, 9]


def test_online_nodes_from_sysfs(tmp_path):
    (tmp_path / "online").write_text("0-1\n")
    assert numa.online_nodes(str(tmp_path)) == [0, 1]
    assert numa.online_nodes(str(tmp_path / "missing")) == [0]
    assert numa.online_nodes() == numa.parse_nodelist(open("/sys/devices/system/node/online").read())


def test_placement_setting(monkeypatch):
    monkeypatch.setattr(numa, "online_nodes", lambda: [0])
    assert numa.placement_nodes("auto") is None and numa.placement_nodes("off") is None
    assert numa.placement_nodes("interleave") == [0]
    monkeypatch.setattr(numa, "online_nodes", lambda: [0, 1])
    assert numa.placement_nodes("auto") == [0, 1] and numa.placement_nodes("off") is None
    monkeypatch.setenv("NTX_NUMA", "sometimes")
    with pytest.raises(NtxIOError, match="NTX_NUMA='sometimes'"):
        numa.placement_nodes()


@pytest.mark.parametrize("lock", [True, False])
def test_pinned_buffer_pages_are_interleaved(lock):
    nodes = numa.online_nodes()
    buf = PinnedBuffer(3 << 20, hugepages=False, lock=lock, numa_nodes=nodes)
    try:
        for off in (0, 1 << 20, (3 << 20) - 1):
            assert numa.policy_of(buf.address + off) == (numa.MPOL_INTERLEAVE, nodes)
        a = buf.numpy()
        assert not a.any()  # touched, zero-filled pages
        a[:] = 7
        assert int(a.sum(dtype=np.int64)) == 7 * (3 << 20)
        del a
    finally:
        buf.close()
    plain = PinnedBuffer(1 << 20, hugepages=False)
    try:
        assert numa.policy_of(plain.address)[0] != numa.MPOL_INTERLEAVE
    finally:
        plain.close()


def test_numpy_host_buffer_interleaved_where_whole_pages():
    from ntx_engine.backends.host_memory import host_buffer

    arr = host_buffer(8 << 20, cuda=False, numa_nodes=numa.online_nodes())
    assert isinstance(arr, np.ndarray) and arr.nbytes == 8 << 20
    inner = -(-arr.ctypes.data // numa.PAGE) * numa.PAGE
    assert numa.policy_of(inner)[0] == numa.MPOL_INTERLEAVE
    assert numa.interleave(inner + 1, 100, [0]) == 0  # no whole page inside: nothing to do


def test_interleave_over_a_node_that_is_not_there_names_the_fix():
    buf = PinnedBuffer(1 << 20, hugepages=False, lock=False)
    try:
        with pytest.raises(NtxIOError, match=r"nodes \[1000\].*NTX_NUMA=off"):
            numa.interleave(buf.address, 1 << 20, [1000])
        with pytest.raises(NtxIOError, match="out of range"):
            numa.interleave(buf.address, 1 << 20, [5000])
    finally:
        buf.close()
