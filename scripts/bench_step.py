"""Where a graph decode step's time goes, three ways, on one model: the step's CUDA graph replayed back to back
(each replay's argmax feeds the next on the device: GPU time alone), `DecodeGraph.greedy()` (the host reads each
token before the next step: + the round trip) and `greedy_stream` (the engine's greedy decode: the next step
queued before the host reads this one's token), then the kernels of one plain step, each timed alone.

    python3 scripts/bench_step.py MODEL.gguf [--fuse all,stack8] [--prompt 512] [--steps 32] [--json OUT]

(--fuse: NTX_CUDA_FUSE's syntax, cuda_backend.FUSIONS; NTX_CUDA_DEFINES selects a build.) After a prompt of random
tokens each measurement runs at later positions, so the context grows by ~6 x steps over the run."""
import argparse
import json
import sys
import time

import numpy as np
from bench_cuda import kernel_times
from ntx_engine.backends.cuda_backend import CudaBackend
from ntx_engine.backends.cuda_driver import Event
from ntx_engine.backends.cuda_graph import DecodeGraph
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.model import Transformer, WeightLoader


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--fuse", default=None, help="fusions (default: the backend's default, NTX_CUDA_FUSE)")
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens before the measured steps")
    ap.add_argument("--steps", type=int, default=32, help="steps a measurement (greedy_stream: twice as many)")
    ap.add_argument("--json", help="write the numbers here")
    a = ap.parse_args(argv)
    b = CudaBackend(matvec="fast", attn="grid", pdl=True, fuse=a.fuse, gemm=None)
    gf = GGUFFile.open(a.model)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    n = a.steps
    model = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, a.prompt + 8 * n + 16)
    g = DecodeGraph(model)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, a.prompt)
    model.forward(prompt, 0)
    tok, pos = g.greedy(int(prompt[-1]), a.prompt), a.prompt + 1
    e0, e1 = Event(), Event()
    b.synchronize()
    e0.record(b.stream)
    g.run_fed(pos, n)
    e1.record(b.stream)
    b.synchronize()
    back = e1.elapsed_ms(e0) / n
    pos += n
    t = time.perf_counter()
    for i in range(n):
        tok = g.greedy(tok, pos + i)
    plain = (time.perf_counter() - t) * 1e3 / n
    pos += n
    t = time.perf_counter()
    for _ in g.greedy_stream(tok, pos, 2 * n):
        pass
    stream = (time.perf_counter() - t) * 1e3 / (2 * n)
    pos += 2 * n
    kernels, step = kernel_times(model, b, tok, pos)
    fuse = ",".join(sorted(b.fuse))
    print(f"{a.model} fuse={fuse}: back to back {back:.4f} ms a step ({1e3 / back:.1f} tok/s); greedy() {plain:.4f} "
          f"({1e3 / plain:.1f}); greedy_stream {stream:.4f} ({1e3 / stream:.1f}); one-launch stack step: "
          f"{b.stack is not None} ({b.stack_why_not or 'ran'})")
    print(f"profiled step {step:.4f} ms: " + ", ".join(f"{k} {v['ms']:.4f}" for k, v in kernels.items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"model": a.model, "fuse": fuse, "back_to_back_ms": back, "greedy_ms": plain,
                       "greedy_stream_ms": stream, "profiled_step_ms": step, "kernels": kernels,
                       "stack": b.stack is not None, "stack_why_not": b.stack_why_not}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
