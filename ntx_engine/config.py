"""Model hyper-parameters read from GGUF metadata (`ModelConfig.from_gguf`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ntx_common.errors import ModelError

# RoPE pairing as GGUF files expect it. The HF->GGUF converter permutes llama's Q/K rows so
# that adjacent pairs (x[2i], x[2i+1]) rotate together ("norm"); qwen2 keeps HF's halves
# (x[i], x[i + d/2]) ("neox"). A wrong pairing still yields fluent text: only the oracle catches it.
ROPE_NORM = "norm"
ROPE_NEOX = "neox"

SUPPORTED_ARCHS = {"llama": ROPE_NORM, "qwen2": ROPE_NEOX}


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_dim: int
    rope_base: float
    rope_type: str
    rope_freq_scale: float  # 1/factor for linear scaling, 1.0 otherwise
    has_rope_freqs: bool  # llama3-style per-dimension frequency factors (`rope_freqs.weight`)
    rms_eps: float
    context_length: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_embd", "n_ff", "n_head", "n_head_kv", "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.n_head % self.n_head_kv:
            raise ValueError(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.rope_dim > self.head_dim or self.rope_dim % 2:
            raise ValueError(f"rope_dim {self.rope_dim} must be even and <= head_dim {self.head_dim}")
        if self.rope_type not in (ROPE_NORM, ROPE_NEOX):
            raise ValueError(f"unknown rope type {self.rope_type!r}")

    @property
    def q_dim(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_head_kv * self.head_dim

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], tensor_names: set[str] | frozenset[str]) -> "ModelConfig":
        arch = str(metadata.get("general.architecture", ""))
        if arch not in SUPPORTED_ARCHS:
            raise ModelError(
                f"unsupported architecture {arch!r} (supported: {', '.join(sorted(SUPPORTED_ARCHS))})"
            )
        get = _getter(metadata, arch)
        n_embd = int(get("embedding_length"))
        n_head = int(get("attention.head_count"))
        head_dim = int(get("attention.key_length", n_embd // n_head))
        vocab = metadata.get(f"{arch}.vocab_size")
        if vocab is None:
            vocab = len(metadata["tokenizer.ggml.tokens"])
        try:
            return cls(
                arch=arch,
                n_layers=int(get("block_count")),
                n_embd=n_embd,
                n_ff=int(get("feed_forward_length")),
                n_head=n_head,
                n_head_kv=int(get("attention.head_count_kv", n_head)),
                head_dim=head_dim,
                rope_dim=int(get("rope.dimension_count", head_dim)),
                rope_base=float(get("rope.freq_base", 10000.0)),
                rope_type=SUPPORTED_ARCHS[arch],
                rope_freq_scale=_rope_freq_scale(get),
                has_rope_freqs="rope_freqs.weight" in tensor_names,
                rms_eps=float(get("attention.layer_norm_rms_epsilon")),
                context_length=int(get("context_length", 2048)),
                vocab_size=int(vocab),
                tied_embeddings="output.weight" not in tensor_names,
                qkv_bias="blk.0.attn_q.bias" in tensor_names,
            )
        except ValueError as exc:
            raise ModelError(f"inconsistent {arch} hyper-parameters in the GGUF metadata: {exc}") from exc


def _getter(metadata: Mapping[str, Any], arch: str):
    missing = object()

    def get(key: str, default: Any = missing) -> Any:
        value = metadata.get(f"{arch}.{key}", missing)
        if value is missing:
            if default is missing:
                raise ModelError(f"GGUF metadata lacks {arch}.{key}, which a {arch} model needs")
            return default
        return value

    return get


def _rope_freq_scale(get) -> float:
    kind = str(get("rope.scaling.type", "none"))
    if kind in ("none", ""):
        return 1.0
    if kind == "linear":
        factor = float(get("rope.scaling.factor", 1.0))
        return 1.0 / factor if factor > 0 else 1.0
    raise ModelError(f"unsupported RoPE scaling type {kind!r} (supported: none, linear, llama3 rope_freqs)")
