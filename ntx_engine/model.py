"""The transformer (llama / qwen2 families), written once against the backend op interface."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ntx_common.errors import ModelError
from ntx_engine.backends import base as ops
from ntx_engine.backends.base import Backend
from ntx_engine.config import ModelConfig
from ntx_engine import head_stream
from ntx_engine.head_stream import StreamedMatrix


@dataclass
class LayerWeights:
    attn_norm: Any  # (n_embd,)
    wq: Any  # (n_head*head_dim, n_embd)
    wk: Any  # (n_head_kv*head_dim, n_embd)
    wv: Any  # (n_head_kv*head_dim, n_embd)
    wo: Any  # (n_embd, n_head*head_dim)
    ffn_norm: Any  # (n_embd,)
    w_gate: Any  # (n_ff, n_embd)
    w_up: Any  # (n_ff, n_embd)
    w_down: Any  # (n_embd, n_ff)
    bq: Any = None  # (n_head*head_dim,) qwen2 only
    bk: Any = None  # (n_head_kv*head_dim,)
    bv: Any = None  # (n_head_kv*head_dim,)


@dataclass
class ModelWeights:
    tok_embd: Any  # (vocab, n_embd)
    output_norm: Any  # (n_embd,)
    output: Any  # (vocab, n_embd); the embedding table itself when tied
    layers: list[LayerWeights]
    rope_freqs: np.ndarray | None  # (rope_dim/2,) llama3 frequency factors


class WeightLoader:
    """Reads tensors by name from a GGUF file, checks their shapes, hands them to the backend."""

    def __init__(self, gf: Any, cfg: ModelConfig, backend: Backend) -> None:
        self.gf, self.cfg, self.backend = gf, cfg, backend

    def matrix(self, name: str, rows: int, cols: int) -> Any:
        info = self._info(name, (rows, cols))
        return self.backend.matrix(self.gf.tensor_data(name), info.ggml_type, (rows, cols), name)

    def vector(self, name: str, n: int, *, optional: bool = False) -> Any:
        if optional and name not in self.gf.tensors:
            return None
        info = self._info(name, (n,))
        return self.backend.vector(self.gf.tensor_data(name), info.ggml_type, n, name)

    def _info(self, name: str, shape: tuple[int, ...]) -> Any:
        info = self.gf.tensors.get(name)
        if info is None:
            raise ModelError(f"{self.gf.path}: tensor {name!r} is missing; the file is not a complete {self.cfg.arch} model")
        if tuple(info.shape) != shape:
            raise ModelError(f"{self.gf.path}: tensor {name!r} has shape {tuple(info.shape)}, expected {shape}")
        return info

    def matrix_specs(self, i: int) -> dict[str, tuple[str, int, tuple[int, int]]]:
        """Layer i's 2-D weights: LayerWeights field -> (tensor name, ggml type, (rows, k)), checked."""
        c, p = self.cfg, f"blk.{i}."
        shapes = {"wq": ("attn_q", c.q_dim, c.n_embd), "wk": ("attn_k", c.kv_dim, c.n_embd),
                  "wv": ("attn_v", c.kv_dim, c.n_embd), "wo": ("attn_output", c.n_embd, c.q_dim),
                  "w_gate": ("ffn_gate", c.n_ff, c.n_embd), "w_up": ("ffn_up", c.n_ff, c.n_embd),
                  "w_down": ("ffn_down", c.n_embd, c.n_ff)}
        out = {}
        for field, (short, rows, cols) in shapes.items():
            name = f"{p}{short}.weight"
            out[field] = (name, int(self._info(name, (rows, cols)).ggml_type), (rows, cols))
        return out

    def layer_vectors(self, i: int) -> dict[str, Any]:
        """Layer i's 1-D weights (norm gains, qwen2 biases): small, kept resident even when the
        layer streams."""
        c, p = self.cfg, f"blk.{i}."
        return dict(attn_norm=self.vector(p + "attn_norm.weight", c.n_embd),
                    ffn_norm=self.vector(p + "ffn_norm.weight", c.n_embd),
                    bq=self.vector(p + "attn_q.bias", c.q_dim, optional=True),
                    bk=self.vector(p + "attn_k.bias", c.kv_dim, optional=True),
                    bv=self.vector(p + "attn_v.bias", c.kv_dim, optional=True))

    def layer(self, i: int) -> LayerWeights:
        mats = {f: self.backend.matrix(self.gf.tensor_data(name), t, shape, name)
                for f, (name, t, shape) in self.matrix_specs(i).items()}
        return LayerWeights(**mats, **self.layer_vectors(i))

    def load(self, progress: Callable[[int, int], None] | None = None,
             layers: Sequence[int] | None = None, head: tuple | None = None) -> ModelWeights:
        """Embeddings, head and the blocks in `layers` (default all); other blocks are None
        (the streaming pipeline builds them in its slots). head: (tok_embd, output) to use
        instead of loading them (head_stream.StreamedMatrix: read from storage every token)."""
        c = self.cfg
        if head is not None:
            tok_embd, output = head
        else:
            tok_embd = self.matrix("token_embd.weight", c.vocab_size, c.n_embd)
            output = tok_embd if c.tied_embeddings else self.matrix("output.weight", c.vocab_size, c.n_embd)
        wanted = set(range(c.n_layers) if layers is None else layers)
        out: list[LayerWeights | None] = []
        for i in range(c.n_layers):
            out.append(self.layer(i) if i in wanted else None)
            if progress:
                progress(i + 1, c.n_layers)
        freqs = None
        if c.has_rope_freqs:
            freqs = self.backend.to_numpy(self.vector("rope_freqs.weight", c.rope_dim // 2))
        return ModelWeights(tok_embd, self.vector("output_norm.weight", c.n_embd), output, out, freqs)


def close_owned_reader(source: Any) -> None:
    """Close the storage reader tiers.build opened for a layer source (`owned_reader`), once."""
    reader = getattr(source, "owned_reader", None)
    if reader is not None:
        source.owned_reader = None
        reader.close()


class ResidentLayers:
    """Layer weights that all sit in the backend already: `acquire` hands them out as they are.
    The streaming pipeline (`pipeline.py`) implements the same two calls over a slot ring."""

    def __init__(self, layers: list[LayerWeights]) -> None:
        self.layers = layers
        self.owned_reader: Any = None  # the storage reader of a streamed head (tiers.build), closed with us

    def acquire(self, i: int) -> LayerWeights:
        return self.layers[i]

    def close(self) -> None:
        close_owned_reader(self)

    def release(self, i: int) -> None:
        pass


class Transformer:
    """forward() runs embed -> blocks -> head. Hooks for the later features: `layers` picks the
    blocks to run (layer skip, self-speculative drafts), `self.source` hands out each block's
    weights (resident, or streamed through the pipeline), `ffn` is one method so a
    mixture-of-experts model can replace it."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, backend: Backend, n_ctx: int) -> None:
        self.cfg, self.w, self.backend, self.n_ctx = cfg, weights, backend, n_ctx
        self.source = ResidentLayers(weights.layers)
        backend.set_model(cfg, n_ctx, weights.rope_freqs)

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False,
                layers: Sequence[int] | None = None) -> np.ndarray:
        """Run tokens `ids` at positions start.. through `layers` (default: all, in order);
        returns logits (n or 1, vocab) as numpy float32."""
        if start + len(ids) > self.n_ctx:
            raise ModelError(f"context length exceeded: {start + len(ids)} tokens > n_ctx {self.n_ctx}")
        pos = np.arange(start, start + len(ids))
        x = self.embed(np.asarray(ids))
        if layers is None and len(ids) == 1 and self.stackable():
            y = self.backend.decode_stack(self.w.layers, x, start)
            if y is not None:  # every layer in one launch (CudaBackend's "stack")
                return self.head(y, all_logits)
        order = range(self.cfg.n_layers) if layers is None else layers
        if hasattr(self.source, "begin"):  # the streaming pipeline follows the pass's layer set
            self.source.begin(order)
        for i in order:
            lw = self.source.acquire(i)
            try:
                x = self.run_layer(i, lw, x, pos, start)
            finally:
                self.source.release(i)
        return self.head(self.settle(x), all_logits)

    def stackable(self) -> bool:
        """Whether a backend's one-launch decode of all layers (decode_stack) may stand for the
        loop: resident layers and none of the per-layer hooks replaced (hybrid, MoE, skip)."""
        cls = type(self)
        return (hasattr(self.backend, "decode_stack") and type(self.source) is ResidentLayers
                and "run_layer" not in vars(self) and cls.run_layer is Transformer.run_layer
                and cls.block is Transformer.block and cls.attention is Transformer.attention
                and cls.ffn is Transformer.ffn)

    # hooks: hybrid.HostLayers runs some layers on a host backend (x then lives in host memory)
    def run_layer(self, i: int, lw: LayerWeights, x: Any, pos: np.ndarray, start: int) -> Any:
        return self.block(i, lw, x, pos, start)

    def settle(self, x: Any) -> Any:
        """x back on this model's backend after the last layer."""
        return x

    def block(self, i: int, lw: LayerWeights, x: Any, pos: np.ndarray, start: int) -> Any:
        """One transformer layer: x + attention(norm(x)), then + ffn(norm(x))."""
        x = self.attention(i, lw, x, pos, start)
        return self.backend.add(x, self.ffn(i, lw, self.backend.rmsnorm(x, lw.ffn_norm, self.cfg.rms_eps)))

    def attention(self, i: int, lw: LayerWeights, x: Any, pos: np.ndarray, start: int) -> Any:
        c, b = self.cfg, self.backend
        h = b.rmsnorm(x, lw.attn_norm, c.rms_eps)
        q, k, v = ops.matmul_many(b, (lw.wq, lw.wk, lw.wv), h)  # fused ops: backends/base.py
        if lw.bq is not None:
            q, k, v = b.add(q, lw.bq), b.add(k, lw.bk), b.add(v, lw.bv)
        return b.add(x, b.matmul(lw.wo, ops.rope_attention(b, c, q, k, v, pos, i, start)))

    def ffn(self, i: int, lw: LayerWeights, h: Any) -> Any:
        """The feed-forward of layer i on the normalized h (SwiGLU); MoE layers override this."""
        b = self.backend
        return b.matmul(lw.w_down, ops.matmul_swiglu(b, lw.w_gate, lw.w_up, h))

    def embed(self, ids: np.ndarray) -> Any:
        return head_stream.embed(self.backend, self.w.tok_embd, ids)

    def head(self, x: Any, all_logits: bool) -> np.ndarray:
        b = self.backend
        if not all_logits:
            x = x[-1:]
        x = b.rmsnorm(x, self.w.output_norm, self.cfg.rms_eps)
        if isinstance(self.w.output, StreamedMatrix):
            return self.w.output.matmul(x)
        return b.to_numpy(b.matmul(self.w.output, x))
