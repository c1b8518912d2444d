"""Engine.stack_decode (ntx-run --json's `stack_decode`): whether the CUDA backend's decode ran every layer in one
launch, and where not, the reason — from the backend's own state; and CudaBackend.decode_stack's fall-back when the
GPU cannot hold the stack step's grid. No GPU needed: stand-in backends."""

from __future__ import annotations

from types import SimpleNamespace

from ntx_engine.backends.cuda_backend import CudaBackend
from ntx_engine.engine import Engine


def _report(stackable=True, fuse=("stack8",), stack=None, why=None, cuda=True):
    backend = SimpleNamespace(fuse=frozenset(fuse), stack=stack, stack_why_not=why) if cuda else SimpleNamespace()
    if cuda:  # the backend's own reading of its fusions
        backend.stack_asked = CudaBackend.stack_asked.fget(backend)
    model = SimpleNamespace(backend=backend, stackable=lambda: stackable)
    return Engine.stack_decode.fget(SimpleNamespace(model=model))


def test_the_report_names_the_path_and_the_reason():
    assert _report(cuda=False) is None
    assert _report(stack=object()) == {"one_launch": True, "why_not": None}
    why = "blk.0.wq is Q4_K: the stack step stack8 takes Q8_0 models"
    assert _report(why=why) == {"one_launch": False, "why_not": why}
    assert "streamed" in _report(stackable=False)["why_not"]
    assert "NTX_CUDA_FUSE" in _report(fuse=("qkv", "norm"))["why_not"]
    assert "no one-token decode step" in _report()["why_not"]


def test_a_grid_the_gpu_cannot_hold_falls_back_layer_by_layer():
    """The stack step is launched as a cooperative grid: where the GPU cannot hold its blocks all at once (an MPS
    share of the SMs) the launch fails with CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE; decode_stack then says
    why and returns None (the model runs the step layer by layer) instead of raising. Other errors, and any error
    while a graph is being captured, still raise. (A stand-in backend: no GPU needed.)"""
    import numpy as np
    import pytest

    from ntx_common.errors import CudaError

    layers = [object()]

    class Stack:
        def __init__(self, err):
            self.err = err

        def run(self, x):
            raise CudaError(self.err)

    def backend(err, capturing=False):
        return SimpleNamespace(fuse=frozenset({"stack8"}), stack_asked=True, _stack=(layers, Stack(err), None), capturing=capturing,
                               flush=lambda: None, _check_room=lambda s, n: None, _stage_positions=lambda p: None)

    x = np.zeros((1, 8), np.float32)
    too_large = ("cuLaunchKernelEx(layer_q8_hd128) failed: CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE (too many blocks "
                 "in cooperative launch)")
    b = backend(too_large)
    assert CudaBackend.decode_stack(b, layers, x, 5) is None
    assert b._stack[1] is None and "cannot hold the stack step's blocks" in b._stack[2] and too_large in b._stack[2]
    for err, capturing in ((too_large, True), ("cuLaunchKernelEx(layer_q8_hd128) failed: CUDA_ERROR_LAUNCH_FAILED", False)):
        with pytest.raises(CudaError):
            CudaBackend.decode_stack(backend(err, capturing), layers, x, 5)
