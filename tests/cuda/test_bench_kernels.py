"""native/cuda/read_ceiling.cu (scripts/bench_cuda.py read_ceiling_table: the streaming-read
ceiling the decode matvecs are measured against) builds warning-free for sm_80 and sm_90 with
every layout the benchmark launches; no GPU needed."""

from __future__ import annotations

import pytest

from ntx_engine.backends import cuda_nvrtc


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_read_ceiling_kernels_build(arch):
    cubin, log = cuda_nvrtc.compile_cubin("read_ceiling.cu", arch)
    assert "warning" not in log.lower(), log
    for u in (1, 2, 4, 8):
        for layout in ("rows", "flat"):
            assert f"read_{layout}_u{u}\0".encode() in cubin, f"read_{layout}_u{u} missing from the {arch} cubin"
