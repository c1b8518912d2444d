"""Fixtures for the QEMU guest tests: every test here is marked `vm` and needs the VM assets.

Missing assets fail the tests when CI is set or NTX_REQUIRE_VM=1 (make test on CI must run
them), and skip them with the reason elsewhere. Build the assets with `make vm-assets`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .harness import VmUnavailable, compile_python, ensure_assets, make_disk

HERE = Path(__file__).resolve().parent


def _required() -> bool:
    return bool(os.environ.get("CI")) or os.environ.get("NTX_REQUIRE_VM") == "1"


def _unavailable(reason: str) -> None:
    if _required():
        pytest.fail(f"VM tests must run here (CI or NTX_REQUIRE_VM=1 is set): {reason}", pytrace=False)
    pytest.skip(f"VM assets unavailable: {reason}")


# tryfirst: the marker must be on the items before `-m "not vm"` deselects by it.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.vm)


@pytest.fixture(scope="session", autouse=True)
def vm_assets() -> Path:
    """The asset dir of the guest kernel; byte-compiles the venv and repo once for the guest."""
    try:
        kdir = ensure_assets()
    except VmUnavailable as e:
        _unavailable(str(e))
    compile_python()
    return kdir


@pytest.fixture(scope="session")
def vm_noiommu_assets(vm_assets: Path) -> Path:
    """Request this in tests that boot mode='noiommu' (needs the rebuilt vfio.ko)."""
    try:
        return ensure_assets(noiommu=True)
    except VmUnavailable as e:
        _unavailable(str(e))


@pytest.fixture
def nvme_disk(tmp_path: Path) -> Path:
    """A fresh sparse 64 MiB file backing the guest's NVMe namespace."""
    return make_disk(tmp_path / "nvme.img", 64)
