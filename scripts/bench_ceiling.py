#!/usr/bin/env python3
"""How fast one decode layer's weights can stream on this GPU: reads only
(native/cuda/read_ceiling.cu), no arithmetic, at the byte counts of a synthetic Llama-3-8B layer.

Three ways to read a layer's four matrices (q/k/v, o, gate + up, down) in their decode order:
  launches      one kernel a matrix, back to back in a CUDA graph with PDL (today's decode step)
  chain         one launch of a resident grid reading them in turn, meeting at a grid barrier
                between matrices (what a persistent per-layer kernel keeps of the dependencies)
  stream        the same launch without the barriers (the layer as one stream: the ceiling)
Each layer's buffers are rotated over copies that exceed the L2 cache; the per-matrix ceilings
are bench_cuda.read_ceiling_table's. JSON out, a short table last.

    python scripts/bench_ceiling.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_cuda import FLAT_BLOCKS_PER_SM, FLAT_THREADS, ceiling_kernels, graph_us, read_ceiling_table  # noqa: E402

# bytes of one layer's matrices in decode order (make_synthetic_model's llama3-8b mixes: q4_k_m has
# Q4_K q/k/o/gate/up and Q6_K v/down; rows of 4096 values: Q4_K 2304 bytes, Q6_K 3360, Q8_0 4352;
# the down rows of 14336 values: Q6_K 11760, Q8_0 15232)
LAYERS = {
    "Q4_K_M": (("qkv", 4096 * 2304 + 1024 * 2304 + 1024 * 3360), ("o", 4096 * 2304),
               ("gate+up", 2 * 14336 * 2304), ("down", 4096 * 11760)),
    "Q8_0": (("qkv", 6144 * 4352), ("o", 4096 * 4352), ("gate+up", 2 * 14336 * 4352), ("down", 4096 * 15232)),
}


def chain_blocks(k, device) -> int:
    """Blocks of read_chain: every one resident at once (its grid barrier needs them all)."""
    from ntx_engine.backends.cuda_driver import check, driver

    per_sm = check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(k.fn("read_ceiling.cu", "read_chain"),
                                                                        FLAT_THREADS, 0), "cuOccupancyMaxActiveBlocks")
    return device.sm_count * int(per_sm)


def layer_ceiling_table(backend, l2_bytes: int = 160 << 20) -> list[dict]:
    """µs a layer (and TB/s) of each way of reading it, for each mix of LAYERS."""
    from ntx_engine.backends.cuda_driver import DeviceArray, upload

    b, k, out = backend, ceiling_kernels(backend), []
    nblk = chain_blocks(k, b.device)
    flat = b.device.sm_count * FLAT_BLOCKS_PER_SM
    sink = DeviceArray(b.pool, (max(nblk, flat) * FLAT_THREADS // 32,), np.uint32)
    bar = upload(b.pool, np.zeros(2, np.uint32), b.stream)
    for mix, mats in LAYERS.items():
        total = sum(n for _, n in mats)
        copies = [[DeviceArray(b.pool, (n,), np.uint8) for _, n in mats] for _ in range(max(2, -(-l2_bytes // total)))]

        def chain(bufs, barriers):
            args = [a for w, (_, n) in zip(bufs, mats) for a in (w, n // 16)]
            return lambda: k._go("read_ceiling.cu", "read_chain", (nblk,), (FLAT_THREADS,),
                                 (*args, int(barriers), bar, sink), b.stream)

        launches = [lambda w=w, n=n: k._go("read_ceiling.cu", "read_flat_u4", (flat,), (FLAT_THREADS,),
                                           (w, n // 16, sink), b.stream)
                    for bufs in copies * 4 for w, (_, n) in zip(bufs, mats)]
        row = {"mix": mix, "layer_mb": round(total / 1e6, 1), "matrices_mb": {m: round(n / 1e6, 1) for m, n in mats},
               "chain_blocks": nblk,
               "launches_us": round(len(mats) * graph_us(b, launches), 2),
               "chain_us": round(graph_us(b, [chain(bufs, True) for bufs in copies * 4]), 2),
               "stream_us": round(graph_us(b, [chain(bufs, False) for bufs in copies * 4]), 2)}
        for way in ("launches", "chain", "stream"):
            row[f"{way}_tb_s"] = round(total / row[f"{way}_us"] / 1e6, 2)
        out.append(row)
        del copies
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--matrices", action="store_true", help="also bench_cuda.read_ceiling_table (each matrix alone)")
    a = ap.parse_args(argv)
    from ntx_engine.backends.cuda_backend import CudaBackend

    b = CudaBackend()
    res = {"device": b.device.name, "layers": layer_ceiling_table(b)}
    if a.matrices:
        res["matrices"] = read_ceiling_table(b)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1) + "\n")
    for r in res["layers"]:
        print(f"{r['mix']:<7} {r['layer_mb']:7.1f} MB a layer: launches {r['launches_us']:7.2f} us "
              f"({r['launches_tb_s']} TB/s), chain {r['chain_us']:7.2f} us ({r['chain_tb_s']} TB/s), "
              f"stream {r['stream_us']:7.2f} us ({r['stream_tb_s']} TB/s); {r['chain_blocks']} blocks")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
