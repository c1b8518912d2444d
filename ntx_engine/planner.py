"""Placement of every layer in a tier (VRAM-resident, pinned RAM, storage) from budgets and
measured link bandwidths, and the predicted token time of that placement.

The cost model is ARCHITECTURE.md's, with perfect overlap of the pipeline's stages:

    t_token = max( B_all / BW_vram,              every weight byte is read by the kernels once
                   (B_ram + B_storage) / BW_h2d,  streamed layers cross PCIe
                   B_storage / BW_storage )       storage layers are read from disk every token

Layers are placed by trying candidate orders (largest layers first, model order) and keeping
the one with the lowest predicted time.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import asdict, dataclass, field

from ntx_common.errors import UsageError
from ntx_engine.config import ModelConfig
from ntx_engine.layout import LayerSpan

TIERS = ("vram", "ram", "storage", "cpu")  # cpu: computed on the host from pinned RAM (hybrid)
GiB = 1 << 30
MiB = 1 << 20
MIN_SLOTS = 2  # one slot being computed while the next is copied
DEFAULT_SLOTS = 3  # + one of slack so a slow copy does not stall compute
DEFAULT_STAGING = 3  # pinned buffers the storage reader fills ahead of the copies
VRAM_MARGIN = 512 * MiB  # CUDA context growth, allocator rounding; at most 1/16 of the budget
RAM_MARGIN = 2 * GiB  # left to the OS and to this process's own heap
PREFILL_CHUNK = 256
TIGHT_CHUNK = 16  # CPU only, when the budget cannot hold a PREFILL_CHUNK pass's activations and logits


class PlanError(UsageError):
    """The budgets cannot hold what every placement needs (KV cache, head, the ring)."""


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str | int, what: str = "size") -> int:
    """'24G', '512M', '1.5GiB', '0' -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(str(text))
    if not m:
        raise UsageError(f"{what} {text!r} is not a size: write e.g. 24G, 512M or 0")
    scale = 1 << (10 * "bkmgt".index((m.group(2) or "b").lower()))
    return int(float(m.group(1)) * scale)


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Links:
    """Measured bandwidths, bytes/s: kernels reading VRAM, host-to-device copy, storage reads."""

    vram: float
    h2d: float
    storage: float
    storage_kind: str = "direct"
    source: str = "measured"
    cpu: float = 0.0  # host kernels' weight-read rate while H2D copies run (0: no CPU-computed layers)

    def __post_init__(self) -> None:
        for name in ("vram", "h2d", "storage"):
            if not getattr(self, name) > 0:
                raise ValueError(f"link bandwidth {name} must be positive, got {getattr(self, name)}")
        if self.cpu < 0:
            raise ValueError(f"cpu compute rate must be >= 0, got {self.cpu}")


@dataclass(frozen=True)
class Budgets:
    vram: int
    ram: int
    margin: int | None = None  # VRAM kept free; None: min(512 MiB, vram / 16)
    # what the compute device's memory is called and set with, for messages (CPU only: the RAM)
    device_memory: str = "VRAM"
    option: str = "--vram-budget"
    # CPU only: one memory. The storage staging buffers come out of `vram` too (ram is 0 then)
    unified: bool = False

    def __post_init__(self) -> None:
        if self.vram < 0 or self.ram < 0 or (self.margin or 0) < 0:
            raise ValueError(f"budgets must be >= 0, got vram={self.vram} ram={self.ram} margin={self.margin}")


@dataclass(frozen=True)
class Reserves:
    """VRAM and RAM set aside before any layer is placed."""

    kv_cache: int
    workspace: int
    head: int  # embeddings, output norm and head: always resident
    ring: int  # n_slots x slot_bytes
    vram_margin: int
    staging: int  # pinned RAM buffers for storage reads
    ram_margin: int

    @property
    def vram(self) -> int:
        return self.kv_cache + self.workspace + self.head + self.ring + self.vram_margin


@dataclass(frozen=True)
class Placement:
    layer: int
    tier: str
    nbytes: int


@dataclass
class Plan:
    placements: list[Placement]
    n_slots: int
    slot_bytes: int
    n_staging: int
    budgets: Budgets
    reserves: Reserves
    links: Links
    strategy: str
    head_bytes: int
    notes: list[str] = field(default_factory=list)
    head_tier: str = "vram"  # "storage": CPU only, embeddings/head read every token (head_stream.py)
    prefill_chunk: int | None = None  # tokens per prefill pass when the budget needs fewer than the default

    def tier_of(self, layer: int) -> str:
        return self.placements[layer].tier

    def without(self, layers) -> "Plan":
        """This placement with `layers` skipped (layer skip): their bytes are neither read nor
        computed, so bytes per tier and the predicted time drop; everything else is unchanged."""
        gone = set(layers)
        kept = [Placement(p.layer, p.tier, 0 if p.layer in gone else p.nbytes) for p in self.placements]
        return dataclasses.replace(self, placements=kept, notes=list(self.notes))

    def layers_in(self, tier: str) -> list[int]:
        return [p.layer for p in self.placements if p.tier == tier]

    @property
    def bytes_per_tier(self) -> dict[str, int]:
        out = {t: 0 for t in TIERS}
        for p in self.placements:
            out[p.tier] += p.nbytes
        return out

    @property
    def terms(self) -> dict[str, float]:
        """Seconds per token each link needs (the bound is the largest). Compute is sequential
        across layers: the GPU's weight reads plus the CPU-computed layers' reads add up."""
        b = self.bytes_per_tier
        gpu = sum(b.values()) - b["cpu"] + self.head_bytes
        compute = gpu / self.links.vram + (b["cpu"] / self.links.cpu if b["cpu"] else 0.0)
        head_read = self.head_bytes if self.head_tier == "storage" else 0
        return {"compute": compute, "h2d": (b["ram"] + b["storage"]) / self.links.h2d,
                "storage": (b["storage"] + head_read) / self.links.storage}

    @property
    def predicted_token_s(self) -> float:
        return max(self.terms.values())

    @property
    def bottleneck(self) -> str:
        terms = self.terms
        return max(terms, key=terms.get)

    @property
    def streamed(self) -> bool:
        return any(p.tier != "vram" for p in self.placements)

    def as_dict(self) -> dict:
        return {
            "strategy": self.strategy,
            "layers": [asdict(p) for p in self.placements],
            "bytes_per_tier": self.bytes_per_tier, "head_bytes": self.head_bytes, "head_tier": self.head_tier,
            "prefill_chunk": self.prefill_chunk,
            "n_slots": self.n_slots, "slot_bytes": self.slot_bytes, "n_staging": self.n_staging,
            "budgets": asdict(self.budgets), "reserves": asdict(self.reserves),
            "links_gbps": {"vram": self.links.vram / 1e9, "h2d": self.links.h2d / 1e9,
                           "storage": self.links.storage / 1e9, "cpu": self.links.cpu / 1e9},
            "storage_kind": self.links.storage_kind, "links_source": self.links.source,
            "terms_s": self.terms, "bottleneck": self.bottleneck,
            "predicted_token_s": self.predicted_token_s,
            "predicted_tok_s": 1.0 / self.predicted_token_s if self.predicted_token_s > 0 else None,
            "notes": list(self.notes),
        }


def kv_cache_bytes(cfg: ModelConfig, n_ctx: int) -> int:
    return 2 * cfg.n_layers * n_ctx * cfg.kv_dim * 2  # K and V, f16


def workspace_bytes(cfg: ModelConfig, n_ctx: int, chunk: int = PREFILL_CHUNK) -> int:
    """Activations of one prefill chunk, its attention scores and the logits (float32)."""
    per_token = 3 * cfg.n_ff + 4 * cfg.n_embd + cfg.q_dim + 2 * cfg.kv_dim + cfg.vocab_size
    return 4 * chunk * (per_token + cfg.n_head * min(n_ctx, 2 * chunk))


def vram_margin(budgets: Budgets) -> int:
    return min(VRAM_MARGIN, budgets.vram // 16) if budgets.margin is None else budgets.margin


def make_plan(spans: list[LayerSpan], head_bytes: int, cfg: ModelConfig, n_ctx: int,
              budgets: Budgets, links: Links, *, n_slots: int | None = None,
              n_staging: int | None = None, extra_workspace: int = 0, hybrid: str = "auto") -> Plan:
    """The lowest-predicted-time placement that fits the budgets; PlanError when none does.
    extra_workspace: device memory the backend takes beyond the activations (the CUDA prefill
    GEMM's fp16 slab and cuBLAS workspace). hybrid: "auto" lets the cost model choose how many
    streamed layers the CPU computes (when links.cpu > 0); "cpu" puts every one the RAM budget
    holds on the CPU (`--hybrid cpu`, the pure-CPU split)."""
    if hybrid not in ("auto", "cpu"):
        raise UsageError(f"hybrid must be auto or cpu, got {hybrid!r}")
    if n_slots is not None and n_slots < MIN_SLOTS:
        raise UsageError(f"the slot ring needs at least {MIN_SLOTS} slots, got {n_slots}")
    ws = workspace_bytes(cfg, n_ctx) + extra_workspace
    args = (spans, cfg, n_ctx, budgets, links, n_slots, n_staging, hybrid)
    try:
        return _fastest(*args, head_bytes, ws)
    except PlanError:
        if not budgets.unified or cfg.is_moe:
            raise
    return _tight(args, head_bytes, workspace_bytes(cfg, n_ctx, TIGHT_CHUNK) + extra_workspace)


def _tight(args: tuple, head_bytes: int, ws: int) -> Plan:
    """CPU only, when the default reserves do not fit: prefill in TIGHT_CHUNK-token passes (ws),
    then, if still too big, the embeddings/head read from storage every token (head_stream.py)."""
    from ntx_engine.head_stream import head_reserve

    head_tier = "vram"
    try:
        plan = _fastest(*args, head_bytes, ws)
    except PlanError:
        head_tier = "storage"
        try:
            plan = _fastest(*args, head_reserve(head_bytes), ws)
        except PlanError as exc:  # the smallest configuration there is: its minimum is the one to name
            raise PlanError(str(exc).replace("embeddings/head", "embeddings/head pieces (the table read from "
                                             f"storage every token, prefill in {TIGHT_CHUNK}-token passes)")) from None
    plan = dataclasses.replace(plan, head_bytes=head_bytes, head_tier=head_tier, prefill_chunk=TIGHT_CHUNK,
                               notes=list(plan.notes))
    plan.notes.append(f"prefill in {TIGHT_CHUNK}-token passes to fit {fmt_bytes(plan.budgets.vram)}")
    if head_tier == "storage":
        plan.notes.append(f"embeddings/head ({fmt_bytes(head_bytes)}) read from storage every token")
    return plan


def _fastest(spans, cfg, n_ctx, budgets, links, n_slots, n_staging, hybrid, head_bytes, ws) -> Plan:
    """The placement of every layer order with the lowest predicted time (model order on ties)."""
    plans = [_place(order, name, spans, head_bytes, cfg, n_ctx, budgets, links, n_slots, n_staging, ws, hybrid)
             for name, order in _orders(spans)]
    return min(plans, key=lambda p: (round(p.predicted_token_s, 12), p.strategy != "model order"))


def _orders(spans: list[LayerSpan]) -> list[tuple[str, list[int]]]:
    by_size = sorted(range(len(spans)), key=lambda i: (-spans[i].nbytes, i))
    return [("model order", list(range(len(spans)))), ("largest first", by_size)]


def _place(order: list[int], strategy: str, spans: list[LayerSpan], head_bytes: int,
           cfg: ModelConfig, n_ctx: int, budgets: Budgets, links: Links,
           n_slots: int | None, n_staging: int | None, ws: int, hybrid: str = "auto") -> Plan:
    fixed = kv_cache_bytes(cfg, n_ctx) + ws + head_bytes + vram_margin(budgets)
    total = sum(s.nbytes for s in spans)
    if fixed + total <= budgets.vram:  # everything fits: no ring at all
        return _plan(spans, {i: "vram" for i in order}, 0, 0, 0, budgets, links, cfg, n_ctx, head_bytes, strategy,
                     ws)
    slot = max(s.nbytes for s in spans)
    slots = n_slots or DEFAULT_SLOTS
    stage = (n_staging or DEFAULT_STAGING) * slot if budgets.unified else 0  # CPU only: same memory
    if fixed + stage + MIN_SLOTS * slot > budgets.vram:
        _impossible(budgets, fixed, slot, cfg, n_ctx, head_bytes, ws, stage)
    slots = max(MIN_SLOTS, min(slots, (budgets.vram - fixed - stage) // slot))
    tiers, room = {}, budgets.vram - fixed - stage - slots * slot
    for i in order:
        if spans[i].nbytes <= room:
            tiers[i], room = "vram", room - spans[i].nbytes
    streamed = sorted(i for i in order if i not in tiers)
    staging = n_staging or DEFAULT_STAGING
    counts = range(len(streamed) + 1) if links.cpu > 0 else [0]
    forced = hybrid == "cpu" and links.cpu > 0
    if forced:  # all of them, or as many as the RAM budget holds
        counts = range(len(streamed), -1, -1)
    best = None
    for n_cpu in counts:  # how many streamed layers the CPU computes instead (hybrid)
        plan = _split(spans, tiers, streamed, n_cpu, slots, slot, staging, budgets, links, cfg, n_ctx,
                      head_bytes, strategy, ws)
        if forced and plan is not None:
            plan.notes.append(f"--hybrid cpu: {n_cpu} of {len(streamed)} non-resident layers computed on the CPU")
            return plan
        if plan is not None and (best is None or plan.predicted_token_s < best.predicted_token_s * (1 - 1e-9)):
            best = plan
    return best


def _spread(layers: list[int], n: int) -> set[int]:
    """n of `layers` evenly spaced: CPU layers interleaved with streamed ones keep the ring fed."""
    return {layers[(2 * j + 1) * len(layers) // (2 * n)] for j in range(n)} if n else set()


def _split(spans, tiers, streamed, n_cpu, slots, slot, staging, budgets, links, cfg, n_ctx, head_bytes,
           strategy, ws) -> Plan | None:
    """Streamed layers: n_cpu computed on the CPU (they need RAM), then pinned RAM, then storage."""
    tiers = dict(tiers)
    cpu = _spread(streamed, n_cpu)
    ram_room = budgets.ram - staging * slot
    for i in sorted(cpu):
        if spans[i].nbytes > ram_room:
            return None
        tiers[i], ram_room = "cpu", ram_room - spans[i].nbytes
    gpu_streamed = [i for i in streamed if i not in cpu]
    for i in gpu_streamed:
        if spans[i].nbytes <= ram_room:
            tiers[i], ram_room = "ram", ram_room - spans[i].nbytes
        else:
            tiers[i] = "storage"
    if "storage" not in tiers.values():
        staging = 0
    slots = min(slots, max(len(gpu_streamed), MIN_SLOTS if cpu else 0))  # cpu layers stream for prefill
    return _plan(spans, tiers, slots, slot if slots else 0, staging, budgets, links, cfg, n_ctx, head_bytes, strategy,
                 ws)


def _plan(spans, tiers, slots, slot, staging, budgets, links, cfg, n_ctx, head_bytes, strategy, ws) -> Plan:
    reserves = Reserves(kv_cache_bytes(cfg, n_ctx), ws, head_bytes, slots * slot,
                        vram_margin(budgets), staging * slot, RAM_MARGIN)
    placements = [Placement(s.index, tiers[s.index], s.nbytes) for s in spans]
    plan = Plan(placements, slots, slot, staging, budgets, reserves, links, strategy, head_bytes)
    if staging and budgets.ram < staging * slot and not budgets.unified:
        plan.notes.append(f"the RAM budget ({fmt_bytes(budgets.ram)}) is below the {staging} pinned staging "
                          f"buffers ({fmt_bytes(staging * slot)}) storage reads need; they are allocated anyway")
    return plan


def _impossible(budgets: Budgets, fixed: int, slot: int, cfg: ModelConfig, n_ctx: int, head_bytes: int,
                ws: int, stage: int = 0) -> None:
    base = fixed - vram_margin(budgets) + MIN_SLOTS * slot + stage  # everything but the margin
    if budgets.margin is not None:
        need = base + budgets.margin
    else:  # the default margin grows with the budget: min(512 MiB, budget / 16)
        need = min(-(-base * 16 // 15), base + VRAM_MARGIN)
    raise PlanError(
        f"a {budgets.device_memory} budget of {fmt_bytes(budgets.vram)} cannot run this model: it needs at least "
        f"{fmt_bytes(need)} = KV cache for {n_ctx} tokens {fmt_bytes(kv_cache_bytes(cfg, n_ctx))} + "
        f"workspaces {fmt_bytes(ws)} + embeddings/head {fmt_bytes(head_bytes)} + "
        f"a {MIN_SLOTS}-slot ring {fmt_bytes(MIN_SLOTS * slot)} + "
        + (f"storage staging {fmt_bytes(stage)} + " if stage else "")
        + f"margin {fmt_bytes(need - base)}; "
        f"raise {budgets.option} to {fmt_bytes(need)} or lower --ctx")
