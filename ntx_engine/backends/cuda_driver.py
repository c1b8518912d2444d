"""A thin layer over the CUDA driver API (cuda-python's `cuda.bindings.driver`).

One `check()` turns every `(err, *values)` result into values or a `CudaError` naming the call.
Device memory is plain `cuMemAlloc` memory (never managed memory), pooled by exact size so the
per-token temporaries of a decode step are recycled instead of re-allocated.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from ntx_common.errors import CudaError


def driver():
    try:
        from cuda.bindings import driver as drv
    except ImportError as exc:
        raise CudaError(f"cuda-python is not installed ({exc}); install ntx with the 'cuda' extra") from exc
    return drv


def check(result: Any, call: str) -> Any:
    """Values of a driver call's `(err, *values)` result; CudaError naming `call` on failure."""
    drv = driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)[1]
        desc = drv.cuGetErrorString(err)[1]
        name = name.decode() if isinstance(name, bytes) else str(err)
        desc = desc.decode() if isinstance(desc, bytes) else ""
        raise CudaError(f"{call} failed: {name} ({desc})")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def init_driver() -> None:
    """cuInit, with the reason when there is no usable driver (e.g. no GPU on this machine)."""
    drv = driver()
    try:
        check(drv.cuInit(0), "cuInit")
    except CudaError:
        raise
    except Exception as exc:  # cuda-pathfinder: DynamicLibNotFoundError when libcuda is absent
        raise CudaError(f"no NVIDIA driver: {exc}") from exc


def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device can be used here, else why not (for test skips and --device)."""
    try:
        init_driver()
        n = check(driver().cuDeviceGetCount(), "cuDeviceGetCount")
    except CudaError as exc:
        return str(exc)
    return None if n > 0 else "cuDeviceGetCount: no CUDA device"


class Device:
    """One GPU with its primary context made current on this thread."""

    def __init__(self, ordinal: int = 0) -> None:
        drv = driver()
        init_driver()
        count = check(drv.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise CudaError(f"CUDA device {ordinal} does not exist ({count} device(s) present)")
        self.ordinal = ordinal
        self.handle = check(drv.cuDeviceGet(ordinal), f"cuDeviceGet({ordinal})")
        self.context = check(drv.cuDevicePrimaryCtxRetain(self.handle), "cuDevicePrimaryCtxRetain")
        check(drv.cuCtxSetCurrent(self.context), "cuCtxSetCurrent")
        raw = check(drv.cuDeviceGetName(128, self.handle), "cuDeviceGetName")
        self.name = raw.split(b"\0")[0].decode(errors="replace")
        attr = drv.CUdevice_attribute
        self.cc = (self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                   self.attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR))
        self.sm_count = self.attribute(attr.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        self.max_smem_optin = self.attribute(attr.CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)

    @property
    def arch(self) -> str:
        return f"sm_{self.cc[0]}{self.cc[1]}"

    def attribute(self, attr) -> int:
        return int(check(driver().cuDeviceGetAttribute(attr, self.handle), f"cuDeviceGetAttribute({attr.name})"))

    def mem_info(self) -> tuple[int, int]:
        free, total = check(driver().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)


class Stream:
    def __init__(self) -> None:
        drv = driver()
        self.handle = check(drv.cuStreamCreate(int(drv.CUstream_flags.CU_STREAM_NON_BLOCKING)), "cuStreamCreate")

    def synchronize(self) -> None:
        check(driver().cuStreamSynchronize(self.handle), "cuStreamSynchronize")


class Event:
    def __init__(self) -> None:
        drv = driver()
        self.handle = check(drv.cuEventCreate(int(drv.CUevent_flags.CU_EVENT_DEFAULT)), "cuEventCreate")

    def record(self, stream: Stream) -> None:
        check(driver().cuEventRecord(self.handle, stream.handle), "cuEventRecord")

    def synchronize(self) -> None:
        check(driver().cuEventSynchronize(self.handle), "cuEventSynchronize")

    def elapsed_ms(self, start: "Event") -> float:
        return float(check(driver().cuEventElapsedTime(start.handle, self.handle), "cuEventElapsedTime"))


class MemoryPool:
    """cuMemAlloc'd buffers recycled by exact size. While `keep` is a list (graph capture),
    every buffer handed out is also appended to it, so a captured graph's buffers live on."""

    def __init__(self) -> None:
        self.free: dict[int, list[int]] = {}
        self.keep: list | None = None
        self.allocated = 0

    def alloc(self, nbytes: int) -> int:
        nbytes = max(nbytes, 4)
        if self.free.get(nbytes):
            return self.free[nbytes].pop()
        ptr = int(check(driver().cuMemAlloc(nbytes), f"cuMemAlloc({nbytes} bytes)"))
        self.allocated += nbytes
        return ptr

    def release(self, ptr: int, nbytes: int) -> None:
        self.free.setdefault(max(nbytes, 4), []).append(ptr)

    def trim(self) -> None:
        """cuMemFree every recycled buffer (cuMemFree waits for the work that may still use it)."""
        for nbytes, ptrs in self.free.items():
            while ptrs:
                check(driver().cuMemFree(ptrs.pop()), "cuMemFree")
                self.allocated -= nbytes

    def __del__(self) -> None:
        # a pool dies after every array it handed out (each holds it): all its buffers are in
        # `free`. Without this a process that makes backend after backend (a benchmark of many
        # variants) kept every one's memory until cuMemAlloc failed.
        try:
            self.trim()
        except Exception:  # noqa: BLE001 (the context may be gone at interpreter exit)
            pass


class DeviceArray:
    """A C-contiguous device buffer with a numpy-like shape and dtype. Row slices are views."""

    def __init__(self, pool: MemoryPool, shape: tuple[int, ...], dtype, *, base: "DeviceArray | None" = None,
                 ptr: int | None = None) -> None:
        self.shape, self.dtype = tuple(int(s) for s in shape), np.dtype(dtype)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self.pool, self.base = pool, base
        self.ptr = pool.alloc(self.nbytes) if ptr is None else ptr
        self._owner = base is None  # set once ptr is: a failed cuMemAlloc leaves nothing to release
        if pool.keep is not None:
            pool.keep.append(self)

    def __del__(self) -> None:
        if getattr(self, "_owner", False):
            self.pool.release(self.ptr, self.nbytes)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize

    def __getitem__(self, index) -> "DeviceArray":
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("DeviceArray supports contiguous row slices only")
        start, stop, _ = index.indices(self.shape[0])
        stop = max(stop, start)
        row = self.nbytes // max(self.shape[0], 1)
        return DeviceArray(self.pool, (stop - start, *self.shape[1:]), self.dtype,
                           base=self.base or self, ptr=self.ptr + start * row)

    def reshape(self, *shape) -> "DeviceArray":
        shape = shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape
        if int(np.prod(shape)) != self.size:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return DeviceArray(self.pool, shape, self.dtype, base=self.base or self, ptr=self.ptr)


@dataclass(frozen=True)
class LaunchConfig:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int = 0


def pack_args(args: tuple) -> tuple[list, ctypes.Array]:
    """ctypes values for kernel arguments and the void* array pointing at them. DeviceArray and
    None become pointers, Python int a 32-bit int, float a 32-bit float: kernels take exactly
    these types, which keeps the packing free of per-kernel signatures. HostSlots become their device
    address."""
    values: list = []
    for a in args:
        if isinstance(a, DeviceArray):
            values.append(ctypes.c_uint64(a.ptr))
        elif a is None:
            values.append(ctypes.c_uint64(0))
        elif isinstance(a, HostSlots):
            values.append(ctypes.c_uint64(a.dptr))
        elif isinstance(a, (bool, int, np.integer)):
            values.append(ctypes.c_int32(int(a)))
        elif isinstance(a, (float, np.floating)):
            values.append(ctypes.c_float(float(a)))
        else:
            raise TypeError(f"cannot pass {type(a).__name__} to a kernel")
    ptrs = (ctypes.c_void_p * max(len(values), 1))(*[ctypes.addressof(v) for v in values])
    return values, ptrs


class Module:
    """A loaded cubin and its functions by name."""

    def __init__(self, cubin: bytes, name: str) -> None:
        self.name = name
        self.handle = check(driver().cuModuleLoadData(cubin), f"cuModuleLoadData({name})")
        self._functions: dict[str, Any] = {}

    def function(self, kernel: str):
        if kernel not in self._functions:
            self._functions[kernel] = check(driver().cuModuleGetFunction(self.handle, kernel.encode()),
                                            f"cuModuleGetFunction({self.name}:{kernel})")
        return self._functions[kernel]


def launch_ex(func, cfg: LaunchConfig, args: tuple, stream: Stream, name: str, *, pdl: bool = False,
              cooperative: bool = False) -> None:
    """cuLaunchKernelEx with PDL (Hopper programmatic stream serialization: the grid may be scheduled while the
    previous one finishes; the kernels' NTX_PDL() waits for it before any work) and/or as a cooperative grid: every
    block resident at once, or the launch fails (CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE) instead of a grid that
    waits on blocks never scheduled; neither: a plain cuLaunchKernel (launch)."""
    if not (pdl or cooperative):
        launch(func, cfg, args, stream, name)
        return
    drv = driver()
    values, ptrs = pack_args(args)
    attrs = []
    if pdl:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    if cooperative:
        attr = drv.CUlaunchAttribute()
        attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
        attr.value.cooperative = 1
        attrs.append(attr)
    lc = drv.CUlaunchConfig()
    lc.gridDimX, lc.gridDimY, lc.gridDimZ = cfg.grid
    lc.blockDimX, lc.blockDimY, lc.blockDimZ = cfg.block
    lc.sharedMemBytes, lc.hStream = cfg.smem, stream.handle
    lc.attrs, lc.numAttrs = attrs, len(attrs)
    check(drv.cuLaunchKernelEx(lc, func, ctypes.addressof(ptrs), 0), f"cuLaunchKernelEx({name})")
    del values


def launch(func, cfg: LaunchConfig, args: tuple, stream: Stream, name: str) -> None:
    values, ptrs = pack_args(args)
    check(driver().cuLaunchKernel(func, *cfg.grid, *cfg.block, cfg.smem, stream.handle,
                                  ctypes.addressof(ptrs), 0), f"cuLaunchKernel({name})")
    del values


def upload(pool: MemoryPool, host: np.ndarray, stream: Stream, out: DeviceArray | None = None) -> DeviceArray:
    host = np.ascontiguousarray(host)
    dev = out if out is not None else DeviceArray(pool, host.shape, host.dtype)
    if host.nbytes > dev.nbytes:
        raise ValueError(f"upload of {host.nbytes} bytes into a {dev.nbytes}-byte device buffer")
    if host.nbytes:
        check(driver().cuMemcpyHtoDAsync(dev.ptr, host.ctypes.data, host.nbytes, stream.handle),
              f"cuMemcpyHtoDAsync({host.nbytes} bytes)")
    return dev


class HostSlots:
    """Page-locked int32 words (cuMemHostAlloc) that the device maps: a kernel given them as an argument (their
    device address, dptr) writes them itself, with no copy in the stream, and the host reads them (values) after
    an event of the stream says that kernel has run."""

    def __init__(self, n: int) -> None:
        drv = driver()
        self.ptr = 0  # (set before the call: a failed allocation leaves nothing to free)
        self.ptr = int(check(drv.cuMemHostAlloc(4 * n, drv.CU_MEMHOSTALLOC_DEVICEMAP), f"cuMemHostAlloc({4 * n} bytes)"))
        self.dptr = int(check(drv.cuMemHostGetDevicePointer(self.ptr, 0), "cuMemHostGetDevicePointer"))
        self.values = np.ctypeslib.as_array((ctypes.c_int32 * n).from_address(self.ptr))

    def __del__(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                driver().cuMemFreeHost(ptr)
            except Exception:  # noqa: BLE001 (the context may be gone at interpreter exit)
                pass


def download(dev: DeviceArray, stream: Stream) -> np.ndarray:
    host = np.empty(dev.shape, dev.dtype)
    if dev.nbytes:
        check(driver().cuMemcpyDtoHAsync(host.ctypes.data, dev.ptr, dev.nbytes, stream.handle),
              f"cuMemcpyDtoHAsync({dev.nbytes} bytes)")
    stream.synchronize()
    return host
