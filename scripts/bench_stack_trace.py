"""Where a "stack" decode step's time goes (backends/cuda_layers.py, native/cuda/layer_q8.cu): every
block's thread 0 writes the GPU clock at the kernel's LQ_MARK points of each layer; this prints, per
point, when the first, the median and the last block reached it (us after the layer's first block
started) and the median and max time of the stage before it, averaged over the inner layers; then, for
each streaming phase, how long after the median block the last one ends it, the blocks that end it latest
on average and how alike the layers' lateness patterns are (1: the same blocks are late in every layer).

    python3 scripts/bench_stack_trace.py MODEL.gguf [PROMPT_TOKENS]
    NTX_CUDA_DEFINES=-DNTX_LQ_PTRACE=1 python3 scripts/bench_stack_trace.py MODEL.gguf [PROMPT_TOKENS] --start

(a model the stack step takes, e.g. make_synthetic_model.py --shape llama3-8b --mix q8_0 or q4_k_m; NTX_CUDA_DEFINES
selects a build, e.g. -DNTX_LQ_PROBE=1 for the step without the rows' arithmetic, -DNTX_LQ_ATRACE=1
for marks inside the attention, -DNTX_LQ_CLK=1 for SM cycles: the "us" columns are then thousands of cycles).
--start (an NTX_LQ_PTRACE=1 build, whose layer 0 marks the launch's start instead): when each block entered, was set
up, had its producer's chunk list and issued its first copies, passed griddepcontrol.wait and normed and multiplied
layer 0's rows, when layers 1 and 2 started and the last one ended (us after the first block's entry), against the
kernel's profiled time (each kernel of a plain step timed alone)."""
import os
import sys

import numpy as np
from ntx_engine.backends.cuda_layers import TRACE_MARKS
from stack_bench import stack_args, stack_model

NAMES = ["start", "wait prev down", "norm1", "qkv rows", "attention", "wait attn", "quant att", "o rows",
         "wait o", "norm2", "gate/up rows", "wait gu", "quant h", "down rows"]
if "NTX_LQ_ATRACE=1" in os.environ.get("NTX_CUDA_DEFINES", ""):  # marks 4..13 at the attention's stages
    NAMES[4:] = ["att: wait q/k/v", "att: RoPE", "att: K/V copies", "att: scores", "att: exp", "att: p.V",
                 "att: partial+count", "att: combine stats", "att: combine+wait", "quant att"]
START = ["entry", "set up", "chunk list", "first copies", "griddep wait", "layer 0 norm", "layer 0 q/k/v"]
args = stack_args(__doc__, start=True)
start = args.start
if start and "NTX_LQ_PTRACE=1" not in os.environ.get("NTX_CUDA_DEFINES", ""):
    sys.exit("--start reads the marks of an NTX_LQ_PTRACE build: NTX_CUDA_DEFINES=-DNTX_LQ_PTRACE=1")
path, npr = args.model, args.prompt
cfg, m, st = stack_model(path, npr)
st.start_trace()
for i in range(3):
    m.forward(np.asarray([1]), npr + 3 + i)
t = st.read_trace().astype(np.int64)
if start:
    from bench_cuda import kernel_times

    t0 = t[0, 0, :].min()
    print(f"{'mark':16s} {'first':>8s} {'median':>8s} {'last':>8s}  (us after the first block's entry)")
    rows = [(n, t[0, k, :]) for k, n in enumerate(START)] + [("layer 1 start", t[1, 0, :]), ("layer 2 start", t[2, 0, :]),
                                                              ("last layer end", t[-1, -1, :])]
    for n, v in rows:
        r = (v - t0) / 1e3
        print(f"{n:16s} {r.min():8.2f} {np.median(r):8.2f} {r.max():8.2f}")
    per = np.diff(t[:, 0, :].min(axis=1))[1:-1].mean() / 1e3
    print(f"layer period {per:.2f} us (layers 1 .. {cfg.n_layers - 2})")
    k, _ = kernel_times(m, m.backend, 1, npr + 6)
    print("profiled: " + ", ".join(f"{n} {v['ms'] * 1e3:.1f} us" for n, v in k.items()))
    sys.exit(0)
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
