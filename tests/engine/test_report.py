"""The run report (ntx_engine/report.py): synthetic stats dicts rendered and read back, a page
opened in headless Chromium (no console errors, no network, the run's numbers visible), and
`ntx-run --report DIR` end to end on the default model."""

from __future__ import annotations

import json
from html.parser import HTMLParser

import pytest
from typer.testing import CliRunner

from ntx_engine.report import KIND_COLORS, RunSummary, fmt_bytes, fmt_rate, render_report, write_report

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


def _stats(n_layers: int = 6) -> dict:
    """A synthetic pipeline record shaped as the engine's `last_run_stats`."""
    timeline, t = [], 0.0
    for layer in range(n_layers):
        for kind, dur in (("io", 0.004), ("h2d", 0.002), ("compute", 0.001)):
            timeline.append({"layer": layer, "start_s": t, "end_s": t + dur, "kind": kind})
            t += dur / 2
    plan = [{"layer": i, "tier": "vram" if i < 2 else "ram" if i < 4 else "nvme", "bytes": 1_000_000 + i}
            for i in range(n_layers)]
    tiers: dict[str, int] = {}
    for row in plan:
        tiers[row["tier"]] = tiers.get(row["tier"], 0) + row["bytes"]
    return {"plan": plan, "timeline": timeline, "bytes_per_tier": tiers,
            "bandwidth": {"h2d": 53.87, "nvme": 3.35}, "bound_tok_s": 12.5}


def _run(stats: dict | None = None) -> RunSummary:
    return RunSummary(model="m<odel>.gguf", device="cpu", prompt_tokens=17, generated_tokens=9,
                      prefill_tok_s=123.456, decode_tok_s=7.891, stop_reason="length", stats=stats or {})


class _Collect(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(html: str) -> _Collect:
    p = _Collect()
    p.feed(html)
    return p


def test_basic_numbers_only_when_the_engine_measured_nothing():
    page = _parse(render_report(_run()))
    text = " ".join(page.text)
    for needle in ("m<odel>.gguf", "cpu", "17", "9", fmt_rate(123.456), fmt_rate(7.891), "length"):
        assert needle in text
    ids = {a.get("id") for _, a in page.tags}
    assert ids & {"timeline", "plan", "tiers", "bandwidth", "bound"} == set()


def test_synthetic_stats_render_every_section():
    stats = _stats()
    html = render_report(_run(stats))
    page = _parse(html)
    rects = [a for t, a in page.tags if t == "rect" and a.get("class") == "ev"]
    assert len(rects) == len(stats["timeline"])
    # each event's bar starts where its start time maps, in the colour of its kind
    assert [r["fill"] for r in rects] == [KIND_COLORS[e["kind"]] for e in stats["timeline"]]
    starts = [float(r["x"]) for r in rects]
    assert starts == sorted(starts) and starts[0] == pytest.approx(56.0)
    text = " ".join(page.text)
    for tier, n in stats["bytes_per_tier"].items():
        assert tier in text and fmt_bytes(n) in text
    for row in stats["plan"]:
        assert fmt_bytes(row["bytes"]) in text
    assert fmt_rate(53.87) in text and fmt_rate(12.5) in text
    assert f"{100 * 7.891 / 12.5:.1f} % of the bound" in text


def test_partial_and_malformed_stats():
    stats = {"bytes_per_tier": {"vram": 10, "ram": "lots"}, "timeline": [{"layer": 0}, "junk"]}
    page = _parse(render_report(_run(stats)))
    ids = {a.get("id") for _, a in page.tags}
    assert "tiers" in ids and "plan" not in ids and "bandwidth" not in ids
    assert not [a for t, a in page.tags if t == "rect" and a.get("class") == "ev"]
    assert "lots" not in " ".join(page.text)


def test_untrusted_strings_are_escaped():
    stats = {"plan": [{"layer": 0, "tier": "<script>alert(1)</script>", "bytes": 1}]}
    html = render_report(_run(stats))
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_summary_rejects_nonsense():
    with pytest.raises(ValueError, match="decode_tok_s"):
        RunSummary(model="m", device="cpu", prompt_tokens=1, generated_tokens=1, prefill_tok_s=1.0,
                   decode_tok_s=float("nan"))


# --- headless Chromium ------------------------------------------------------------------------



def open_page(browser, url: str) -> tuple[str, list[str], list[str], int]:
    """Visible text of the page at `url`, its console/page errors, the other URLs it requested,
    and the number of timeline bars drawn."""
    page = browser.new_page()
    errors: list[str] = []
    requests: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("request", lambda r: requests.append(r.url) if r.url != url else None)
    page.goto(url, wait_until="load")
    text = page.inner_text("body")
    n_bars = page.locator("svg#timeline rect.ev").count()
    page.close()
    return text, errors, requests, n_bars


def test_report_page_loads_in_chromium(browser, tmp_path):
    stats = _stats(8)
    path = write_report(tmp_path, _run(stats))
    text, errors, requests, n_bars = open_page(browser, path.as_uri())
    assert errors == [] and requests == []  # nothing fetched besides the page itself
    assert n_bars == len(stats["timeline"])
    for needle in (fmt_rate(123.456), fmt_rate(7.891), "17", fmt_bytes(stats["bytes_per_tier"]["nvme"])):
        assert needle in text


def test_ntx_run_report_dir(browser, tmp_path):
    from ntx_engine.cli.run import app

    out = tmp_path / "rep"
    result = CliRunner().invoke(app, ["1, 2, 3,", "--raw", "--temperature", "0", "-n", "6", "--device", "cpu",
                                      "--json", "--report", str(out)], env=ENV)
    assert result.exit_code == 0, result.output
    run = json.loads(result.stdout)
    page = out / "report.html"
    assert page.is_file()
    text, errors, requests, _ = open_page(browser, page.as_uri())
    assert errors == [] and requests == []
    for needle in (str(len(run["prompt_tokens"])), str(len(run["tokens"])), fmt_rate(run["prefill_tok_s"]),
                   fmt_rate(run["decode_tok_s"]), run["stop_reason"], "cpu"):
        assert needle in text
