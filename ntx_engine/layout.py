"""Where each layer's bytes live in the GGUF file, and how a layer lands in a ring slot.

A streamed layer is moved as ONE contiguous byte span of the file: from its first tensor's
first byte to its last tensor's last byte (GGUF writers store `blk.N.*` together). The slot
that receives it keeps the file's relative offsets, so a tensor's place in the slot is
`tensor.offset - span.start` and one read + one host-to-device copy move the whole layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from ntx_common.errors import ModelError
from ntx_engine.config import ModelConfig

# the 2-D weights of a block, in the order LayerWeights names them
MATRIX_FIELDS = {"wq": "attn_q", "wk": "attn_k", "wv": "attn_v", "wo": "attn_output",
                 "w_gate": "ffn_gate", "w_up": "ffn_up", "w_down": "ffn_down"}
VECTOR_FIELDS = {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm",
                 "bq": "attn_q.bias", "bk": "attn_k.bias", "bv": "attn_v.bias"}
WASTE_LIMIT = 1.10  # a span holding >10 % of other bytes means the file interleaves layers


@dataclass(frozen=True)
class LayerSpan:
    """Layer `index` = file bytes [start, end); `tensors` maps tensor name -> its offset in the span."""

    index: int
    start: int
    end: int
    tensors: dict[str, int]
    tensor_bytes: int  # sum of the tensors' own bytes (the span may hold padding)

    def __post_init__(self) -> None:
        if self.end <= self.start:
            raise ValueError(f"layer {self.index}: empty span [{self.start}, {self.end})")

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layer_spans(gf, cfg: ModelConfig) -> list[LayerSpan]:
    """One span per block, checked to be contiguous enough to stream as one read."""
    spans = []
    for i in range(cfg.n_layers):
        prefix = f"blk.{i}."
        infos = [t for name, t in gf.tensors.items() if name.startswith(prefix)]
        if not infos:
            raise ModelError(f"{gf.path}: layer {i} has no tensors (blk.{i}.*): the file is not a "
                             f"complete {cfg.arch} model")
        start, end = min(t.offset for t in infos), max(t.end for t in infos)
        own = sum(t.nbytes for t in infos)
        if end - start > WASTE_LIMIT * own + 4096:
            raise ModelError(f"{gf.path}: the tensors of layer {i} are not stored together "
                             f"({end - start} bytes span for {own} bytes of tensors); re-save the "
                             "file with a standard GGUF writer to stream it")
        spans.append(LayerSpan(i, start, end, {t.name: t.offset - start for t in infos}, own))
    return spans


def resident_bytes(gf, cfg: ModelConfig) -> int:
    """Bytes of everything outside the blocks: embeddings, output norm and head (always in VRAM)."""
    names = ["token_embd.weight", "output_norm.weight", "rope_freqs.weight"]
    if not cfg.tied_embeddings:
        names.append("output.weight")
    return sum(gf.tensors[n].nbytes for n in names if n in gf.tensors)
