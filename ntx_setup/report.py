"""`ntx-setup report`: the check's facts as JSON plus one self-contained HTML page.

The HTML has inline CSS and inline SVG only (no scripts, fonts or network), so it opens
offline and can be attached to a bug report. Every string from the machine is escaped.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path

from ntx_common.errors import SetupError

GiB = 1 << 30
_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.6em;border-bottom:1px solid #ccc}
table{border-collapse:collapse;width:100%;margin:.5em 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:left;
vertical-align:top}th{background:#f4f4f4}.ok{color:#176117}.warn{color:#8a5a00}.fail{color:#a30000;font-weight:bold}
.fix{color:#555;font-size:.9em}code{background:#f4f4f4;padding:0 3px}svg text{font:12px system-ui,sans-serif}
"""


def _h(value) -> str:
    return escape("" if value is None else str(value))


def _gib(n) -> str:
    return "?" if n is None else f"{n / GiB:.1f} GiB"


def _table(headers: list[str], rows: list[list]) -> str:
    head = "".join(f"<th>{_h(x)}</th>" for x in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body or '<tr><td colspan=99>none</td></tr>'}</table>"


def bar_chart(title: str, bars: list[tuple[str, float | None, str]], unit: str) -> str:
    """Horizontal bars (label, value, colour) as inline SVG; missing values are shown as '?'."""
    width, row, label_w = 760, 26, 230
    top = max([v for _, v, _ in bars if v] or [1.0])
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{row * len(bars) + 30}" '
             f'role="img" aria-label="{_h(title)}"><text x="0" y="14" font-weight="bold">{_h(title)}</text>']
    for i, (label, value, colour) in enumerate(bars):
        y = 24 + i * row
        w = 0 if not value else max(2, (width - label_w - 110) * value / top)
        text = "?" if value is None else f"{value:,.1f} {unit}"
        parts.append(f'<text x="0" y="{y + 14}">{_h(label)}</text>'
                     f'<rect x="{label_w}" y="{y + 2}" width="{w:.1f}" height="{row - 8}" fill="{colour}"/>'
                     f'<text x="{label_w + w + 6:.1f}" y="{y + 14}">{_h(text)}</text>')
    return "".join(parts) + "</svg>"


def _charts(report: dict) -> str:
    facts, b = report["facts"], report["recommendation"]["budgets"]
    tiers = [("VRAM (budget)", b["vram_bytes"] / GiB if b["vram_bytes"] else None, "#5b8def"),
             ("pinned RAM (budget)", b["pinned_ram_bytes"] / GiB, "#47a447"),
             ("RAM total", facts["memory"]["total"] / GiB, "#9fd49f"),
             ("NVMe storage (dedicated)", b["storage_bytes"] / GiB if b["storage_bytes"] else None, "#e0a030")]
    links = [(f"GPU {g['bdf']}", g["link"]["gbps"], "#5b8def") for g in facts["gpus"]]
    links += [(f"NVMe {n['bdf']}", n["link"]["gbps"], "#e0a030") for n in facts["nvme"]]
    out = bar_chart("memory tiers", tiers, "GiB")
    if links:
        out += "<br>" + bar_chart("PCIe link bandwidth (current, after line coding)", links, "GB/s")
    return out


def _findings(report: dict) -> str:
    rows = [[f'<span class="{f["level"]}">{_h(f["level"])}</span>', _h(f["area"]),
             _h(f["message"]) + (f'<div class="fix">fix: {_h(f["fix"])}</div>' if f["fix"] and f["level"] != "ok" else "")]
            for f in report["findings"]]
    return _table(["level", "area", "finding"], rows)


def _devices(facts: dict) -> str:
    gpus = [[_h(g["bdf"]), _h(g["model"] or g["device_id"]), _h(g["compute_capability"]), _gib(g["vram_bytes"]),
             _h(g["driver"]), _h(f"{g['link']['speed_gts']} GT/s x{g['link']['width']} (max {g['link']['max_speed_gts']} x{g['link']['max_width']})"),
             _h(g["numa_node"])] for g in facts["gpus"]]
    nvmes = [[_h(n["bdf"]), _h(n["model"]), _h(n["serial"]), _h(n["firmware"]), _h(n["driver"]),
              _h(", ".join(f"{ns['name']} {_gib(ns['size_bytes'])} ({ns['lba_bytes']} B LBA)" for ns in n["namespaces"])),
              _h(f"{n['link']['speed_gts']} GT/s x{n['link']['width']}"), _h(n["iommu_group"]),
              _h(", ".join(n["group_peers"])), _h(n["numa_node"]),
              _h("; ".join(r["message"] for r in n["refusals"]) or ("dedicated" if n["dedicated"] else "free"))]
             for n in facts["nvme"]]
    return ("<h2>GPUs</h2>" + _table(["PCI", "model", "cc", "VRAM", "driver", "link", "NUMA"], gpus) +
            "<h2>NVMe controllers</h2>" + _table(["PCI", "model", "serial", "firmware", "driver", "namespaces", "link",
                                                  "IOMMU group", "group peers", "NUMA", "use"], nvmes))


def render_html(report: dict) -> str:
    facts, rec = report["facts"], report["recommendation"]
    return ("<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>ntx-setup report</title>"
            f"<style>{_CSS}</style></head><body><h1>ntx-setup report</h1>"
            f"<p>Linux {_h(facts['kernel']['release'])}, CPU {_h(facts['cpu']['vendor'])}, "
            f"Secure Boot {_h(facts['secure_boot'])}, enumeration via {_h(report['enumeration'])}.</p>"
            f"<h2>Recommendation</h2><p><b>{_h(rec['summary'])}</b> {_h(rec.get('fix', ''))}</p>{_charts(report)}"
            f"<h2>Findings</h2>{_findings(report)}{_devices(facts)}"
            f"<h2>Raw facts</h2><pre>{_h(json.dumps(facts, indent=1))}</pre></body></html>\n")


def write_report(report: dict, out_dir: Path) -> dict[str, Path]:
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = {"json": out_dir / "ntx-report.json", "html": out_dir / "ntx-report.html"}
        paths["json"].write_text(json.dumps(report, indent=2) + "\n")
        paths["html"].write_text(render_html(report))
    except OSError as exc:
        raise SetupError(f"cannot write the report into {out_dir}: {exc.strerror or exc}") from exc
    return paths
