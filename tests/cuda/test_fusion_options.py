"""The fusion switches (no GPU needed): NTX_CUDA_FUSE / CudaBackend(fuse=) and the benchmark's
variant syntax that drives them."""

from __future__ import annotations

import argparse

import pytest

from ntx_common.errors import UsageError
from ntx_engine.backends.cuda_backend import DEFAULT_FUSE, FUSIONS, parse_fusions


def test_fusion_names(monkeypatch):
    monkeypatch.delenv("NTX_CUDA_FUSE", raising=False)
    assert parse_fusions(None) == parse_fusions(DEFAULT_FUSE)
    assert parse_fusions("all") == parse_fusions(True) == frozenset(FUSIONS)
    assert parse_fusions("none") == parse_fusions(False) == parse_fusions("") == frozenset()
    assert parse_fusions("qkv, norm") == {"qkv", "norm"}
    monkeypatch.setenv("NTX_CUDA_FUSE", "ffn,rope")
    assert parse_fusions(None) == {"ffn", "rope"}
    with pytest.raises(UsageError, match=r"unknown CUDA fusion\(s\) \['qvk'\].*qkv, ffn, rope, norm"):
        parse_fusions("qvk,ffn")


def test_bench_variants():
    from tests.cuda.conftest import _load_script

    be = _load_script("bench_engine")
    assert be.parse_variant("fast/split/pdl") == ("fast", "split", True, "none", False)
    assert be.parse_variant("fast/split/pdl/fuse/mmq") == ("fast", "split", True, "all", True)
    assert be.parse_variant("staged/single/fuse=qkv+ffn") == ("staged", "single", False, "qkv,ffn", False)
    with pytest.raises(argparse.ArgumentTypeError):
        be.parse_variant("fast/split/turbo")
