"""Fixtures for ntx-setup tests: a fake machine under tmp_path and a CLI runner bound to it."""

import os
import sys
from dataclasses import replace

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, os.path.dirname(__file__))

from fakeroot import FakeKernel, FakeRoot  # noqa: E402

from ntx_setup.cli import main  # noqa: E402
from ntx_setup.machine import Machine  # noqa: E402

CLI_ENV = {"NO_COLOR": "1", "COLUMNS": "120", "TERM": "dumb"}


@pytest.fixture
def fr(tmp_path):
    return FakeRoot(tmp_path / "root")


@pytest.fixture
def kernel(fr):
    return FakeKernel(fr)


@pytest.fixture
def m(fr, kernel):
    return fr.machine(kernel)


@click.command(context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def _entry(args):
    main(list(args))  # the real entry point, with its error boundary


class Cli:
    """Runs `ntx-setup --root <fake> ...` through click's CliRunner against the fake kernel."""

    def __init__(self, fr, kernel, monkeypatch):
        self.fr, self.kernel, self.euid = fr, kernel, 0
        monkeypatch.setattr(Machine, "from_root", classmethod(lambda cls, root: self.machine()))

    def machine(self):
        return replace(self.fr.machine(self.kernel), euid=self.euid)

    def __call__(self, *args, input=None):
        return CliRunner().invoke(_entry, ["--root", str(self.fr.base), *args], env=CLI_ENV, input=input)


@pytest.fixture
def cli(fr, kernel, monkeypatch):
    return Cli(fr, kernel, monkeypatch)
