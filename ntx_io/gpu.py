"""The little CUDA that the storage layer needs: host registration and H2D bandwidth.

Everything goes through cuda-python's driver bindings (`cuda.bindings.driver`), imported only
here and only when called, so `ntx_io` works on machines without CUDA. `cuda_status()` says
whether a GPU can be used and, if not, why.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ntx_common.errors import CudaError


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError:
            raise CudaError("cuda-python is not installed (pip install 'ntx[cuda]')") from None
    return driver


def check(result, call: str):
    """Unwrap a cuda-python `(err, *values)` tuple, raising CudaError that names the call."""
    cu = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        _, name = cu.cuGetErrorName(err)
        raise CudaError(f"{call} failed: {name.decode() if isinstance(name, bytes) else err}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _init(cu) -> None:
    try:
        check(cu.cuInit(0), "cuInit")
    except CudaError:
        raise
    except Exception as exc:  # the bindings raise their own loader errors without a driver
        raise CudaError(f"cuInit: NVIDIA driver library not found ({type(exc).__name__}: {exc})") from None


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): is there a CUDA driver with at least one GPU?"""
    try:
        cu = _driver()
        _init(cu)
        count = check(cu.cuDeviceGetCount(), "cuDeviceGetCount")
    except CudaError as exc:
        return False, str(exc)
    if count < 1:
        return False, "the CUDA driver sees no GPU"
    return True, f"{count} GPU(s)"


class _Context:
    """The device's primary context made current (what the engine uses too)."""

    def __init__(self, ordinal: int):
        cu = _driver()
        _init(cu)
        self.device = check(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        self.ctx = check(cu.cuDevicePrimaryCtxRetain(self.device), "cuDevicePrimaryCtxRetain")
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def release(self) -> None:
        check(_driver().cuDevicePrimaryCtxRelease(self.device), "cuDevicePrimaryCtxRelease")


@dataclass
class CudaRegistration:
    address: int
    nbytes: int
    context: _Context

    def release(self) -> None:
        cu = _driver()
        check(cu.cuCtxSetCurrent(self.context.ctx), "cuCtxSetCurrent")
        check(cu.cuMemHostUnregister(self.address), "cuMemHostUnregister")
        self.context.release()


def register_host(address: int, nbytes: int, ordinal: int = 0) -> CudaRegistration:
    """cuMemHostRegister (portable): the GPU may DMA from these bytes at full PCIe speed."""
    cu = _driver()
    ctx = _Context(ordinal)
    flags = cu.CU_MEMHOSTREGISTER_PORTABLE
    check(cu.cuMemHostRegister(address, nbytes, flags), f"cuMemHostRegister({nbytes} bytes)")
    return CudaRegistration(address, nbytes, ctx)


def h2d_gbps(host_address: int, nbytes: int, repeats: int = 5, ordinal: int = 0) -> float:
    """Best-of-`repeats` host-to-device copy bandwidth from `host_address`, in GB/s (1e9)."""
    cu = _driver()
    ctx = _Context(ordinal)
    dev_ptr = check(cu.cuMemAlloc(nbytes), "cuMemAlloc")
    stream = check(cu.cuStreamCreate(0), "cuStreamCreate")
    try:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            check(cu.cuMemcpyHtoDAsync(dev_ptr, host_address, nbytes, stream), "cuMemcpyHtoDAsync")
            check(cu.cuStreamSynchronize(stream), "cuStreamSynchronize")
            times.append(time.perf_counter() - t0)
        return nbytes / min(times[1:]) / 1e9  # the first copy warms up the link and mappings
    finally:
        check(cu.cuStreamDestroy(stream), "cuStreamDestroy")
        check(cu.cuMemFree(dev_ptr), "cuMemFree")
        ctx.release()


def cuda_pinned_h2d_gbps(nbytes: int, repeats: int = 5, ordinal: int = 0) -> float:
    """The reference: H2D from memory CUDA itself allocated page-locked (cuMemAllocHost)."""
    cu = _driver()
    ctx = _Context(ordinal)
    host = check(cu.cuMemAllocHost(nbytes), "cuMemAllocHost")
    try:
        return h2d_gbps(int(host), nbytes, repeats, ordinal)
    finally:
        check(cu.cuMemFreeHost(host), "cuMemFreeHost")
        ctx.release()
