"""Run-time compilation of `native/cuda/*.cu` to cubin with NVRTC, cached on disk.

Cubin, not PTX: PTX from an NVRTC newer than the driver does not load (the lent H200's driver is
CUDA 13.0), while cubin for the exact arch does. The cache key covers everything that changes
the output: the source and every header it may include, the arch, NVRTC's version and options.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from ntx_common.errors import CudaError

KERNEL_DIR = Path(__file__).resolve().parents[2] / "native" / "cuda"
SOURCES = ("matvec.cu", "matvec_fast.cu", "fused.cu", "mmq.cu", "dequant.cu", "ops.cu", "attention.cu",
           "attn_grid.cu", "matvec_reg.cu", "layer_q8.cu", "layer_q8_ks.cu", "layer_q8_ks5.cu")
OPTIONS = ("-std=c++17", "-default-device", "-lineinfo")
# the decode step's macros (the dp4a matvec's launch shape NTX_G_*, NTX_FAST_WARPS, NTX_FAST_MINB,
# NTX_SWIGLU_MINB; NTX_PRE_WAIT, NTX_SWIGLU_PAIR, NTX_Q6_PAIR: matvec_fast.cuh, fused.cu; the grid
# attention's NTX_AG_PRE_WAIT: attn_grid.cu; NTX_REG=0: the build without matvec_reg.cuh's decode,
# which the host reads too: cuda_kernels.reg_build) can be set for a tuning run with
# NTX_CUDA_DEFINES="-DNAME=VALUE ..."; they apply to these sources only
TUNABLE = ("matvec_fast.cu", "fused.cu", "attn_grid.cu", "matvec_reg.cu", "layer_q8.cu", "layer_q8_ks.cu",
           "layer_q8_ks5.cu")


def define_value(name: str) -> str | None:
    """The value NTX_CUDA_DEFINES gives macro `name` (-D<name>=V: the first such), None where it sets none: the tuning
    macros the host must mirror (cuda_kernels.fast_rows, cuda_layers.stack_chunks)."""
    for d in os.environ.get("NTX_CUDA_DEFINES", "").split():
        if d.startswith(f"-D{name}="):
            return d.split("=", 1)[1]
    return None


def options(source: str) -> tuple[str, ...]:
    defines = os.environ.get("NTX_CUDA_DEFINES", "").split() if source in TUNABLE else []
    bad = [d for d in defines if not d.startswith("-DNTX_")]
    if bad:
        raise CudaError(f"NTX_CUDA_DEFINES may only set -DNTX_* macros, not {bad}")
    return OPTIONS + tuple(defines)


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise CudaError(f"cuda-python is not installed ({exc}); install ntx with the 'cuda' extra") from exc
    return nvrtc


def check_nvrtc(result, call: str, log: str = "") -> object:
    """Unwrap an NVRTC `(err, *values)` result or raise CudaError naming the call (and the log)."""
    nvrtc = _nvrtc()
    err, *values = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        msg = nvrtc.nvrtcGetErrorString(err)[1].decode(errors="replace")
        detail = f"\n--- NVRTC log ---\n{log}" if log else ""
        raise CudaError(f"{call} failed: {msg}{detail}")
    return values[0] if len(values) == 1 else tuple(values) or None


def nvrtc_version() -> tuple[int, int]:
    try:
        return tuple(check_nvrtc(_nvrtc().nvrtcVersion(), "nvrtcVersion"))  # type: ignore[arg-type]
    except RuntimeError as exc:  # cuda-pathfinder found no libnvrtc
        raise CudaError(f"NVRTC library not found ({exc}); pip install nvidia-cuda-nvrtc") from exc


def default_cache_dir() -> Path:
    root = os.environ.get("NTX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ntx")
    return Path(root) / "cubin"


def included_sources(source: str, kernel_dir: Path = KERNEL_DIR) -> list[str]:
    """The .cu files `source` includes (layer_q8_ks.cu: layer_q8.cu built with other macros), and theirs."""
    found: list[str] = []
    todo = [source]
    while todo:
        text = (kernel_dir / todo.pop()).read_text()
        for name in re.findall(r'^\s*#\s*include\s+"([^"/]+\.cu)"', text, re.M):
            if name not in found and name != source:
                found.append(name)
                todo.append(name)
    return sorted(found)


def cache_key(source: str, arch: str, kernel_dir: Path = KERNEL_DIR) -> str:
    h = hashlib.sha256()
    for path in [kernel_dir / source, *(kernel_dir / s for s in included_sources(source, kernel_dir)),
                 *sorted(kernel_dir.glob("*.cuh"))]:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    h.update(f"{arch}|{nvrtc_version()}|{' '.join(options(source))}".encode())
    return h.hexdigest()[:24]


def _program_log(nvrtc, prog) -> str:
    size = check_nvrtc(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
    # a fresh mutable buffer: NVRTC writes into it, and `b" " * 1` would be CPython's shared
    # one-byte bytes object (an empty log has size 1), corrupting it for the whole process
    buf = bytearray(size)
    check_nvrtc(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
    return bytes(buf).rstrip(b"\0 ").decode(errors="replace")


def compile_cubin(source: str, arch: str, kernel_dir: Path = KERNEL_DIR) -> tuple[bytes, str]:
    """Compile `kernel_dir/source` for `arch` (e.g. "sm_90"); returns (cubin, compile log)."""
    nvrtc = _nvrtc()
    nvrtc_version()  # a clear error if the library is missing
    path = kernel_dir / source
    prog = check_nvrtc(nvrtc.nvrtcCreateProgram(path.read_bytes(), source.encode(), 0, [], []),
                       f"nvrtcCreateProgram({source})")
    try:
        opts = [f"--gpu-architecture={arch}".encode(), f"--include-path={kernel_dir}".encode(),
                *(o.encode() for o in options(source))]
        err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _program_log(nvrtc, prog)
        check_nvrtc((err,), f"nvrtcCompileProgram({source}, {arch})", log)
        size = check_nvrtc(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        check_nvrtc(nvrtc.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def cache_path(source: str, arch: str, cache_dir: Path | None = None, kernel_dir: Path = KERNEL_DIR) -> Path:
    """Where the disk cache keeps the cubin of `source` for `arch` (cache_key names it)."""
    cache = cache_dir or default_cache_dir()
    return cache / f"{Path(source).stem}-{arch}-{cache_key(source, arch, kernel_dir)}.cubin"


def cached_cubins(sources, arch: str, cache_dir: Path | None = None, kernel_dir: Path = KERNEL_DIR,
                  on_compile=None) -> dict[str, bytes]:
    """{source: cubin} for each of `sources`, as cached_cubin gives them, the ones not yet in
    the cache compiled side by side on threads (NVRTC releases the GIL): a first run pays for the
    slowest source, not their sum. on_compile(done, total) is called before the first compile and
    after each one; it is not called when every source is cached."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    paths = {s: cache_path(s, arch, cache_dir, kernel_dir) for s in sources}  # each key hashed once
    missing = [s for s, path in paths.items() if not path.exists()]
    built: dict[str, bytes] = {}
    if missing:
        if on_compile:
            on_compile(0, len(missing))
        with ThreadPoolExecutor(max_workers=min(len(missing), os.cpu_count() or 1)) as pool:
            jobs = {pool.submit(cached_cubin, s, arch, cache_dir, kernel_dir): s for s in missing}
            for done, job in enumerate(as_completed(jobs), 1):
                built[jobs[job]] = job.result()  # a compile error (CudaError with the log) stops here
                if on_compile:
                    on_compile(done, len(missing))
    return {s: built[s] if s in built else path.read_bytes() for s, path in paths.items()}


def cached_cubin(source: str, arch: str, cache_dir: Path | None = None,
                 kernel_dir: Path = KERNEL_DIR) -> bytes:
    """The cubin of `source` for `arch`, compiled once and then read from the disk cache."""
    target = cache_path(source, arch, cache_dir, kernel_dir)
    cache = target.parent
    if target.exists():
        return target.read_bytes()
    cubin, _ = compile_cubin(source, arch, kernel_dir)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(cubin)
        tmp.replace(target)  # atomic: concurrent processes never read half a file
    except OSError:
        pass  # an unwritable cache only costs a recompile next time
    return cubin
