"""Compute backends behind one small op interface (see `base.Backend`)."""

from ntx_engine.backends.base import Backend

__all__ = ["Backend", "default_device", "make_backend"]


def make_backend(device: str = "cpu", **options) -> Backend:
    # "numpy": the pure-numpy oracle; "cpu": the native kernels (native/cpu) when they are built,
    # and for the oracle-only float32-activation mode (matmul_mode="exact")
    if device == "numpy" or (device == "cpu" and not _native_cpu_usable(options)):
        from ntx_engine.backends.numpy_backend import NumpyBackend

        return NumpyBackend(**options)
    if device == "cpu":
        from ntx_engine.backends.cpu_native import NativeCpuBackend

        return NativeCpuBackend(**options)
    # --- cuda (issue 5) ---
    if device == "cuda" or device.startswith("cuda:"):
        from ntx_engine.backends.cuda_backend import CudaBackend

        ordinal = int(device.partition(":")[2] or 0)
        return CudaBackend(device=ordinal, **options)
    from ntx_common.errors import UsageError

    raise UsageError(f"unknown device {device!r} (available: cpu, numpy, cuda, cuda:N)")


def _native_cpu_usable(options: dict) -> bool:
    if options.get("matmul_mode", "ggml") != "ggml":
        return False
    from ntx_engine.backends.cpu_kernels import load_module

    return load_module() is not None


def default_device() -> str:
    """"cuda" when a CUDA GPU and cuda-python are usable here, else "cpu" (numpy)."""
    try:
        from ntx_engine.backends.cuda_driver import gpu_unavailable_reason
    except ImportError:
        return "cpu"
    try:
        return "cpu" if gpu_unavailable_reason() else "cuda"
    except Exception:  # any failure probing the driver means: no usable GPU
        return "cpu"
