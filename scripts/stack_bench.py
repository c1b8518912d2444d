"""Shared by the "stack" decode's benchmark tools (bench_stack_trace.py, bench_stack_ring.py):
their command line (a model, the prompt's length) and a model the stack step takes (Q8_0, Q4_K and Q6_K matrices) on
the CUDA backend, a prompt decoded and three steps run (cubins built, the step warm)."""
import argparse
import sys

import numpy as np
from ntx_common.errors import NtxError
from ntx_engine.backends.cuda_backend import CudaBackend
from ntx_engine.config import ModelConfig
from ntx_engine.gguf import GGUFFile
from ntx_engine.model import Transformer, WeightLoader


def stack_args(doc: str, start: bool = False) -> argparse.Namespace:
    """The tools' command line: MODEL [PROMPT_TOKENS] (and bench_stack_trace's --start); the script's docstring
    is its help."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a GGUF model the stack step takes")
    ap.add_argument("prompt", nargs="?", type=int, default=512, help="prompt tokens before the traced steps (512)")
    if start:
        ap.add_argument("--start", action="store_true", help="the launch's start marks (an NTX_LQ_PTRACE=1 build)")
    a = ap.parse_args()
    if a.prompt < 1:
        ap.error(f"PROMPT_TOKENS must be at least 1, not {a.prompt}")
    return a


def stack_model(path: str, n_prompt: int, n_ctx: int = 1024):
    """(cfg, model, StackDecode) after a prompt of n_prompt random tokens and three decode steps; exits with
    the reason when the model cannot be read or the stack step does not take it."""
    try:
        gf = GGUFFile.open(path)
        cfg = ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
        if n_prompt + 8 > n_ctx:
            sys.exit(f"a prompt of {n_prompt} tokens leaves no room for the traced steps in {n_ctx} positions")
        b = CudaBackend(fuse="all,stack")
        m = Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, n_ctx)
    except NtxError as e:
        sys.exit(f"error: {e}")
    m.forward(np.random.default_rng(0).integers(0, cfg.vocab_size, n_prompt), 0)
    for i in range(3):
        m.forward(np.asarray([1]), n_prompt + i)
    if b.stack is None:
        sys.exit(f"the stack decode does not run this model: {b.stack_why_not}")
    return cfg, m, b.stack
