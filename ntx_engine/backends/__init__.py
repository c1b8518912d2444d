"""Compute backends behind one small op interface (see `base.Backend`)."""

from ntx_engine.backends.base import Backend

__all__ = ["Backend", "make_backend"]


def make_backend(device: str = "cpu", **options) -> Backend:
    if device == "cpu":
        from ntx_engine.backends.numpy_backend import NumpyBackend

        return NumpyBackend(**options)
    from ntx_common.errors import UsageError

    raise UsageError(f"unknown device {device!r} (available: cpu)")
