"""On a GPU machine: pinned + CUDA-registered buffers feed the GPU at full PCIe speed, and the
bytes a reader put there arrive unchanged.

The reference is CUDA's own page-locked memory (cuMemAllocHost) copied by cuMemcpyHtoD: a
`PinnedBuffer` registered with cuMemHostRegister must reach 90 % of it. Run on the lent H200:

    PYTHONPATH=. python -m pytest -m gpu tests/io/test_gpu_io.py -v
"""

from __future__ import annotations

import ctypes
import os

import pytest

from ntx_io import gpu
from ntx_io.buffers import PinnedBuffer
from ntx_io.direct import DirectReader

USABLE, WHY = gpu.cuda_status()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not USABLE, reason=f"no usable CUDA GPU: {WHY}")]

H2D_BYTES = 1 << 30


def test_registered_pinned_buffer_reaches_90_percent_of_cuda_pinned_h2d(record_measurement):
    with PinnedBuffer(H2D_BYTES) as buf:
        buf.register_cuda()
        assert buf.cuda_registered
        ours = gpu.h2d_gbps(buf.address, H2D_BYTES, repeats=10)
    reference = gpu.cuda_pinned_h2d_gbps(H2D_BYTES, repeats=10)
    record_measurement({"test": "h2d", "registered_gbps": round(ours, 2),
                        "cuda_pinned_gbps": round(reference, 2), "hugepages": buf.hugepages})
    assert ours >= 0.9 * reference, f"registered {ours:.1f} GB/s vs cudaMemcpy pinned {reference:.1f} GB/s"


def test_bytes_read_with_o_direct_reach_the_gpu_unchanged(tmp_path):
    """The same pinned bytes are the reader's target and the H2D source."""
    cu = gpu._driver()
    data = os.urandom(64 << 20) + os.urandom(12345)
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    n = len(data)
    ctx = gpu._Context(0)
    dev_ptr = gpu.check(cu.cuMemAlloc(n), "cuMemAlloc")
    try:
        with PinnedBuffer(n) as buf, DirectReader(str(path)) as reader:
            buf.register_cuda()
            reader.read_into(0, n, buf)
            gpu.check(cu.cuMemcpyHtoD(dev_ptr, buf.address, n), "cuMemcpyHtoD")
        back = bytearray(n)
        address = ctypes.addressof((ctypes.c_char * n).from_buffer(back))
        gpu.check(cu.cuMemcpyDtoH(address, dev_ptr, n), "cuMemcpyDtoH")
        assert back == data
    finally:
        gpu.check(cu.cuMemFree(dev_ptr), "cuMemFree")
        ctx.release()
