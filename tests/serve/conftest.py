"""One `ntx-serve` process for the tests of this folder: the default SmolLM2 model on the numpy
backend, an ephemeral loopback port read from the server's own start-up line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

CTX = 512
ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}
START_LINE = re.compile(r"serving (\S+) \(cpu, context (\d+)\) on http://127\.0\.0\.1:(\d+)/v1")


@dataclass(frozen=True)
class Server:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    model_id: str
    log: Path

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=60) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        out = {}
        for line in text.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out


@pytest.fixture(scope="session")
def server(tmp_path_factory) -> Server:
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "ntx_serve.cli", "--device", "cpu", "--ctx", str(CTX),
                                 "--port", "0"], stdout=subprocess.DEVNULL, stderr=f,
                                env={**os.environ, **ENV})
    try:
        m = _wait_for_start(proc, log)
        srv = Server(proc, f"http://127.0.0.1:{m.group(3)}", m.group(1), log)
        assert int(m.group(2)) == CTX
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_for_start(proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> re.Match:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = START_LINE.search(log.read_text())
        if m:
            return m
        if proc.poll() is not None:
            pytest.fail(f"ntx-serve exited with {proc.returncode}:\n{log.read_text()}", pytrace=False)
        time.sleep(0.1)
    pytest.fail(f"ntx-serve did not start within {timeout} s:\n{log.read_text()}", pytrace=False)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
