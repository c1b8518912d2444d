"""Pinned buffers: shared bytes, lifetime rules, and the errors for missing hugepages/memlock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ntx_common.errors import CudaError, NtxIOError
from ntx_io import gpu
from ntx_io.buffers import HUGE_PAGE, PAGE, PinnedBuffer, hugepages_free


def test_view_and_numpy_are_the_same_bytes():
    with PinnedBuffer(10_000, hugepages=False) as buf:
        assert buf.address % PAGE == 0 and buf.capacity == 3 * PAGE and len(buf) == 10_000
        arr = buf.numpy()
        arr[:5] = [1, 2, 3, 4, 5]
        with buf.view() as view:
            assert bytes(view[:5]) == b"\x01\x02\x03\x04\x05" and len(view) == 10_000
            view[9_999] = 7
        assert arr[9_999] == 7
        del arr


def test_close_refuses_while_views_live_then_frees():
    buf = PinnedBuffer(PAGE, hugepages=False)
    view = buf.view()
    with pytest.raises(NtxIOError, match="live views"):
        buf.close()
    assert not buf.closed
    view.release()
    buf.close()
    buf.close()  # idempotent
    assert buf.closed
    with pytest.raises(NtxIOError, match="closed"):
        buf.view()
    with pytest.raises(NtxIOError, match="closed"):
        buf.numpy()


def test_sizes_are_validated():
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="positive int"):
            PinnedBuffer(bad)


def test_hugepages_required_but_not_reserved_is_a_clear_error():
    if hugepages_free() > 0:
        with PinnedBuffer(HUGE_PAGE, hugepages=True) as buf:
            assert buf.hugepages and buf.capacity == HUGE_PAGE
        return
    with pytest.raises(NtxIOError, match=r"hugepages \(0 free.*nr_hugepages"):
        PinnedBuffer(HUGE_PAGE, hugepages=True)
    with PinnedBuffer(HUGE_PAGE) as buf:  # auto: falls back to locked 4 KiB pages
        assert not buf.hugepages


def test_rlimit_memlock_error_names_the_limit_and_the_fix():
    """Without CAP_IPC_LOCK and with a 64 KiB memlock limit, locking 8 MiB must fail clearly."""
    code = ("from ntx_io.buffers import PinnedBuffer\n"
            "try:\n    PinnedBuffer(8 << 20, hugepages=False)\nexcept Exception as e:\n    print(type(e).__name__, e)\n"
            "else:\n    print('locked')\n")
    cmd = ["prlimit", "--memlock=65536:65536", "setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock",
           sys.executable, "-c", code]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        pytest.skip("prlimit/setpriv (util-linux) not installed")
    if run.returncode != 0:
        pytest.skip(f"cannot drop CAP_IPC_LOCK here: {run.stderr.strip()[-200:]}")
    assert run.stdout.startswith("NtxIOError"), run.stdout + run.stderr
    assert "RLIMIT_MEMLOCK is 64 KiB" in run.stdout and "ulimit -l" in run.stdout


def test_cuda_absent_is_reported_not_crashed():
    usable, why = gpu.cuda_status()
    if usable:
        pytest.skip("a CUDA driver is present: tests/io/test_gpu_io.py covers it")
    assert why
    with PinnedBuffer(PAGE, hugepages=False) as buf:
        with pytest.raises(CudaError):
            buf.register_cuda()
        assert not buf.cuda_registered
