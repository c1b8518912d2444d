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

SUPPORTED_ARCHS = {"llama": ROPE_NORM, "qwen2": ROPE_NEOX, "qwen2moe": ROPE_NEOX, "qwen3moe": ROPE_NEOX}
# Whether llama.cpp renormalizes the top-k router probabilities to sum to 1, per architecture
# (hard-coded in its graph builders, not read from the file): Mixtral-style llama and qwen3moe
# do, qwen2moe does not (its shared expert carries the rest).
EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True}
MOE_ARCHS = ("qwen2moe", "qwen3moe")  # architectures that always have experts


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
    # mixture of experts (moe.py); 0 experts = a dense model
    n_expert: int = 0  # experts per layer (`expert_count`)
    n_expert_used: int = 0  # experts each token is routed to (`expert_used_count`)
    n_ff_exp: int = 0  # rows of one expert's gate/up (`expert_feed_forward_length`)
    n_ff_shexp: int = 0  # rows of the shared expert (qwen2moe), 0 when there is none
    expert_weights_norm: bool = False  # top-k weights renormalized to sum 1
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (qwen3moe)

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
        if self.n_expert < 0 or self.n_expert_used < 0 or self.n_ff_exp < 0 or self.n_ff_shexp < 0:
            raise ValueError("expert counts and widths must not be negative")
        if self.n_expert and not 0 < self.n_expert_used <= self.n_expert:
            raise ValueError(f"expert_used_count {self.n_expert_used} must be between 1 and "
                             f"expert_count {self.n_expert}")
        if self.n_expert and self.n_ff_exp <= 0:
            raise ValueError("a mixture-of-experts model needs a positive expert feed-forward length")

    @property
    def is_moe(self) -> bool:
        return self.n_expert > 0

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
        experts = _expert_fields(get, arch)
        try:
            return cls(
                arch=arch,
                n_layers=int(get("block_count")),
                n_embd=n_embd,
                n_ff=int(get("feed_forward_length", *([experts["n_ff_exp"]] if experts else []))),
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
                qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
                **experts,
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


def _expert_fields(get, arch: str) -> dict[str, Any]:
    """The MoE hyper-parameters, as llama.cpp derives them: an expert's width defaults to
    feed_forward_length / expert_used_count (qwen*moe) or feed_forward_length itself (llama)."""
    n_expert = int(get("expert_count", 0))
    if n_expert == 0:
        if arch in MOE_ARCHS:
            raise ModelError(f"GGUF metadata lacks {arch}.expert_count, which a {arch} model needs")
        return {}
    used = int(get("expert_used_count", 0))
    if not 0 < used <= n_expert:
        raise ModelError(f"{arch}.expert_used_count is {used} but {arch}.expert_count is {n_expert}: "
                         f"each token must use between 1 and {n_expert} experts; the file's metadata is broken")
    n_ff = int(get("feed_forward_length", 0))
    default_exp = n_ff if arch == "llama" else n_ff // used
    n_ff_exp = int(get("expert_feed_forward_length", default_exp))
    shexp = int(get("expert_shared_feed_forward_length", n_ff)) if arch == "qwen2moe" else 0
    if n_ff_exp <= 0:
        raise ModelError(f"GGUF metadata lacks {arch}.expert_feed_forward_length (and feed_forward_length)")
    return dict(n_expert=n_expert, n_expert_used=used, n_ff_exp=n_ff_exp, n_ff_shexp=shexp,
                expert_weights_norm=EXPERT_WEIGHTS_NORM[arch])


def _rope_freq_scale(get) -> float:
    kind = str(get("rope.scaling.type", "none"))
    if kind in ("none", ""):
        return 1.0
    if kind == "linear":
        factor = float(get("rope.scaling.factor", 1.0))
        return 1.0 / factor if factor > 0 else 1.0
    raise ModelError(f"unsupported RoPE scaling type {kind!r} (supported: none, linear, llama3 rope_freqs)")
