"""Sampler: the filtered distribution against llama.cpp's sampler chain, the empirical draws
against an independently computed distribution (chi-square), greedy, penalties, seeds."""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np
import pytest

from ntx_engine.sampler import Sampler, SamplerConfig


def _init_penalties(last_n: int, repeat: float, freq: float, present: float):
    # llama-cpp-python declares an n_vocab argument before penalty_last_n that upstream
    # llama.cpp dropped; giving both integers the window length is right under either signature.
    return llama_cpp.llama_sampler_init_penalties(last_n, last_n, repeat, freq, present)


def llama_cpp_distribution(logits: np.ndarray, history: list[int], cfg: SamplerConfig) -> dict[int, float]:
    """llama.cpp's default chain (penalties, top-k, top-p, min-p, temperature) applied to the
    logits; the returned probabilities are what its final `dist` sampler draws from."""
    chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
    last_n = len(history) if cfg.repeat_last_n < 0 else cfg.repeat_last_n
    for smpl in (_init_penalties(last_n, cfg.repeat_penalty, 0.0, 0.0), llama_cpp.llama_sampler_init_top_k(cfg.top_k),
                 llama_cpp.llama_sampler_init_top_p(cfg.top_p, 1), llama_cpp.llama_sampler_init_min_p(cfg.min_p, 1),
                 llama_cpp.llama_sampler_init_temp(cfg.temperature)):
        llama_cpp.llama_sampler_chain_add(chain, smpl)
    try:
        for t in history:
            llama_cpp.llama_sampler_accept(chain, int(t))
        n = len(logits)
        data = (llama_cpp.llama_token_data * n)(*[llama_cpp.llama_token_data(i, float(v), 0.0)
                                                  for i, v in enumerate(logits)])
        arr = llama_cpp.llama_token_data_array(data, n, -1, False)
        llama_cpp.llama_sampler_apply(chain, ctypes.byref(arr))
        kept = [(arr.data[i].id, arr.data[i].logit) for i in range(arr.size)]
    finally:
        llama_cpp.llama_sampler_free(chain)
    top = max(v for _, v in kept)
    weights = {t: math.exp(v - top) for t, v in kept if v != -math.inf}
    total = sum(weights.values())
    return {t: w / total for t, w in weights.items()}


def reference_distribution(logits, history, cfg: SamplerConfig) -> dict[int, float]:
    """The expected distribution, written out plainly in Python."""
    x = [float(v) for v in logits]
    window = [] if cfg.repeat_last_n == 0 else (history if cfg.repeat_last_n < 0 else history[-cfg.repeat_last_n:])
    for t in set(window):
        x[t] = x[t] * cfg.repeat_penalty if x[t] <= 0 else x[t] / cfg.repeat_penalty
    order = sorted(range(len(x)), key=lambda i: (-x[i], i))
    if cfg.temperature <= 0:
        return {order[0]: 1.0}
    if cfg.top_k > 0:
        order = order[:cfg.top_k]
    if cfg.top_p < 1.0:
        z = sum(math.exp(x[i] - x[order[0]]) for i in order)
        kept, acc = [], 0.0
        for i in order:
            kept.append(i)
            acc += math.exp(x[i] - x[order[0]]) / z
            if acc >= cfg.top_p:
                break
        order = kept
    if cfg.min_p > 0.0:
        order = [i for i in order if math.exp(x[i] - x[order[0]]) >= cfg.min_p] or order[:1]
    w = {i: math.exp((x[i] - x[order[0]]) / cfg.temperature) for i in order}
    total = sum(w.values())
    return {i: v / total for i, v in w.items()}


def chi2_sf(x: float, df: int) -> float:
    """P(X >= x) for a chi-square variable, from the closed forms for integer df."""
    h = x / 2.0
    if df % 2 == 0:
        term, total = 1.0, 1.0
        for i in range(1, df // 2):
            term *= h / i
            total += term
        return math.exp(-h) * total
    total, term = math.erfc(math.sqrt(h)), math.sqrt(h) / math.gamma(1.5)
    for i in range(1, (df + 1) // 2):
        total += math.exp(-h) * term
        term *= h / (i + 0.5)
    return total


@pytest.mark.parametrize("df", [1, 2, 3, 4, 7])
def test_chi2_sf_matches_monte_carlo(df):
    draws = (np.random.default_rng(df).standard_normal((200_000, df)) ** 2).sum(axis=1)
    for x in (0.5 * df, df, 2.0 * df + 3):
        assert abs(chi2_sf(x, df) - float(np.mean(draws >= x))) < 0.005


# ---- distribution --------------------------------------------------------------------------

def _random_case(rng: np.random.Generator):
    n = int(rng.integers(5, 200))
    logits = (rng.standard_normal(n) * rng.uniform(0.5, 4)).astype(np.float32)
    history = rng.integers(0, n, size=int(rng.integers(0, 40))).tolist()
    cfg = SamplerConfig(
        temperature=float(rng.choice([0.0, 0.3, 0.8, 1.0, 1.7])), top_k=int(rng.choice([0, 1, 5, 40, 1000])),
        top_p=float(rng.choice([1.0, 0.95, 0.5, 0.1])), min_p=float(rng.choice([0.0, 0.05, 0.3])),
        repeat_penalty=float(rng.choice([1.0, 1.1, 1.5, 0.8])), repeat_last_n=int(rng.choice([0, 1, 8, 64, -1])))
    return logits, history, cfg


def test_distribution_matches_llama_cpp_sampler_chain():
    rng = np.random.default_rng(2024)
    for _ in range(300):
        logits, history, cfg = _random_case(rng)
        ids, probs = Sampler(cfg).distribution(logits, history)
        theirs = llama_cpp_distribution(logits, history, cfg)
        assert sorted(ids.tolist()) == sorted(theirs), (cfg, history)
        assert max(abs(p - theirs[int(i)]) for i, p in zip(ids, probs)) < 1e-5
        ref = reference_distribution(logits, history, cfg)
        assert sorted(ref) == sorted(theirs)


CHI2_CASES = [
    (SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), []),
    (SamplerConfig(temperature=0.6, top_k=4, top_p=1.0, min_p=0.0, seed=2), []),
    (SamplerConfig(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0, seed=3), []),
    (SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.2, seed=4), []),
    (SamplerConfig(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.4, repeat_last_n=3, seed=5),
     [0, 0, 1, 7, 2, 3]),
]


@pytest.mark.parametrize("cfg, history", CHI2_CASES)
def test_samples_follow_the_expected_distribution(cfg, history):
    logits = np.array([2.0, 1.6, 1.5, 1.0, 0.3, -0.4, -1.0, -2.5], dtype=np.float32)
    expected = reference_distribution(logits, history, cfg)
    n = 20_000
    sampler = Sampler(cfg)
    counts = np.bincount([sampler.sample(logits, history) for _ in range(n)], minlength=logits.size)
    outside = [i for i in range(logits.size) if i not in expected]
    assert counts[outside].sum() == 0, (counts, expected)
    stat = sum((counts[i] - n * p) ** 2 / (n * p) for i, p in expected.items())
    df = len(expected) - 1
    if df:
        p_value = chi2_sf(stat, df)
        print(f"\n{cfg}: chi2={stat:.2f} df={df} p={p_value:.3f}")
        assert p_value > 1e-3, (counts, expected)
    else:
        assert counts[next(iter(expected))] == n


def test_filters_actually_filter():
    """The chi-square cases are not all the same distribution in disguise."""
    logits = np.array([2.0, 1.6, 1.5, 1.0, 0.3, -0.4, -1.0, -2.5], dtype=np.float32)
    supports = [len(reference_distribution(logits, h, cfg)) for cfg, h in CHI2_CASES]
    assert supports[0] == 8 and supports[1] == 4 and min(supports[2:]) < 8


# ---- greedy, penalties, seeds ------------------------------------------------------------------

def test_greedy_is_argmax():
    rng = np.random.default_rng(7)
    greedy = Sampler(SamplerConfig(temperature=0.0))
    for _ in range(200):
        x = rng.standard_normal(int(rng.integers(1, 50_000))).astype(np.float32)
        assert greedy.sample(x, []) == int(np.argmax(x))
    assert greedy.sample(np.array([1.0, 3.0, 3.0, 0.0]), []) == 1  # ties: the lower id, as llama.cpp


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    logits = np.array([4.0, -2.0, 1.0, 3.0, -0.5], dtype=np.float32)
    cfg = SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=2.0, repeat_last_n=3)
    ids, probs = Sampler(cfg).distribution(logits, [2, 0, 1, 1])  # window: [0, 1, 1]; token 2 is outside
    got = dict(zip(ids.tolist(), probs.tolist()))
    adjusted = np.array([2.0, -4.0, 1.0, 3.0, -0.5])
    want = np.exp(adjusted - adjusted.max()) / np.exp(adjusted - adjusted.max()).sum()
    assert all(abs(got[i] - want[i]) < 1e-6 for i in range(5))
    # with the penalty, greedy moves off a repeated argmax
    assert Sampler(SamplerConfig(temperature=0, repeat_penalty=2.0)).sample(logits, [0]) == 3


def test_same_seed_same_sequence_and_different_seed_differs():
    rng = np.random.default_rng(11)
    steps = [rng.standard_normal(1000).astype(np.float32) for _ in range(64)]

    def run(seed):
        s, hist = Sampler(SamplerConfig(temperature=1.0, top_k=100, top_p=0.98, min_p=0.0, seed=seed,
                                        repeat_penalty=1.1)), []
        for x in steps:
            hist.append(s.sample(x, hist))
        return hist

    assert run(42) == run(42)
    assert run(42) != run(43)


@pytest.mark.parametrize("kwargs", [
    {"temperature": float("nan")}, {"temperature": float("inf")}, {"top_k": -1}, {"top_p": 0.0},
    {"top_p": 1.5}, {"min_p": -0.1}, {"min_p": 1.1}, {"repeat_penalty": 0.0}, {"repeat_penalty": float("nan")},
    {"repeat_last_n": -2}, {"seed": -1}, {"seed": 2**64},
])
def test_config_validation(kwargs):
    with pytest.raises(ValueError):
        SamplerConfig(**kwargs)


@pytest.mark.parametrize("logits, history", [
    (np.zeros((2, 3)), []), (np.zeros(0), []), (np.array([0.0, np.nan]), []), (np.zeros(3), [5]),
])
def test_bad_inputs_raise(logits, history):
    with pytest.raises(ValueError):
        Sampler(SamplerConfig(repeat_penalty=1.2)).sample(logits, history)
