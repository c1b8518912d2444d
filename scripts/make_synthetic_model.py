#!/usr/bin/env python3
"""Write a GGUF file with a real model's shapes filled with random but valid quant blocks.

For benchmarks and kernel tests where only bytes and shapes matter: every block's scale fields
are finite fp16 values sized so activations stay in range through all layers; the rest of each
block is random bits. Written with gguf-py's GGUFWriter (llama.cpp loads these files too).

    python scripts/make_synthetic_model.py --shape llama3-8b --mix q4_k_m -o /tmp/l8b-q4km.gguf
    python scripts/make_synthetic_model.py --shape mixtral-8x7b --mix q4_k_m -o /tmp/mixtral.gguf

Mixture-of-experts shapes (MOE_SHAPES) write 3-D expert tensors `ffn_{gate,up,down}_exps`, an F32
router `ffn_gate_inp`, a shared expert for qwen2moe and q/k norms for qwen3moe; in the q4_k_m mix
the experts' down projection is Q6_K like the dense ffn_down.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ntx_engine.quants import GGML_BLOCK_SIZES, GGMLType  # noqa: E402

# name: (n_layers, n_embd, n_ff, n_head, n_head_kv, vocab, rope_base, context)
SHAPES = {
    "llama3-8b": (32, 4096, 14336, 32, 8, 128256, 500000.0, 8192),
    "llama3-70b": (80, 8192, 28672, 64, 8, 128256, 500000.0, 8192),
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152, 100000.0, 8192),
    "tiny": (2, 256, 512, 4, 2, 512, 10000.0, 512),
    "small": (2, 2048, 2048, 16, 4, 512, 10000.0, 512),  # rows of 2048: every weight takes the dp4a kernels
    "gqa8": (2, 4096, 1024, 32, 8, 512, 10000.0, 2048),  # Llama-3-8B's heads (32 x 128, 8 KV) in a small model
    "gqa3": (2, 768, 1024, 12, 4, 512, 100000.0, 2048),  # SmolLM2's group: 3 query heads of 64 a KV head (odd)
    # Llama-3-8B's heads and n_embd with down rows of two 2048-value K slices (the stack step's NTX_LQ_KS form:
    # 256 row groups of 16 on 132 SMs, so blocks with two and with one)
    "wide": (2, 4096, 4096, 32, 8, 512, 10000.0, 2048),
}


@dataclass(frozen=True)
class MoeShape:
    arch: str  # llama (Mixtral-style), qwen2moe or qwen3moe
    n_layers: int
    n_embd: int
    n_ff_exp: int  # one expert's gate/up rows
    n_head: int
    n_head_kv: int
    head_dim: int
    vocab: int
    rope_base: float
    context: int
    n_expert: int
    n_expert_used: int
    n_ff_shexp: int = 0  # shared expert rows (qwen2moe)


MOE_SHAPES = {
    "mixtral-8x7b": MoeShape("llama", 32, 4096, 14336, 32, 8, 128, 32000, 1e6, 32768, 8, 2),
    "qwen3-30b-a3b": MoeShape("qwen3moe", 48, 2048, 768, 32, 4, 128, 151936, 1e6, 40960, 128, 8),
    "qwen1.5-moe-a2.7b": MoeShape("qwen2moe", 24, 2048, 1408, 16, 16, 128, 151936, 1e6, 8192, 60, 4, 5632),
    "tiny-moe": MoeShape("llama", 2, 256, 256, 4, 2, 64, 512, 10000.0, 512, 8, 2),
    "tiny-qwen2moe": MoeShape("qwen2moe", 2, 256, 256, 4, 2, 64, 512, 1e6, 512, 8, 4, 512),
    "tiny-qwen3moe": MoeShape("qwen3moe", 2, 256, 256, 4, 2, 128, 512, 1e6, 512, 16, 4),
}

T = GGMLType
# mix: (default matrix type, {tensor-name suffix: type}). "q4_k_m": Q6_K for attn_v, ffn_down and output in every
# layer, Q4_K elsewhere (embeddings included) — the file the benchmarks and FACTS.md's llama.cpp numbers use since
# session 1. llama.cpp's own Q4_K_M gives attn_v and ffn_down Q6_K in half the layers only (MORE_BITS):
# "q4_k_m_lcpp" is that file ("q5_k_m_lcpp" its Q5_K_M).
MIXES = {
    "q4_k_m": (T.Q4_K, {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}),
    "q4_k_m_lcpp": (T.Q4_K, {"output": T.Q6_K}),
    "q5_k_m_lcpp": (T.Q5_K, {"output": T.Q6_K}),
    "q8_0": (T.Q8_0, {}),
    "q4_k": (T.Q4_K, {"output": T.Q6_K}),
    "q6_k": (T.Q6_K, {}),
    "f16": (T.F16, {}),
    "q4_1": (T.Q4_1, {"token_embd": T.Q8_0}),
    "q4_0": (T.Q4_0, {}),
    "q5_k_m": (T.Q5_K, {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}),
}

# mix: {tensor-name suffix: type} in the layers llama.cpp's quantizer gives more bits (llama_tensor_get_type's
# use_more_bits for Q4_K_M / Q5_K_M: the first and last eighth of the layers and every third between)
MORE_BITS = {m: {"attn_v": T.Q6_K, "ffn_down": T.Q6_K} for m in ("q4_k_m_lcpp", "q5_k_m_lcpp")}


def more_bits(i: int, n: int) -> bool:
    """Whether llama.cpp's K-quant mixes give layer i of n their higher-bit types."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def layer_type(mix: str, kind: str, layer: int, n_layers: int) -> GGMLType:
    """The type of a layer tensor (kind: its name's suffix, e.g. "attn_v") in a mix."""
    default, special = MIXES[mix]
    more = MORE_BITS.get(mix, {})
    if kind in more and more_bits(layer, n_layers):
        return more[kind]
    return special.get(kind, default)


# Largest |q * sub-scale| per type; d is drawn so d * that is about 0.06.
_QMAX = {T.Q4_0: 8, T.Q4_1: 15, T.Q5_0: 16, T.Q5_1: 31, T.Q8_0: 127, T.Q2_K: 45, T.Q3_K: 128,
         T.Q4_K: 945, T.Q5_K: 1953, T.Q6_K: 4096}
# byte offsets of the fp16 (d, min) fields; min is None for types without one
_SCALE_FIELDS = {T.Q4_0: (0, None), T.Q4_1: (0, 2), T.Q5_0: (0, None), T.Q5_1: (0, 2), T.Q8_0: (0, None),
                 T.Q2_K: (80, 82), T.Q3_K: (108, None), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, None)}
# min field = -d * this for legacy types (centres q), +d * this for K-quants (subtracted)
_MIN_CENTRE = {T.Q4_1: -8.0, T.Q5_1: -16.0, T.Q2_K: 1.5, T.Q4_K: 7.5, T.Q5_K: 15.0}


def random_blocks(ggml_type: GGMLType, n_elements: int, rng: np.random.Generator, std: float = 0.02) -> np.ndarray:
    """(n_blocks, type_size) uint8 of random valid blocks of `ggml_type`."""
    block, size = GGML_BLOCK_SIZES[ggml_type]
    nb = n_elements // block
    if ggml_type in (T.F32, T.F16, T.BF16):
        vals = (rng.standard_normal(n_elements, dtype=np.float32) * np.float32(std))
        if ggml_type == T.F16:
            vals = vals.astype(np.float16)
        elif ggml_type == T.BF16:
            vals = (vals.view(np.uint32) >> 16).astype(np.uint16)
        return vals.view(np.uint8).reshape(nb, size)
    blocks = np.frombuffer(rng.bytes(nb * size), np.uint8).reshape(nb, size).copy()
    d_off, m_off = _SCALE_FIELDS[ggml_type]
    d = (rng.uniform(0.5, 1.5, nb) * 0.06 / _QMAX[ggml_type]).astype(np.float32)
    blocks[:, d_off:d_off + 2] = d.astype("<f2").view(np.uint8).reshape(nb, 2)
    if m_off is not None:
        m = d * np.float32(_MIN_CENTRE[ggml_type]) * rng.uniform(0.8, 1.2, nb).astype(np.float32)
        blocks[:, m_off:m_off + 2] = m.astype("<f2").view(np.uint8).reshape(nb, 2)
    return blocks


def tensor_plan(shape: str, n_layers: int | None, mix: str) -> tuple[tuple, list[tuple[str, GGMLType, tuple[int, ...]]]]:
    """The hyper-parameters and (name, type, numpy shape) of every tensor, in file order."""
    layers, e, ff, nh, nkv, vocab, base, ctx = SHAPES[shape]
    layers = n_layers or layers
    hd = e // nh

    def typed(name: str, kind: str, shp: tuple[int, ...], i: int = -1):
        return (name, layer_type(mix, kind, i, layers), shp)

    plan = [typed("token_embd.weight", "token_embd", (vocab, e)), ("output_norm.weight", T.F32, (e,)),
            typed("output.weight", "output", (vocab, e))]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", T.F32, (e,)), typed(p + "attn_q.weight", "attn_q", (nh * hd, e), i),
                 typed(p + "attn_k.weight", "attn_k", (nkv * hd, e), i),
                 typed(p + "attn_v.weight", "attn_v", (nkv * hd, e), i),
                 typed(p + "attn_output.weight", "attn_output", (e, nh * hd), i), (p + "ffn_norm.weight", T.F32, (e,)),
                 typed(p + "ffn_gate.weight", "ffn_gate", (ff, e), i), typed(p + "ffn_up.weight", "ffn_up", (ff, e), i),
                 typed(p + "ffn_down.weight", "ffn_down", (e, ff), i)]
    return (layers, e, ff, nh, nkv, vocab, base, ctx), plan


def moe_tensor_plan(shape: str, n_layers: int | None, mix: str) -> tuple[MoeShape, list[tuple[str, GGMLType, tuple[int, ...]]]]:
    """The MoE shape (layer count applied) and (name, type, numpy shape) of every tensor."""
    m = MOE_SHAPES[shape]
    if n_layers:
        m = MoeShape(**{**m.__dict__, "n_layers": n_layers})
    e, q_dim, kv_dim, ff, n_exp = m.n_embd, m.n_head * m.head_dim, m.n_head_kv * m.head_dim, m.n_ff_exp, m.n_expert

    def typed(name: str, kind: str, shp: tuple[int, ...]):
        i = int(name.split(".")[1]) if name.startswith("blk.") else -1
        return (name, layer_type(mix, kind, i, m.n_layers), shp)

    plan = [typed("token_embd.weight", "token_embd", (m.vocab, e)), ("output_norm.weight", T.F32, (e,)),
            typed("output.weight", "output", (m.vocab, e))]
    for i in range(m.n_layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", T.F32, (e,)), typed(p + "attn_q.weight", "attn_q", (q_dim, e)),
                 typed(p + "attn_k.weight", "attn_k", (kv_dim, e)), typed(p + "attn_v.weight", "attn_v", (kv_dim, e)),
                 typed(p + "attn_output.weight", "attn_output", (e, q_dim)), (p + "ffn_norm.weight", T.F32, (e,)),
                 (p + "ffn_gate_inp.weight", T.F32, (n_exp, e)),
                 typed(p + "ffn_gate_exps.weight", "ffn_gate", (n_exp, ff, e)),
                 typed(p + "ffn_up_exps.weight", "ffn_up", (n_exp, ff, e)),
                 typed(p + "ffn_down_exps.weight", "ffn_down", (n_exp, e, ff))]
        if m.arch == "qwen3moe":
            plan += [(p + "attn_q_norm.weight", T.F32, (m.head_dim,)), (p + "attn_k_norm.weight", T.F32, (m.head_dim,))]
        if m.n_ff_shexp:
            sh = m.n_ff_shexp
            plan += [(p + "ffn_gate_inp_shexp.weight", T.F32, (e,)),
                     typed(p + "ffn_gate_shexp.weight", "ffn_gate", (sh, e)),
                     typed(p + "ffn_up_shexp.weight", "ffn_up", (sh, e)),
                     typed(p + "ffn_down_shexp.weight", "ffn_down", (e, sh))]
    return m, plan


def _moe_header(w, m: MoeShape) -> None:
    w.add_block_count(m.n_layers)
    w.add_context_length(m.context)
    w.add_embedding_length(m.n_embd)
    w.add_feed_forward_length(m.n_ff_exp if m.arch == "llama" else m.n_ff_exp * m.n_expert_used)
    w.add_head_count(m.n_head)
    w.add_head_count_kv(m.n_head_kv)
    w.add_key_length(m.head_dim)
    w.add_value_length(m.head_dim)
    w.add_rope_freq_base(m.rope_base)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(m.head_dim)
    w.add_vocab_size(m.vocab)
    w.add_expert_count(m.n_expert)
    w.add_expert_used_count(m.n_expert_used)
    if m.arch != "llama":
        w.add_expert_feed_forward_length(m.n_ff_exp)
    if m.n_ff_shexp:
        w.add_expert_shared_feed_forward_length(m.n_ff_shexp)


def _write_tensors(w, plan, rng: np.random.Generator) -> int:
    import gguf

    total = 0
    for name, t, shp in plan:
        if t == T.F32 and len(shp) == 1 and "shexp" not in name:  # norm gains near 1
            w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(shp[0])).astype(np.float32))
            continue
        if t == T.F32 and "gate_inp" in name:  # router: logits spread over a few units
            w.add_tensor(name, (rng.standard_normal(shp) * 0.1).astype(np.float32))
            continue
        blocks = random_blocks(t, int(np.prod(shp)), rng)
        row_bytes = blocks.size // int(np.prod(shp[:-1]))
        raw_shape = (*shp[:-1], row_bytes)
        w.add_tensor(name, blocks.reshape(raw_shape), raw_shape=raw_shape, raw_dtype=gguf.GGMLQuantizationType(int(t)))
        total += blocks.size
    return total


def write_moe_model(path: Path, shape: str, mix: str, n_layers: int | None = None, seed: int = 0) -> int:
    import gguf

    m, plan = moe_tensor_plan(shape, n_layers, mix)
    w = gguf.GGUFWriter(str(path), m.arch)
    w.add_name(f"synthetic {shape} {mix}")
    _moe_header(w, m)
    total = _write_tensors(w, plan, np.random.default_rng(seed))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def write_model(path: Path, shape: str, mix: str, n_layers: int | None = None, seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    import gguf

    if shape in MOE_SHAPES:
        return write_moe_model(path, shape, mix, n_layers, seed)
    (layers, e, ff, nh, nkv, vocab, base, ctx), plan = tensor_plan(shape, n_layers, mix)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic {shape} {mix}")
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(e)
    w.add_feed_forward_length(ff)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(e // nh)
    w.add_vocab_size(vocab)
    total = 0
    for name, t, shp in plan:
        if t == T.F32 and len(shp) == 1:  # norm gains near 1
            arr = (1.0 + 0.1 * rng.standard_normal(shp[0])).astype(np.float32)
            w.add_tensor(name, arr)
        else:
            blocks = random_blocks(t, int(np.prod(shp)), rng)
            row_bytes = blocks.size // shp[0]
            w.add_tensor(name, blocks.reshape(shp[0], row_bytes), raw_shape=(shp[0], row_bytes),
                         raw_dtype=gguf.GGMLQuantizationType(int(t)))
            total += blocks.size
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="llama3-8b")
    ap.add_argument("--mix", choices=sorted(MIXES), default="q4_k_m")
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--out", type=Path, required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    nbytes = write_model(a.out, a.shape, a.mix, a.layers, a.seed)
    print(f"{a.out}: {nbytes / 1e9:.2f} GB of tensors in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
