"""`ntx-run` with tier options: --plan (table and --json, no generation), a streamed run's
--json statistics, and the budget errors as a real process (one `error:` line, exit 2)."""
from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from ntx_engine.cli.run import app
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.layout import layer_spans, resident_bytes

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}
BUDGET = ["--device", "cpu", "--ctx", "128", "--vram-budget", "110M", "--ram-budget", "20M"]


def test_plan_json_places_every_layer(smollm2_path):
    res = CliRunner().invoke(app, ["--plan", "--json", "-m", str(smollm2_path), *BUDGET], env=ENV)
    assert res.exit_code == 0, res.output
    plan = json.loads(res.stdout)
    with GGUFFile.open(smollm2_path) as gf:
        cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        spans, head = layer_spans(gf, cfg), resident_bytes(gf, cfg)
    assert [row["layer"] for row in plan["layers"]] == list(range(cfg.n_layers))
    assert {row["tier"] for row in plan["layers"]} == {"vram", "ram", "storage"}
    assert sum(plan["bytes_per_tier"].values()) == sum(s.nbytes for s in spans) and plan["head_bytes"] == head
    links = plan["links_gbps"]
    terms = plan["terms_s"]  # the bound recomputed from the plan's own bytes and links
    b = plan["bytes_per_tier"]
    assert terms["storage"] == b["storage"] / (links["storage"] * 1e9)
    assert plan["predicted_token_s"] == max(terms.values()) and plan["predicted_tok_s"] > 0


def test_plan_table(smollm2_path):
    res = CliRunner().invoke(app, ["--plan", "-m", str(smollm2_path), *BUDGET], env=ENV)
    assert res.exit_code == 0, res.output
    for text in ("placement", "storage", "bytes per token", "links", "predicted decode", "tok/s"):
        assert text in res.stdout


def test_streamed_run_reports_pipeline(smollm2_path):
    res = CliRunner().invoke(app, ["Hello", "--raw", "--temperature", "0", "-n", "4", "--json",
                                   "-m", str(smollm2_path), *BUDGET], env=ENV)
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    tiers = out["tiers"]
    assert tiers["streamed"] and tiers["pipeline"]["passes"] == 4
    for tier in ("ram", "storage"):
        assert tiers["pipeline"]["bytes"][tier] == 4 * tiers["bytes_per_tier"][tier] > 0


def _run(*args):
    return subprocess.run([sys.executable, "-m", "ntx_engine.cli.run", *args], capture_output=True, text=True,
                          env={**ENV, "PATH": "/usr/bin:/bin"}, timeout=300)


def test_impossible_budget_is_one_clear_error(smollm2_path):
    res = _run("--plan", "-m", str(smollm2_path), "--device", "cpu", "--vram-budget", "50M")
    assert res.returncode == 2, res.stderr
    assert res.stderr.startswith("error: a VRAM budget of 50.00 MiB cannot run this model")
    assert "raise --vram-budget to" in res.stderr and "Traceback" not in res.stderr


def test_bad_size_is_one_clear_error(smollm2_path):
    res = _run("--plan", "-m", str(smollm2_path), "--device", "cpu", "--vram-budget", "lots")
    assert res.returncode == 2 and "--vram-budget 'lots' is not a size" in res.stderr
