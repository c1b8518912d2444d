"""`scripts/bench_cpu.py matvec` (the thread-scaling benchmark the H200 run uses) at a tiny size:
it finishes, its JSON has one row per (type, threads, rows, table), the throughput it reports
is the bytes it read over the time it took, and the machine facts agree with what the OS says."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_matvec_subcommand_reports_every_configuration(tmp_path):
    out = tmp_path / "mv.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_cpu.py"), "matvec", "--threads", "1,2", "--types",
           "q4_k,q8_0", "--rows-per-token", "1,3", "--gb", "0.05", "--seconds", "0.01", "--simd", "avx2,avx512",
           "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    doc = json.loads(out.read_text())
    got = {(r["type"], r["threads"], r["rows"], r["simd"]) for r in doc["results"]}
    from ntx_engine.backends.cpu_kernels import SIMD_NAMES, CpuKernels

    levels = list(SIMD_NAMES.values())
    kern = CpuKernels(1)
    have = levels.index(kern.supported_simd())
    kern.close()
    tables = {levels[min(levels.index(s), have)] for s in ("avx2", "avx512")}  # capped at what the CPU has
    want = {(t, th, n, s) for t in ("q4_k", "q8_0") for th in (1, 2) for n in (1, 3) for s in tables}
    assert got == want
    shape = doc["shape"]
    for r in doc["results"]:
        per_matrix = shape[0] * shape[1] // 256 * {"q4_k": 144, "q8_0": 272}[r["type"]]
        assert abs(r["gb_s"] - per_matrix / (r["ms"] / 1e3) / 1e9) <= 0.02 * r["gb_s"] + 0.01
        assert r["matrices"] * per_matrix >= 0.05e9
    m = doc["machine"]
    assert m["logical_cpus"] == os.cpu_count()
    assert m["usable_cpus"] == len(os.sched_getaffinity(0))
    assert 1 <= m["physical_cores"] <= m["logical_cpus"]
    assert m["flags"]["avx2"] == ("avx2" in Path("/proc/cpuinfo").read_text().split())
    assert [p["threads"] for p in doc["pool"]] == [1, 2]
    assert all(p["rows_8_us"] > 0 and p["rows_512_us"] > p["rows_8_us"] for p in doc["pool"])


def test_float_weight_sets_hold_normal_numbers(monkeypatch):
    """F16/BF16/F32 matrices are timed on small normal values, not on random bits (NaNs and
    denormals run slower on some CPUs), and the quantized sets keep finite fp16 scales."""
    import numpy as np

    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_matvec

    monkeypatch.setattr(bench_matvec, "SHAPE", (8, 512))
    buf = np.random.default_rng(5).integers(0, 256, 8 * 512 * 4 * 3, dtype=np.uint8)
    as_f32 = {"f16": lambda m: m.view(np.float16).astype(np.float32), "f32": lambda m: m.view(np.float32),
              "bf16": lambda m: (m.view(np.uint16).astype(np.uint32) << 16).view(np.float32)}
    for name, conv in as_f32.items():
        _, mats, nbytes = bench_matvec.weight_set(name, 1, buf)
        assert nbytes == 8 * 512 * bench_matvec.TYPES[name][1] // 256
        vals = conv(mats[0])
        tiny = np.finfo(np.float16 if name == "f16" else np.float32).tiny
        assert vals.size == 8 * 512
        assert np.isfinite(vals).all() and (np.abs(vals) >= tiny).all(), name
    for name in ("q5_0", "q5_1", "q2_k", "q3_k", "q4_1"):
        _, mats, _ = bench_matvec.weight_set(name, 1, buf)
        _, _, offs, blk = bench_matvec.TYPES[name]
        blocks = mats[0].reshape(-1, blk)
        for off in offs:
            assert np.isfinite(blocks[:, off:off + 2].copy().view(np.float16)).all(), (name, off)
