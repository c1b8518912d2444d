"""Engine.generate's device-greedy paths (the CUDA DecodeGraph's `greedy` and `greedy_stream`),
driven here by a stand-in over the numpy model: each step's token is the argmax of the model's
own forward pass, and the stream asks for its steps one ahead as DecodeGraph does. The tokens must
be those of the host-sampled greedy decode of the same model (the oracle), with the stream asked
for exactly the steps generate can use, under the max_tokens and context limits, and an EOS
stopping it."""

from __future__ import annotations

import numpy as np
import pytest

from ntx_engine.engine import Engine, EngineConfig


class DeviceGreedy:
    """The model with DecodeGraph's one-step greedy interface."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def _step(self, tok: int, pos: int) -> int:
        self.calls.append(pos)
        return int(np.argmax(self.model.forward(np.asarray([tok]), pos)[-1]))

    def greedy(self, tok: int, pos: int) -> int:
        return self._step(tok, pos)


class DeviceStream(DeviceGreedy):
    """... and greedy_stream, computing the step after each token before yielding it."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.asked = []

    def greedy_stream(self, tok: int, pos: int, n: int):
        self.asked.append((pos, n))
        nxt = self._step(tok, pos) if n > 0 else None
        for i in range(n):
            cur, nxt = nxt, None
            if i + 1 < n and pos + i + 2 <= self.model.n_ctx:  # queued before this token is read
                nxt = self._step(cur, pos + i + 1)
            yield cur
            if nxt is None and i + 1 < n:
                nxt = self._step(cur, pos + i + 1)


@pytest.fixture(scope="module")
def eng(smollm2_path):
    e = Engine.load(smollm2_path, EngineConfig(device="numpy", n_ctx=48))
    yield e
    e.close()


def _run(eng, wrap, ids, n):
    plain = eng.model
    eng._cached = []
    if wrap is not None:
        eng.model = wrap
    try:
        return list(eng.generate(ids, n))
    finally:
        eng.model = plain


@pytest.mark.parametrize("n", [1, 2, 9])
def test_stream_and_one_step_tokens_equal_host_greedy(eng, n):
    ids = eng.tokenize("The capital of France is Paris. The capital of Germany is")
    ref = _run(eng, None, ids, n)
    one, streamed = DeviceGreedy(eng.model), DeviceStream(eng.model)
    assert _run(eng, one, ids, n) == ref
    assert _run(eng, streamed, ids, n) == ref
    # the first token comes from the prefill; the stream is asked for the rest, from the prompt's end
    assert streamed.asked == ([(len(ids), n - 1)] if n > 1 else [])
    assert len(ref) == n
    assert len(set(ref)) > 1 or n < 3, "a constant token stream tests little"


def test_the_context_limit_ends_the_stream(eng):
    ids = eng.tokenize("The capital of France is Paris. The capital of Germany is")
    n = 48 - len(ids) + 5  # more than the context holds
    is_eog = eng.tokenizer.is_eog
    eng.tokenizer.is_eog = lambda t: False  # SmolLM2 ends this text with an EOS before the context's end
    try:
        ref = _run(eng, None, ids, n)
        streamed = DeviceStream(eng.model)
        got = _run(eng, streamed, ids, n)
    finally:
        eng.tokenizer.is_eog = is_eog
    assert got == ref and len(ids) + len(got) == 48
    # the last token's step is at 46; one more was queued ahead at 47, the context's last position
    assert max(streamed.calls) == 47


def test_eos_stops_generate_with_at_most_one_step_ahead(eng):
    ids = eng.tokenize("The capital of France is Paris. The capital of Germany is")
    ref = _run(eng, None, ids, 8)
    eos = ref[3]
    is_eog = eng.tokenizer.is_eog
    eng.tokenizer.is_eog = lambda t: t == eos or is_eog(t)
    try:
        streamed = DeviceStream(eng.model)
        got = _run(eng, streamed, ids, 8)
    finally:
        eng.tokenizer.is_eog = is_eog
    stop = ref.index(eos)
    assert got == ref[:stop + 1]
    assert len(streamed.calls) <= stop + 1  # the steps for tokens 1..stop, and one queued ahead
