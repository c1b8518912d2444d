"""matvec_reg.cu, the Q4_K and Q5_K (and Q6_K, k <= 4096) decode matvecs with the activations in registers, on the
GPU: against the numpy backend (rel L2 < 2e-5, every dp4a matvec test's bound) over row widths of one to seven
passes, partial passes and odd row counts; and bit for bit against the kernels that must give
its bits: the one-warp-a-row dp4a kernels (matvecf_<type>_n1), every row of a several-token product
(speculative decoding's verify pass), the fused q/k/v and gate/up launches against the unfused
products, and itself under other launch shapes. Outputs are poisoned with NaN first."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends import cuda_kernels as ck
from ntx_engine.backends.cuda_driver import DeviceArray, download, upload
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.quants import GGMLType as T

pytestmark = pytest.mark.gpu

MATVEC_REL = 2e-5
# rows x k: one warp two passes, a partial pass (k = 5120: three one-pass warps, the last half
# empty), seven one-pass warps (the 8B down projection), a 1000-row grid, one pass
SHAPES = [(T.Q4_K, 67, 4096), (T.Q4_K, 37, 5120), (T.Q4_K, 5, 14336), (T.Q4_K, 1000, 4096), (T.Q4_K, 3, 2048),
          (T.Q4_K, 129, 6144), (T.Q6_K, 67, 4096), (T.Q6_K, 1000, 2048), (T.Q6_K, 3001, 4096),
          (T.Q5_K, 67, 4096), (T.Q5_K, 37, 5120), (T.Q5_K, 5, 14336), (T.Q5_K, 1000, 2048)]


def _nan(b, shape):
    return upload(b.pool, np.full(shape, np.nan, np.float32), b.stream)


def _acts(b, rng, n, k):
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
    xq, xd, xs = DeviceArray(b.pool, (n, k), np.int8), b._new(n, k // 32), b._new(n, k // 32)
    b.k.quantize_int8(T.Q8_K, b.from_numpy(x), xq, xd, xs, b.stream)
    return x, (xq, xd, xs)


def _weight(b, synth, rng, t, rows, k):
    raw = synth.random_blocks(t, rows * k, rng)
    return raw, b.matrix(raw, t, (rows, k), "w")


def _rel(out, ref, what):
    assert np.isfinite(out).all(), f"{what}: {int((~np.isfinite(out)).sum())} outputs unwritten"
    err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref))
    assert err < MATVEC_REL, f"{what}: rel L2 {err:.2e}"


@pytest.mark.parametrize("t,rows,k", SHAPES, ids=lambda v: getattr(v, "name", v))
def test_reg_matvec_matches_numpy_and_the_warp_row_kernels(cuda_backend, synth, t, rows, k):
    b, rng = cuda_backend, np.random.default_rng(rows * 7 + k + int(t))
    assert ck.reg_shape(t, k, 1) is not None
    raw, w = _weight(b, synth, rng, t, rows, k)
    x, (xq, xd, xs) = _acts(b, rng, 3, k)
    ref = NumpyBackend().matmul(NumpyBackend().matrix(raw, t, (rows, k), "w"), x)
    one = []
    for i in range(3):  # the register kernel, one token at a time
        y = _nan(b, (1, rows))
        b.k.matvec_fast(t, w.data, xq[i:i + 1], xd[i:i + 1], xs[i:i + 1], y, rows, k, 1, b.stream)
        one.append(download(y, b.stream)[0])
    one = np.stack(one)
    _rel(one, ref, f"matvecr {t.name} {rows}x{k}")
    many = _nan(b, (3, rows))  # the n8 dp4a kernel: every token's row as its one-token product
    b.k.matvec_fast(t, w.data, xq, xd, xs, many, rows, k, 3, b.stream)
    assert np.array_equal(download(many, b.stream), one)
    warp = _nan(b, (1, rows))  # matvecf_<type>_n1 (NTX_REG=0's decode): one warp a row, the same order
    b.k._go("matvec_fast.cu", f"matvecf_{ck.FAST_TYPES[t]}_n1", (-(-rows // b.k.fast_rows),), (32 * b.k.fast_rows,),
            (w.data, xq, xd, xs, warp, rows, k, 1), b.stream)
    assert np.array_equal(download(warp, b.stream)[0], one[0])


@pytest.mark.parametrize("t,k", [(T.Q4_K, 14336), (T.Q6_K, 4096), (T.Q5_K, 14336), (T.Q5_K, 4096)],
                         ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("grid", [1, 7, 1000])
def test_reg_values_do_not_depend_on_the_launch_shape(cuda_backend, synth, grid, t, k):
    b, rng = cuda_backend, np.random.default_rng(grid)
    rows = 301
    ppw, wk = ck.reg_shape(t, k, 1)
    _, w = _weight(b, synth, rng, t, rows, k)
    _, (xq, xd, xs) = _acts(b, rng, 1, k)
    want, got = _nan(b, (1, rows)), _nan(b, (1, rows))
    b.k.matvec_fast(t, w.data, xq, xd, xs, want, rows, k, 1, b.stream)
    b.k._go("matvec_reg.cu", f"matvecr_{ck.FAST_TYPES[t]}_p{ppw}", (grid,), (32 * (ck.REG_WARPS // wk) * wk,),
            (w.data, xq, xd, xs, got, rows, k), b.stream)
    assert np.array_equal(download(got, b.stream), download(want, b.stream))


def test_reg_block_of_partial_teams_writes_nothing_and_returns(cuda_backend, synth):
    """A block that is not whole teams (7 warps and 28 threads for WK = 7) must not wait at a
    named barrier the missing threads never reach: the kernel returns, the outputs stay NaN."""
    b, rng = cuda_backend, np.random.default_rng(3)
    rows, k = 40, 14336
    ppw, wk = ck.reg_shape(T.Q4_K, k, 1)
    _, w = _weight(b, synth, rng, T.Q4_K, rows, k)
    _, (xq, xd, xs) = _acts(b, rng, 1, k)
    y = _nan(b, (1, rows))
    b.k._go("matvec_reg.cu", f"matvecr_q4_k_p{ppw}", (5,), (32 * wk + 28,), (w.data, xq, xd, xs, y, rows, k), b.stream)
    assert np.isnan(download(y, b.stream)).all()


@pytest.mark.parametrize("types", [(T.Q4_K, T.Q4_K, T.Q6_K), (T.Q4_K, T.Q4_K, T.Q4_K), (T.Q6_K, T.Q4_K, T.Q6_K)],
                         ids=lambda ts: "-".join(t.name for t in ts))
@pytest.mark.parametrize("k", [2048, 4096, 6144])
def test_reg_multi_equals_the_unfused_products(cuda_backend, synth, types, k):
    b, rng = cuda_backend, np.random.default_rng(k + len(set(types)))
    rows = (96, 33, 33)
    ws = [_weight(b, synth, rng, t, r, k)[1] for t, r in zip(types, rows)]
    _, (xq, xd, xs) = _acts(b, rng, 1, k)
    ys = [_nan(b, (1, r)) for r in rows]
    b.k.matvec_multi([(w.data, t, r) for w, t, r in zip(ws, types, rows)], xq, xd, xs, ys, k, 1, b.stream)
    for w, t, r, y in zip(ws, types, rows, ys):
        one = _nan(b, (1, r))
        b.k.matvec_fast(t, w.data, xq, xd, xs, one, r, k, 1, b.stream)
        assert np.array_equal(download(y, b.stream), download(one, b.stream)), f"{t.name} rows of the multi launch"


@pytest.mark.parametrize("tg,tu", [(T.Q4_K, T.Q4_K), (T.Q6_K, T.Q6_K), (T.Q4_K, T.Q6_K), (T.Q5_K, T.Q5_K)],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("rows,k", [(300, 4096), (77, 6144), (1000, 2048)])
def test_reg_swiglu_equals_swiglu_of_the_products(cuda_backend, synth, rows, k, tg, tu):
    """One type: matvecr_swiglu (Q6_K up to k = 4096); otherwise fused.cu's matvecf_swiglu, whose
    Q4_K rows take matvecr_q4_k's order and whose Q6_K rows take matvecf_q6_k's (matvecr_q6_k's)."""
    b, rng = cuda_backend, np.random.default_rng(rows + k)
    (_, g), (_, u) = _weight(b, synth, rng, tg, rows, k), _weight(b, synth, rng, tu, rows, k)
    _, (xq, xd, xs) = _acts(b, rng, 1, k)
    y, yg, yu = _nan(b, (1, rows)), _nan(b, (1, rows)), _nan(b, (1, rows))
    b.k.matvec_swiglu(g.data, tg, u.data, tu, xq, xd, xs, y, rows, k, 1, b.stream)
    b.k.matvec_fast(tg, g.data, xq, xd, xs, yg, rows, k, 1, b.stream)
    b.k.matvec_fast(tu, u.data, xq, xd, xs, yu, rows, k, 1, b.stream)
    ref = b.to_numpy(b.swiglu(yg, yu))
    assert np.array_equal(download(y, b.stream), ref)
