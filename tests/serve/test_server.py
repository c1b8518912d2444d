"""ntx-serve through the official `openai` client: the same text as `ntx-run --temperature 0`,
streamed or not; stop strings; 4xx errors in the OpenAI format; concurrent clients; a client that
disconnects mid-stream stops generation (seen in /metrics)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
from urllib.parse import urlparse

import pytest
from typer.testing import CliRunner

from ntx_engine.modelfile import resolve_model

ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}
CHAT_PROMPT = "What is 2+2?"
RAW_PROMPT = "1, 2, 3,"


def ntx_run(prompt: str, n: int, *extra: str) -> dict:
    """The oracle: `ntx-run --temperature 0 --json` on the same model and context."""
    from ntx_engine.cli.run import app

    result = CliRunner().invoke(app, [prompt, "--temperature", "0", "-n", str(n), "--device", "cpu",
                                      "--ctx", "512", "--json", *extra], env=ENV)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def chat_ref() -> dict:
    return ntx_run(CHAT_PROMPT, 12)


@pytest.fixture(scope="module")
def raw_ref() -> dict:
    return ntx_run(RAW_PROMPT, 12, "--raw")


def _finish(ref: dict) -> str:
    return "stop" if ref["stop_reason"] == "eos" else "length"


def test_models_lists_the_loaded_model(client, server):
    assert server.model_id == resolve_model(None).name.removesuffix(".gguf")
    assert [m.id for m in client.models.list().data] == [server.model_id]
    assert client.models.retrieve(server.model_id).id == server.model_id


def test_chat_matches_ntx_run(client, server, chat_ref):
    msgs = [{"role": "user", "content": CHAT_PROMPT}]
    r = client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=12, temperature=0)
    assert chat_ref["text"].strip(), "the oracle produced no text"
    assert r.choices[0].message.content == chat_ref["text"]
    assert r.choices[0].finish_reason == _finish(chat_ref)
    assert r.usage.prompt_tokens == len(chat_ref["prompt_tokens"])
    assert r.usage.completion_tokens == len(chat_ref["tokens"])
    stream = client.chat.completions.create(model=server.model_id, messages=msgs, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_ref["text"]
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 1  # really streamed
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [_finish(chat_ref)]
    assert chunks[-1].usage.completion_tokens == len(chat_ref["tokens"])


def test_completions_match_ntx_run_raw(client, server, raw_ref):
    r = client.completions.create(model=server.model_id, prompt=RAW_PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == raw_ref["text"]
    assert r.usage.prompt_tokens == len(raw_ref["prompt_tokens"])
    streamed = client.completions.create(model=server.model_id, prompt=RAW_PROMPT, max_tokens=12, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == raw_ref["text"]
    # token ids as the prompt: the same prompt, the same text
    by_ids = client.completions.create(model=server.model_id, prompt=raw_ref["prompt_tokens"], max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == raw_ref["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_cuts_the_text(client, server, raw_ref, stream):
    full = raw_ref["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]  # a stop string spanning tokens, inside the reply
    assert len(stop) == 3 and stop in full
    r = client.completions.create(model=server.model_id, prompt=RAW_PROMPT, max_tokens=12, temperature=0,
                                  stop=[stop, "never-seen"], stream=stream)
    chunks = list(r) if stream else [r]
    text = "".join(c.choices[0].text for c in chunks)
    assert text == full[:full.index(stop)]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]


def _assert_openai_error(status: int, body: dict, want_status: int, param: str | None) -> dict:
    assert status == want_status, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"] and body["error"]["param"] == param
    return body["error"]


def test_malformed_json(server):
    status, body = server.post("/v1/chat/completions", b'{"model": "x", "messages": [')
    err = _assert_openai_error(status, body, 400, None)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]


@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", "ten", "max_tokens"),
    ("temperature", "hot", "temperature"),
    ("messages", "hi", "messages"),
    ("stream", "yes", "stream"),
    ("messages", [{"role": "wizard", "content": "hi"}], "messages.0.role"),
])
def test_wrong_types(server, field, value, param):
    body = {"model": server.model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, field: value}
    status, out = server.post("/v1/chat/completions", body)
    _assert_openai_error(status, out, 400, param)


def test_body_not_an_object(server):
    status, out = server.post("/v1/completions", b"[1, 2]")
    _assert_openai_error(status, out, 400, None)


def test_unknown_model(client, server):
    import openai

    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert exc.value.body["code"] == "model_not_found" and "gpt-4o" in exc.value.body["message"]
    status, out = server.post("/v1/completions", {"model": "nope", "prompt": "hi"})
    _assert_openai_error(status, out, 404, "model")


def test_n_other_than_one(client, server):
    import openai

    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=server.model_id, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, n=2)
    assert exc.value.body["param"] == "n"


def test_prompt_longer_than_the_context(server):
    status, out = server.post("/v1/completions", {"model": server.model_id, "prompt": "word " * 600, "max_tokens": 1})
    err = _assert_openai_error(status, out, 400, "prompt")
    assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    status, out = server.post("/v1/chat/completions", {"model": server.model_id, "max_tokens": 1,
                                                       "messages": [{"role": "user", "content": "word " * 600}]})
    _assert_openai_error(status, out, 400, "messages")


def test_max_tokens_over_the_limit(server):
    room = 512 - _prompt_len(server, RAW_PROMPT)
    status, out = server.post("/v1/completions", {"model": server.model_id, "prompt": RAW_PROMPT, "max_tokens": room + 1})
    err = _assert_openai_error(status, out, 400, "max_tokens")
    assert str(room) in err["message"]
    status, out = server.post("/v1/completions", {"model": server.model_id, "prompt": RAW_PROMPT, "max_tokens": -1})
    _assert_openai_error(status, out, 400, "max_tokens")


def _prompt_len(server, prompt: str) -> int:
    status, out = server.post("/v1/completions", {"model": server.model_id, "prompt": prompt, "max_tokens": 0})
    assert status == 200, out
    return out["usage"]["prompt_tokens"]


def test_concurrent_requests_all_complete(server, raw_ref):
    before = server.metrics()
    prompts = [RAW_PROMPT, "The sky is", RAW_PROMPT, "The sky is"]
    results: list = [None] * len(prompts)

    def ask(i: int) -> None:
        results[i] = server.post("/v1/completions", {"model": server.model_id, "prompt": prompts[i],
                                                     "max_tokens": 4, "temperature": 0})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(r is not None and r[0] == 200 for r in results), results
    texts = [r[1]["choices"][0]["text"] for r in results]
    assert texts[0] == texts[2] and texts[1] == texts[3]  # served one at a time: no cross-talk
    assert raw_ref["text"].startswith(texts[0])
    after = server.metrics()
    key = 'ntx_requests_total{endpoint="completions",outcome="ok"}'
    assert after[key] - before.get(key, 0) == 4


def _send(server, body: dict) -> http.client.HTTPConnection:
    """A request sent on a connection we can drop at will (the response is not read here)."""
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    return conn


def _drop(conn: http.client.HTTPConnection) -> None:
    conn.sock.shutdown(2)
    conn.close()


def _wait_idle(server, key: str, want: float, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = server.metrics()
        if m.get(key, 0) >= want and m["ntx_busy"] == 0 and m["ntx_queue_depth"] == 0:
            return m
        time.sleep(0.1)
    pytest.fail(f"server still busy or {key} < {want} after {timeout} s: {server.metrics()}")


CANCELLED = 'ntx_requests_total{endpoint="completions",outcome="cancelled"}'


LONG = 400  # tokens a long request asks for; the native CPU backend needs ~3 s for them here


def _long(stream: bool) -> dict:
    return {"prompt": RAW_PROMPT, "max_tokens": LONG, "temperature": 0, "stream": stream}


# The disconnect tests wait for the server's own "cancelled" counter (a request that ran to its
# end is counted as "ok", so that wait fails if cancelling does not work), then check that
# generation stopped before the request's max_tokens. How many tokens came out before the
# cancel landed depends on the machine's speed, so no tighter bound holds everywhere.


def test_disconnect_mid_stream_stops_generation(server):
    before = server.metrics()
    conn = _send(server, {"model": server.model_id, **_long(True)})
    resp = conn.getresponse()
    assert resp.status == 200
    seen = 0
    while seen < 3:  # a few pieces arrived: generation is under way
        line = resp.readline()
        assert line, "stream ended early"
        seen += line.startswith(b"data: {")
    _drop(conn)
    after = _wait_idle(server, CANCELLED, before.get(CANCELLED, 0) + 1)
    generated = after["ntx_generated_tokens_total"] - before["ntx_generated_tokens_total"]
    assert 3 <= generated < LONG, generated


def test_disconnect_while_waiting_for_a_full_reply(server):
    before = server.metrics()
    conn = _send(server, {"model": server.model_id, **_long(False)})
    time.sleep(1.0)
    _drop(conn)
    after = _wait_idle(server, CANCELLED, before.get(CANCELLED, 0) + 1)
    assert after["ntx_generated_tokens_total"] - before["ntx_generated_tokens_total"] < LONG


def test_disconnect_while_queued(server):
    # a queued request whose client leaves is never generated; the one in hand still runs
    before = server.metrics()
    first = _send(server, {"model": server.model_id, **_long(True)})
    resp = first.getresponse()
    assert resp.status == 200 and resp.readline()
    queued = _send(server, {"model": server.model_id, **_long(False)})
    time.sleep(0.5)
    assert server.metrics()["ntx_queue_depth"] == 1
    _drop(queued)
    time.sleep(0.5)  # longer than the handler's disconnect poll
    _drop(first)
    after = _wait_idle(server, CANCELLED, before.get(CANCELLED, 0) + 2)
    assert after["ntx_generated_tokens_total"] - before["ntx_generated_tokens_total"] < LONG
    assert after["ntx_prompt_tokens_total"] - before["ntx_prompt_tokens_total"] == _prompt_len(server, RAW_PROMPT)


def test_health(server):
    status, body = server.get("/health")
    out = json.loads(body)
    assert status == 200 and out["status"] == "ok" and out["model"] == server.model_id and out["n_ctx"] == 512


def test_binding_elsewhere_warns(tmp_path):
    # the model path is checked before anything listens: nothing is bound on 0.0.0.0 here
    proc = subprocess.run([sys.executable, "-m", "ntx_serve.cli", "--host", "0.0.0.0", "--port", "0",
                           "-m", str(tmp_path / "missing.gguf")], capture_output=True, text=True,
                          env={**ENV, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "warning:" in proc.stderr and "0.0.0.0" in proc.stderr and "no authentication" in proc.stderr
    assert "missing.gguf" in proc.stderr


def test_busy_port_is_one_clear_error():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "ntx_serve.cli", "--port", str(port), "--device", "cpu"],
                              capture_output=True, text=True, env={**ENV, "PATH": "/usr/bin:/bin"}, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0], proc.stderr
