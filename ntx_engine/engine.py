"""The Python API: load a model, tokenize, full logits, and streaming generation."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from ntx_common.errors import ModelError, UsageError
from ntx_engine import tiers
from ntx_engine.backends import default_device, make_backend
from ntx_engine.chat import ChatTemplate
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.layout import layer_spans
from ntx_engine.model import Transformer
from ntx_engine.modelfile import open_model
from ntx_engine.planner import Links
from ntx_engine.moe import model_classes
from ntx_engine.sampler import Sampler, SamplerConfig
from ntx_engine.tokenizer import Tokenizer

PREFILL_CHUNK = 256  # tokens per batched prefill pass: bounds the attention score buffer


@dataclass(frozen=True)
class EngineConfig:
    device: str = "auto"  # "auto": cuda when a usable GPU is present, else cpu (numpy)
    matmul_mode: str = "ggml"  # "ggml": activations quantized as llama.cpp does; "exact": float32
    kv_dtype: str = "f16"
    n_ctx: int = 4096
    # tiers (see planner.py): None = what is free (cuMemGetInfo / MemAvailable) minus reserves
    vram_budget: int | None = None
    ram_budget: int | None = None
    storage: str = "auto"  # reader for storage-tier layers: auto | direct | mmap | vfio
    tiers: str = "auto"  # "mmap-baseline": the naive synchronous mode benchmarks compare against
    n_slots: int | None = None  # VRAM ring slots for streamed layers (None: the planner's default)
    links: Links | None = None  # measured bandwidths; None = measure (cached in ~/.cache/ntx)
    # backend computing CPU-tier layers (hybrid): None = auto (native CPU kernels next to a GPU),
    # "none" = never, or a device name ("cpu", "numpy")
    host_device: str | None = None
    hybrid: str = "auto"  # "cpu": every non-resident layer computed on the CPU (--hybrid cpu)
    # MoE expert offload (moe_offload.py): cache policy, slots (None: from the VRAM budget; a
    # number forces the offload), and where experts are computed: auto | gpu | cpu
    expert_cache: str = "lru"
    expert_slots: int | None = None
    moe_experts: str = "auto"

    def __post_init__(self) -> None:
        if self.storage not in ("auto", "direct", "mmap", "vfio"):
            raise ValueError(f"storage must be auto, direct, mmap or vfio, got {self.storage!r}")
        if self.n_ctx <= 0:
            raise ValueError(f"n_ctx must be positive, got {self.n_ctx}")
        if self.matmul_mode not in ("ggml", "exact"):
            raise ValueError(f"matmul_mode must be 'ggml' or 'exact', got {self.matmul_mode!r}")
        if self.kv_dtype not in ("f16", "f32"):
            raise ValueError(f"kv_dtype must be 'f16' or 'f32', got {self.kv_dtype!r}")
        if self.hybrid not in ("auto", "cpu"):
            raise ValueError(f"hybrid must be 'auto' or 'cpu', got {self.hybrid!r}")
        if self.hybrid == "cpu" and self.host_device == "none":
            raise ValueError("hybrid 'cpu' computes layers on a host backend; host_device 'none' forbids one")
        if self.expert_cache not in ("lru", "lfu"):
            raise ValueError(f"--expert-cache must be lru or lfu, got {self.expert_cache!r}")
        if self.expert_slots is not None and self.expert_slots < 1:
            raise ValueError(f"--expert-slots must be at least 1, got {self.expert_slots}")
        if self.moe_experts not in ("auto", "gpu", "cpu"):
            raise ValueError(f"--moe-experts must be auto, gpu or cpu, got {self.moe_experts!r}")


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    generated: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    stop_reason: str = ""
    tokens: list[int] = field(default_factory=list)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tok_s(self) -> float:
        # the first generated token comes out of prefill; the rest are decode steps
        steps = max(self.generated - 1, 0)
        return steps / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
    def __init__(self, gf: GGUFFile, cfg: ModelConfig, model: Transformer, tokenizer: Tokenizer,
                 chat_template: ChatTemplate | None, engine_cfg: EngineConfig) -> None:
        self.gguf, self.config, self.model = gf, cfg, model
        self.tokenizer, self.chat_template, self.engine_config = tokenizer, chat_template, engine_cfg
        self._cached: list[int] = []  # token ids whose K/V sit in the cache, in order

    @classmethod
    def load(cls, path: str | Path | None = None, config: EngineConfig | None = None,
             progress: Callable[[int, int], None] | None = None) -> "Engine":
        ecfg = config or EngineConfig()
        device = default_device() if ecfg.device == "auto" else ecfg.device
        gf = open_model(path)
        cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        backend = make_backend(device, matmul_mode=ecfg.matmul_mode, kv_dtype=ecfg.kv_dtype)
        model = load_model(gf, cfg, backend, ecfg, progress)
        tok = Tokenizer.from_metadata(gf.metadata)
        return cls(gf, cfg, model, tok, ChatTemplate.from_metadata(gf.metadata, tok),
                   dataclasses.replace(ecfg, device=device))

    @classmethod
    def plan_model(cls, path: str | Path | None = None, config: EngineConfig | None = None):
        """The tier placement `load` would use, with measured links, without loading weights."""
        ecfg = config or EngineConfig()
        device = default_device() if ecfg.device == "auto" else ecfg.device
        with open_model(path) as gf:
            cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
            backend = make_backend(device, matmul_mode=ecfg.matmul_mode, kv_dtype=ecfg.kv_dtype)
            if cfg.is_moe:  # experts offloaded when the model does not fit (moe_offload.py)
                from ntx_engine import moe_offload

                if moe_offload.needs_offload(gf, cfg, backend, ecfg, min(ecfg.n_ctx, cfg.context_length)):
                    return moe_offload.plan_offload(gf, cfg, backend, ecfg, min(ecfg.n_ctx, cfg.context_length),
                                                    moe_offload.host_for(backend, ecfg))
            return tiers.plan_for(gf, cfg, backend, ecfg, min(ecfg.n_ctx, cfg.context_length), measure_links=True,
                                  host=tiers.host_backend(backend, ecfg))

    def plan(self):
        """The placement this engine runs with (`planner.Plan`: tiers, bytes, predicted speed)."""
        return self.model.plan

    def tier_stats(self) -> dict:
        """Plan summary and the streaming pipeline's counters since the last generate()."""
        plan = self.model.plan
        out = {"streamed": plan.streamed, "bytes_per_tier": plan.bytes_per_tier,
               "predicted_tok_s": 1.0 / plan.predicted_token_s if plan.streamed else None,
               "links_source": plan.links.source}
        stats = getattr(self.model.source, "stats", None)
        if stats is not None:
            out["pipeline"] = stats.as_dict()
        if getattr(self.model, "offload", None) is not None:  # MoE experts: cache hits, bytes
            out["experts"] = self.model.offload.stats()
        if plan.head_tier == "storage":  # embeddings/head read from storage (head_stream.py)
            out["head_storage_bytes_since_load"] = self.model.w.output.bytes_read + (
                0 if self.model.w.tok_embd is self.model.w.output else self.model.w.tok_embd.bytes_read)
        return out

    @property
    def stack_decode(self) -> dict | None:
        """The CUDA backend's decode (None on the others): whether a one-token step ran every layer in one
        launch (the stack step, backends/cuda_layers.py), and where not, why."""
        b = self.model.backend
        if not hasattr(b, "stack_why_not"):
            return None
        if not self.model.stackable():
            why = "the layers are streamed, split with the CPU, mixture-of-experts or hooked: one launch a layer"
        elif not b.stack_asked:
            why = "NTX_CUDA_FUSE leaves the stack step out (it is in the default, all,stack)"
        elif b.stack is None and b.stack_why_not is None:
            why = "no one-token decode step has run yet"
        else:
            return {"one_launch": b.stack is not None, "why_not": b.stack_why_not}
        return {"one_launch": False, "why_not": why}

    @property
    def last_run_stats(self) -> dict:
        """For reports: per-layer plan rows, the last pass's timeline, bytes, links, bound."""
        plan = self.model.plan
        stats = getattr(self.model.source, "stats", None)
        return {"plan": [{"layer": p.layer, "tier": p.tier, "bytes": p.nbytes} for p in plan.placements],
                "timeline": list(stats.timeline) if stats is not None else [],
                "bytes_per_tier": plan.bytes_per_tier,
                "bandwidth": {k: v / 1e9 for k, v in (("vram", plan.links.vram), ("h2d", plan.links.h2d),
                                                      ("storage", plan.links.storage))},
                "bound_tok_s": 1.0 / plan.predicted_token_s,
                "experts": self.model.offload.stats() if getattr(self.model, "offload", None) is not None else None}

    @property
    def model_name(self) -> str:
        return str(self.gguf.metadata.get("general.name", self.gguf.path.name))

    # --- text --------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=True)

    def detokenize(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids)

    def render_chat(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise ModelError(f"{self.gguf.path.name} has no chat template (tokenizer.chat_template)")
        return self.chat_template.render(messages, add_generation_prompt=True)

    # --- compute -----------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits (n, vocab) for every position of `ids`, from an empty context."""
        self._check_ids(ids)
        self._cached = []
        chunk = self._chunk()
        parts = [self.model.forward(np.asarray(ids[s:s + chunk]), s, all_logits=True)
                 for s in range(0, len(ids), chunk)]
        self._cached = list(ids)
        return np.concatenate(parts, axis=0)

    def _prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Bring the cache to `ids` reusing the longest cached prefix; logits of the last token."""
        keep = common_prefix(self._cached, ids)
        if keep == len(ids):  # everything cached: recompute the last token to get its logits
            keep -= 1
        self.model.backend.truncate(keep)
        last = None
        chunk = self._chunk()
        for s in range(keep, len(ids), chunk):
            last = self.model.forward(np.asarray(ids[s:s + chunk]), s)
        self._cached = list(ids)
        return last[-1]

    def _chunk(self) -> int:
        """Tokens per prefill pass: the backend's (CUDA: larger, so a streamed model is read
        fewer times per prompt; the planner reserves its activations) or PREFILL_CHUNK."""
        chunk = getattr(self.model.backend, "prefill_chunk", PREFILL_CHUNK)
        plan = getattr(self.model, "plan", None)
        return min(chunk, plan.prefill_chunk) if plan is not None and plan.prefill_chunk else chunk

    def generate(self, prompt_ids: Sequence[int], max_tokens: int = 128,
                 sampler: SamplerConfig | None = None, stats: GenerationStats | None = None) -> Iterator[int]:
        """Yield generated token ids one by one; fills `stats` as it goes."""
        self._check_ids(prompt_ids)
        if max_tokens < 0:
            raise UsageError(f"max_tokens must be >= 0, got {max_tokens}")
        st = stats if stats is not None else GenerationStats()
        smp = Sampler(sampler or SamplerConfig(temperature=0.0))
        ids = list(prompt_ids)
        st.prompt_tokens = len(ids)
        if hasattr(self.model.source, "reset_stats"):
            self.model.source.reset_stats()
        t0 = time.perf_counter()
        logits = self._prefill(ids)
        st.prefill_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        st.stop_reason = "length"
        device_greedy, next_tok = self._device_greedy(smp), -1
        streamed = device_greedy and hasattr(self.model, "greedy_stream")
        ahead = None  # the device greedy steps, one queued ahead of the token read (greedy_stream)
        for step in range(max_tokens):
            tok = smp.sample(logits, ids) if logits is not None else next_tok
            ids.append(tok)
            st.tokens.append(tok)
            st.generated += 1
            if self.tokenizer.is_eog(tok):
                st.stop_reason = "eos"
                yield tok
                break
            yield tok
            if len(ids) >= self.model.n_ctx:
                st.stop_reason = "context"
                break
            if step + 1 < max_tokens:
                if streamed:  # the GPU picks the argmax
                    if ahead is None:  # only the token ids come back, the next step already queued
                        ahead = self.model.greedy_stream(tok, len(ids) - 1, max_tokens - step - 1)
                    logits, next_tok = None, next(ahead)
                elif device_greedy:
                    logits, next_tok = None, self.model.greedy(tok, len(ids) - 1)
                else:
                    logits = self.model.forward(np.asarray([tok]), len(ids) - 1)[-1]
                self._cached = list(ids)
        st.decode_s = time.perf_counter() - t1

    def _device_greedy(self, smp: Sampler) -> bool:
        cfg = smp.cfg
        return hasattr(self.model, "greedy") and cfg.temperature <= 0 and cfg.repeat_penalty == 1.0

    def _check_ids(self, ids: Sequence[int]) -> None:
        if len(ids) == 0:
            raise UsageError("empty prompt: nothing to run")
        if len(ids) > self.model.n_ctx:
            raise UsageError(f"prompt has {len(ids)} tokens, more than the context ({self.model.n_ctx})")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise UsageError(f"token id {bad[0]} is outside the vocabulary (0..{self.config.vocab_size - 1})")

    def reset(self) -> None:
        """Forget the cached context: the next prompt is prefilled from scratch. A prefix reused
        from the cache rounds differently from one batched prefill (different matmul shapes), so
        greedy text can differ; the server resets before each request to answer like `ntx-run`."""
        self._cached = []

    # --- text in, text out (the documented Python API: docs/python.md) ---------------------
    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128,
               sampler: SamplerConfig | None = None, stats: GenerationStats | None = None,
               add_special: bool = True) -> Iterator[str]:
        """Yield the generated text piece by piece (greedy unless `sampler` says otherwise).

        A string prompt is tokenized as is (no chat template; see `chat`). Pieces hold whole
        characters only: a UTF-8 character split across tokens comes out once it is complete.
        End-of-generation and other control tokens are not part of the text."""
        ids = self.tokenize(prompt, add_special=add_special) if isinstance(prompt, str) else list(prompt)
        dec = self.tokenizer.stream_decoder(skip_special=True)
        for tok in self.generate(ids, max_tokens, sampler, stats):
            piece = "" if self.tokenizer.is_eog(tok) else dec.push(tok)
            if piece:
                yield piece
        tail = dec.flush()
        if tail:
            yield tail

    def chat_ids(self, messages: list[dict]) -> list[int]:
        """Token ids of `messages` rendered with the model's chat template, ready to generate."""
        return self.tokenize(self.render_chat(messages), add_special=False)

    def chat(self, messages: list[dict], max_tokens: int = 128, sampler: SamplerConfig | None = None,
             stats: GenerationStats | None = None) -> str:
        """The assistant's reply to `messages` (dicts with `role` and `content`)."""
        return "".join(self.stream(self.chat_ids(messages), max_tokens, sampler, stats))

    def close(self) -> None:
        source = getattr(self.model, "source", None)
        if hasattr(source, "close"):
            source.close()
        self.gguf.close()


def load_model(gf: GGUFFile, cfg: ModelConfig, backend, ecfg: EngineConfig,
               progress: Callable[[int, int], None] | None = None):
    """The model in the tiers the planner picks for `ecfg`'s budgets (weights loaded, pipeline
    started); wrapped in a decode CUDA graph when everything is resident on a GPU."""
    loader_cls, model_cls = model_classes(cfg)  # moe.py's pair when the file has experts
    n_ctx = min(ecfg.n_ctx, cfg.context_length)
    if cfg.is_moe:  # experts that do not fit go to RAM and a VRAM expert cache (moe_offload.py)
        from ntx_engine.moe_offload import load_offloaded

        model = load_offloaded(gf, cfg, backend, ecfg, n_ctx, progress)
        if model is not None:
            return model
    loader = loader_cls(gf, cfg, backend)
    host = tiers.host_backend(backend, ecfg)
    plan = tiers.plan_for(gf, cfg, backend, ecfg, n_ctx, host=host)
    cpu_layers = plan.layers_in("cpu")
    if host is not None and not cpu_layers:
        getattr(host, "close", lambda: None)()
        host = None
    weights, source = tiers.build(gf, loader, layer_spans(gf, cfg), plan, mode=ecfg.tiers, host=host,
                                  progress=progress)
    model = model_cls(cfg, weights, backend, n_ctx)
    model.source, model.plan = source, plan
    if backend.name == "cpu":  # native kernels: each dense layer is one C call
        from ntx_engine.backends.cpu_native import WholeLayers

        WholeLayers(model)
    if cpu_layers:  # hybrid: these layers run on the host backend (hybrid.py)
        from ntx_engine.hybrid import HostLayers

        model.host_layers = HostLayers(model, host, cpu_layers)
    if backend.name == "cuda" and plan.streamed and ecfg.tiers != "mmap-baseline":  # graphs per layer run
        from ntx_engine.backends.cuda_runs import install

        model.resident_runs = install(model, [p.tier for p in sorted(plan.placements, key=lambda p: p.layer)])
    if backend.name == "cuda" and not plan.streamed:  # one CUDA graph per decode step
        from ntx_engine.backends.cuda_graph import DecodeGraph

        model = DecodeGraph(model)
    return model


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids a and b share (the reusable part of a cached prefix)."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
