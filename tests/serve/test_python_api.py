"""`Engine.stream`, `Engine.chat`, `Engine.reset`: text out of the Python API, checked against the
token-level API (`generate` + the tokenizer's whole-sequence `decode`) on the default model."""

from __future__ import annotations

import pytest

from ntx_engine.engine import Engine, EngineConfig, GenerationStats
from ntx_engine.sampler import SamplerConfig


@pytest.fixture(scope="module")
def engine():
    eng = Engine.load(None, EngineConfig(device="cpu", n_ctx=512))
    yield eng
    eng.close()


def _greedy_text(eng: Engine, ids: list[int], n: int) -> tuple[list[int], str]:
    eng.reset()
    toks = list(eng.generate(ids, n))
    return toks, eng.tokenizer.decode([t for t in toks if not eng.tokenizer.is_eog(t)])


def test_stream_joins_characters_split_across_tokens(engine):
    # SmolLM2 continues Japanese text with byte-level tokens that end inside a character: the
    # pieces must still be whole characters and join to the decode of all the bytes at once
    ids = engine.tokenize("日本語の文章：東京は")
    toks, want = _greedy_text(engine, ids, 24)
    split = [t for t in toks if _is_partial_utf8(engine.tokenizer.token_bytes(t, special=False))]
    assert split, "fixture changed: no token ends inside a UTF-8 character"
    engine.reset()
    pieces = list(engine.stream(ids, 24))
    assert "".join(pieces) == want
    assert all("\ufffd" not in p for p in pieces[:-1])  # only the final flush may hold a cut character


def _is_partial_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


def test_stream_accepts_text_and_fills_stats(engine):
    ids = engine.tokenize("1, 2, 3, 4, 5,")
    toks, want = _greedy_text(engine, ids, 8)
    engine.reset()
    stats = GenerationStats()
    assert "".join(engine.stream("1, 2, 3, 4, 5,", 8, stats=stats)) == want
    assert stats.tokens == toks and stats.prompt_tokens == len(ids)


def test_chat_is_the_greedy_reply_to_the_rendered_conversation(engine):
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    ids = engine.tokenize(engine.render_chat(msgs), add_special=False)
    assert engine.chat_ids(msgs) == ids
    _, want = _greedy_text(engine, ids, 10)
    engine.reset()
    assert engine.chat(msgs, max_tokens=10) == want and want.strip()


def test_seeded_sampling_repeats(engine):
    smp = SamplerConfig(temperature=1.0, seed=7)
    engine.reset()
    a = engine.chat([{"role": "user", "content": "Name a colour."}], 12, smp)
    engine.reset()
    b = engine.chat([{"role": "user", "content": "Name a colour."}], 12, smp)
    assert a == b


def test_reset_makes_a_repeated_prompt_repeat_its_tokens(engine):
    ids = engine.tokenize("Le café est très")
    first, _ = _greedy_text(engine, ids, 16)
    again, _ = _greedy_text(engine, ids, 16)
    assert first == again
