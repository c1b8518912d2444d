"""docs/python.md is runnable: its ```python blocks run in order in one namespace (a reader
pasting them into one session), and what they print is checked against the API itself."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def test_python_md_examples_run():
    blocks = BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 5, "docs/python.md lost its examples"
    ns: dict = {"__name__": "docs_python_md"}
    out = io.StringIO()
    for i, code in enumerate(blocks):
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"{DOC}:block{i}", "exec"), ns)  # noqa: S102 - our own documentation
    eng, page = ns["eng"], ns["page"]
    printed = out.getvalue()
    # the streamed example printed the greedy continuation of its prompt
    eng_check = type(eng).load(None, type(eng.engine_config)(device="cpu", n_ctx=512))
    try:
        want = "".join(eng_check.stream("The capital of France is", max_tokens=8))
    finally:
        eng_check.close()
    assert want and want in printed
    # the report example wrote a page with the numbers of its own run
    from ntx_engine.report import fmt_rate

    html, stats = page.read_text(), ns["stats"]
    assert stats.generated > 0
    for needle in (f"<td>{stats.prompt_tokens}</td>", f"<td>{stats.generated}</td>",
                   f"<td>{fmt_rate(stats.decode_tok_s)}</td>"):
        assert needle in html
