"""Mixture-of-experts transformers: Mixtral-style `llama` with experts, `qwen2moe`, `qwen3moe`.

A MoE layer replaces the dense SwiGLU with a router (`ffn_gate_inp`, F32, one logit per expert),
a top-k choice of experts per token and the weighted sum of those experts' SwiGLUs, read from
3-D tensors `ffn_{gate,up,down}_exps` (experts x rows x k). Numerics follow llama.cpp's
`build_moe_ffn`: softmax over all experts, top-k of the probabilities, the chosen
probabilities as weights (renormalized to sum 1 where the architecture does, see
`config.EXPERT_WEIGHTS_NORM`), each expert's down projection times its weight, added in slot
order. qwen2moe adds a shared expert scaled by sigmoid(`ffn_gate_inp_shexp` . h); qwen3moe has
no shared expert but RMS-normalizes each head of q and k before RoPE.

The routed products go through a per-backend `MoeOps` (numpy here, CUDA in
`backends/cuda_moe.py`: one launch per projection for all selected experts of a layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ntx_common.errors import ModelError
from ntx_engine.backends.base import Backend
from ntx_engine.config import ModelConfig
from ntx_engine.model import LayerWeights, Transformer, WeightLoader
from ntx_engine.quants import GGMLType, tensor_nbytes

GATING = ("softmax", "sigmoid")


def route(logits: np.ndarray, k: int, norm: bool, gating: str = "softmax") -> tuple[np.ndarray, np.ndarray]:
    """Router logits (n, n_expert) -> (ids (n, k) int32, weights (n, k) float32), as llama.cpp:
    probabilities by softmax (or sigmoid), the k largest (ties: the lower expert id first),
    their probabilities as weights, divided by their sum when `norm`."""
    x = np.asarray(logits, np.float32)
    if gating == "softmax":
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        probs = (e * (1.0 / e.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)).astype(np.float32)
    elif gating == "sigmoid":
        probs = (1.0 / (1.0 + np.exp(-x))).astype(np.float32)
    else:
        raise ValueError(f"gating must be one of {GATING}, got {gating!r}")
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"cannot pick {k} of {x.shape[-1]} experts")
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :k].astype(np.int32)
    w = np.take_along_axis(probs, ids, axis=-1)
    if norm:
        w = (w / w.sum(axis=-1, keepdims=True, dtype=np.float32)).astype(np.float32)
    return ids, w


@dataclass(frozen=True)
class ExpertTensor:
    """Where one 3-D expert tensor lives in the file: what the streaming tiers need to read
    only the selected experts (expert e is bytes [offset + e*expert_nbytes, + expert_nbytes))."""
    name: str
    ggml_type: GGMLType
    n_expert: int
    rows: int
    k: int
    offset: int  # absolute file offset of expert 0

    def __post_init__(self) -> None:
        if min(self.n_expert, self.rows, self.k) <= 0:
            raise ValueError(f"{self.name}: bad expert tensor shape {(self.n_expert, self.rows, self.k)}")

    @property
    def expert_nbytes(self) -> int:
        return tensor_nbytes(self.ggml_type, self.rows * self.k)

    def expert_range(self, e: int) -> tuple[int, int]:
        """(absolute file offset, nbytes) of expert e's (rows, k) matrix."""
        if not 0 <= e < self.n_expert:
            raise ValueError(f"{self.name}: expert {e} outside 0..{self.n_expert - 1}")
        return self.offset + e * self.expert_nbytes, self.expert_nbytes


@dataclass
class Experts:
    """A 3-D expert tensor prepared by a backend's MoeOps (`data`), with its file location."""
    where: ExpertTensor
    data: Any  # numpy: list of per-expert MatmulWeight; cuda: cuda_moe.CudaExperts


@dataclass
class MoeLayerWeights(LayerWeights):
    router: Any = None  # (n_expert, n_embd) ffn_gate_inp
    gate_exps: Experts | None = None  # (n_expert, n_ff_exp, n_embd)
    up_exps: Experts | None = None  # (n_expert, n_ff_exp, n_embd)
    down_exps: Experts | None = None  # (n_expert, n_embd, n_ff_exp)
    shexp_gate: Any = None  # (1, n_embd) qwen2moe: the shared expert's sigmoid gate
    w_gate_shexp: Any = None  # (n_ff_shexp, n_embd)
    w_up_shexp: Any = None  # (n_ff_shexp, n_embd)
    w_down_shexp: Any = None  # (n_embd, n_ff_shexp)
    q_norm: Any = None  # (head_dim,) qwen3moe
    k_norm: Any = None  # (head_dim,)


class NumpyMoe:
    """The routed-expert ops on the numpy backend. Every product goes through backend.matmul,
    so the oracle tests' rounding-noise jitter reaches the experts too."""

    def __init__(self, backend: Backend) -> None:
        self.b = backend

    def experts(self, raw: np.ndarray, where: ExpertTensor) -> list:
        flat = np.asarray(raw).reshape(-1).view(np.uint8)
        size = where.expert_nbytes
        return [self.b.matrix(flat[e * size:(e + 1) * size], where.ggml_type, (where.rows, where.k),
                              f"{where.name}[{e}]") for e in range(where.n_expert)]

    def route(self, logits: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
        return route(logits, k, norm)

    def routed(self, w: Experts, x: np.ndarray, ids: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """y (n, k_used, rows): token t's slot s through expert ids[t, s]. x is (n, k) (the same
        input for every slot: gate/up) or (n, k_used, k) (one input per slot: down). With `out`,
        entries whose id is negative are left as they are (the expert cache fills y in groups)."""
        n, used = ids.shape
        xs = x if x.ndim == 3 else np.broadcast_to(x[:, None, :], (n, used, x.shape[-1]))
        y = np.empty((n, used, w.where.rows), np.float32) if out is None else out
        for e in np.unique(ids):  # one matmul per selected expert over all its tokens
            if e < 0:
                continue
            t, s = np.nonzero(ids == e)
            y[t, s] = self.b.matmul(w.data[int(e)], np.ascontiguousarray(xs[t, s]))
        return y

    def combine(self, y: np.ndarray, weights: np.ndarray, shared: np.ndarray | None = None,
                shared_gate: np.ndarray | None = None) -> np.ndarray:
        """sum_s weights[:, s] * y[:, s] in slot order (+ sigmoid(shared_gate) * shared)."""
        out = y[:, 0] * weights[:, :1]
        for s in range(1, y.shape[1]):
            out = out + y[:, s] * weights[:, s:s + 1]
        if shared is not None:
            out = out + shared * (np.float32(1) / (np.float32(1) + np.exp(-shared_gate)))
        return out.astype(np.float32)


def make_ops(backend: Backend):
    if backend.name == "cuda":
        from ntx_engine.backends.cuda_moe import CudaMoe

        return CudaMoe(backend)
    return NumpyMoe(backend)


class MoeWeightLoader(WeightLoader):
    """WeightLoader for MoE layers: router, 3-D expert tensors, shared expert, q/k norms."""

    def __init__(self, gf: Any, cfg: ModelConfig, backend: Backend) -> None:
        super().__init__(gf, cfg, backend)
        self.ops = make_ops(backend)

    def experts(self, name: str, rows: int, k: int) -> Experts:
        where = self.expert_location(name, rows, k).where
        return Experts(where, self.ops.experts(self.gf.tensor_data(name), where))

    def expert_location(self, name: str, rows: int, k: int) -> Experts:
        """The tensor's place in the file, checked, without its bytes."""
        info = self._info(name, (self.cfg.n_expert, rows, k))
        return Experts(ExpertTensor(name, info.ggml_type, self.cfg.n_expert, rows, k, info.offset), None)

    def layer(self, i: int, experts: bool = True) -> MoeLayerWeights:
        """Layer i; experts=False leaves the expert tensors' bytes out (`Experts.data` None):
        the expert offload (moe_offload.py) keeps them in RAM and a VRAM cache."""
        c, p = self.cfg, f"blk.{i}."
        make = self.experts if experts else self.expert_location
        if p + "ffn_gate.0.weight" in self.gf.tensors:
            raise ModelError(f"{self.gf.path}: layer {i} stores its experts as separate 2-D tensors (an old "
                             "Mixtral conversion); re-convert it with a current llama.cpp convert_hf_to_gguf.py")
        shared = c.n_ff_shexp > 0
        return MoeLayerWeights(
            attn_norm=self.vector(p + "attn_norm.weight", c.n_embd),
            wq=self.matrix(p + "attn_q.weight", c.q_dim, c.n_embd),
            wk=self.matrix(p + "attn_k.weight", c.kv_dim, c.n_embd),
            wv=self.matrix(p + "attn_v.weight", c.kv_dim, c.n_embd),
            wo=self.matrix(p + "attn_output.weight", c.n_embd, c.q_dim),
            ffn_norm=self.vector(p + "ffn_norm.weight", c.n_embd),
            w_gate=None, w_up=None, w_down=None,
            bq=self.vector(p + "attn_q.bias", c.q_dim, optional=True),
            bk=self.vector(p + "attn_k.bias", c.kv_dim, optional=True),
            bv=self.vector(p + "attn_v.bias", c.kv_dim, optional=True),
            router=self.matrix(p + "ffn_gate_inp.weight", c.n_expert, c.n_embd),
            gate_exps=make(p + "ffn_gate_exps.weight", c.n_ff_exp, c.n_embd),
            up_exps=make(p + "ffn_up_exps.weight", c.n_ff_exp, c.n_embd),
            down_exps=make(p + "ffn_down_exps.weight", c.n_embd, c.n_ff_exp),
            shexp_gate=self._gate_row(p + "ffn_gate_inp_shexp.weight") if shared else None,
            w_gate_shexp=self.matrix(p + "ffn_gate_shexp.weight", c.n_ff_shexp, c.n_embd) if shared else None,
            w_up_shexp=self.matrix(p + "ffn_up_shexp.weight", c.n_ff_shexp, c.n_embd) if shared else None,
            w_down_shexp=self.matrix(p + "ffn_down_shexp.weight", c.n_embd, c.n_ff_shexp) if shared else None,
            q_norm=self.vector(p + "attn_q_norm.weight", c.head_dim) if c.qk_norm else None,
            k_norm=self.vector(p + "attn_k_norm.weight", c.head_dim) if c.qk_norm else None,
        )

    def matrix_specs(self, i: int) -> dict:
        """The streaming tiers build a streamed layer from its 2-D matrices; a MoE layer is never
        streamed whole: `engine.load_model` offloads its experts instead (moe_offload.py)."""
        raise ModelError(f"{self.gf.path}: layer {i} is a mixture-of-experts layer, which is not streamed "
                         "whole; load the model with Engine.load / engine.load_model, which keeps the dense "
                         "part in VRAM and offloads the experts (docs/moe.md)")

    def _gate_row(self, name: str) -> Any:
        """The shared expert's gate, a 1-D (n_embd,) tensor, as a (1, n_embd) matrix: llama.cpp
        multiplies it like one."""
        info = self._info(name, (self.cfg.n_embd,))
        return self.backend.matrix(self.gf.tensor_data(name), info.ggml_type, (1, self.cfg.n_embd), name)


class MoeTransformer(Transformer):
    """Transformer whose ffn is the routed mixture (plus a shared expert on qwen2moe) and whose
    attention normalizes q/k heads on qwen3moe. `on_route(i, ids)`, when set, sees each layer's
    chosen experts (numpy (n, k_used) int32, or a device array on CUDA) before they are read:
    the hook the expert-streaming tiers and cache statistics attach to."""

    def __init__(self, cfg: ModelConfig, weights: Any, backend: Backend, n_ctx: int) -> None:
        if not cfg.is_moe:
            raise ModelError(f"{cfg.arch} model has no experts: use the dense Transformer")
        super().__init__(cfg, weights, backend, n_ctx)
        self.moe = make_ops(backend)
        self.on_route: Callable[[int, Any], None] | None = None
        self.offload: Any = None  # moe_offload.ExpertOffload when the experts are not resident

    def ffn(self, i: int, lw: MoeLayerWeights, h: Any) -> Any:
        b, m, c = self.backend, self.moe, self.cfg
        ids, weights = m.route(b.matmul(lw.router, h), c.n_expert_used, c.expert_weights_norm)
        if self.on_route is not None:
            self.on_route(i, ids)
        if self.offload is not None:  # experts in RAM: the VRAM cache or the CPU computes them
            down = self.offload.routed(i, h, ids)
        else:
            act = b.swiglu(m.routed(lw.gate_exps, h, ids), m.routed(lw.up_exps, h, ids))  # (n, k_used, n_ff_exp)
            down = m.routed(lw.down_exps, act, ids)  # (n, k_used, n_embd)
        if lw.w_up_shexp is None:
            return m.combine(down, weights)
        shared = b.matmul(lw.w_down_shexp, b.swiglu(b.matmul(lw.w_gate_shexp, h), b.matmul(lw.w_up_shexp, h)))
        return m.combine(down, weights, shared, b.matmul(lw.shexp_gate, h))

    def attention(self, i: int, lw: MoeLayerWeights, x: Any, pos: np.ndarray, start: int) -> Any:
        if lw.q_norm is None:
            return super().attention(i, lw, x, pos, start)
        c, b = self.cfg, self.backend
        h = b.rmsnorm(x, lw.attn_norm, c.rms_eps)
        q, k, v = b.matmul(lw.wq, h), b.matmul(lw.wk, h), b.matmul(lw.wv, h)
        if lw.bq is not None:
            q, k, v = b.add(q, lw.bq), b.add(k, lw.bk), b.add(v, lw.bv)
        q, k = self._head_norm(q, lw.q_norm, c.n_head), self._head_norm(k, lw.k_norm, c.n_head_kv)
        q, k = b.rope(q, pos, c.n_head), b.rope(k, pos, c.n_head_kv)
        return b.add(x, b.matmul(lw.wo, b.attention(q, k, v, i, start)))

    def _head_norm(self, x: Any, w: Any, n_heads: int) -> Any:
        n, hd = x.shape[0], self.cfg.head_dim
        return self.backend.rmsnorm(x.reshape(n * n_heads, hd), w, self.cfg.rms_eps).reshape(n, n_heads * hd)


def model_classes(cfg: ModelConfig) -> tuple[type[WeightLoader], type[Transformer]]:
    """The loader and model for a config: the MoE pair when the file has experts."""
    return (MoeWeightLoader, MoeTransformer) if cfg.is_moe else (WeightLoader, Transformer)
