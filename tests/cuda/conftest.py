"""CUDA test plumbing: `gpu` tests skip with the driver's own reason when no GPU is usable."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def built_with(monkeypatch, defines: str = "", **kw):
    """A CUDA backend whose tunable kernels (cuda_nvrtc.TUNABLE) are built with `defines`
    (NTX_CUDA_DEFINES; "": the default build), kw passed to CudaBackend."""
    from ntx_engine.backends.cuda_backend import CudaBackend

    monkeypatch.setenv("NTX_CUDA_DEFINES", defines)
    b = CudaBackend(**kw)
    monkeypatch.delenv("NTX_CUDA_DEFINES")
    return b


@pytest.fixture(scope="session")
def synth():
    """scripts/make_synthetic_model.py as a module (random valid blocks, model writer)."""
    return _load_script("make_synthetic_model")


@pytest.fixture(scope="session")
def cuda_backend():
    from ntx_engine.backends.cuda_driver import gpu_unavailable_reason

    reason = gpu_unavailable_reason()
    if reason:
        pytest.skip(f"no usable CUDA GPU: {reason}")
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.config import ModelConfig

    b = CudaBackend()
    cfg = ModelConfig(arch="llama", n_layers=1, n_embd=256, n_ff=512, n_head=4, n_head_kv=2, head_dim=64,
                      rope_dim=64, rope_base=10000.0, rope_type="norm", rope_freq_scale=1.0,
                      has_rope_freqs=False, rms_eps=1e-5, context_length=64, vocab_size=64,
                      tied_embeddings=True, qkv_bias=False)
    b.set_model(cfg, 64, None)  # the id/position buffers the embed and rope kernels read
    return b


@pytest.fixture(scope="session")
def host_check(tmp_path_factory):
    """The kernels' decoders built for the host with g++ (same headers as the NVRTC build)."""
    import ctypes

    out = tmp_path_factory.mktemp("host_check") / "libntx_host_check.so"
    cmd = ["g++", "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           str(ROOT / "native/cuda/host_check.cpp"), "-o", str(out)]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    f32p = np.ctypeslib.ndpointer(np.float32, flags="C")
    lib.ntx_host_deq.argtypes = [ctypes.c_int, np.ctypeslib.ndpointer(np.uint8, flags="C"), ctypes.c_long,
                                 f32p, ctypes.c_void_p]
    lib.ntx_host_q8.argtypes = [f32p, f32p, ctypes.c_void_p, ctypes.c_long]
    lib.ntx_host_q8k.argtypes = [f32p, f32p, ctypes.c_long]
    lib.ntx_host_round.argtypes = [f32p, f32p, ctypes.c_long, ctypes.c_int]
    return lib


def greedy_logits(model, forward, prompt, steps: int) -> list:
    """The prompt's logits (all positions) from model.forward, then `steps` greedy decode steps
    through `forward` (model.forward or a DecodeGraph's): the logits of every pass, in order."""
    logits = [model.forward(prompt, 0, all_logits=True)]
    tok = int(np.argmax(logits[0][-1]))
    for i in range(steps):
        logits.append(forward(np.asarray([tok]), len(prompt) + i))
        tok = int(np.argmax(logits[-1][-1]))
    return logits


def synthetic_gguf(synth, tmp_path, shape: str, mix: str, layers: int, seed: int):
    """A synthetic model written by make_synthetic_model, opened: (GGUFFile, ModelConfig)."""
    from ntx_engine.config import ModelConfig
    from ntx_engine.gguf import GGUFFile

    path = tmp_path / f"{shape}-{mix}.gguf"
    synth.write_model(path, shape, mix, layers, seed=seed)
    gf = GGUFFile.open(path)
    return gf, ModelConfig.from_gguf(gf.metadata, frozenset(gf.tensors))
