"""Layer skip: a calibration profile of how little each block changes its input, and the choice
of blocks to leave out.

A block whose output hidden state points almost the same way as its input (cosine similarity
near 1, averaged over the tokens of a calibration text) contributes little; skipping it saves
its compute and, for a streamed layer, its bytes. The first and last quarter of the blocks are
never skipped: the early blocks build the token representation and the late ones shape the
logits, and both hurt perplexity far more than their similarity suggests.

The profile is a small JSON file next to the model, `<model file>.skip.json`, holding one entry
per model hash (see `model_hash`), so a replaced model file never reuses a stale profile. When
the model's folder is not writable the file goes to `~/.cache/ntx/skip/` instead.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ntx_common.errors import ModelError, UsageError
from ntx_engine.head_stream import embed

PROFILE_FORMAT = "ntx-skip-profile/1"
HASH_METHOD = "sha256(size, first 1 MiB, 16 x 64 KiB evenly spaced, last 1 MiB)"
_EDGE, _SAMPLES, _SAMPLE = 1 << 20, 16, 1 << 16
CACHE_DIR = Path(os.environ.get("NTX_CACHE", Path.home() / ".cache" / "ntx")) / "skip"
CALIBRATION_TOPICS = ("execmodel", "types")  # CPython's own docs; the ppl text uses other topics
CALIBRATION_TOKENS = 1024


def model_hash(path: str | Path) -> str:
    """A fast content hash of a (possibly 40 GB) model file: sha256 over its size, its first
    and last MiB (header, metadata, tensor index, last tensors) and 16 evenly spaced 64 KiB
    samples. Reads 2 MiB + 1 MiB whatever the size; any re-quantization or re-export changes
    the header or the sampled bytes."""
    p = Path(path)
    size = p.stat().st_size
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(p, "rb") as f:
        offsets = [0] + [size * (i + 1) // (_SAMPLES + 1) for i in range(_SAMPLES)]
        for off, n in zip(offsets, [_EDGE] + [_SAMPLE] * _SAMPLES):
            f.seek(off)
            h.update(f.read(n))
        f.seek(max(0, size - _EDGE))
        h.update(f.read(_EDGE))
    return h.hexdigest()


@dataclass(frozen=True)
class SkipProfile:
    model_hash: str
    similarity: tuple[float, ...]  # (n_layers,) mean cosine(input, output) of each block
    tokens: int  # calibration tokens the means are over
    text: str = ""  # where the calibration text came from

    def __post_init__(self) -> None:
        if not self.similarity:
            raise ValueError("a skip profile needs at least one layer")
        bad = [s for s in self.similarity if not (math.isfinite(s) and -1.0001 <= s <= 1.0001)]
        if bad:
            raise ValueError(f"similarities must be cosines in [-1, 1], got {bad[0]}")
        if self.tokens <= 0:
            raise ValueError(f"calibration needs tokens, got {self.tokens}")

    @property
    def n_layers(self) -> int:
        return len(self.similarity)

    def to_dict(self) -> dict[str, Any]:
        return {"similarity": list(self.similarity), "tokens": self.tokens, "text": self.text}

    @classmethod
    def from_dict(cls, key: str, d: dict[str, Any]) -> "SkipProfile":
        return cls(key, tuple(float(s) for s in d["similarity"]), int(d["tokens"]), str(d.get("text", "")))


def eligible_layers(n_layers: int) -> range:
    """Blocks that may be skipped: none of the first or last quarter (rounded up)."""
    q = math.ceil(n_layers / 4)
    return range(q, max(q, n_layers - q))


def choose_skip(profile: SkipProfile, threshold: float | None = None, count: int | None = None) -> tuple[int, ...]:
    """Layers to skip: those with similarity > threshold, or the `count` most similar, always
    within `eligible_layers`; sorted."""
    if (threshold is None) == (count is None):
        raise UsageError("give exactly one of a skip threshold or a skip layer count")
    ok = list(eligible_layers(profile.n_layers))
    if count is not None:
        if not 0 <= count <= len(ok):
            raise UsageError(f"--skip-layers {count}: this {profile.n_layers}-layer model allows 0..{len(ok)} "
                             f"(layers {ok[0]}..{ok[-1]}; the first and last quarter are never skipped)")
        ranked = sorted(ok, key=lambda i: (-profile.similarity[i], i))
        return tuple(sorted(ranked[:count]))
    return tuple(i for i in ok if profile.similarity[i] > threshold)


@dataclass(frozen=True)
class SkipPlan:
    """Which blocks a forward pass leaves out, and how many of them the pipeline streams (their
    bytes are not read at all) versus keeps resident (only their compute is saved)."""
    n_layers: int
    skipped: tuple[int, ...] = ()
    streamed: frozenset[int] = field(default_factory=frozenset)  # the planner's streamed layers

    def __post_init__(self) -> None:
        bad = [i for i in (*self.skipped, *self.streamed) if not 0 <= i < self.n_layers]
        if bad:
            raise ValueError(f"layer {bad[0]} is outside 0..{self.n_layers - 1}")
        if len(set(self.skipped)) != len(self.skipped):
            raise ValueError(f"skipped layers repeat: {self.skipped}")

    @property
    def layers(self) -> list[int]:
        """The blocks to run, in order (Transformer.forward's `layers`)."""
        skip = set(self.skipped)
        return [i for i in range(self.n_layers) if i not in skip]

    @property
    def skipped_streamed(self) -> int:
        return sum(1 for i in self.skipped if i in self.streamed)

    @property
    def skipped_resident(self) -> int:
        return len(self.skipped) - self.skipped_streamed

    def to_dict(self) -> dict[str, Any]:
        return {"skipped_layers": list(self.skipped), "skipped_streamed": self.skipped_streamed,
                "skipped_resident": self.skipped_resident}


# --- calibration -----------------------------------------------------------------------------
def layer_similarity(model: Any, ids: Sequence[int], chunk: int = 256) -> np.ndarray:
    """(n_layers,) mean over tokens of cosine(block input, block output), running `ids` from
    position 0 through every block in chunks of `chunk` tokens (the KV cache is overwritten)."""
    b, n = model.backend, model.cfg.n_layers
    if len(ids) == 0:
        raise UsageError("calibration text is empty")
    if len(ids) > model.n_ctx:
        raise UsageError(f"calibration text has {len(ids)} tokens, more than the context ({model.n_ctx})")
    sums = np.zeros(n, np.float64)
    for s in range(0, len(ids), chunk):
        part = np.asarray(ids[s:s + chunk])
        pos = np.arange(s, s + len(part))
        x = embed(b, model.w.tok_embd, part)
        for i in range(n):
            lw = model.source.acquire(i)
            try:  # run_layer: a hybrid model computes its CPU-tier layers on the host there
                y = model.run_layer(i, lw, x, pos, s)
            finally:
                model.source.release(i)
            sums[i] += _cosines(_on_host(b, x), _on_host(b, y)).sum()
            x = y
    return sums / len(ids)


def _on_host(backend: Any, x: Any) -> np.ndarray:
    from ntx_engine.hybrid import OnHost

    return x.x if isinstance(x, OnHost) else backend.to_numpy(x)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a, b = a.astype(np.float64), b.astype(np.float64)
    den = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return np.sum(a * b, axis=-1) / np.maximum(den, 1e-30)


def calibration_text() -> str:
    """The default calibration text: two chapters of the Python reference shipped inside every
    CPython (`pydoc_data`), different from the perplexity text under tests/data/."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in CALIBRATION_TOPICS)


def calibrate(engine: Any, text: str | None = None, n_tokens: int = CALIBRATION_TOKENS) -> SkipProfile:
    """Profile `engine`'s model on `text` (default: `calibration_text()`), first `n_tokens` tokens."""
    ids = engine.tokenize(text if text is not None else calibration_text())[:min(n_tokens, engine.model.n_ctx)]
    sims = layer_similarity(engine.model, ids)
    source = "pydoc_data:" + "+".join(CALIBRATION_TOPICS) if text is None else "user text"
    return SkipProfile(model_hash(engine.gguf.path), tuple(float(s) for s in sims), len(ids), source)


# --- storage -------------------------------------------------------------------------------
def profile_paths(model_path: str | Path) -> list[Path]:
    """Where a profile may live: next to the model, then the user cache (first one found wins)."""
    p = Path(model_path)
    return [p.with_name(p.name + ".skip.json"), CACHE_DIR / (p.name + ".skip.json")]


def save_profile(profile: SkipProfile, model_path: str | Path) -> Path:
    """Add/replace this hash's entry in the profile file; returns the file written."""
    for target in profile_paths(model_path):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            doc = _read(target) or {"format": PROFILE_FORMAT, "hash": HASH_METHOD, "profiles": {}}
            doc["profiles"][profile.model_hash] = profile.to_dict()
            tmp = target.with_name(target.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(doc, indent=1) + "\n")
            tmp.replace(target)  # atomic: a reader never sees half a file
            return target
        except PermissionError:
            continue
    raise ModelError(f"cannot write a skip profile next to {model_path} nor under {CACHE_DIR} (permission denied)")


def load_profile(model_path: str | Path, key: str | None = None) -> SkipProfile | None:
    """The profile of this exact model file (by hash), or None when it was never calibrated."""
    key = key or model_hash(model_path)
    for path in profile_paths(model_path):
        doc = _read(path)
        if doc and key in doc["profiles"]:
            try:
                return SkipProfile.from_dict(key, doc["profiles"][key])
            except (KeyError, TypeError, ValueError) as exc:
                raise ModelError(f"{path}: the skip profile is malformed ({exc}); delete it and "
                                 f"run `ntx-run --calibrate-skip` again") from exc
    return None


def _read(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: cannot read the skip profile ({exc}); delete it and calibrate again") from exc
    if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT or not isinstance(doc.get("profiles"), dict):
        raise ModelError(f"{path} is not an ntx skip profile ({PROFILE_FORMAT}); delete it and calibrate again")
    return doc


# --- running with skipped layers -------------------------------------------------------------
class SkippingModel:
    """A model view whose forward runs only `plan.layers`; everything else is the model's.
    Hides a CUDA graph's `greedy` (the graph runs every layer), so decoding takes the layered
    forward path."""

    def __init__(self, model: Any, plan: SkipPlan) -> None:
        self.model, self.skip_plan = model, plan  # not `plan`: that name is the tier plan's
        self._layers = plan.layers

    def forward(self, ids: np.ndarray, start: int, all_logits: bool = False, layers: Sequence[int] | None = None) -> np.ndarray:
        return self.model.forward(ids, start, all_logits, self._layers if layers is None else layers)

    def __getattr__(self, name: str) -> Any:
        if name == "greedy":
            raise AttributeError(name)
        return getattr(self.model, name)


def apply_skip(engine: Any, plan: SkipPlan) -> None:
    """Make `engine` run without `plan.skipped` from now on (clears its prefix cache: KV entries
    written with every layer are not those of the skipping model)."""
    base = engine.model.model if isinstance(engine.model, SkippingModel) else engine.model
    engine.model = SkippingModel(base, plan) if plan.skipped else base
    engine._cached = []


def plan_for(engine: Any, threshold: float | None = None, count: int | None = None,
             streamed: frozenset[int] | None = None) -> SkipPlan:
    """The skip plan of `engine`'s model from its stored profile. `streamed` is the planner's set
    of streamed layers (default: `engine.streamed_layers` if the pipeline set one, else none)."""
    path = engine.gguf.path
    profile = load_profile(path)
    if profile is None:
        raise UsageError(f"{path.name} has no skip profile yet: run `ntx-run --calibrate-skip -m {path}` first")
    n = engine.config.n_layers
    if profile.n_layers != n:
        raise ModelError(f"the skip profile of {path.name} has {profile.n_layers} layers, the model {n}; calibrate again")
    if streamed is None:
        streamed = streamed_layers(engine)
    return SkipPlan(n, choose_skip(profile, threshold, count), frozenset(streamed))


def streamed_layers(engine: Any) -> frozenset[int]:
    """Layers whose bytes cross a link every token: `engine.streamed_layers` when set, else the
    tier plan's RAM- and storage-tier layers (none when the model has no plan)."""
    explicit = getattr(engine, "streamed_layers", None)
    if explicit is not None:
        return frozenset(explicit)
    plan = getattr(engine.model, "plan", None)
    if plan is None or not hasattr(plan, "tier_of"):
        return frozenset()
    return frozenset(i for i in range(engine.config.n_layers) if plan.tier_of(i) in ("ram", "storage"))
