#!/usr/bin/env python3
"""Build the oracle-test fixtures once and cache them (default ~/.cache/ntx/fixtures).

1. Re-quantized variants of SmolLM2-135M-Instruct (llama.cpp's own quantizer, allow_requantize).
2. Tiny synthetic llama (256-multiple widths, every K-quant) and qwen2 (biases, NeoX RoPE) models,
   and tiny mixture-of-experts models (Mixtral-style llama, qwen2moe, qwen3moe).
3. llama.cpp's logits and greedy continuations for every model (F16 KV cache, as llama.cpp
   defaults; plus an F32 KV cache for the F32 models), saved as .npz.
A manifest records what was built; bump FIXTURE_VERSION when any of this changes. Entries that
are only added (new models) do not need a bump: a manifest that lacks some is completed in place.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llama_oracle  # noqa: E402
import tiny_models  # noqa: E402

FIXTURE_VERSION = 2
SMOLLM_VARIANTS = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K_M", "Q5_K_M", "Q6_K")
TINY_LLAMA_VARIANTS = ("Q8_0", "Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K")
TINY_QWEN2_VARIANTS = ("Q8_0",)
# family: (write_tiny_moe arch, seed, variants); llama.cpp keeps ffn_gate_inp in F32 when quantizing
TINY_MOE = {"tiny-llamamoe": ("llama", 3, ("Q8_0", "Q4_K_M")), "tiny-qwen2moe": ("qwen2moe", 4, ("Q8_0",)),
            "tiny-qwen3moe": ("qwen3moe", 5, ("Q8_0",))}


def source_model() -> Path:
    from ntx_engine.modelfile import default_model

    return default_model()


@contextlib.contextmanager
def _quiet_stderr(log: Path):
    saved = os.dup(2)
    with open(log, "wb") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def quantize(src: Path, dst: Path, ftype_name: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, "LLAMA_FTYPE_ALL_F32" if ftype_name == "F32" else f"LLAMA_FTYPE_MOSTLY_{ftype_name}")
    params.allow_requantize = True
    params.nthread = 2
    tmp = dst.with_suffix(".tmp")
    with _quiet_stderr(dst.with_suffix(".log")):  # llama.cpp prints one line per tensor
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {src.name} -> {ftype_name} failed with {rc}")
    tmp.rename(dst)


def build_models(models: Path) -> dict[str, Path]:
    src = source_model()
    out = {"smollm2-Q4_1": models / "smollm2-Q4_1.gguf"}
    if not out["smollm2-Q4_1"].exists():
        shutil.copyfile(src, out["smollm2-Q4_1"])
    plan = [("smollm2", out["smollm2-Q4_1"], v) for v in SMOLLM_VARIANTS]
    for arch, variants in (("llama", TINY_LLAMA_VARIANTS), ("qwen2", TINY_QWEN2_VARIANTS)):
        base = out[f"tiny-{arch}-F32"] = models / f"tiny-{arch}-F32.gguf"
        if not base.exists():
            tiny_models.write_tiny(base.with_suffix(".tmp"), src, arch, seed=1 if arch == "llama" else 2)
            base.with_suffix(".tmp").rename(base)
        plan += [(f"tiny-{arch}", base, v) for v in variants]
    for family, (arch, seed, variants) in TINY_MOE.items():
        base = out[f"{family}-F32"] = models / f"{family}-F32.gguf"
        if not base.exists():
            tiny_models.write_tiny_moe(base.with_suffix(".tmp"), src, arch, seed=seed)
            base.with_suffix(".tmp").rename(base)
        plan += [(family, base, v) for v in variants]
    for family, base, ftype in plan:
        path = out[f"{family}-{ftype}"] = models / f"{family}-{ftype}.gguf"
        if not path.exists():
            t = time.time()
            quantize(base, path, ftype)
            print(f"  quantized {family}-{ftype} in {time.time() - t:.1f}s", file=sys.stderr)
    return out


def expected_models() -> list[str]:
    names = ["smollm2-Q4_1", *(f"smollm2-{v}" for v in SMOLLM_VARIANTS)]
    for family, variants in (("tiny-llama", TINY_LLAMA_VARIANTS), ("tiny-qwen2", TINY_QWEN2_VARIANTS),
                             *((f, v[2]) for f, v in TINY_MOE.items())):
        names += [f"{family}-F32", *(f"{family}-{v}" for v in variants)]
    return names


def build_oracles(models: dict[str, Path], oracle: Path) -> list[str]:
    done = []
    for name, path in models.items():
        for f32_kv in ((False, True) if name.endswith("-F32") else (False,)):
            tag = f"{name}{'.f32kv' if f32_kv else ''}"
            dst = oracle / f"{tag}.npz"
            if not dst.exists():
                t = time.time()
                llama_oracle.record(path, dst.with_suffix(".tmp.npz"), f32_kv)
                dst.with_suffix(".tmp.npz").rename(dst)
                print(f"  llama.cpp oracle {tag} in {time.time() - t:.1f}s", file=sys.stderr)
            done.append(tag)
    return done


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--cache", type=Path, default=Path.home() / ".cache/ntx/fixtures")
    args = ap.parse_args()
    root = args.cache / f"v{FIXTURE_VERSION}"
    manifest = root / "manifest.json"
    if manifest.exists() and set(expected_models()) <= set(json.loads(manifest.read_text())["models"]):
        print(f"fixtures up to date in {root}", file=sys.stderr)
        return
    (root / "models").mkdir(parents=True, exist_ok=True)
    (root / "oracle").mkdir(parents=True, exist_ok=True)
    t = time.time()
    models = build_models(root / "models")
    oracles = build_oracles(models, root / "oracle")
    manifest.write_text(json.dumps({"version": FIXTURE_VERSION, "models": {k: str(v.relative_to(root)) for k, v in models.items()},
                                    "oracles": oracles}, indent=1))
    print(f"fixtures built in {root} in {time.time() - t:.0f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
