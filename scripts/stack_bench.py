"""Shared by the "stack" decode's benchmark tools (bench_stack_trace.py, bench_stack_ring.py): a model the
stack step takes (Q8_0, Q4_K and Q6_K matrices) on the CUDA backend, a prompt decoded and three steps run
(cubins built, the step warm)."""
import sys

import numpy as np
from ntx_engine.backends.cuda_backend import CudaBackend
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.model import Transformer, WeightLoader


def stack_model(path: str, n_prompt: int, n_ctx: int = 1024):
    """(cfg, model, StackDecode) after a prompt of n_prompt random tokens and three decode steps; exits with
    the reason when the stack step does not take the model."""
    gf = GGUFFile.open(path)
    cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
    b = CudaBackend(fuse="all,stack")
    m = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, n_ctx)
    m.forward(np.random.default_rng(0).integers(0, cfg.vocab_size, n_prompt), 0)
    for i in range(3):
        m.forward(np.asarray([1]), n_prompt + i)
    if b.stack is None:
        sys.exit(f"the stack decode does not run this model: {b.stack_why_not}")
    return cfg, m, b.stack
