"""How the "stack" decode's weight ring keeps up (backends/cuda_layers.py, native/cuda/layer_q8.cu built with
-DNTX_LQ_RTRACE=1): for every chunk of one layer (LQ_RT_LAYER) each block records when its producer issued
the copies, when the consumers' group saw the slot full and when the producer saw it read again. Per phase
this prints the median and 90th percentile over blocks and steps of a chunk's fill (issue -> full),
consumption (full -> read), the slot's idle time (read -> the next issue into it) and the time between a
block's consecutive chunks of the phase; a phase's end markers count as chunks.

    NTX_CUDA_DEFINES=-DNTX_LQ_RTRACE=1 python3 scripts/bench_stack_ring.py MODEL.gguf [PROMPT_TOKENS]

(a model the stack step takes, e.g. make_synthetic_model.py --shape llama3-8b --mix q8_0 or q4_k_m)."""
import os
import sys

import numpy as np
from ntx_engine.backends.cuda_layers import SLOTS, TRACE_MARKS
from stack_bench import stack_args, stack_model

MAX_CHUNKS, PHASES = 100, ("q/k/v", "o", "gate/up", "down")  # LQ_RT_MAX; the phases' order in a layer
args = stack_args(__doc__)
if "NTX_LQ_RTRACE=1" not in os.environ.get("NTX_CUDA_DEFINES", ""):
    sys.exit("build the kernel with the ring trace: NTX_CUDA_DEFINES=-DNTX_LQ_RTRACE=1")
path, npr = args.model, args.prompt
cfg, m, st = stack_model(path, npr)
if cfg.n_layers * TRACE_MARKS < 4 * MAX_CHUNKS:
    sys.exit(f"{cfg.n_layers} layers: the ring trace needs at least {-(-4 * MAX_CHUNKS // TRACE_MARKS)}")
rows: dict[int, list[dict]] = {ph: [] for ph in range(len(PHASES))}
steps = 4
for rep in range(steps):
    st.start_trace()  # zeroed: a chunk never issued reads 0
    m.forward(np.asarray([1]), npr + 3 + rep)
    t = st.read_trace().reshape(-1, st.blocks)[:4 * MAX_CHUNKS].astype(np.int64).reshape(MAX_CHUNKS, 4, st.blocks)
    for blk in range(st.blocks):
        issue, full, free, ph = (t[:, e, blk] for e in range(4))
        n = int(np.argmax(issue == 0)) if (issue == 0).any() else MAX_CHUNKS
        for k in range(n):
            rows[int(ph[k])].append(dict(
                fill=(full[k] - issue[k]) / 1e3,
                cons=(free[k] - full[k]) / 1e3 if free[k] else np.nan,
                idle=(issue[k + SLOTS] - free[k]) / 1e3 if k + SLOTS < n and free[k] else np.nan,
                gap=(full[k] - full[k - 1]) / 1e3 if k and ph[k - 1] == ph[k] else np.nan))


def stat(r: list[dict], key: str) -> str:
    v = np.array([x[key] for x in r], float)
    v = v[np.isfinite(v)]
    return f"{np.median(v):6.2f} /{np.percentile(v, 90):6.2f}" if len(v) else "-"


print(f"{'phase':8s} {'chunks':>7s} {'fill':>14s} {'consume':>14s} {'idle':>14s} {'full gap':>14s}  (us: median / p90)")
for ph, name in enumerate(PHASES):
    r = rows[ph]
    print(f"{name:8s} {len(r) / steps / st.blocks:7.1f} {stat(r, 'fill'):>14s} {stat(r, 'cons'):>14s} "
          f"{stat(r, 'idle'):>14s} {stat(r, 'gap'):>14s}")
