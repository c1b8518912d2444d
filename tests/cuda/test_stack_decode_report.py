"""Engine.stack_decode (ntx-run --json's `stack_decode`): whether the CUDA backend's decode ran every layer in one
launch, and where not, the reason — from the backend's own state (no GPU needed: a stand-in backend)."""

from __future__ import annotations

from types import SimpleNamespace

from ntx_engine.engine import Engine


def _report(stackable=True, fuse=("stack8",), stack=None, why=None, cuda=True):
    backend = SimpleNamespace(fuse=frozenset(fuse), stack=stack, stack_why_not=why) if cuda else SimpleNamespace()
    model = SimpleNamespace(backend=backend, _stackable=lambda: stackable)
    return Engine.stack_decode.fget(SimpleNamespace(model=model))


def test_the_report_names_the_path_and_the_reason():
    assert _report(cuda=False) is None
    assert _report(stack=object()) == {"one_launch": True, "why_not": None}
    why = "blk.0.wq is Q4_K: the default stack step (stack8) takes Q8_0 models"
    assert _report(why=why) == {"one_launch": False, "why_not": why}
    assert "streamed" in _report(stackable=False)["why_not"]
    assert "NTX_CUDA_FUSE" in _report(fuse=("qkv", "norm"))["why_not"]
    assert "no one-token decode step" in _report()["why_not"]
