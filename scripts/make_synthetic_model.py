#!/usr/bin/env python3
"""Write a GGUF file with a real model's shapes filled with random but valid quant blocks.

For benchmarks and kernel tests where only bytes and shapes matter: every block's scale fields
are finite fp16 values sized so activations stay in range through all layers; the rest of each
block is random bits. Written with gguf-py's GGUFWriter (llama.cpp loads these files too).

    python scripts/make_synthetic_model.py --shape llama3-8b --mix q4_k_m -o /tmp/l8b-q4km.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
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
}

T = GGMLType
# mix: (default matrix type, {tensor-name suffix: type}); "q4_k_m" as llama.cpp makes it for
# Llama-3 (Q6_K for attn_v, ffn_down and output; Q4_K elsewhere, embeddings included)
MIXES = {
    "q4_k_m": (T.Q4_K, {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}),
    "q8_0": (T.Q8_0, {}),
    "q6_k": (T.Q6_K, {}),
    "f16": (T.F16, {}),
    "q4_1": (T.Q4_1, {"token_embd": T.Q8_0}),
    "q4_0": (T.Q4_0, {}),
    "q5_k_m": (T.Q5_K, {"attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K}),
}

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
    default, special = MIXES[mix]

    def typed(name: str, kind: str, shp: tuple[int, ...]):
        return (name, special.get(kind, default), shp)

    plan = [typed("token_embd.weight", "token_embd", (vocab, e)), ("output_norm.weight", T.F32, (e,)),
            typed("output.weight", "output", (vocab, e))]
    for i in range(layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", T.F32, (e,)), typed(p + "attn_q.weight", "attn_q", (nh * hd, e)),
                 typed(p + "attn_k.weight", "attn_k", (nkv * hd, e)), typed(p + "attn_v.weight", "attn_v", (nkv * hd, e)),
                 typed(p + "attn_output.weight", "attn_output", (e, nh * hd)), (p + "ffn_norm.weight", T.F32, (e,)),
                 typed(p + "ffn_gate.weight", "ffn_gate", (ff, e)), typed(p + "ffn_up.weight", "ffn_up", (ff, e)),
                 typed(p + "ffn_down.weight", "ffn_down", (e, ff))]
    return (layers, e, ff, nh, nkv, vocab, base, ctx), plan


def write_model(path: Path, shape: str, mix: str, n_layers: int | None = None, seed: int = 0) -> int:
    """Write the file; returns its tensor bytes."""
    import gguf

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
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
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
