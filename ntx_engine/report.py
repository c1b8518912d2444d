"""A self-contained HTML page of one run: the basic numbers, and when the engine measured them, the
tier plan, a per-layer timeline (inline SVG), bytes per tier and bandwidth against the bound.

No JavaScript, stylesheet or font is fetched: the page is one file that opens offline. Every
string that comes from a model file or a stats dict is escaped before it reaches the page.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from ntx_engine.engine import Engine, GenerationStats

KIND_COLORS = {"io": "#d95f02", "h2d": "#7570b3", "compute": "#1b9e77"}
MAX_EVENTS = 20_000  # a longer timeline is cut: the page must stay small enough to open
CHART_W, ROW_H, LEFT, TOP = 760, 12, 56, 24


@dataclass(frozen=True)
class RunSummary:
    """What a report shows. `stats` is the engine's `last_run_stats` (may be empty)."""

    model: str
    device: str
    prompt_tokens: int
    generated_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    stop_reason: str = ""
    stats: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.generated_tokens < 0:
            raise ValueError(f"token counts must be >= 0, got {self.prompt_tokens}, {self.generated_tokens}")
        for name in ("prefill_tok_s", "decode_tok_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")

    @classmethod
    def from_run(cls, engine: Engine, stats: GenerationStats) -> RunSummary:
        extra = getattr(engine, "last_run_stats", None)
        return cls(model=engine.gguf.path.name, device=engine.engine_config.device,
                   prompt_tokens=stats.prompt_tokens, generated_tokens=stats.generated,
                   prefill_tok_s=stats.prefill_tok_s, decode_tok_s=stats.decode_tok_s,
                   stop_reason=stats.stop_reason, stats=dict(extra) if isinstance(extra, Mapping) else {})


def fmt_rate(x: float) -> str:
    """tok/s and GB/s as the page prints them (tests look for these strings)."""
    return f"{x:.2f}"


def fmt_bytes(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.1f} MiB)"


def write_report(directory: str | Path, run: RunSummary) -> Path:
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "report.html"
    path.write_text(render_report(run), encoding="utf-8")
    return path


def render_report(run: RunSummary) -> str:
    sections = [_summary(run)]
    st = run.stats
    if _is_list(st.get("timeline")):
        sections.append(_timeline(st["timeline"]))
    if _is_list(st.get("plan")):
        sections.append(_plan(st["plan"]))
    if isinstance(st.get("bytes_per_tier"), Mapping):
        sections.append(_bytes_per_tier(st["bytes_per_tier"]))
    if isinstance(st.get("bandwidth"), Mapping) or _num(st.get("bound_tok_s")) is not None:
        sections.append(_bandwidth(st.get("bandwidth") or {}, _num(st.get("bound_tok_s")), run.decode_tok_s))
    title = f"ntx run: {escape(run.model)}"
    # the empty data: icon keeps browsers from asking the server for /favicon.ico (a 404)
    head = f'<meta charset="utf-8"><link rel="icon" href="data:,"><title>{title}</title><style>{_CSS}</style>'
    return (f'<!DOCTYPE html>\n<html lang="en"><head>{head}</head><body><h1>{title}</h1>\n'
            + "\n".join(sections) + "\n</body></html>\n")


_CSS = ("body{font:14px system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}"
        "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f3f3f3}"
        "td:first-child,th:first-child{text-align:left}svg text{font:11px sans-serif}")


def _is_list(x: Any) -> bool:
    return isinstance(x, (list, tuple))


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    return float(x) if math.isfinite(x) else None


def _table(head: list[str], rows: list[list[str]], table_id: str) -> str:
    th = "".join(f"<th>{escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table id="{table_id}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _summary(run: RunSummary) -> str:
    rows = [["model", escape(run.model)], ["device", escape(run.device)],
            ["prompt tokens", str(run.prompt_tokens)], ["generated tokens", str(run.generated_tokens)],
            ["prefill tok/s", fmt_rate(run.prefill_tok_s)], ["decode tok/s", fmt_rate(run.decode_tok_s)]]
    if run.stop_reason:
        rows.append(["stop reason", escape(run.stop_reason)])
    return "<h2>Run</h2>" + _table(["", "value"], rows, "summary")


def _events(timeline: list) -> list[tuple[int, float, float, str]]:
    """(layer, start, end, kind) of the well-formed events; malformed rows are left out."""
    out = []
    for ev in timeline[:MAX_EVENTS]:
        if not isinstance(ev, Mapping):
            continue
        layer, s, e = ev.get("layer"), _num(ev.get("start_s")), _num(ev.get("end_s"))
        if isinstance(layer, int) and s is not None and e is not None and e >= s:
            out.append((layer, s, e, str(ev.get("kind", ""))))
    return out


def _timeline(timeline: list) -> str:
    events = _events(timeline)
    if not events:
        return "<h2>Timeline</h2><p>no timeline events</p>"
    layers = sorted({ev[0] for ev in events})
    row = {layer: i for i, layer in enumerate(layers)}
    t0, t1 = min(ev[1] for ev in events), max(ev[2] for ev in events)
    span = (t1 - t0) or 1e-9
    height = TOP + ROW_H * len(layers) + 20

    def x(t: float) -> float:
        return LEFT + (t - t0) / span * CHART_W

    parts = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{LEFT + CHART_W + 10}" '
             f'height="{height}" role="img" aria-label="per-layer timeline">']
    parts += _legend() + _axis(t0, span, TOP + ROW_H * len(layers))
    for layer in layers:
        y = TOP + row[layer] * ROW_H
        parts.append(f'<text x="{LEFT - 6}" y="{y + ROW_H - 2}" text-anchor="end">{layer}</text>')
    for layer, s, e, kind in events:
        y = TOP + row[layer] * ROW_H
        color = KIND_COLORS.get(kind, "#999")
        tip = f"layer {layer} {kind} {s:.6f}-{e:.6f} s"
        parts.append(f'<rect class="ev" x="{x(s):.2f}" y="{y + 1}" width="{max(x(e) - x(s), 0.5):.2f}" '
                     f'height="{ROW_H - 2}" fill="{color}"><title>{escape(tip)}</title></rect>')
    parts.append("</svg>")
    note = f"<p>{len(events)} events over {span * 1e3:.3f} ms; rows are layers.</p>"
    return "<h2>Timeline</h2>" + "".join(parts) + note


def _legend() -> list[str]:
    out = []
    for i, (kind, color) in enumerate(KIND_COLORS.items()):
        x = LEFT + i * 90
        out.append(f'<rect x="{x}" y="4" width="10" height="10" fill="{color}"/>'
                   f'<text x="{x + 14}" y="13">{kind}</text>')
    return out


def _axis(t0: float, span: float, y: float) -> list[str]:
    out = [f'<line x1="{LEFT}" y1="{y}" x2="{LEFT + CHART_W}" y2="{y}" stroke="#444"/>']
    for i in range(5):
        frac = i / 4
        anchor = "start" if i == 0 else "end" if i == 4 else "middle"  # the end labels stay inside
        out.append(f'<text x="{LEFT + frac * CHART_W:.1f}" y="{y + 14}" text-anchor="{anchor}">'
                   f"{(frac * span) * 1e3:.2f} ms</text>")
    return out


def _plan(plan: list) -> str:
    rows = [[escape(str(r.get("layer", ""))), escape(str(r.get("tier", ""))),
             fmt_bytes(int(r["bytes"])) if _num(r.get("bytes")) is not None else ""]
            for r in plan if isinstance(r, Mapping)]
    return "<h2>Plan</h2>" + _table(["layer", "tier", "bytes"], rows, "plan")


def _bytes_per_tier(tiers: Mapping) -> str:
    sizes = {str(k): int(v) for k, v in tiers.items() if _num(v) is not None}
    total = sum(sizes.values()) or 1
    rows = [[escape(k), fmt_bytes(v), f"{100 * v / total:.1f} %"] for k, v in sizes.items()]
    return "<h2>Bytes per tier</h2>" + _table(["tier", "bytes", "share"], rows, "tiers")


def _bandwidth(bw: Mapping, bound: float | None, achieved: float) -> str:
    rows = [[escape(str(k)), fmt_rate(g)] for k, v in bw.items() if (g := _num(v)) is not None]
    html = "<h2>Bandwidth vs bound</h2>" + _table(["link", "GB/s"], rows, "bandwidth")
    if bound is not None:
        share = f" ({100 * achieved / bound:.1f} % of the bound)" if bound > 0 else ""
        html += (f'<p id="bound">bound {fmt_rate(bound)} tok/s; achieved decode '
                 f"{fmt_rate(achieved)} tok/s{share}</p>")
    return html
