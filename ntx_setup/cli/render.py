"""Human-readable rendering of `check` (the JSON form is the dict itself)."""

from __future__ import annotations

from ntx_common.console import out

_TAG = {"ok": "[green] ok [/]", "warn": "[yellow]warn[/]", "fail": "[red]FAIL[/]"}
GiB = 1 << 30


def _gib(n) -> str:
    from ntx_setup.check import human

    return human(n)


def render_check(report: dict) -> None:
    from rich.markup import escape

    for f in report["findings"]:
        out.print(f"{_TAG[f['level']]} {escape(f['area'])}: {escape(f['message'])}")
        if f["fix"] and f["level"] != "ok":
            out.print(f"       fix: {escape(f['fix'])}")
    b = report["recommendation"]["budgets"]
    out.print(f"tier budgets: VRAM {_gib(b['vram_bytes'])}, pinned RAM {_gib(b['pinned_ram_bytes'])}, "
              f"storage {_gib(b['storage_bytes'])} via {b['reader']}; "
              f"links: GPU {b['h2d_gbps'] or '?'} GB/s, NVMe {b['nvme_gbps'] or '?'} GB/s", markup=False)
    counts = {lvl: sum(f["level"] == lvl for f in report["findings"]) for lvl in ("ok", "warn", "fail")}
    out.print(f"{counts['ok']} ok, {counts['warn']} warnings, {counts['fail']} failures "
              f"(enumeration: {report['enumeration']})", markup=False)
