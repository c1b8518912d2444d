"""`bench_cpu.py matvec`: native CPU matvec throughput per thread count, type and activation
rows per pass, on a set of weight matrices larger than any L3 (cycled, so every call reads
its weights from DRAM), plus the per-job cost of the thread pool on tiny matrices.

    python scripts/bench_cpu.py matvec --threads 1,2,4,8,12,16 --types q4_k,q6_k,q8_0 \\
        --rows-per-token 1,4 --json out.json

Per (threads, type, rows): GB/s of weight bytes read, and ns per 256-value super-block per
thread (time x threads / super-blocks: the per-thread compute cost; it stays flat while the
kernels are compute-bound and grows once DRAM is the limit). With rows-per-token 4 each weight
block serves 4 activation rows (the speculative verify pass, small prefill chunks).
The machine facts (CPU model, SIMD flags, cores, threads per core, NUMA nodes, L3) come from
/proc/cpuinfo and /sys.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# type: (ggml id, bytes per 256 values, byte offsets of the fp16 scales inside a block, block bytes);
# the float types' "block" is one value, all of it "scale": every value is then a small normal
# number (random bits would hold NaNs and denormals, which some CPUs compute slowly)
TYPES = {"q4_k": (12, 144, (0, 2), 144), "q6_k": (14, 210, (208,), 210), "q8_0": (8, 272, (0,), 34),
         "q5_k": (13, 176, (0, 2), 176), "q4_0": (2, 144, (0,), 18), "q4_1": (3, 160, (0, 2), 20),
         "q5_0": (6, 176, (0,), 22), "q5_1": (7, 192, (0, 2), 24), "q2_k": (10, 84, (80, 82), 84),
         "q3_k": (11, 110, (108,), 110), "f16": (1, 512, (0,), 2), "bf16": (30, 512, (0,), 2),
         "f32": (0, 1024, (0, 2), 4)}
SHAPE = (14336, 4096)  # a 70B/8B FFN matrix
FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni",
         "avx512_bf16", "amx_int8", "amx_tile")


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return ""


def machine_facts() -> dict:
    """CPU model, the SIMD flags that matter here, topology and L3, from /proc and /sys."""
    info = _read("/proc/cpuinfo")
    model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    flags = set(next((ln.split(":", 1)[1].split() for ln in info.splitlines() if ln.startswith("flags")), []))
    cpus = sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*"))
    cores = {(_read(f"{c}/topology/physical_package_id"), _read(f"{c}/topology/core_id")) for c in cpus}
    nodes = list(Path("/sys/devices/system/node").glob("node[0-9]*"))
    l3 = {_read(f"{c}/cache/index3/shared_cpu_list"): _read(f"{c}/cache/index3/size") for c in cpus
          if _read(f"{c}/cache/index3/level") == "3"}
    return {"model_name": model, "flags": {f: f in flags for f in FLAGS}, "logical_cpus": len(cpus),
            "usable_cpus": len(os.sched_getaffinity(0)), "physical_cores": len(cores),
            "threads_per_core": round(len(cpus) / max(len(cores), 1), 2), "numa_nodes": max(len(nodes), 1),
            "l3_per_domain": sorted(set(l3.values())), "l3_domains": len(l3),
            "mem_total_kb": next((ln.split()[1] for ln in _read("/proc/meminfo").splitlines()
                                  if ln.startswith("MemTotal")), "?")}


def weight_set(name: str, total_bytes: int, buf):
    """Views into one random buffer: as many SHAPE matrices of type `name` as make total_bytes,
    their fp16 scales set to a small finite value (random bits would give inf/NaN sums)."""
    import numpy as np

    t, per256, scale_offs, blk = TYPES[name]
    rows, k = SHAPE
    nbytes = rows * k // 256 * per256
    count = max(1, -(-total_bytes // nbytes))
    if count * nbytes > buf.size:
        raise SystemExit(f"buffer of {buf.size} bytes too small for {count} x {nbytes}")
    blocks = buf[:count * nbytes].reshape(-1, blk)
    half = np.frombuffer(np.array([0.01], np.float16).tobytes(), np.uint8)
    for off in scale_offs:
        blocks[:, off:off + 2] = half
    return t, [buf[i * nbytes:(i + 1) * nbytes] for i in range(count)], nbytes


def time_pass(kern, handles, x, min_seconds: float) -> float:
    """Seconds per matvec, cycling over the matrices (whole passes) until min_seconds."""
    for w in handles[:2]:
        kern.matmul_w(w, x)
    calls, t0 = 0, time.perf_counter()
    while True:
        for w in handles:
            kern.matmul_w(w, x)
        calls += len(handles)
        dt = time.perf_counter() - t0
        if dt >= min_seconds:
            return dt / calls


def job_cost_us(kern, buf) -> dict:
    """Per-call cost on tiny Q4_K matrices: 8 rows (one chunk: no pool wake-up, the call and
    activation quantization only) and 64 rows (split over the pool), best of many."""
    import numpy as np

    x = np.random.default_rng(1).standard_normal((1, SHAPE[1])).astype(np.float32)
    out = {}
    for rows in (8, 64, 512):
        w = kern.weight(12, buf[:rows * SHAPE[1] // 256 * 144], rows, SHAPE[1], f"tiny{rows}")
        best = min(_timed(kern, w, x, 200) for _ in range(5))
        out[f"rows_{rows}_us"] = round(best * 1e6, 2)
    return out


def _timed(kern, w, x, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        kern.matmul_w(w, x)
    return (time.perf_counter() - t0) / reps


def run(threads: list[int], types: list[str], rows_per_token: list[int], total_gb: float,
        seconds: float, simds: list[str] | None = None) -> dict:
    import numpy as np

    from ntx_engine.backends.cpu_kernels import CpuKernels

    total = int(total_gb * 1e9)
    biggest = max(TYPES[t][1] for t in types) * SHAPE[0] * SHAPE[1] // 256
    size = (-(-total // biggest) + 1) * biggest
    buf = np.random.default_rng(0).integers(0, 2**63, size // 8 + 1, dtype=np.uint64).view(np.uint8)[:size]
    doc = {"machine": machine_facts(), "shape": list(SHAPE), "set_gb": total_gb, "results": [], "pool": []}
    sb = SHAPE[0] * SHAPE[1] / 256
    for name in types:  # type outside: each writes its scales into the shared buffer
        t, mats, nbytes = weight_set(name, total, buf)
        for th in threads:
            kern = CpuKernels(threads=th)
            doc["simd"] = kern.simd
            handles = [kern.weight(t, m, *SHAPE, f"{name}[{i}]") for i, m in enumerate(mats)]
            for level in simds or [kern.simd]:
                simd = kern.select_simd(level)
                for n in rows_per_token:
                    x = np.random.default_rng(n).standard_normal((n, SHAPE[1])).astype(np.float32)
                    dt = time_pass(kern, handles, x, seconds)
                    row = {"threads": th, "type": name, "rows": n, "simd": simd, "matrices": len(handles),
                           "ms": round(dt * 1e3, 3), "gb_s": round(nbytes / dt / 1e9, 2),
                           "ns_per_superblock_thread": round(dt * th / sb * 1e9, 2)}
                    doc["results"].append(row)
                    print(f"threads {th:3d} {name:5s} rows {n} {simd:10s}: {row['ms']:8.3f} ms/matvec "
                          f"{row['gb_s']:7.2f} GB/s {row['ns_per_superblock_thread']:7.2f} ns/super-block/thread",
                          file=sys.stderr, flush=True)
            kern.close()
    weight_set("q4_k", 0, buf)  # the tiny matrices are Q4_K
    for th in threads:
        kern = CpuKernels(threads=th)
        pool = {"threads": th, **job_cost_us(kern, buf)}
        doc["pool"].append(pool)
        print(f"threads {th:3d} per call: " + ", ".join(f"{k} {v}" for k, v in pool.items() if k != "threads"),
              file=sys.stderr, flush=True)
        kern.close()
    return doc


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="bench_cpu.py matvec", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2,4,8,12,16", help="comma-separated thread counts")
    ap.add_argument("--types", default="q4_k,q6_k,q8_0", help=f"comma-separated, of {','.join(TYPES)}")
    ap.add_argument("--rows-per-token", default="1,4", help="activation rows per matvec (1 = decode)")
    ap.add_argument("--gb", type=float, default=1.0, help="weight bytes per type, cycled (>= 1 GB: no L3 hits)")
    ap.add_argument("--seconds", type=float, default=0.4, help="minimum timed seconds per configuration")
    ap.add_argument("--simd", default="", help="comma-separated kernel tables to compare "
                    "(avx512,avx512vnni,avx2,portable; capped at what the CPU has); default: the best")
    ap.add_argument("--json", type=Path, default=None, help="write the result here (always printed)")
    args = ap.parse_args(argv)
    types = args.types.split(",")
    bad = [t for t in types if t not in TYPES]
    if bad:
        raise SystemExit(f"unknown type(s) {bad}; known: {', '.join(TYPES)}")
    doc = run([int(v) for v in args.threads.split(",")], types, [int(v) for v in args.rows_per_token.split(",")],
              args.gb, args.seconds, [v for v in args.simd.split(",") if v] or None)
    text = json.dumps(doc, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
