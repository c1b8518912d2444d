"""Session-wide test plumbing: the oracle fixtures built by scripts/build_fixtures.py, and a
closing table of the measured oracle numbers (max logit difference, top-1 agreement)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

FIXTURE_VERSION = 2
FIXTURES = Path(os.environ.get("NTX_FIXTURES", Path.home() / ".cache/ntx/fixtures")) / f"v{FIXTURE_VERSION}"

_measured: list[dict] = []


@pytest.fixture(scope="session")
def oracle_manifest() -> dict:
    """The models and llama.cpp outputs; missing fixtures are a failure, not a skip."""
    manifest = FIXTURES / "manifest.json"
    if not manifest.exists():
        pytest.fail(f"oracle fixtures missing ({manifest}): run `make test` or "
                    f"`python scripts/build_fixtures.py` first", pytrace=False)
    data = json.loads(manifest.read_text())
    data["root"] = FIXTURES
    data["models"] = {k: FIXTURES / v for k, v in data["models"].items()}
    return data


@pytest.fixture(scope="session")
def record_measurement():
    """Tests call this with a dict of measured numbers; they are printed at the end of the run."""
    return _measured.append


def pytest_terminal_summary(terminalreporter):
    if not _measured:
        return
    tr = terminalreporter
    tr.section("measured (oracle comparisons and timings)")
    for row in _measured:
        tr.write_line("  " + "  ".join(f"{k}={v}" for k, v in row.items()))
    out = Path(os.environ.get("NTX_REPORT_DIR", FIXTURES.parent.parent / "reports"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "measured.json").write_text(json.dumps(_measured, indent=1))


@pytest.fixture(scope="session")
def browser():
    """Debian's chromium driven by Playwright (report pages); missing pieces fail, since
    `make test` installs both."""
    import shutil

    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: run `make browser` (apt-get install chromium)", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is not installed: pip install -e '.[test]'", pytrace=False)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=exe, args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()
