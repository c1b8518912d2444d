"""`ntx-run --plan`: the placement table, bytes per tier per token, the measured links and the
predicted decode speed, as a rich table on stdout (or the plan's dict with --json)."""

from __future__ import annotations

from rich.table import Table

from ntx_engine.planner import Plan, fmt_bytes


def layer_ranges(plan: Plan) -> list[tuple[str, str, int]]:
    """Consecutive layers of one tier merged: (\"0-37\", tier, bytes)."""
    rows: list[list] = []
    for p in plan.placements:
        if rows and rows[-1][1] == p.tier and rows[-1][3] == p.layer - 1:
            rows[-1][3], rows[-1][2] = p.layer, rows[-1][2] + p.nbytes
        else:
            rows.append([p.layer, p.tier, p.nbytes, p.layer])
    return [(f"{a}" if a == b else f"{a}-{b}", tier, n) for a, tier, n, b in rows]


def render(plan: Plan, console) -> None:
    table = Table(title="placement", show_edge=False)
    for col in ("layers", "tier", "bytes"):
        table.add_column(col)
    for rng, tier, n in layer_ranges(plan):
        table.add_row(rng, tier, fmt_bytes(n))
    console.print(table)
    per_tier = plan.bytes_per_tier
    b = plan.budgets
    console.print("bytes per token: " + ", ".join(f"{t} {fmt_bytes(n)}" for t, n in per_tier.items())
                  + f", embeddings/head {fmt_bytes(plan.head_bytes)} "
                  + ("(storage, every token)" if plan.head_tier == "storage" else f"({b.device_memory})"))
    r = plan.reserves
    staging = f"staging {plan.n_staging} x {fmt_bytes(plan.slot_bytes)}"
    console.print(f"{b.device_memory} budget {fmt_bytes(b.vram)}: KV {fmt_bytes(r.kv_cache)}, workspaces "
                  f"{fmt_bytes(r.workspace)}, ring {plan.n_slots} x {fmt_bytes(plan.slot_bytes)}, margin "
                  f"{fmt_bytes(r.vram_margin)}"
                  + (f", {staging}" if b.unified else f"; RAM budget {fmt_bytes(b.ram)}: {staging}"))
    lk = plan.links
    console.print(f"links ({lk.source}): VRAM {lk.vram / 1e9:.1f} GB/s, H2D {lk.h2d / 1e9:.1f} GB/s, "
                  f"storage ({lk.storage_kind}) {lk.storage / 1e9:.2f} GB/s")
    terms = ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in plan.terms.items())
    console.print(f"predicted decode: {1.0 / plan.predicted_token_s:.2f} tok/s "
                  f"(bound by {plan.bottleneck}; per-link time per token: {terms})")
    for note in plan.notes:
        console.print(f"note: {note}")
