#!/usr/bin/env python3
"""SmolLM2's llama.cpp variants on a machine that cannot build the full fixtures (the lent GPU):
re-quantize the Q4_1 source with llama.cpp's own quantizer and the parameters of
scripts/build_fixtures.py, check each file's sha256 against the file the carried llama.cpp
oracles were recorded on, and lay them out as a fixtures folder (NTX_FIXTURES) whose manifest
lists only the variants that match. docs/cuda.md ("SmolLM2 on the lent GPU") has the recipe.

    here:  python3 scripts/smollm2_variants.py sums ~/.cache/ntx/fixtures/v2/models > sha256.txt
    there: python3 scripts/smollm2_variants.py build SRC.gguf OUT_DIR sha256.txt
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_fixtures import FIXTURE_VERSION, SMOLLM_VARIANTS, quantize  # noqa: E402


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def build(src: Path, out: Path, sums: Path, variants: tuple[str, ...] = ("Q4_1", *SMOLLM_VARIANTS)) -> int:
    want = dict(reversed(line.split()) for line in sums.read_text().splitlines() if line.strip())
    root = out / f"v{FIXTURE_VERSION}"
    models = root / "models"
    models.mkdir(parents=True, exist_ok=True)
    manifest: dict = {"version": FIXTURE_VERSION, "models": {}, "oracles": []}
    bad = 0
    for v in variants:
        dst = models / f"smollm2-{v}.gguf"
        if v == "Q4_1":
            shutil.copyfile(src, dst)
        else:
            quantize(src, dst, v)  # build_fixtures' own call, so the bytes are the fixture's
        ok = sha256(dst) == want.get(dst.name)
        bad += not ok
        print(f"{dst.name}: {dst.stat().st_size} bytes, sha256 {'matches' if ok else 'DIFFERS from'} the oracle's file")
        if ok:
            manifest["models"][f"smollm2-{v}"] = f"models/{dst.name}"
            manifest["oracles"].append(f"smollm2-{v}")
    (root / "manifest.json").write_text(json.dumps(manifest))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("sums", help="sha256 lines of the smollm2-*.gguf files in a models folder")
    s.add_argument("models", type=Path)
    b = sub.add_parser("build", help="re-quantize SRC into OUT/v2/models and write the manifest")
    b.add_argument("src", type=Path)
    b.add_argument("out", type=Path)
    b.add_argument("sums", type=Path)
    b.add_argument("--variants", default=",".join(("Q4_1", *SMOLLM_VARIANTS)), help="comma list (default: all)")
    a = ap.parse_args()
    if a.cmd == "sums":
        for path in sorted(a.models.glob("smollm2-*.gguf")):
            print(f"{sha256(path)}  {path.name}")
        return 0
    variants = tuple(v.strip() for v in a.variants.split(","))
    unknown = set(variants) - {"Q4_1", *SMOLLM_VARIANTS}
    if unknown:
        ap.error(f"unknown variant(s) {sorted(unknown)}; known: Q4_1, {', '.join(SMOLLM_VARIANTS)}")
    return build(a.src, a.out, a.sums, variants)


if __name__ == "__main__":
    raise SystemExit(main())
