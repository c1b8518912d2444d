"""Each CUDA kernel against the numpy backend (the oracle) on fresh random inputs, odd shapes,
every weight type; outputs poisoned with NaN first so an unwritten element fails."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.backends.cuda_driver import DeviceArray, download, upload
from ntx_engine.backends.numpy_backend import NumpyBackend
from ntx_engine.config import ModelConfig
from ntx_engine.quants import GGMLType

pytestmark = pytest.mark.gpu

TYPES = [GGMLType.F32, GGMLType.F16, GGMLType.BF16, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0,
         GGMLType.Q5_1, GGMLType.Q8_0, GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
         GGMLType.Q6_K]
REPORT: list[str] = []


def _poisoned(b, shape, dtype=np.float32) -> DeviceArray:
    return upload(b.pool, np.full(shape, np.nan, dtype), b.stream)


def _rel_err(out: np.ndarray, ref: np.ndarray, what: str, tol: float) -> float:
    assert np.isfinite(out).all(), f"{what}: {int((~np.isfinite(out)).sum())} elements unwritten or not finite"
    err = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))
    rows = np.abs(out - ref).reshape(len(out), -1).max(axis=1)
    REPORT.append(f"{what}: rel L2 {err:.2e}, max |diff| {rows.max():.2e} (worst row {int(rows.argmax())})")
    assert err < tol, REPORT[-1]
    return err


@pytest.mark.parametrize("variant", ["staged", "direct"])
@pytest.mark.parametrize("n", [1, 3, 11])
@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_matvec_matches_numpy(cuda_backend, synth, t, n, variant):
    b, rng = cuda_backend, np.random.default_rng(1000 * int(t) + n)
    rows, k = 37, 2304  # 72 units a row: lanes loop and the last pass is partial
    b.k.matvec_prefix = {"staged": "matvec", "direct": "matvecd"}[variant]
    b.k.fast = False
    raw = synth.random_blocks(t, rows * k, rng)
    w_gpu, w_np = b.matrix(raw, t, (rows, k), "w"), NumpyBackend().matrix(raw, t, (rows, k), "w")
    x = rng.standard_normal((n, k)).astype(np.float32)
    xd = b.from_numpy(x)
    y = _poisoned(b, (n, rows))
    xq, s = b._activations(w_gpu, xd)
    for t0 in range(0, n, 8):
        m = min(8, n - t0)
        b.k.matvec(t, w_gpu.data, xq[t0:t0 + m], None if s is None else s[t0:t0 + m], y[t0:t0 + m], rows, k, m, b.stream)
    ref = NumpyBackend().matmul(w_np, x)
    _rel_err(download(y, b.stream), ref, f"matvec {variant} {t.name} n={n}", 2e-5)
    _rel_err(b.to_numpy(b.matmul(w_gpu, xd)), ref, f"matmul {variant} {t.name} n={n}", 2e-5)
    b.k.matvec_prefix, b.k.fast = "matvec", True


FAST = [GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K, GGMLType.Q8_0]


@pytest.mark.parametrize("vec_dot", [GGMLType.Q8_K, GGMLType.Q8_0])
def test_rmsnorm_quanti_equals_rmsnorm_then_quantize(cuda_backend, vec_dot):
    """The fused rmsnorm + int8 quantization (NTX_CUDA_FUSE) is bit-identical to the two kernels
    it replaces, which the tests above check against numpy."""
    b, rng = cuda_backend, np.random.default_rng(int(vec_dot))
    n, k = 3, 4096
    x, w = b.from_numpy((rng.standard_normal((n, k)) * 3).astype(np.float32)), b.from_numpy(
        rng.standard_normal(k).astype(np.float32))
    h = b._new(n, k)
    b.k.rmsnorm(x, w, h, 1e-5, b.stream)
    ref = [DeviceArray(b.pool, (n, k), np.int8), b._new(n, k // 32), b._new(n, k // 32)]
    b.k.quantize_int8(vec_dot, h, *ref, b.stream)
    fused = [_poisoned(b, (n, k)), upload(b.pool, np.full((n, k), 77, np.int8), b.stream), _poisoned(b, (n, k // 32)),
             _poisoned(b, (n, k // 32))]
    b.k.rmsnorm_quanti(x, w, *fused, 1e-5, vec_dot == GGMLType.Q8_K, b.stream)
    assert np.array_equal(download(fused[0], b.stream), download(h, b.stream))
    for got, want in zip(fused[1:], ref):
        assert np.array_equal(download(got, b.stream), download(want, b.stream))


@pytest.mark.parametrize("n", [1, 3, 11])
@pytest.mark.parametrize("rows,k", [(67, 6144), (37, 2304)])
@pytest.mark.parametrize("t", FAST, ids=lambda t: t.name)
def test_fast_matvec_matches_numpy(cuda_backend, synth, t, rows, k, n):
    """The dp4a kernels (int8 activations): whole and partial 16-byte groups, odd row counts;
    where a row is not whole 16-byte chunks (Q6_K at 2304) the backend must fall back."""
    b, rng = cuda_backend, np.random.default_rng(7000 * int(t) + k + n)
    raw = synth.random_blocks(t, rows * k, rng)
    w_gpu, w_np = b.matrix(raw, t, (rows, k), "w"), NumpyBackend().matrix(raw, t, (rows, k), "w")
    assert b.uses_fast(w_gpu) == (t != GGMLType.Q6_K or k % 2048 == 0)
    x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10, k)).astype(np.float32)
    ref = NumpyBackend().matmul(w_np, x)
    xd = b.from_numpy(x)
    b._act_cache = None
    _rel_err(b.to_numpy(b.matmul(w_gpu, xd)), ref, f"matmul fast {t.name} {rows}x{k} n={n}", 2e-5)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_embed_matches_numpy(cuda_backend, synth, t):
    b, rng = cuda_backend, np.random.default_rng(int(t))
    vocab, k = 53, 512
    raw = synth.random_blocks(t, vocab * k, rng)
    table = b.matrix(raw, t, (vocab, k), "tok_embd")
    ids = np.array([0, 52, 7, 7, 31], np.int64)
    ref = NumpyBackend().embed(NumpyBackend().matrix(raw, t, (vocab, k), "e"), ids)
    out = b.to_numpy(b.embed(table, ids))
    assert np.array_equal(out, ref), _rel_err(out, ref, f"embed {t.name}", 0.0)


def _cfg(rope_type="norm", rope_dim=64, head_dim=64, n_head=8, n_head_kv=2, freq_scale=1.0) -> ModelConfig:
    return ModelConfig(arch="llama", n_layers=2, n_embd=n_head * head_dim, n_ff=256, n_head=n_head,
                       n_head_kv=n_head_kv, head_dim=head_dim, rope_dim=rope_dim, rope_base=10000.0,
                       rope_type=rope_type, rope_freq_scale=freq_scale, has_rope_freqs=False, rms_eps=1e-5,
                       context_length=512, vocab_size=64, tied_embeddings=True, qkv_bias=False)


def _pair(cfg, n_ctx=64, freqs=None, attn="split"):
    import ntx_engine.backends.cuda_backend as cb

    gpu = cb.CudaBackend(attn=attn)
    cpu = NumpyBackend()
    for be in (gpu, cpu):
        be.set_model(cfg, n_ctx, freqs)
    return gpu, cpu


def test_rmsnorm_swiglu_add_argmax(cuda_backend):
    b, rng = cuda_backend, np.random.default_rng(5)
    ref = NumpyBackend()
    x = (rng.standard_normal((5, 576)) * 3).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    g, u = rng.standard_normal((2, 5, 1536)).astype(np.float32) * 4
    bias = rng.standard_normal(576).astype(np.float32)
    _rel_err(b.to_numpy(b.rmsnorm(b.from_numpy(x), b.from_numpy(w), 1e-5)), ref.rmsnorm(x, w, 1e-5), "rmsnorm", 1e-6)
    _rel_err(b.to_numpy(b.swiglu(b.from_numpy(g), b.from_numpy(u))), ref.swiglu(g, u), "swiglu", 1e-6)
    assert np.array_equal(b.to_numpy(b.add(b.from_numpy(x), b.from_numpy(x[::-1].copy()))), x + x[::-1])
    assert np.array_equal(b.to_numpy(b.add(b.from_numpy(x), b.from_numpy(bias))), x + bias)
    logits = rng.standard_normal(49157).astype(np.float32)
    logits[[17, 40000]] = logits.max() + 1  # a tie: the first index wins, as numpy's argmax
    assert int(b.to_numpy(b.argmax(b.from_numpy(logits)))[0]) == int(np.argmax(logits)) == 17


@pytest.mark.parametrize("rope_type,rope_dim,freq_scale,freqs", [
    ("norm", 64, 1.0, False), ("neox", 64, 1.0, False), ("norm", 32, 0.25, False), ("neox", 48, 1.0, True)])
def test_rope_matches_numpy(cuda_backend, rope_type, rope_dim, freq_scale, freqs):
    cfg = _cfg(rope_type, rope_dim, freq_scale=freq_scale)
    rng = np.random.default_rng(rope_dim)
    ff = rng.uniform(1, 8, rope_dim // 2).astype(np.float32) if freqs else None
    gpu, cpu = _pair(cfg, 4096, ff)
    pos = np.array([0, 1, 17, 1000, 4095])
    x = rng.standard_normal((5, cfg.q_dim)).astype(np.float32)
    out = gpu.to_numpy(gpu.rope(gpu.from_numpy(x), pos, cfg.n_head))
    _rel_err(out, cpu.rope(x, pos, cfg.n_head), f"rope {rope_type} dim {rope_dim} fs {freq_scale} ff {freqs}", 1e-5)


@pytest.mark.parametrize("attn", ["grid", "grid-form", "grid-cluster8", "grid-1-per-sm", "grid-generic", "grid-minr48",
                                  "split", "single"])
@pytest.mark.parametrize("head_dim,n_head,n_head_kv", [(64, 8, 2), (128, 4, 4), (64, 9, 3), (96, 6, 2), (256, 16, 2),
                                                      (128, 32, 8), (128, 16, 2), (80, 4, 2)])
def test_attention_prefill_then_decode(cuda_backend, monkeypatch, head_dim, n_head, n_head_kv, attn):
    """Decode steps (n = 1) take the split kernels unless attn == "single" (or the layout is one
    they do not take: head_dim 80); chunks of 64 positions: decode at 7, 8 (one partial chunk) and
    259 (five chunks, the last partial); GQA groups of 1 to 8 query heads, head_dim 64 to 256.
    "grid" takes the fixed-group kernels for (64, 3), (128, 4) and (128, 8); "grid-generic" the
    generic one for every layout. For (128, 4) "grid" takes the cluster form, 16 blocks a KV head
    (attn_cl16_4_g4; "grid-cluster8": 8), and "grid-form" and the other grid variants its grid form."""
    cfg = _cfg(head_dim=head_dim, n_head=n_head, n_head_kv=n_head_kv)
    monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", {"grid": "16", "grid-cluster8": "8"}.get(attn, "0"))
    attn = "grid" if attn in ("grid-form", "grid-cluster8") else attn
    if attn == "grid-1-per-sm":  # the grid kernel with half the blocks (one an SM)
        monkeypatch.setenv("NTX_CUDA_GRID_PER_SM", "1")
        attn = "grid"
    if attn == "grid-generic":
        monkeypatch.setenv("NTX_CUDA_GRID_FIXED", "0")
        attn = "grid"
    if attn == "grid-minr48":  # at least 48 positions a block: other block boundaries, fewer blocks
        from ntx_engine.backends import cuda_kernels

        monkeypatch.setattr(cuda_kernels, "GRID_MINR", 48)
        attn = "grid"
    gpu, cpu = _pair(cfg, n_ctx=300, attn=attn)
    rng = np.random.default_rng(head_dim + n_head)
    start = 0
    for n in (7, 1, 1, 250, 1):  # prefill, decode steps, a long chunk, decode at 259
        q = rng.standard_normal((n, cfg.q_dim)).astype(np.float32) * 2
        k = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32) * 2
        v = rng.standard_normal((n, cfg.kv_dim)).astype(np.float32)
        for layer in (0, 1):
            ref = cpu.attention(q, k, v, layer, start)
            gpu.k.profile = []
            out = gpu.to_numpy(gpu.attention(gpu.from_numpy(q), gpu.from_numpy(k), gpu.from_numpy(v), layer, start))
            ran, gpu.k.profile = {name for name, *_ in gpu.k.profile}, None
            if n == 1 and head_dim != 80:  # the variant under test computed it
                assert any(x.startswith({"grid": ("attn_grid_", "attn_cl"), "split": "attn_gqa_",
                                         "single": "attention"}[attn]) for x in ran), ran
            _rel_err(out, ref, f"attention {attn} hd {head_dim} {n_head}/{n_head_kv} n={n} start={start} layer {layer}", 1e-3)
        start += n


def test_zz_write_report(cuda_backend):
    """Per-kernel errors, for docs/benchmarks (NTX_REPORT_DIR) and the -s output."""
    import os
    from pathlib import Path

    print("\n" + "\n".join(REPORT))
    if os.environ.get("NTX_REPORT_DIR"):
        Path(os.environ["NTX_REPORT_DIR"], "kernel_errors.txt").write_text("\n".join(REPORT) + "\n")
