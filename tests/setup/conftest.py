"""Fixtures for ntx-setup tests: a fake machine under tmp_path."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from fakeroot import FakeKernel, FakeRoot  # noqa: E402


@pytest.fixture
def fr(tmp_path):
    return FakeRoot(tmp_path / "root")


@pytest.fixture
def kernel(fr):
    return FakeKernel(fr)


@pytest.fixture
def m(fr, kernel):
    return fr.machine(kernel)
