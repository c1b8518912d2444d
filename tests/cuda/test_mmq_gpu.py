"""The tensor-core prefill matmul (mmq.cu, opt-in NTX_CUDA_MMQ=1) against the numpy backend (the
oracle) and the dp4a kernels: same function of the same int8 activations, only float32 rounding
and summation order differ. Odd row counts and token counts that leave partial 64 x 64 tiles;
the output is poisoned with NaN first, so a row or token left unwritten fails."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.cuda_driver import download, upload
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType

pytestmark = pytest.mark.gpu


def _rel(out, ref) -> float:
    assert np.isfinite(out).all(), f"{int((~np.isfinite(out)).sum())} outputs unwritten or not finite"
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("n", [9, 64, 100])
@pytest.mark.parametrize("rows,k", [(67, 4096), (130, 2304)])
@pytest.mark.parametrize("t", [GGMLType.Q4_K, GGMLType.Q8_0], ids=lambda t: t.name)
def test_mmq_matches_numpy_and_dp4a(cuda_backend, synth, t, rows, k, n):
    from ntx_engine.backends.cuda_backend import CudaBackend

    rng = np.random.default_rng(9000 + rows + n + int(t))
    raw = synth.random_blocks(t, rows * k, rng)
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
    ref = NumpyBackend().matmul(NumpyBackend().matrix(raw, t, (rows, k), "w"), x)
    b = CudaBackend(mmq=True)
    w = b.matrix(raw, t, (rows, k), "w")
    xq, (xd, xs) = b._activations(w, b.from_numpy(x), int8=True)
    y = upload(b.pool, np.full((n, rows), np.nan, np.float32), b.stream)
    b.k.mmq(t, w.data, xq, xd, xs, y, rows, k, n, b.stream)
    got = download(y, b.stream)
    assert _rel(got, ref) < 2e-5, f"mmq {t.name} {rows}x{k} n={n} vs numpy"
    b.k.profile = []
    via_backend = b.to_numpy(b.matmul(w, b.from_numpy(x)))
    assert [name for name, *_ in b.k.profile if name.startswith("mmq")] == [f"mmq_{t.name.lower()}"]
    b.k.profile = None
    assert np.array_equal(via_backend, got)
    plain = CudaBackend(mmq=False, gemm="0")  # the dp4a kernels, not the fp16 prefill GEMM
    dp4a = plain.to_numpy(plain.matmul(plain.matrix(raw, t, (rows, k), "w"), plain.from_numpy(x)))
    assert _rel(got, dp4a) < 2e-6, "mmq and the dp4a kernels compute the same function"
