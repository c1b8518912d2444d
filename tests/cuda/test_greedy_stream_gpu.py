"""DecodeGraph.greedy_stream: each step's argmax leaves its token and the next position on the
device, and the next step is queued before the host reads the token. The tokens must be those of
the plain decode (model.forward, kernel by kernel, the argmax on the host) and of greedy() one
step at a time, also where the decode form changes under the stream (the attention's cluster
form to its grid form) and where the context ends it; a consumer that stops early leaves the
model where the next greedy() call goes on from."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cuda.conftest import synthetic_gguf

pytestmark = pytest.mark.gpu


def _model(synth, tmp_path, monkeypatch, n_ctx: int = 64, cluster: int | None = None):
    from ntx_engine.backends.cuda_backend import CudaBackend
    from ntx_engine.model import Transformer, WeightLoader

    if cluster is not None:
        monkeypatch.setenv("NTX_CUDA_GRID_CLUSTER", str(cluster))
    gf, cfg = synthetic_gguf(synth, tmp_path, "small", "q8_0", 2, seed=9)
    b = CudaBackend(fuse="all", attn="grid")
    return Transformer(cfg, WeightLoader(gf, cfg, b).load(), b, n_ctx), cfg


def _plain(model, prompt, n: int) -> list[int]:
    """n greedy tokens after the prompt, kernel by kernel (the oracle of the graph's tokens)."""
    tok = int(np.argmax(model.forward(prompt, 0)[-1]))
    out = []
    for i in range(n):
        tok = int(np.argmax(model.forward(np.asarray([tok]), len(prompt) + i)[-1]))
        out.append(tok)
    return out


def _first(model, prompt) -> int:
    return int(np.argmax(model.forward(prompt, 0)[-1]))


def test_stream_tokens_equal_plain_and_one_step_decoding(cuda_backend, synth, tmp_path, monkeypatch):
    from ntx_engine.backends.cuda_graph import DecodeGraph

    model, cfg = _model(synth, tmp_path, monkeypatch)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 11)
    ref = _plain(model, prompt, 20)
    graph = DecodeGraph(model)
    tok = _first(model, prompt)
    one = []
    for i in range(20):
        tok = graph.greedy(tok, len(prompt) + i)
        one.append(tok)
    streamed = list(graph.greedy_stream(_first(model, prompt), len(prompt), 20))
    assert one == ref, "greedy() differs from the plain decode"
    assert streamed == ref, "greedy_stream differs from the plain decode"
    assert len(set(ref)) > 1, "a constant token stream tests nothing"


def test_stream_across_the_form_change_and_to_the_context_end(cuda_backend, synth, tmp_path, monkeypatch):
    """CLUSTER_MAX_T lowered to 14: the steps at positions 11..13 run the cluster form, the rest the
    grid form (the stream must launch the new form's step itself); n_ctx 24 ends the stream."""
    from ntx_engine.backends import cuda_backend
    from ntx_engine.backends.cuda_graph import DecodeGraph

    monkeypatch.setattr(cuda_backend, "CLUSTER_MAX_T", 14)
    model, cfg = _model(synth, tmp_path, monkeypatch, n_ctx=24, cluster=16)
    prompt = np.random.default_rng(4).integers(0, cfg.vocab_size, 11)
    n = 24 - len(prompt)  # steps at positions 11 .. 23: the last one fills the context
    ref = _plain(model, prompt, n)
    graph = DecodeGraph(model)
    streamed = list(graph.greedy_stream(_first(model, prompt), len(prompt), n))
    assert sorted(graph._graphs) == [(0,), (16,)], sorted(graph._graphs)
    assert streamed == ref


def test_a_stream_stopped_early_leaves_the_model_consistent(cuda_backend, synth, tmp_path, monkeypatch):
    """Stop after 5 tokens (one more step is computed ahead), then go on one step at a time and by
    a plain forward: the same tokens as an unbroken plain decode."""
    from ntx_engine.backends.cuda_graph import DecodeGraph

    model, cfg = _model(synth, tmp_path, monkeypatch)
    prompt = np.random.default_rng(7).integers(0, cfg.vocab_size, 11)
    ref = _plain(model, prompt, 12)
    graph = DecodeGraph(model)
    it = graph.greedy_stream(_first(model, prompt), len(prompt), 10)
    got = [next(it) for _ in range(5)]
    it.close()
    tok = got[-1]
    for i in range(5, 10):
        prev, tok = tok, graph.greedy(tok, len(prompt) + i)
        got.append(tok)
    # the same step again kernel by kernel: the graph's argmax advanced pos_buf, so the backend must
    # stage position len + 9 anew (a stale record of it would leave len + 10 there)
    again = int(np.argmax(model.forward(np.asarray([prev]), len(prompt) + 9)[-1]))
    got.append(int(np.argmax(model.forward(np.asarray([tok]), len(prompt) + 10)[-1])))
    assert again == got[9]
    assert got == ref[:11]
