"""The fusion switches (no GPU needed): NTX_CUDA_FUSE / CudaBackend(fuse=) and the benchmark's
variant syntax that drives them."""

from __future__ import annotations

import argparse

import pytest

from ntx_common.errors import UsageError
from ntx_engine.backends.cuda_backend import DEFAULT_FUSE, FUSIONS, OPT_IN_FUSIONS, parse_fusions


def test_fusion_names(monkeypatch):
    monkeypatch.delenv("NTX_CUDA_FUSE", raising=False)
    assert parse_fusions(None) == parse_fusions(DEFAULT_FUSE)
    assert parse_fusions("all") == parse_fusions(True) == frozenset(FUSIONS) - OPT_IN_FUSIONS
    assert {"stack", "stack8"} <= set(FUSIONS) and not {"stack", "stack8"} & parse_fusions("all")
    assert parse_fusions("all,stack,stack8") == frozenset(FUSIONS)
    assert parse_fusions(None) == parse_fusions("all") | {"stack"}  # the default: the stack step (Q8_0, Q4_K, Q6_K)
    assert parse_fusions("none") == parse_fusions(False) == parse_fusions("") == frozenset()
    assert parse_fusions("qkv, norm") == {"qkv", "norm"}
    monkeypatch.setenv("NTX_CUDA_FUSE", "ffn,rope")
    assert parse_fusions(None) == {"ffn", "rope"}
    with pytest.raises(UsageError, match=r"unknown CUDA fusion\(s\) \['qvk'\].*qkv, ffn, rope, norm"):
        parse_fusions("qvk,ffn")


def test_bench_variants():
    from tests.cuda.conftest import _load_script

    be = _load_script("bench_engine")
    assert be.parse_variant("fast/split/pdl") == ("fast", "split", True, "none", False, None, (), ())
    assert be.parse_variant("fast/split/pdl/fuse/mmq") == ("fast", "split", True, "all", True, None, (), ())
    assert be.parse_variant("staged/single/fuse=qkv+ffn") == ("staged", "single", False, "qkv,ffn", False, None, (), ())
    assert be.parse_variant("fast/split/fuse/gemm")[5] == "1" and be.parse_variant("fast/split/nogemm")[5] == "0"
    assert be.parse_variant("fast/grid/pdl/noprewait/nopair")[1:2] + be.parse_variant("fast/grid/noprewait/nopair")[-2:-1] \
        == ("grid", ("-DNTX_PRE_WAIT=0", "-DNTX_SWIGLU_PAIR=0"))
    assert be.parse_variant("fast/grid/pdl/fuse/noq6pair")[-2] == ("-DNTX_Q6_PAIR=0",)
    assert be.parse_variant("fast/grid/pdl/fuse/noagpre")[-2] == ("-DNTX_AG_PRE_WAIT=0",)
    assert be.parse_variant("fast/grid/pdl/fuse/nonormpre")[-2] == ("-DNTX_NORM_PRE_WAIT=0",)
    assert be.parse_variant("fast/grid/pdl/fuse/noreg/skip=10")[-2] == ("-DNTX_REG=0", "-DNTX_SKIP=10")
    assert be.parse_variant("fast/grid/pdl/fuse/cl=16")[-1] == (("NTX_CUDA_GRID_CLUSTER", "16"),)
    assert be.parse_variant("fast/grid/pdl/fuse/cl=0/drop=norm+quanti")[-1] == (
        ("NTX_CUDA_GRID_CLUSTER", "0"), ("NTX_CUDA_DROP", "add_rmsnorm_quanti,quanti_q8_1,quanti_q8_k"))
    assert be.parse_variant("fast/grid/pdl/noreg/D=FAST_WARPS:8+SWIGLU_MINB:3")[-2] == (
        "-DNTX_REG=0", "-DNTX_FAST_WARPS=8", "-DNTX_SWIGLU_MINB=3")
    for bad in ("fast/split/turbo", "fast/split/async=4", "fast/split/preload", "fast/flash/pdl", "fast/grid/unroll",
                "fast/grid/q4pair", "fast/grid/skip=attn", "fast/grid/skip=",
                "fast/grid/drop=rope", "fast/grid/drop=", "fast/grid/D=FAST_WARPS", "fast/grid/D=FAST_WARPS:x",
                "fast/grid/D=A-B:1", "fast/grid/D="):
        with pytest.raises(argparse.ArgumentTypeError):
            be.parse_variant(bad)


def test_bench_variant_defines_keep_the_callers_own(monkeypatch):
    from tests.cuda.conftest import _load_script

    be = _load_script("bench_engine")
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_G_Q4_K=16 -DNTX_PRE_WAIT=2 -DNTX_SWIGLU_PAIR=0")
    assert be.variant_defines(("-DNTX_PRE_WAIT=0",)) == "-DNTX_G_Q4_K=16 -DNTX_PRE_WAIT=0"
    assert be.variant_defines(()) == "-DNTX_G_Q4_K=16"
    # a D= macro replaces the caller's value of the same macro, and only that one
    assert be.variant_defines(("-DNTX_G_Q4_K=8",)) == "-DNTX_G_Q4_K=8"
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_FAST_WARPS=16 -DNTX_FAST_MINB=2")
    assert be.variant_defines(("-DNTX_FAST_WARPS=8",)) == "-DNTX_FAST_MINB=2 -DNTX_FAST_WARPS=8"


class _UnfusedTransformer:
    """The op sequence of Transformer.attention/ffn before the fused ops (the reference)."""

    @staticmethod
    def attention(self, i, lw, x, pos, start):
        c, b = self.cfg, self.backend
        h = b.rmsnorm(x, lw.attn_norm, c.rms_eps)
        q, k, v = b.matmul(lw.wq, h), b.matmul(lw.wk, h), b.matmul(lw.wv, h)
        q, k = b.rope(q, pos, c.n_head), b.rope(k, pos, c.n_head_kv)
        return b.add(x, b.matmul(lw.wo, b.attention(q, k, v, i, start)))

    @staticmethod
    def ffn(self, i, lw, h):
        b = self.backend
        return b.matmul(lw.w_down, b.swiglu(b.matmul(lw.w_gate, h), b.matmul(lw.w_up, h)))


class _RowWrapper:
    """A backend wrapper that forwards everything but matmul (as speculative.RowExact does)."""

    def __init__(self, backend):
        self.backend, self.calls = backend, 0

    def matmul(self, w, x):
        self.calls += 1
        return self.backend.matmul(w, x)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def test_numpy_model_unchanged_by_the_fused_ops(synth, tmp_path):
    """The model now calls matmul_many / matmul_swiglu / rope_attention: on the numpy backend (the
    oracle) its logits are bit-identical to the old op sequence, and a forwarding wrapper's own
    matmul still sees every product (the class-level lookup in base.py)."""
    import numpy as np

    from ntx_engine.backends.numpy_backend import NumpyBackend
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile
    from ntx_engine.model import Transformer, WeightLoader

    path = tmp_path / "tiny.gguf"
    synth.write_model(path, "tiny", "q8_0", 2, seed=1)
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, 7)

    def model():
        b = NumpyBackend()
        return Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, 32)

    fused = model()
    got = [fused.forward(ids, 0, all_logits=True), fused.forward(ids[:1], 7)]
    old = model()
    old.attention = _UnfusedTransformer.attention.__get__(old)
    old.ffn = _UnfusedTransformer.ffn.__get__(old)
    want = [old.forward(ids, 0, all_logits=True), old.forward(ids[:1], 7)]
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    wrapped = model()
    wrapped.backend = _RowWrapper(wrapped.backend)
    assert np.array_equal(wrapped.forward(ids, 0, all_logits=True), want[0])
    assert wrapped.backend.calls == 7 * cfg.n_layers + 1


def test_dropped_kernels_are_not_launched():
    """Kernels.drop (NTX_CUDA_DROP, the bench's drop= variants): a dropped name returns before any
    launch; any other name goes on to look its function up (here: no module, so it raises)."""
    from ntx_engine.backends.cuda_kernels import Kernels

    k = Kernels.__new__(Kernels)  # no device: only the launch path's first steps are under test
    k.drop, k.profile, k.pdl, k.modules = frozenset({"add_rmsnorm_quanti"}), None, False, {}
    assert k._go("fused.cu", "add_rmsnorm_quanti", (1,), (1024,), (), None) is None
    with pytest.raises(KeyError):
        k._go("fused.cu", "matvecf_multi_n1", (1,), (128,), (), None)
