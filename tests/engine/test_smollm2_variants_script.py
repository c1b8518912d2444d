"""scripts/smollm2_variants.py, the way the lent GPU gets SmolLM2's variants: re-quantizing the
Q4_1 source there must give the very files the fixtures (and so the llama.cpp oracles) were
built from, byte for byte, and a file that differs must be left out of the manifest."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "smollm2_variants.py"


def _run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=600)


def test_rebuilt_variants_match_the_fixture_files(oracle_manifest, tmp_path):
    models = oracle_manifest["models"]
    sums = tmp_path / "sha256.txt"
    r = _run("sums", models["smollm2-Q4_1"].parent)
    assert r.returncode == 0, r.stderr
    sums.write_text(r.stdout)
    assert "smollm2-Q8_0.gguf" in r.stdout and "smollm2-Q4_K_M.gguf" in r.stdout
    r = _run("build", models["smollm2-Q4_1"], tmp_path / "fx", sums, "--variants", "Q4_1,Q8_0,Q4_K_M")
    assert r.returncode == 0, r.stdout + r.stderr
    manifest = json.loads((tmp_path / "fx" / "v2" / "manifest.json").read_text())
    assert set(manifest["models"]) == {"smollm2-Q4_1", "smollm2-Q8_0", "smollm2-Q4_K_M"}
    for name in manifest["models"]:
        built = tmp_path / "fx" / "v2" / manifest["models"][name]
        assert built.read_bytes() == models[name].read_bytes(), f"{name} differs from the fixture"


def test_a_file_that_differs_is_left_out(oracle_manifest, tmp_path):
    models = oracle_manifest["models"]
    sums = tmp_path / "sha256.txt"
    sums.write_text("0" * 64 + "  smollm2-Q4_1.gguf\n")  # not the file's hash
    r = _run("build", models["smollm2-Q4_1"], tmp_path / "fx", sums, "--variants", "Q4_1")
    assert r.returncode == 1 and "DIFFERS" in r.stdout
    assert json.loads((tmp_path / "fx" / "v2" / "manifest.json").read_text())["models"] == {}
    assert _run("build", models["smollm2-Q4_1"], tmp_path / "fx", sums, "--variants", "Q9_9").returncode == 2
