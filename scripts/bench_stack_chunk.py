"""Where a "stack" decode consumer warp's time goes, chunk by chunk (backends/cuda_layers.py, native/cuda/layer_q8.cu
built with -DNTX_LQ_CTRACE=PHASE + 1): in one layer (LQ_RT_LAYER) and one phase (0 q/k/v, 1 o, 2 gate/up, 3 down),
lane 0 of warps 0..3 of each consumer group times its first chunks: waiting for the slot to be full, the rows' dot
products, their warp sums, the parts' combine and the outputs (the residual's add, the stores), the slot's release.
This prints the median and 90th percentile of each over blocks, warps, chunks and steps (thousands of SM cycles and
us at the GPU's clock), and the chunks of no rows (a group's end of the phase) apart.

    NTX_CUDA_DEFINES=-DNTX_LQ_CTRACE=4 python3 scripts/bench_stack_chunk.py MODEL.gguf [PROMPT_TOKENS]

(a model the stack step takes, e.g. make_synthetic_model.py --shape llama3-8b --mix q8_0 or q4_k_m)."""
import os
import re
import sys

import numpy as np
from ntx_engine.backends.cuda_layers import TRACE_MARKS
from stack_bench import stack_args, stack_model

CHUNKS, GROUPS, WARPS, PARTS = 8, 2, 4, 5  # LQ_CT_CHUNKS, LQ_GROUPS, LQ_CT_WARPS, the times a chunk
NAMES = ("wait full", "dot", "sums", "combine/out", "release")
PHASES = ("q/k/v", "o", "gate/up", "down")
args = stack_args(__doc__)
m_def = re.search(r"-DNTX_LQ_CTRACE=(\d+)", os.environ.get("NTX_CUDA_DEFINES", ""))
if m_def is None or not 1 <= int(m_def.group(1)) <= len(PHASES):
    sys.exit("build the kernel with the chunk trace of one phase: NTX_CUDA_DEFINES=-DNTX_LQ_CTRACE=N, N 1..4 "
             "(1 q/k/v, 2 o, 3 gate/up, 4 down)")
phase = PHASES[int(m_def.group(1)) - 1]
cfg, m, st = stack_model(args.model, args.prompt)
rows = CHUNKS * GROUPS * WARPS * PARTS
if cfg.n_layers * TRACE_MARKS < rows:
    sys.exit(f"{cfg.n_layers} layers: the chunk trace needs at least {-(-rows // TRACE_MARKS)}")
from cuda.bindings import driver as drv  # noqa: E402 (after the model: the backend made the context)

khz = st.b.device.attribute(drv.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CLOCK_RATE)
steps, parts = 4, []
for rep in range(steps):
    st.start_trace()  # zeroed: a chunk a warp never reached reads 0 throughout
    m.forward(np.asarray([1]), args.prompt + 3 + rep)
    t = st.read_trace().reshape(-1, st.blocks)[:rows].astype(np.int64)
    parts.append(t.reshape(CHUNKS * GROUPS * WARPS, PARTS, st.blocks).transpose(0, 2, 1).reshape(-1, PARTS))
p = np.concatenate(parts)
p = p[p.sum(axis=1) > 0]  # (entries of chunks the warp never reached)
work = p[:, 1] > 0  # a chunk with rows for this warp; the others: a group's end of the phase, or no item for the warp


def line(name: str, v: np.ndarray) -> str:
    if len(v) == 0:
        return f"{name:12s} -"
    med, p90 = np.median(v), np.percentile(v, 90)
    return f"{name:12s} {med / 1e3:7.2f} /{p90 / 1e3:7.2f} k cycles  {med / khz * 1e3:6.2f} /{p90 / khz * 1e3:6.2f} us"


print(f"{phase}: {int(work.sum())} chunk-warps with rows, {int((~work).sum())} without "
      f"(median / p90; SM clock {khz / 1e3:.0f} MHz)")
for e, name in enumerate(NAMES):
    print(line(name, p[work, e]))
print(line("a chunk", p[work].sum(axis=1)))
print(line("end: wait", p[~work, 0]))
