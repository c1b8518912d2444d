"""Which models the "stack" decode takes (backends/cuda_layers.stack_unfit; no GPU needed): every
limit of native/cuda/layer_q8.cu gives a reason naming it, and its shared memory fits an H200."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ntx_engine.backends.cuda_layers import (KINDS, Q6W_KS, ks_fits, layer_chunks, layer_mixes, qkv_rows, stack_smem,
                                             stack_unfit)
from ntx_engine.quants import GGMLType, tensor_nbytes

H200 = dict(cc=(9, 0), sm_count=132, smem_optin=232448)  # cuDeviceGetAttribute on the lent H200


def _cfg(**kw):
    c = dict(n_embd=4096, n_ff=14336, head_dim=128, n_head=32, n_head_kv=8, n_expert=0, qkv_bias=False,
             qk_norm=False)
    c.update(kw)
    c["q_dim"] = c["n_head"] * c["head_dim"]
    return SimpleNamespace(**c)


NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
Q4_K_M = {"wv": GGMLType.Q6_K, "w_down": GGMLType.Q6_K}  # the synthetic q4_k_m mix (Q4_K elsewhere)


def _layers(n=32, t=GGMLType.Q8_0, odd=None, mix=None, odd_name="w_down", more=None):
    """n layers of type t (mix: other types by matrix); odd: the last layer's odd_name matrix's type; more: other
    types by matrix in the layers llama.cpp's K-quant mixes give more bits (make_synthetic_model.more_bits)."""
    def more_bits(i):
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    def typ(i, m):
        if odd and m == odd_name and i == n - 1:
            return odd
        if more and m in more and more_bits(i):
            return more[m]
        return (mix or {}).get(m, t)
    return [SimpleNamespace(**{m: SimpleNamespace(ggml_type=typ(i, m), name=f"blk.{i}.{m}") for m in NAMES})
            for i in range(n)]


def test_llama3_8b_q8_0_and_q4_k_m_fit_the_h200():
    assert stack_unfit(_cfg(), _layers(), 4096, **H200) is None
    assert stack_unfit(_cfg(), _layers(), 4096, **H200, allowed=(GGMLType.Q8_0,)) is None  # the default's stack8
    assert stack_unfit(_cfg(), _layers(t=GGMLType.Q4_K, mix=Q4_K_M), 4096, **H200) is None
    assert stack_unfit(_cfg(), _layers(t=GGMLType.Q6_K), 4096, **H200) is None
    assert stack_unfit(_cfg(), _layers(t=GGMLType.Q5_K, more={"wv": GGMLType.Q6_K, "w_down": GGMLType.Q6_K}), 4096,
                       **H200) is None  # llama.cpp's Q5_K_M
    assert stack_smem(128, 4) + 768 <= H200["smem_optin"]  # + the kernel's static shared memory (ptxas)


def test_the_k_quant_build_takes_q6_k_down_rows_in_k_quant_layers_only():
    """layer_q8_ks.cu (NTX_LQ_Q8 0) has no Q8_0 dot: a layer with a Q8_0 matrix loads layer_q8.cu's build."""
    def types(**kw):
        return tuple(kw.get(n, Q4_K_M.get(n, GGMLType.Q4_K)) for n in NAMES)
    assert ks_fits(_cfg(), [types()])
    assert ks_fits(_cfg(), [tuple(GGMLType.Q6_K for _ in NAMES)])
    assert not ks_fits(_cfg(), [types(wv=GGMLType.Q8_0)])  # a Q8_0 matrix: the build with the Q8_0 dot
    assert not ks_fits(_cfg(), [types(w_down=GGMLType.Q4_K)])  # (Q6_K down rows only)
    assert not ks_fits(_cfg(), [tuple(GGMLType.Q8_0 for _ in NAMES)])
    assert not ks_fits(_cfg(n_ff=14080), [types()])  # 55 Q6_K blocks a row: not whole 2048-value slices
    # llama.cpp's Q4_K_M: Q6_K down rows in half the layers (as slices), Q4_K in the others (whole rows, same build)
    assert ks_fits(_cfg(), [types(), types(wv=GGMLType.Q4_K, w_down=GGMLType.Q4_K)])
    assert not ks_fits(_cfg(), [types(), types(wq=GGMLType.Q8_0)])  # a Q8_0 matrix in either mix
    # Q5_K matrices (llama.cpp's Q5_K_M, Q4_K_S): the build with the Q5_K dot, whatever the down rows
    q5 = tuple(GGMLType.Q5_K for _ in NAMES)
    assert ks_fits(_cfg(), [q5]) and ks_fits(_cfg(n_ff=14080), [q5])
    assert ks_fits(_cfg(), [types(wq=GGMLType.Q5_K, wk=GGMLType.Q5_K)])


def test_each_model_loads_the_build_with_only_the_dots_it_needs():
    """stack_source: a Q5_K matrix anywhere loads the K-quant build with the Q5_K dot (layer_q8_ks5.cu); other K-quant
    models the one without it (its branch cost Q4_K_M 2 %); a Q8_0 matrix layer_q8.cu's build."""
    from ntx_engine.backends.cuda_layers import KS5_SOURCE, KS_SOURCE, SOURCE, stack_source

    def types(**kw):
        return tuple(kw.get(n, Q4_K_M.get(n, GGMLType.Q4_K)) for n in NAMES)
    q4_lcpp = [types(), types(wv=GGMLType.Q4_K, w_down=GGMLType.Q4_K)]
    assert stack_source(_cfg(), [types()]) == KS_SOURCE
    assert stack_source(_cfg(), q4_lcpp) == KS_SOURCE
    q5 = {n: GGMLType.Q5_K for n in NAMES if n not in ("wv", "w_down")}
    assert stack_source(_cfg(), [types(**q5), types(**q5, wv=GGMLType.Q5_K, w_down=GGMLType.Q5_K)]) == KS5_SOURCE
    assert stack_source(_cfg(), [types(), types(wq=GGMLType.Q5_K)]) == KS5_SOURCE  # in the second mix alone
    assert stack_source(_cfg(), [tuple(GGMLType.Q8_0 for _ in NAMES)]) == SOURCE
    assert stack_source(_cfg(), [types(wv=GGMLType.Q8_0)]) == SOURCE


def test_llama_cpps_q4_k_m_is_two_type_mixes_the_kernel_takes():
    """A real Q4_K_M file (llama.cpp's use_more_bits: attn_v and ffn_down Q6_K in 16 of Llama-3-8B's 32 layers) has
    two type mixes: each layer's kind names its mix, the chunk lists are bounded by the larger mix's, and a third mix
    is refused with the layer that brings it."""
    layers = _layers(t=GGMLType.Q4_K, more={"wv": GGMLType.Q6_K, "w_down": GGMLType.Q6_K})
    mixes, kinds = layer_mixes(layers)
    assert [m[2] for m in mixes] == [GGMLType.Q6_K, GGMLType.Q4_K] and [m[6] for m in mixes] == [m[2] for m in mixes]
    assert [i for i, k in enumerate(kinds) if k == 0] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert len(mixes) <= KINDS and stack_unfit(_cfg(), layers, 4096, **H200) is None
    assert max(layer_chunks(_cfg(), 132, m) for m in mixes) <= 256
    layers[5].wq.ggml_type = GGMLType.Q6_K
    why = stack_unfit(_cfg(), layers, 4096, **H200)
    assert why is not None and "layer 5's matrices are Q6_K/Q4_K/Q4_K" in why and f"at most {KINDS} mixes" in why


def _kernel_qkv_starts(cfg, types, blocks, w):
    """lq_r0 of layer_q8.cu for phase 0 where q, k and v rows differ in size: block b's first q|k|v row, the rows'
    costs their bytes times 100 (a Q6_K row's times w, NTX_LQ_Q6W)."""
    d, kvd = cfg.n_embd, cfg.n_head_kv * cfg.head_dim
    cq, ck, cv = (tensor_nbytes(t, d) * (w if t == GGMLType.Q6_K else 100) for t in types[:3])
    starts = []
    for b in range(blocks):
        at = b * (d * cq + kvd * ck + kvd * cv) // blocks
        starts.append(at // cq if at < d * cq else d + (at - d * cq) // ck if at < d * cq + kvd * ck
                      else d + kvd + (at - d * cq - kvd * ck) // cv)
    return starts + [d + 2 * kvd]


@pytest.mark.parametrize("w", [100, Q6W_KS])
def test_qkv_rows_bounds_the_kernels_shares_under_either_builds_weight(w):
    """layer_chunks sizes the producers' lists from qkv_rows: no block's q|k|v share (the kernel's lq_r0) exceeds it."""
    types = tuple(Q4_K_M.get(n, GGMLType.Q4_K) for n in NAMES)
    for blocks in (1, 2, 7, 8, 66, 132, 199):
        s = _kernel_qkv_starts(_cfg(), types, blocks, w)
        assert max(b - a for a, b in zip(s, s[1:])) <= qkv_rows(_cfg(), blocks, types), blocks


@pytest.mark.parametrize("change,why", [
    (dict(cc=(8, 0)), "needs sm_90"),
    (dict(layers=_layers(t=GGMLType.Q5_0)), "blk.0.wq is Q5_0, not one of the kernel's types (Q8_0, Q4_K, Q6_K, Q5_K)"),
    # Q5_K's dot is in the K-quant build alone, which has no Q8_0 dot
    (dict(layers=_layers(odd=GGMLType.Q5_K)), "Q5_K matrices are in the K-quant build of the kernel, which has no Q8_0"),
    # two mixes: Q6_K down rows in the more-bits layers, and in the last layer a third (Q4_K down rows)
    (dict(layers=_layers(more={"w_down": GGMLType.Q6_K}, odd=GGMLType.Q4_K)),
     "layer 31's matrices are Q8_0/Q8_0/Q8_0/Q8_0/Q8_0/Q8_0/Q4_K, a type mix after"),
    (dict(layers=_layers(odd=GGMLType.Q4_K, odd_name="w_up")), "ffn_gate is Q8_0 and ffn_up Q4_K"),
    # 55 Q6_K blocks: 11550 bytes a row
    (dict(cfg=_cfg(n_ff=14080), layers=_layers(t=GGMLType.Q4_K, mix=Q4_K_M)), "blk.0.w_down: a row of 14080 Q6_K"),
    (dict(cfg=_cfg(n_expert=8)), "mixture-of-experts"),
    (dict(cfg=_cfg(qkv_bias=True)), "biases"),
    (dict(cfg=_cfg(head_dim=80, n_embd=2560)), "head shape 32x80"),
    (dict(cfg=_cfg(n_head=64, n_head_kv=4, head_dim=64)), "head shape 64x64 / 4 KV heads"),
    (dict(cfg=_cfg(n_ff=14000)), "n_ff 14000"),
    (dict(cfg=_cfg(n_ff=28672)), "n_ff 28672"),
    (dict(layers=_layers(n=97)), "97 layers"),
    # a block's rows in chunks: q|k|v (768 + 1) / 8 + 3, o 512 / 8 + 1, gate/up 1792 / 4 + 1, down 512 / 2 + 1
    (dict(sm_count=8), "871 ring chunks"),
    (dict(cfg=_cfg(n_ff=4096), sm_count=8), "359 ring chunks"),  # gate/up 512 / 4 + 1, down 512 / 8 + 1
    (dict(n_ctx=1 << 20), "n_ctx 1048576 is too long"),
    (dict(smem_optin=166912), "shared memory"),
    # the default "stack8" (cuda_backend.decode_stack) allows Q8_0 alone and names the option that takes the rest
    (dict(layers=_layers(t=GGMLType.Q4_K, mix=Q4_K_M), allowed=(GGMLType.Q8_0,), hint=": stack8 takes Q8_0"),
     "blk.0.wq is Q4_K, not one of the step's types (Q8_0): stack8 takes Q8_0"),
    (dict(layers=_layers(odd=GGMLType.Q6_K), allowed=(GGMLType.Q8_0,)), "blk.31.w_down is Q6_K, not one of the step's"),
])
def test_every_limit_gives_its_reason(change, why):
    kw = dict(cfg=_cfg(), layers=_layers(), n_ctx=4096, **H200)
    kw.update(change)
    got = stack_unfit(kw.pop("cfg"), kw.pop("layers"), kw.pop("n_ctx"), **kw)
    assert got is not None and why in got, got


def test_the_host_mirrors_the_kernels_constants():
    """cuda_layers sizes buffers and shared memory from copies of layer_q8.cu's macros."""
    import re

    from ntx_engine.backends import cuda_layers as cl
    from ntx_engine.backends.cuda_nvrtc import KERNEL_DIR

    src = (KERNEL_DIR / "layer_q8.cu").read_text()
    macro = {m: int(v) for m, v in re.findall(r"^#define (LQ_\w+) (\d+)\b", src, re.M)}
    assert {"LQ_THREADS": cl.THREADS, "LQ_SLOTS": cl.SLOTS, "LQ_SLOT": cl.SLOT, "LQ_KMAX": cl.KMAX,
            "LQ_GMAX": cl.GMAX, "LQ_NCTR": cl.NCTR, "LQ_MARKS": cl.TRACE_MARKS, "LQ_MAX_LAYERS": cl.MAX_LAYERS,
            "LQ_GROUPS": cl.GROUPS, "LQ_KVS": cl.KVS, "LQ_NV": cl.NORM_MAX // cl.THREADS,
            "LQ_CMAX": cl.CHUNK_MAX, "LQ_KINDS": cl.KINDS} == {k: macro[k] for k in (
        "LQ_THREADS", "LQ_SLOTS", "LQ_SLOT", "LQ_KMAX", "LQ_GMAX", "LQ_NCTR", "LQ_MARKS", "LQ_MAX_LAYERS",
        "LQ_GROUPS", "LQ_KVS", "LQ_NV", "LQ_CMAX", "LQ_KINDS")}
    assert {t.name: c for t, c in cl.TYPE_CODES.items()} == {k[3:]: macro[k] for k in ("LQ_Q8_0", "LQ_Q4_K", "LQ_Q6_K",
                                                                                      "LQ_Q5_K")}
    assert cl.GROUP_WARPS == macro["LQ_THREADS"] // 32 // macro["LQ_GROUPS"]
    fields = re.search(r"struct LqLayer \{[^}]*\}", src).group(0)
    # 11 pointers (LAYER_FIELDS, the k and v caches) and the kind, 8 bytes each
    assert len(re.findall(r"\*\s*\w+", fields)) == len(cl.LAYER_FIELDS) + 2
    assert re.findall(r"unsigned long long (\w+);", fields) == ["kind"]
    assert cl.LAYER_BYTES == 8 * (len(cl.LAYER_FIELDS) + 3)
    chunk = re.search(r"struct LqChunk \{([^}]*)\}", src).group(1)  # unsigned, unsigned short, 2 unsigned chars
    assert re.findall(r"(unsigned(?: short| char)?) \w+", chunk) == ["unsigned", "unsigned short", "unsigned char"]
    assert cl.CHUNK_BYTES == 8
    assert all(f"LQ_KERNEL({hd})" in src for hd in cl.HEAD_DIMS)
    ks = (KERNEL_DIR / cl.KS_SOURCE).read_text()  # its q|k|v shares weigh a Q6_K byte as layer_chunks does
    assert int(re.search(r"^#define NTX_LQ_Q6W (\d+)", ks, re.M).group(1)) == cl.Q6W_KS
    assert int(re.search(r"^#define NTX_LQ_Q6W (\d+)", src, re.M).group(1)) == 100
    # the Q5_K dot is in the K-quant build with it alone (cuda_layers.KS_ONLY, KS5_SOURCE), which includes the other
    ks5 = (KERNEL_DIR / cl.KS5_SOURCE).read_text()
    assert int(re.search(r"^#define NTX_LQ_Q5 (\d+)", ks5, re.M).group(1)) == 1
    assert re.search(r'^#include "(\S+)"', ks5, re.M).group(1) == cl.KS_SOURCE
    assert int(re.search(r"^#define NTX_LQ_Q5 (\d+)", ks, re.M).group(1)) == 0
    assert int(re.search(r"^#define NTX_LQ_Q5 (\d+)", src, re.M).group(1)) == 0


def test_the_gqa8_gpu_case_reaches_a_second_round_of_scores(synth, tmp_path):
    """test_stack_gpu's "gqa8" case is a real model the stack step takes on the H200, with Llama-3-8B's heads: 16
    context chunks a KV head, and from its first decode step (601 positions) a chunk holds more (position, head)
    scores than the block's 4-lane teams (LQ_THREADS / 4), so the kernel's scores loop runs a second round."""
    from ntx_engine.backends.cuda_layers import THREADS, stack_chunks
    from ntx_engine.backends.numpy_backend import NumpyBackend
    from ntx_engine.model import WeightLoader
    from tests.cuda.conftest import synthetic_gguf

    gf, cfg = synthetic_gguf(synth, tmp_path, "gqa8", "q8_0", 2, seed=5)
    layers = WeightLoader(gf, cfg, NumpyBackend()).load().layers
    assert (cfg.n_head, cfg.head_dim, cfg.n_head_kv) == (32, 128, 8)
    assert stack_unfit(cfg, layers, 640, **H200) is None
    chunks = stack_chunks(cfg, H200["sm_count"])
    per_chunk = -(-601 // chunks)
    assert chunks == 16 and per_chunk * (cfg.n_head // cfg.n_head_kv) > THREADS // 4


def test_a_tuning_run_may_cap_the_context_chunks(monkeypatch):
    """-DNTX_LQ_ACH=N in NTX_CUDA_DEFINES caps the context chunks a KV head (a tuning run: fewer partials to combine),
    never above what the SMs give each KV head; a value that is no count is refused with the define named."""
    from ntx_common.errors import CudaError
    from ntx_engine.backends.cuda_layers import stack_chunks

    monkeypatch.delenv("NTX_CUDA_DEFINES", raising=False)
    assert stack_chunks(_cfg(), H200["sm_count"]) == 132 // 8
    for value, chunks in (("4", 4), ("1", 1), ("64", 16)):
        monkeypatch.setenv("NTX_CUDA_DEFINES", f"-DNTX_FAST_WARPS=8 -DNTX_LQ_ACH={value}")
        assert stack_chunks(_cfg(), H200["sm_count"]) == chunks
    monkeypatch.setenv("NTX_CUDA_DEFINES", "-DNTX_LQ_ACH=4")
    assert stack_unfit(_cfg(), _layers(), 4096, **H200) is None  # 1024 positions a chunk: the scores still fit
    for bad in ("0", "x", "-2"):
        monkeypatch.setenv("NTX_CUDA_DEFINES", f"-DNTX_LQ_ACH={bad}")
        with pytest.raises(CudaError, match="NTX_LQ_ACH"):
            stack_chunks(_cfg(), H200["sm_count"])


def test_the_gqa3_gpu_case_is_an_odd_group_the_stack_step_takes(synth, tmp_path):
    """test_stack_gpu's "gqa3" case (12 heads of 64, 4 KV: SmolLM2's group of 3) runs the stack step on the H200 with
    an odd group of query heads a KV head: the combine's path for partials that are not whole 16-byte pieces
    (NTX_LQ_CPRE's shared-memory copy does not apply), and a head group's outputs (192) not a multiple of a warp's."""
    from ntx_engine.backends.numpy_backend import NumpyBackend
    from ntx_engine.model import WeightLoader
    from tests.cuda.conftest import synthetic_gguf

    gf, cfg = synthetic_gguf(synth, tmp_path, "gqa3", "q8_0", 2, seed=5)
    layers = WeightLoader(gf, cfg, NumpyBackend()).load().layers
    assert (cfg.n_head, cfg.head_dim, cfg.n_head_kv) == (12, 64, 4)
    assert (cfg.n_head // cfg.n_head_kv) % 2 == 1
    assert stack_unfit(cfg, layers, 256, **H200) is None
