"""Small synthetic GGUF models with random weights, for oracle tests that real files cannot cover.

- a llama model with 256-multiple widths (every K-quant block path), untied output head and
  llama3-style `rope_freqs` factors;
- a qwen2 model (Q/K/V biases, NeoX RoPE);
- mixture-of-experts models (`write_tiny_moe`): a Mixtral-style llama, a qwen2moe (shared expert
  with its sigmoid gate, Q/K/V biases) and a qwen3moe (per-head q/k RMSNorm, head_dim != n_embd/n_head).
All borrow SmolLM2's tokenizer metadata so llama.cpp loads them. Written with gguf-py.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

TOKENIZER_KEYS = (
    "tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.add_bos_token",
)


def _copy_tokenizer(w: gguf.GGUFWriter, src: gguf.GGUFReader) -> int:
    vocab = 0
    for key in TOKENIZER_KEYS:
        f = src.fields.get(key)
        if f is None:
            continue
        value = f.contents()
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
            if key == "tokenizer.ggml.tokens":
                vocab = len(value)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(key, value)
        elif vtype == gguf.GGUFValueType.BOOL:
            w.add_bool(key, value)
        else:
            w.add_uint32(key, int(value))
    return vocab


def write_tiny(path: Path, tokenizer_src: Path, arch: str, *, seed: int = 0, n_layers: int = 2,
               n_embd: int = 256, n_ff: int = 512, n_head: int = 4, n_head_kv: int = 2) -> Path:
    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(tokenizer_src))
    w = gguf.GGUFWriter(str(path), arch)
    vocab = _copy_tokenizer(w, src)
    head_dim = n_embd // n_head
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    def t(name: str, *shape: int, scale: float = 0.05) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, n_embd, scale=0.5)
    for i in range(n_layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1.0 + 0.1 * rng.standard_normal(n_embd)).astype(np.float32))
        t(p + "attn_q.weight", n_head * head_dim, n_embd)
        t(p + "attn_k.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_v.weight", n_head_kv * head_dim, n_embd)
        t(p + "attn_output.weight", n_embd, n_head * head_dim)
        t(p + "ffn_gate.weight", n_ff, n_embd)
        t(p + "ffn_up.weight", n_ff, n_embd)
        t(p + "ffn_down.weight", n_embd, n_ff)
        if arch == "qwen2":
            t(p + "attn_q.bias", n_head * head_dim, scale=0.5)
            t(p + "attn_k.bias", n_head_kv * head_dim, scale=0.5)
            t(p + "attn_v.bias", n_head_kv * head_dim, scale=0.5)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", vocab, n_embd, scale=0.1)
    if arch == "llama":  # llama3-style frequency factors: low frequencies slowed down
        ff = np.where(np.arange(head_dim // 2) < head_dim // 4, 1.0, 4.0).astype(np.float32)
        w.add_tensor("rope_freqs.weight", ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# arch: (n_expert, n_expert_used, n_ff_exp, n_ff_shexp, head_dim)
MOE_SHAPES = {"llama": (8, 2, 256, 0, 64), "qwen2moe": (8, 4, 256, 512, 64), "qwen3moe": (16, 4, 256, 0, 128)}


def write_tiny_moe(path: Path, tokenizer_src: Path, arch: str, *, seed: int = 0, n_layers: int = 2,
                   n_embd: int = 256, n_head: int = 4, n_head_kv: int = 2) -> Path:
    """A tiny MoE model with F32 random weights; the router is scaled so its logits spread over
    a few units (routing that depends on the token, with few near-ties)."""
    n_expert, n_used, n_ff_exp, n_ff_shexp, head_dim = MOE_SHAPES[arch]
    rng = np.random.default_rng(seed)
    src = gguf.GGUFReader(str(tokenizer_src))
    w = gguf.GGUFWriter(str(path), arch)
    vocab = _copy_tokenizer(w, src)
    w.add_block_count(n_layers)
    w.add_context_length(2048)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff_exp if arch == "llama" else 2 * n_ff_exp)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(10000.0 if arch == "llama" else 1000000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(head_dim)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(n_used)
    if arch != "llama":
        w.add_expert_feed_forward_length(n_ff_exp)
    if n_ff_shexp:
        w.add_expert_shared_feed_forward_length(n_ff_shexp)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)

    def t(name: str, *shape: int, scale: float = 0.05) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def gain(name: str, n: int) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", vocab, n_embd, scale=0.5)
    q_dim, kv_dim = n_head * head_dim, n_head_kv * head_dim
    for i in range(n_layers):
        p = f"blk.{i}."
        gain(p + "attn_norm.weight", n_embd)
        gain(p + "ffn_norm.weight", n_embd)
        t(p + "attn_q.weight", q_dim, n_embd)
        t(p + "attn_k.weight", kv_dim, n_embd)
        t(p + "attn_v.weight", kv_dim, n_embd)
        t(p + "attn_output.weight", n_embd, q_dim)
        if arch == "qwen2moe":
            t(p + "attn_q.bias", q_dim, scale=0.5)
            t(p + "attn_k.bias", kv_dim, scale=0.5)
            t(p + "attn_v.bias", kv_dim, scale=0.5)
        if arch == "qwen3moe":
            gain(p + "attn_q_norm.weight", head_dim)
            gain(p + "attn_k_norm.weight", head_dim)
        t(p + "ffn_gate_inp.weight", n_expert, n_embd, scale=0.2)
        t(p + "ffn_gate_exps.weight", n_expert, n_ff_exp, n_embd)
        t(p + "ffn_up_exps.weight", n_expert, n_ff_exp, n_embd)
        t(p + "ffn_down_exps.weight", n_expert, n_embd, n_ff_exp)
        if n_ff_shexp:
            t(p + "ffn_gate_inp_shexp.weight", n_embd, scale=0.2)
            t(p + "ffn_gate_shexp.weight", n_ff_shexp, n_embd)
            t(p + "ffn_up_shexp.weight", n_ff_shexp, n_embd)
            t(p + "ffn_down_shexp.weight", n_embd, n_ff_shexp)
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    t("output.weight", vocab, n_embd, scale=0.1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
