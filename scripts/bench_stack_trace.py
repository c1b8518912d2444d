"""Where a "stack" decode step's time goes (backends/cuda_layers.py, native/cuda/layer_q8.cu): every
block's thread 0 writes the GPU clock at the kernel's LQ_MARK points of each layer; this prints, per
point, when the first, the median and the last block reached it (us after the layer's first block
started) and the median and max time of the stage before it, averaged over the inner layers; then, for
each streaming phase, how long after the median block the last one ends it, the blocks that end it latest
on average and how alike the layers' lateness patterns are (1: the same blocks are late in every layer).

    python3 scripts/bench_stack_trace.py MODEL.gguf [PROMPT_TOKENS]

(a model the stack step takes, e.g. make_synthetic_model.py --shape llama3-8b --mix q8_0 or q4_k_m; NTX_CUDA_DEFINES
selects a build, e.g. -DNTX_LQ_PROBE=1 for the step without the rows' arithmetic, -DNTX_LQ_ATRACE=1
for marks inside the attention, -DNTX_LQ_CLK=1 for SM cycles: the "us" columns are then thousands of cycles)."""
import os
import sys

import numpy as np
from ntx_engine.backends.cuda_layers import TRACE_MARKS
from stack_bench import stack_model

NAMES = ["start", "wait prev down", "norm1", "qkv rows", "attention", "wait attn", "quant att", "o rows",
         "wait o", "norm2", "gate/up rows", "wait gu", "quant h", "down rows"]
if "NTX_LQ_ATRACE=1" in os.environ.get("NTX_CUDA_DEFINES", ""):  # marks 4..13 at the attention's stages
    NAMES[4:] = ["att: wait q/k/v", "att: RoPE", "att: K/V copies", "att: scores", "att: exp", "att: p.V",
                 "att: partial+count", "att: combine stats", "att: combine+wait", "quant att"]
if len(sys.argv) < 2:
    sys.exit(__doc__)
path, npr = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 512
cfg, m, st = stack_model(path, npr)
st.start_trace()
for i in range(3):
    m.forward(np.asarray([1]), npr + 3 + i)
t = st.read_trace().astype(np.int64)
L = slice(1, cfg.n_layers - 1)
base = t[:, 0, :].min(axis=1)[:, None]
print(f"layer period {np.diff(t[:, 0, :].min(axis=1))[L].mean() / 1e3:.2f} us; step {(t[-1, -1].max() - t[0, 0].min()) / 1e3:.1f} us")
print(f"{'mark':16s} {'first':>8s} {'median':>8s} {'last':>8s}  (us after the layer's first block start) | stage median, max")
for k in range(TRACE_MARKS):
    rel = (t[:, k, :] - base)[L] / 1e3
    d = (t[:, k, :] - t[:, k - 1, :])[L] / 1e3 if k else rel
    print(f"{NAMES[k]:16s} {rel.min(axis=1).mean():8.2f} {np.median(rel, axis=1).mean():8.2f} {rel.max(axis=1).mean():8.2f}"
          f"  | {np.median(d, axis=1).mean():7.2f} {d.max(axis=1).mean():7.2f}")
if "NTX_LQ_ATRACE=1" not in os.environ.get("NTX_CUDA_DEFINES", ""):
    # which blocks end the streaming phases late, and whether the same ones do in every layer
    print(f"{'phase end':16s} {'max-median':>10s}  latest blocks (mean us after the median block) | pattern corr over layers")
    for k in (3, 7, 10, 13):
        late = (t[L, k, :] - np.median(t[L, k, :], axis=1, keepdims=True)) / 1e3
        mean = late.mean(axis=0)
        order = np.argsort(mean)[::-1][:6]
        rows = [row for row in late if row.std() > 0]  # a layer whose blocks all end together has no pattern
        corr = np.mean([np.corrcoef(row, mean)[0, 1] for row in rows]) if rows and mean.std() > 0 else float("nan")
        blocks = " ".join(f"{b}:{mean[b]:.2f}" for b in order)
        print(f"{NAMES[k]:16s} {late.max(axis=1).mean():10.2f}  {blocks} | {corr:.2f}")
