"""`GET /report` of a running server, opened in headless Chromium: the page of the last request
loads without errors or outside requests and shows that request's numbers."""

from __future__ import annotations

from ntx_engine.report import fmt_rate


def test_report_shows_the_last_request(server, browser):
    status, out = server.post("/v1/completions", {"model": server.model_id, "prompt": "Once upon a time",
                                                  "max_tokens": 5, "temperature": 0})
    assert status == 200, out
    m = server.metrics()
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda msg: problems.append(msg.text) if msg.type in ("error", "warning") else None)
    page.on("pageerror", lambda exc: problems.append(str(exc)))
    page.on("request", lambda r: problems.append(r.url) if not r.url.endswith("/report") else None)
    resp = page.goto(server.url + "/report", wait_until="load")
    assert resp.status == 200
    text = page.inner_text("body")
    page.close()
    assert problems == []
    use = out["usage"]
    for needle in (server.model_id, str(use["prompt_tokens"]), str(use["completion_tokens"]),
                   fmt_rate(m["ntx_last_prefill_tok_s"]), fmt_rate(m["ntx_last_decode_tok_s"])):
        assert needle in text, needle
