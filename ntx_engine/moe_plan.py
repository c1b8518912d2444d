"""Placement of a mixture-of-experts model whose experts do not all fit in VRAM.

The dense part of every layer (attention, norms, router `ffn_gate_inp`, shared experts) stays
VRAM-resident; the routed experts (`ffn_{gate,up,down}_exps`) live in pinned RAM, or are read
from storage when the RAM budget is short, and a VRAM expert cache of `n_slots` slots (one
expert's gate+up+down each) holds the recently or frequently used ones. What the VRAM budget
leaves after the KV cache, workspaces, embeddings/head, the dense part and the margin sizes
the cache.

Per layer the selected experts are computed either on the GPU from the cache (`gpu`: a miss
copies the expert over the link) or on the CPU straight from their pinned-RAM bytes (`cpu`:
only the hidden state crosses the link). `auto` picks per layer the side with the lower
predicted time.

Predicted bytes per token assume routing that is uniform and independent from token to token
(random weights route that way): with S slots over E experts x L layers, a lookup hits with
probability S / (E x L), so the link carries used x expert_bytes x (1 - S / (E x L)) per GPU
layer per token. Real models route with locality and do better; the benchmark measures it.
The time terms add up (`MoeOffloadPlan.predicted_token_s`): a miss is copied only after its
layer has routed, and that layer's experts wait for it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ntx_common.errors import UsageError
from ntx_engine.config import ModelConfig
from ntx_engine.expert_cache import POLICIES
from ntx_engine.layout import LayerSpan
from ntx_engine.planner import (RAM_MARGIN, Budgets, Links, Placement, Plan, PlanError, Reserves, fmt_bytes,
                                kv_cache_bytes, vram_margin, workspace_bytes)

EXPERT_SIDES = ("auto", "gpu", "cpu")
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class ExpertPlan:
    """Where the routed experts are and how they are computed (one entry per layer)."""
    n_slots: int
    slot_bytes: int  # one expert of one layer: gate + up + down
    policy: str
    expert_tiers: tuple[str, ...]  # per layer: "ram" (pinned) or "storage"
    sides: tuple[str, ...]  # per layer: "gpu" (VRAM cache) or "cpu" (host kernels)
    expert_bytes: tuple[int, ...]  # per layer: all its experts
    n_expert: int
    n_used: int

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if any(s not in ("gpu", "cpu") for s in self.sides):
            raise ValueError(f"expert sides must be gpu or cpu, got {self.sides}")
        if self.n_slots < 0:
            raise ValueError(f"expert slots must be >= 0, got {self.n_slots}")

    def layers_on(self, side: str) -> list[int]:
        return [i for i, s in enumerate(self.sides) if s == side]

    @property
    def miss_rate(self) -> float:
        """Predicted, for uniform independent routing (module docstring)."""
        cached_over = self.n_expert * len(self.layers_on("gpu"))
        return 1.0 - min(1.0, self.n_slots / cached_over) if cached_over else 0.0

    def per_token(self) -> dict[str, float]:
        """Predicted bytes per token: over the link (cache misses), read by the CPU, read
        from storage (misses of storage-tier layers)."""
        one = self.n_used * self.slot_bytes
        gpu, cpu = self.layers_on("gpu"), self.layers_on("cpu")
        sto = [i for i in gpu if self.expert_tiers[i] == "storage"]
        return {"h2d": one * self.miss_rate * len(gpu), "cpu": float(one * len(cpu)),
                "storage": one * self.miss_rate * len(sto), "gpu_reads": float(one * len(gpu))}

    def as_dict(self) -> dict:
        return {**asdict(self), "cache_bytes": self.n_slots * self.slot_bytes,
                "predicted_miss_rate": self.miss_rate, "predicted_bytes_per_token": self.per_token(),
                "miss_rate_assumption": "uniform, independent routing (random weights); real models do better"}


@dataclass
class MoeOffloadPlan(Plan):
    """A Plan whose layers' dense parts are all in VRAM and whose experts follow `experts`."""
    experts: ExpertPlan | None = None

    @property
    def streamed(self) -> bool:  # experts move per token: no CUDA graph
        return True

    @property
    def terms(self) -> dict[str, float]:
        return expert_terms(self.experts, sum(p.nbytes for p in self.placements) + self.head_bytes, self.links)

    @property
    def predicted_token_s(self) -> float:
        """The terms add: a miss's copy can start only once the layer has routed, and the
        layer's experts wait for it (the next-layer prefetch experiment aside)."""
        return sum(self.terms.values())

    def as_dict(self) -> dict:
        return {**super().as_dict(), "experts": self.experts.as_dict()}

    def describe(self) -> list[str]:
        """Lines for `ntx-run --plan` after the placement table."""
        e = self.experts
        pt = e.per_token()
        ram = sum(n for n, t in zip(e.expert_bytes, e.expert_tiers) if t == "ram")
        sto = sum(e.expert_bytes) - ram
        return [f"experts offloaded: dense part of every layer in VRAM ({fmt_bytes(sum(p.nbytes for p in self.placements))}); "
                f"experts in pinned RAM {fmt_bytes(ram)}, storage {fmt_bytes(sto)}",
                f"expert cache: {e.n_slots} slots x {fmt_bytes(e.slot_bytes)} = {fmt_bytes(e.n_slots * e.slot_bytes)} "
                f"({e.policy}); experts on GPU in {len(e.layers_on('gpu'))} layers, on CPU in {len(e.layers_on('cpu'))}",
                f"per token: {e.n_used} experts x {fmt_bytes(e.slot_bytes)} per layer; predicted miss rate "
                f"{e.miss_rate:.2f} (uniform routing) -> H2D {fmt_bytes(pt['h2d'])}, CPU reads {fmt_bytes(pt['cpu'])}"]


def expert_terms(e: ExpertPlan, dense_bytes: int, lk: Links) -> dict[str, float]:
    """Seconds per token: kernels reading the dense part and the cached experts from VRAM plus
    the CPU reading its layers' experts; predicted misses over H2D; storage-tier misses."""
    pt = e.per_token()
    compute = (dense_bytes + pt["gpu_reads"]) / lk.vram + (pt["cpu"] / lk.cpu if pt["cpu"] else 0.0)
    return {"compute": compute, "h2d": pt["h2d"] / lk.h2d, "storage": pt["storage"] / lk.storage}


def expert_nbytes(gf, i: int) -> int:
    return sum(gf.tensors[f"blk.{i}.{t}.weight"].nbytes for t in EXPERT_TENSORS)


def make_expert_plan(gf, spans: list[LayerSpan], head_bytes: int, cfg: ModelConfig, n_ctx: int,
                     budgets: Budgets, links: Links, *, policy: str = "lru", n_slots: int | None = None,
                     side: str = "auto", cpu_ok: bool = True) -> MoeOffloadPlan:
    """The offload placement; PlanError when the budget cannot hold the dense part plus
    n_expert_used slots."""
    if side not in EXPERT_SIDES:
        raise UsageError(f"--moe-experts must be one of {', '.join(EXPERT_SIDES)}, got {side!r}")
    if n_slots is not None and n_slots < cfg.n_expert_used:
        raise UsageError(f"--expert-slots {n_slots} is fewer than the {cfg.n_expert_used} experts each token "
                         f"uses; give at least {cfg.n_expert_used}")
    experts = [expert_nbytes(gf, i) for i in range(cfg.n_layers)]
    dense = [s.nbytes - e for s, e in zip(spans, experts)]
    slot = max(experts) // cfg.n_expert
    kv, ws, margin = kv_cache_bytes(cfg, n_ctx), workspace_bytes(cfg, n_ctx), vram_margin(budgets)
    fixed = kv + ws + head_bytes + margin + sum(dense)
    room = max(0, budgets.vram - fixed) // slot
    slots = min(room, cfg.n_expert * cfg.n_layers) if n_slots is None else n_slots
    ram_room, tiers = budgets.ram, []
    for n in experts:  # pinned RAM while it lasts, then storage
        tiers.append("ram" if n <= ram_room else "storage")
        ram_room -= n if n <= ram_room else 0

    def make(sides: tuple[str, ...]) -> ExpertPlan:
        return ExpertPlan(slots if "gpu" in sides else 0, slot, policy, tuple(tiers), sides, tuple(experts),
                          cfg.n_expert, cfg.n_expert_used)
    sides = _sides(make, tiers, links, sum(dense) + head_bytes, side, cpu_ok, slots >= cfg.n_expert_used)
    if "gpu" in sides and slots < cfg.n_expert_used:
        raise PlanError(f"a VRAM budget of {fmt_bytes(budgets.vram)} leaves room for {room} expert slots of "
                        f"{fmt_bytes(slot)} after the dense part ({fmt_bytes(sum(dense))}), KV cache, workspaces, "
                        f"head and margin ({fmt_bytes(fixed - sum(dense))}); each token needs "
                        f"{cfg.n_expert_used}: raise --vram-budget by "
                        f"{fmt_bytes(fixed + cfg.n_expert_used * slot - budgets.vram)} or use --moe-experts cpu")
    plan_e = make(sides)
    slots = plan_e.n_slots
    reserves = Reserves(kv, ws, head_bytes, slots * slot, margin, 0, RAM_MARGIN)
    placements = [Placement(i, "vram", n) for i, n in enumerate(dense)]
    plan = MoeOffloadPlan(placements, 0, 0, 0, budgets, reserves, links, "experts offloaded", head_bytes,
                          experts=plan_e)
    if fixed > budgets.vram:
        plan.notes.append(f"the dense part alone ({fmt_bytes(fixed)} with KV and workspaces) exceeds the VRAM "
                          f"budget ({fmt_bytes(budgets.vram)}); it is kept resident anyway")
    return plan


def _sides(make, tiers: list[str], links: Links, dense_bytes: int, side: str, cpu_ok: bool,
           gpu_ok: bool) -> tuple[str, ...]:
    """Per layer gpu or cpu. auto: the split with the lowest predicted token time. Moving k
    RAM-tier layers to the CPU costs their full expert reads at the CPU's rate but leaves the
    cache to fewer layers, so the rest miss less; storage-tier layers stay on the GPU side."""
    n = len(tiers)
    if side != "auto":
        return (side,) * n
    if not cpu_ok or links.cpu <= 0:
        return ("gpu",) * n
    ram = [i for i, t in enumerate(tiers) if t == "ram"]
    best, best_s = None, float("inf")
    for k in range(len(ram) + 1):
        cpu = {ram[(2 * j + 1) * len(ram) // (2 * k)] for j in range(k)} if k else set()
        sides = tuple("cpu" if i in cpu else "gpu" for i in range(n))
        if "gpu" in sides and not gpu_ok:
            continue
        t = sum(expert_terms(make(sides), dense_bytes, links).values())
        if t < best_s * (1 - 1e-9):
            best, best_s = sides, t
    return best if best is not None else ("gpu",) * n
