"""`ntx-run` end to end: --json through CliRunner (tokens checked against llama.cpp's greedy
continuation), and every error case as a real process: one `error:` line, non-zero exit."""

from __future__ import annotations

import json
import subprocess
import sys

import gguf
import numpy as np
from typer.testing import CliRunner

from llama_oracle import GREEDY_PROMPTS  # scripts/ is on pytest's pythonpath
from ntx_engine.cli.run import app
from ntx_engine.engine import Engine, EngineConfig

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


def test_json_output_matches_llama_cpp_greedy(oracle_manifest):
    # the F32 variant: its float32 rounding noise is far below llama.cpp's near-tie margin, so the
    # greedy tokens must equal llama.cpp's up to its first near-tie (tests/engine/test_oracle.py)
    model = oracle_manifest["models"]["smollm2-F32"]
    ref = np.load(oracle_manifest["root"] / "oracle" / "smollm2-F32.npz")
    n = 8
    result = CliRunner().invoke(app, [GREEDY_PROMPTS[0], "--raw", "--temperature", "0", "-n", str(n),
                                      "--json", "-m", str(model)], env=ENV)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert set(out) >= {"model", "prompt_tokens", "tokens", "text", "prefill_tok_s", "decode_tok_s", "stop_reason"}
    assert out["prompt_tokens"] == ref["prompt_0"].tolist()
    margins = ref["margin_0"][:n]
    first_tie = int(np.argmax(margins < 0.05)) if (margins < 0.05).any() else n
    assert first_tie >= 3, "fixture changed: too few clear steps to compare"
    assert out["tokens"][:first_tie] == ref["greedy_0"][:first_tie].tolist()
    # every token is what the Python API generates, and the text is their detokenization
    eng = Engine.load(model, EngineConfig(n_ctx=512))
    assert out["tokens"] == list(eng.generate(out["prompt_tokens"], max_tokens=n))
    assert out["text"] == eng.detokenize(out["tokens"])
    assert out["stop_reason"] == "length" and len(out["tokens"]) == n
    assert out["decode_tok_s"] > 0 and out["prefill_tok_s"] > 0
    assert out["stack_decode"] is None  # CUDA's one-launch decode: not on the CPU backends


def _run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ntx_engine.cli.run", *args], capture_output=True,
                          text=True, input=stdin, env={**ENV, "PATH": "/usr/bin:/bin"}, timeout=300)


def _assert_clean_error(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def _tiny_gguf(path, arch="llama", tensor_type=None):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    if tensor_type is None:
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    else:  # raw bytes of a type we do not decode
        w.add_tensor("token_embd.weight", np.zeros((4, 8), np.uint8), raw_dtype=tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_missing_model(tmp_path):
    _assert_clean_error(_run("hi", "-m", str(tmp_path / "nope.gguf")), "not found", "nope.gguf")


def test_directory_as_model(tmp_path):
    _assert_clean_error(_run("hi", "-m", str(tmp_path)), "directory")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUX" + b"\0" * 64)
    _assert_clean_error(_run("hi", "-m", str(bad)), "bad.gguf")


def test_truncated_gguf(tmp_path, oracle_manifest):
    src = oracle_manifest["models"]["tiny-llama-F32"].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src[: len(src) // 2])
    _assert_clean_error(_run("hi", "-m", str(cut)), "cut.gguf")


def test_unsupported_architecture(tmp_path):
    _assert_clean_error(_run("hi", "-m", str(_tiny_gguf(tmp_path / "g.gguf", arch="gpt2"))),
                        "unsupported architecture", "gpt2")


def test_unsupported_quant(tmp_path, oracle_manifest):
    # a real model whose embedding is re-typed to IQ2_XXS (a type ntx does not decode)
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.token_embedding_type = int(gguf.GGMLQuantizationType.IQ4_NL)
    params.allow_requantize = True
    dst = tmp_path / "iq.gguf"
    src = oracle_manifest["models"]["tiny-llama-F32"]
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params) == 0
    _assert_clean_error(_run("hi", "-m", str(dst)), "token_embd.weight", "IQ4_NL")


def test_bad_sampling_option():
    proc = _run("hi", "--top-p", "1.5")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_chat_session_answers_with_the_templated_greedy_reply(oracle_manifest):
    model = oracle_manifest["models"]["smollm2-Q4_1"]
    result = CliRunner().invoke(app, ["--chat", "-m", str(model), "-n", "6", "--temperature", "0",
                                      "--system", "Answer briefly."], input="What is 2+2?\n\n", env=ENV)
    assert result.exit_code == 0, result.output
    # the oracle: the Python API on the same rendered conversation
    eng = Engine.load(model, EngineConfig(n_ctx=512))
    ids = eng.tokenize(eng.render_chat([{"role": "system", "content": "Answer briefly."},
                                        {"role": "user", "content": "What is 2+2?"}]), add_special=False)
    reply = [t for t in eng.generate(ids, max_tokens=6) if not eng.tokenizer.is_eog(t)]
    text = eng.detokenize(reply).strip()
    assert text and text in result.stdout
    assert "<|im_start|>" not in result.stdout  # control tokens are not echoed


def test_chat_needs_a_template(oracle_manifest):
    proc = _run("--chat", "-m", str(oracle_manifest["models"]["tiny-llama-F32"]), stdin="hi\n")
    _assert_clean_error(proc, "no chat template")
