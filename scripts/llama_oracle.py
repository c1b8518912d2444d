"""Record llama.cpp's outputs (through llama-cpp-python) for the oracle tests.

For one model file and KV-cache type: the logits at every position of a reference prompt, and
for each greedy prompt the 32 greedy tokens with llama.cpp's own top-1/top-2 margin per step
(a near-tie there is a legitimate place for a float32 engine to pick the other token).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

LOGITS_PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
GREEDY_PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The three primary colors are",
    "<|im_start|>user\nWhat is 17 times 23?<|im_end|>\n<|im_start|>assistant\n",
    "Water boils at 100 degrees Celsius at sea level because",
)
GREEDY_TOKENS = 32
GGML_TYPE_F32 = 0


def _llama(path: Path, f32_kv: bool):
    import llama_cpp

    kw = dict(model_path=str(path), n_ctx=512, n_batch=512, n_threads=2, logits_all=True,
              verbose=False, seed=0)
    if f32_kv:
        kw.update(type_k=GGML_TYPE_F32, type_v=GGML_TYPE_F32)
    return llama_cpp.Llama(**kw)


def record(path: Path, out: Path, f32_kv: bool = False) -> Path:
    llm = _llama(path, f32_kv)
    arrays: dict[str, np.ndarray] = {}
    ids = llm.tokenize(LOGITS_PROMPT.encode(), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    arrays["logits_ids"] = np.asarray(ids, dtype=np.int32)
    arrays["logits"] = np.array(llm.scores[: len(ids)], dtype=np.float32)  # a copy: scores is reused
    for i, text in enumerate(GREEDY_PROMPTS):
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        toks, margins = _greedy(llm, ids)
        arrays[f"prompt_{i}"] = np.asarray(ids, dtype=np.int32)
        arrays[f"greedy_{i}"] = np.asarray(toks, dtype=np.int32)
        arrays[f"margin_{i}"] = np.asarray(margins, dtype=np.float32)
    llm.close()
    np.savez_compressed(out, **arrays)
    return out


def _greedy(llm, ids: list[int]) -> tuple[list[int], list[float]]:
    llm.reset()
    llm.eval(ids)
    toks, margins = [], []
    for _ in range(GREEDY_TOKENS):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        top2 = np.partition(logits, -2)[-2:]
        tok = int(np.argmax(logits))
        toks.append(tok)
        margins.append(float(top2[1] - top2[0]))
        llm.eval([tok])
    return toks, margins
