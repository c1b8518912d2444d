"""The kernels of `native/cuda`, loaded for one device, with their launch shapes.

Each method launches one kernel on the given stream; shapes and the rounding each kernel does
are documented in the `.cu` files. Weight-type kernels are named `<op>_<type>` after ggml's type.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from ntx_engine.backends import cuda_nvrtc
from ntx_engine.backends.cuda_driver import (Device, DeviceArray, LaunchConfig, Module, Stream, check, driver,
                                             launch_ex)
from ntx_engine.quants import GGMLType

# ggml type -> suffix of its matvec_/embed_ kernels (NTX_FOR_EACH_TYPE in ntx_quants.cuh)
KERNEL_TYPES: dict[GGMLType, str] = {
    GGMLType.F32: "f32", GGMLType.F16: "f16", GGMLType.BF16: "bf16",
    GGMLType.Q4_0: "q4_0", GGMLType.Q4_1: "q4_1", GGMLType.Q5_0: "q5_0", GGMLType.Q5_1: "q5_1",
    GGMLType.Q8_0: "q8_0", GGMLType.Q2_K: "q2_k", GGMLType.Q3_K: "q3_k", GGMLType.Q4_K: "q4_k",
    GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
}
# elements per 32-element unit's block, for launch sizes
BLOCK_ELEMENTS = {t: (256 if t in (GGMLType.Q2_K, GGMLType.Q3_K, GGMLType.Q4_K, GGMLType.Q5_K,
                                   GGMLType.Q6_K) else 32) for t in KERNEL_TYPES}
MATVEC_ROWS_PER_BLOCK = 4  # NTX_WARPS in matvec.cu
MATVEC_MAX_TOKENS = 8  # the _n8 variants
ATTN_THREADS = 256
ATTN_CHUNK = 64  # positions per block of the split (flash-decoding) attention, attention.cu
ATTN_SPLIT_THREADS = 256
ATTN_GQA_V = (2, 3, 4, 8)  # head_dim / 32 of the attn_gqa_* kernels
ATTN_GMAX, ATTN_QMAX = 16, 4096  # query heads per KV head, and their values, the kernels hold
# attn_grid.cu: blocks a KV head at most (AG_NBMAX), positions a block at least (the kernel's minr
# argument), its static shared memory (q of the group, the statistics, the new K/V rows)
GRID_NBMAX, GRID_MINR, GRID_STATIC_SMEM = 32, 16, 18 * 1024
# (head_dim / 32, query heads a KV head) with a grid attention kernel of that fixed group size,
# attn_grid_<V>_g<G> (fixed loop counts, a third of the generic kernel's code); others take attn_grid_<V>
GRID_FIXED_GROUPS = ((4, 4), (4, 8), (2, 3))
# the cluster form of the grid attention (attn_cl<C>_<V>_g<G>, sm_90 and later): C blocks a KV head
# in one thread-block cluster; its layouts and cluster sizes, and its static shared memory
CLUSTER_GROUPS, CLUSTER_SIZES, CLUSTER_STATIC_SMEM = ((4, 4),), (8, 16), 20 * 1024
# the decode attention takes the cluster form up to this many positions: beyond, the grid form's
# 32 blocks a KV head beat the cluster's 16 (H200, session 10, attention alone: 8.60 against
# 10.80 us at 576 positions, 10.41 against 11.82 at 1024, 13.11 against 12.52 at 1280)
CLUSTER_MAX_T = 1024
# "fast" (default): matvec_fast.cu's dp4a kernels for FAST_TYPES, "staged" for the others;
# "staged": blocks copied to shared memory with wide loads, float decode; "direct": byte loads
MATVEC_VARIANTS = {"fast": "matvec", "staged": "matvec", "direct": "matvecd"}
# types with an int8 dp4a kernel (matvecf_<suffix>_n1/_n8 in matvec_fast.cu); the fused kernels take FAST_CODES'
FAST_TYPES: dict[GGMLType, str] = {GGMLType.Q4_K: "q4_k", GGMLType.Q5_K: "q5_k", GGMLType.Q6_K: "q6_k",
                                   GGMLType.Q8_0: "q8_0"}
FAST_ROWS_PER_BLOCK = 4  # NTX_FAST_WARPS in matvec_fast.cuh (fast_rows(): a tuning run may change it)
MMQ_TYPES: dict[GGMLType, str] = {GGMLType.Q4_K: "q4_k", GGMLType.Q8_0: "q8_0"}  # mmq.cu's tensor-core prefill
MMQ_TILE = 64  # NTX_MMQ_ROWS = NTX_MMQ_TOKENS in mmq.cu
FAST_CODES = {GGMLType.Q4_K: 0, GGMLType.Q6_K: 1, GGMLType.Q8_0: 2}  # NTX_FT_* in matvec_fast.cuh: fused.cu's types
NORM_THREADS = 1024  # one block a row: a decode step's norm is one row, so latency is all that counts


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fast_rows() -> int:
    """Rows per block of the dp4a kernels: NTX_FAST_WARPS as the kernels were compiled with it."""
    value = cuda_nvrtc.define_value("NTX_FAST_WARPS")
    return int(value) if value is not None else FAST_ROWS_PER_BLOCK


REG_WARPS = 8  # NTX_REG_WARPS in matvec_reg.cuh: warps a block of the register-activation kernels


def reg_build(defines: str | None = None) -> bool:
    """Whether kernels built with these NTX_CUDA_DEFINES (default: the environment's now) have
    matvec_reg.cuh's decode: not with -DNTX_REG=0, nor in the unit-decode build -DNTX_Q6_PAIR=0.
    Kernels reads it once, when it compiles its modules."""
    words = (os.environ.get("NTX_CUDA_DEFINES", "") if defines is None else defines).split()
    return {"-DNTX_REG=0", "-DNTX_Q6_PAIR=0"}.isdisjoint(words)


def reg_shape(t: GGMLType, k: int, n: int, build: bool = True) -> tuple[int, int] | None:
    """(passes a warp PPW, warps a row WK) of matvec_reg.cu for n activation rows of k values
    (reg_ppw / reg_wk there), or None when its kernels do not take the product: they take one
    row of Q4_K or Q5_K weights of at most 16 passes of 2048 values, or of Q6_K weights of one or two
    2048-value groups, in a build with them (reg_build).
    Every other kernel adds such rows in the same order (reg_row_n), so this picks the launch,
    never the bits."""
    if not build or n != 1 or t not in (GGMLType.Q4_K, GGMLType.Q5_K, GGMLType.Q6_K) or k % 256:
        return None
    if t == GGMLType.Q6_K:  # one warp a row of one or two groups: matvecf_q6_k's bits (matvec_reg.cuh)
        return (2, 1) if k % 2048 == 0 and k <= 4096 else None
    p = _cdiv(k // 256, 8)
    ppw = 2 if p <= 2 or p > 8 else 1
    wk = _cdiv(p, ppw)
    return (ppw, wk) if wk <= REG_WARPS else None


def gqa_split_ok(n_head: int, n_kv: int, head_dim: int) -> bool:
    """Whether the attn_gqa_* decode kernels take this head layout (else the one-block kernel)."""
    g = n_head // n_kv
    return head_dim % 32 == 0 and head_dim // 32 in ATTN_GQA_V and g <= ATTN_GMAX and g * head_dim <= ATTN_QMAX


def grid_attn_shape(n_head: int, n_kv: int, head_dim: int, n_ctx: int, sm_count: int,
                    smem_optin: int, per_sm: int = 1, minr: int | None = None,
                    cluster: int = 0) -> tuple[int, int, int] | None:
    """(blocks a KV head, positions a block at most, positions a block at least) of the one-launch
    decode attention (attn_grid.cu), or None when it cannot run. Its blocks wait for each other
    inside the kernel, so the whole grid must be resident at once: at most per_sm blocks an SM
    (what the occupancy calculator allows them, Kernels.grid_per_sm); the scores of a block's
    positions must fit its shared memory (else the two split kernels take the layout). A token
    at position T uses max(ceil(T / nb), minr) positions a block (minr: GRID_MINR). cluster: the
    cluster form's blocks a KV head (grid_cluster_size), whose clusters need not be resident at once."""
    minr = GRID_MINR if minr is None else minr
    if not gqa_split_ok(n_head, n_kv, head_dim) or (not cluster and n_kv > sm_count * per_sm):
        return None
    nb = cluster or min(GRID_NBMAX, sm_count * per_sm // n_kv)
    rmax = max(_cdiv(n_ctx, nb), minr)
    if (CLUSTER_STATIC_SMEM if cluster else GRID_STATIC_SMEM) + 4 * (n_head // n_kv) * rmax > smem_optin:
        return None
    return nb, rmax, minr


def grid_fixed_setting() -> bool:
    """NTX_CUDA_GRID_FIXED (default 1): whether the grid attention may take its fixed-group kernels."""
    text = os.environ.get("NTX_CUDA_GRID_FIXED", "1")
    if text not in ("0", "1"):
        from ntx_common.errors import UsageError

        raise UsageError(f"NTX_CUDA_GRID_FIXED must be 0 or 1, not {text!r}")
    return text == "1"


def grid_cluster_setting() -> int:
    """NTX_CUDA_GRID_CLUSTER (default 16): the cluster form's blocks a KV head (one of
    CLUSTER_SIZES), 0 for the grid form only."""
    text = os.environ.get("NTX_CUDA_GRID_CLUSTER", "16")
    if text not in ("0", *map(str, CLUSTER_SIZES)):
        from ntx_common.errors import UsageError

        raise UsageError(f"NTX_CUDA_GRID_CLUSTER must be 0 or one of {', '.join(map(str, CLUSTER_SIZES))}, "
                         f"not {text!r}")
    return int(text)


def grid_cluster_size(n_head: int, n_kv: int, head_dim: int, cc: tuple[int, int], setting: int) -> int:
    """The cluster form's blocks a KV head for this layout and GPU (compute capability cc), 0 where
    the grid form runs: the setting, where the layout has a cluster kernel and the GPU clusters."""
    if not setting or cc < (9, 0) or (head_dim // 32, n_head // n_kv) not in CLUSTER_GROUPS or head_dim % 32:
        return 0
    return setting


def grid_attn_kernel(n_head: int, n_kv: int, head_dim: int, fixed: bool | None = None, cluster: int = 0) -> str:
    """The grid attention kernel for this head layout: the one with the group size fixed where
    GRID_FIXED_GROUPS has it, unless fixed is False (None: grid_fixed_setting()); the cluster form
    of cluster blocks a KV head where cluster is set (grid_cluster_size)."""
    fixed = grid_fixed_setting() if fixed is None else fixed
    v, g = head_dim // 32, n_head // n_kv
    if cluster:
        return f"attn_cl{cluster}_{v}_g{g}"
    return f"attn_grid_{v}_g{g}" if fixed and (v, g) in GRID_FIXED_GROUPS else f"attn_grid_{v}"


def fast_matvec_ok(t: GGMLType, ptr: int, k: int) -> bool:
    """The dp4a kernels stream 16-byte aligned chunks: the tensor must start 16-byte aligned and
    every row be a whole number of 16 bytes (true for Llama shapes; Q6_K needs k % 2048 == 0)."""
    if t not in FAST_TYPES:
        return False
    from ntx_engine import quants

    return ptr % 16 == 0 and quants.tensor_nbytes(t, k) % 16 == 0


def compile_kernels(arch: str, cache_dir: Path | None = None) -> dict[str, bytes]:
    """The cubins of cuda_nvrtc.SOURCES for arch: from the disk cache, or compiled side by side
    behind a progress bar on stderr (a first run on a GPU, or after the kernels or NVRTC change)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ntx_common.console import err

    progress: Progress | None = None
    task = None

    def on_compile(done: int, total: int) -> None:
        nonlocal progress, task
        if progress is None:
            where = cuda_nvrtc.default_cache_dir() if cache_dir is None else cache_dir
            progress = Progress(TextColumn(f"compiling CUDA kernels for {arch} (once; cached in {where})"), BarColumn(),
                                MofNCompleteColumn(), TextColumn("sources"), TimeElapsedColumn(), console=err,
                                transient=True)
            progress.start()
            task = progress.add_task("nvrtc", total=total)
        progress.update(task, completed=done)

    try:
        return cuda_nvrtc.cached_cubins(cuda_nvrtc.SOURCES, arch, cache_dir, on_compile=on_compile)
    finally:
        if progress is not None:
            progress.stop()


class Kernels:
    def __init__(self, device: Device, cache_dir: Path | None = None, matvec: str = "fast",
                 pdl: bool | None = None) -> None:
        if matvec not in MATVEC_VARIANTS:
            raise ValueError(f"matvec variant must be one of {sorted(MATVEC_VARIANTS)}, got {matvec!r}")
        self.device = device
        self.matvec_prefix = MATVEC_VARIANTS[matvec]
        self.fast = matvec == "fast"
        # Hopper programmatic dependent launch for every kernel (sm_90 and newer; NTX_CUDA_PDL=0 turns it off)
        self.pdl = pdl if pdl is not None else os.environ.get("NTX_CUDA_PDL", "1") == "1"
        self.pdl = self.pdl and int(device.arch.removeprefix("sm_")) >= 90
        self.profile: list | None = None  # (name, start Event, end Event) per launch while a list
        cubins = compile_kernels(device.arch, cache_dir)
        self.modules = {src: Module(cubins[src], src) for src in cuda_nvrtc.SOURCES}
        self._smem_limits: dict[tuple[str, str], int] = {}  # dynamic shared memory allowed so far
        self._reg_per_sm: dict[tuple[str, int], int] = {}  # matvec_reg.cu's resident blocks an SM, by (kernel, block)
        self.reg = reg_build()  # the defines the modules below are compiled with
        self.fast_rows = fast_rows()
        self.grid_fixed = grid_fixed_setting()  # read once: the grid attention launches every layer
        self.grid_cluster = grid_cluster_setting()
        self._nonportable: set[str] = set()  # cluster kernels allowed more than 8 blocks a cluster
        # kernels never launched (bench_engine.py's drop= variants: a step without them; garbage out)
        self.drop = frozenset(n for n in os.environ.get("NTX_CUDA_DROP", "").split(",") if n)

    def fn(self, source: str, name: str):
        return self.modules[source].function(name)

    def _go(self, source: str, name: str, grid, block, args, stream: Stream, smem: int = 0,
            cooperative: bool = False) -> None:
        """Launch kernel `name` of `source` (cooperative: every block resident at once, or a launch error)."""
        if name in self.drop:
            return
        cfg = LaunchConfig(tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block)), smem)
        fn = self.fn(source, name)
        if self.profile is None:
            launch_ex(fn, cfg, args, stream, name, pdl=self.pdl, cooperative=cooperative)
            return
        from ntx_engine.backends.cuda_driver import Event

        e0, e1 = Event(), Event()
        e0.record(stream)
        launch_ex(fn, cfg, args, stream, name, cooperative=cooperative)  # a profiled launch is timed alone: no PDL
        e1.record(stream)
        self.profile.append((name, e0, e1))

    # --- quantized weights --------------------------------------------------------------
    def matvec(self, t: GGMLType, w: DeviceArray, xq: DeviceArray, s: DeviceArray | None, y: DeviceArray,
               rows: int, k: int, n: int, stream: Stream, x_off: int = 0) -> None:
        """y (n, rows) = xq (n, k) . w^T; n <= MATVEC_MAX_TOKENS; pointers already offset."""
        variant = "n1" if n == 1 else "n8"
        grid = (_cdiv(rows, MATVEC_ROWS_PER_BLOCK),)
        self._go("matvec.cu", f"{self.matvec_prefix}_{KERNEL_TYPES[t]}_{variant}", grid, (32 * MATVEC_ROWS_PER_BLOCK,),
                 (w, xq, s, y, rows, k, n), stream)

    def matvec_fast(self, t: GGMLType, w: DeviceArray, xq: DeviceArray, xd: DeviceArray, xs: DeviceArray,
                    y: DeviceArray, rows: int, k: int, n: int, stream: Stream) -> None:
        """y (n, rows) = dequant(xq, xd) . w^T with dp4a; n <= MATVEC_MAX_TOKENS; see fast_matvec_ok."""
        shape = reg_shape(t, k, n, self.reg)
        if shape is not None:
            self._reg_go(f"matvecr_{FAST_TYPES[t]}_p{shape[0]}", shape[1], rows, (w, xq, xd, xs, y, rows, k), stream)
            return
        variant = "n1" if n == 1 else "n8"
        self._go("matvec_fast.cu", f"matvecf_{FAST_TYPES[t]}_{variant}", (_cdiv(rows, self.fast_rows),),
                 (32 * self.fast_rows,), (w, xq, xd, xs, y, rows, k, n), stream)

    def mmq(self, t: GGMLType, w: DeviceArray, xq: DeviceArray, xd: DeviceArray, xs: DeviceArray, y: DeviceArray,
            rows: int, k: int, n: int, stream: Stream) -> None:
        """y (n, rows) = dequant(xq, xd) . w^T on the int8 tensor cores, any n (mmq.cu)."""
        self._go("mmq.cu", f"mmq_{MMQ_TYPES[t]}", (_cdiv(rows, MMQ_TILE), _cdiv(n, MMQ_TILE)), (128,),
                 (w, xq, xd, xs, y, rows, k, n), stream)

    def dequant_f16(self, t: GGMLType, w: DeviceArray, out: DeviceArray, rows: int, k: int, stream: Stream) -> None:
        """out (rows, k) fp16 = the first rows of w decoded (dequant.cu; pointers already offset)."""
        units = rows * (k // 32)
        self._go("dequant.cu", f"dequant_f16_{KERNEL_TYPES[t]}", (_cdiv(units, 128),), (128,), (w, out, rows, k), stream)

    def to_f16_rows(self, x: DeviceArray, xh: DeviceArray, scales: DeviceArray, stream: Stream) -> None:
        """xh (n, k) fp16 = x / scales[t] per row, scales a power of two keeping fp16 finite."""
        n, k = x.shape
        self._go("dequant.cu", "to_f16_rows", (n,), (256,), (x, xh, scales, k), stream)

    def scale_rows(self, y: DeviceArray, scales: DeviceArray, stream: Stream) -> None:
        n, rows = y.shape
        self._go("dequant.cu", "scale_rows", (n,), (256,), (y, scales, rows), stream)

    def matvec_multi(self, ws: list, xq: DeviceArray, xd: DeviceArray, xs: DeviceArray, ys: list, k: int, n: int,
                     stream: Stream) -> None:
        """ys[i] (n, rows_i) = x . ws[i]^T for up to three (data, type, rows) weights sharing the
        activations (fused.cu's matvecf_multi; one grid over all their rows)."""
        if not 1 <= len(ws) <= 3 or len(ys) != len(ws):
            raise ValueError(f"matvec_multi takes 1 to 3 weights and as many outputs, got {len(ws)}/{len(ys)}")
        pad = 3 - len(ws)
        data = [w[0] for w in ws] + [None] * pad
        codes = [FAST_CODES[w[1]] for w in ws] + [0] * pad
        rows = [w[2] for w in ws] + [0] * pad
        shape = next((reg_shape(w[1], k, n, self.reg) for w in ws if w[1] == GGMLType.Q4_K), None)
        if shape is not None:  # the Q4_K weights' rows by teams, the others' as matvecf_multi's warps do
            self._reg_go(f"matvecr_multi_p{shape[0]}", shape[1], sum(rows),
                         (*data, *(list(ys) + [None] * pad), *rows, *codes, xq, xd, xs, k), stream)
            return
        grid = (_cdiv(sum(rows), self.fast_rows),)
        self._go("fused.cu", f"matvecf_multi_{'n1' if n == 1 else 'n8'}", grid, (32 * self.fast_rows,),
                 (*data, *(list(ys) + [None] * pad), *rows, *codes, xq, xd, xs, k, n), stream)

    def matvec_swiglu(self, wg: DeviceArray, tg: GGMLType, wu: DeviceArray, tu: GGMLType, xq: DeviceArray,
                      xd: DeviceArray, xs: DeviceArray, y: DeviceArray, rows: int, k: int, n: int,
                      stream: Stream) -> None:
        """y (n, rows) = swiglu(x . wg^T, x . wu^T) in one kernel (fused.cu's matvecf_swiglu, or
        matvec_reg.cu's for one row of Q4_K gate and up weights)."""
        shape = reg_shape(tg, k, n, self.reg)
        if shape is not None and tg == tu:
            self._reg_go(f"matvecr_swiglu_{FAST_TYPES[tg]}_p{shape[0]}", shape[1], rows, (wg, wu, xq, xd, xs, y, rows, k),
                         stream)
            return
        self._go("fused.cu", f"matvecf_swiglu_{'n1' if n == 1 else 'n8'}", (_cdiv(rows, self.fast_rows),),
                 (32 * self.fast_rows,), (wg, wu, FAST_CODES[tg], FAST_CODES[tu], xq, xd, xs, y, rows, k, n),
                 stream)

    def add_rmsnorm_quanti(self, x, d, s, w, out, xq, xd, xs, eps: float, qmode: int, stream: Stream) -> None:
        """s = x + d (d None: no add), out = rmsnorm(s) * w, and out quantized for the next
        matmul when qmode is 1 (Q8_0/Q8_1 blocks) or 2 (Q8_K), in one launch (fused.cu)."""
        n, k = x.shape
        self._go("fused.cu", "add_rmsnorm_quanti", (n,), (NORM_THREADS,),
                 (x, d, s, w, out, xq, xd, xs, k, float(eps), int(qmode)), stream)

    def rope_kv(self, q, k, v, q_out, kc, vc, pos, ff, n_head, n_kv, head_dim, rope_dim, scale, freq_scale, neox,
                stream) -> None:
        """rope(q) -> q_out, rope(k) and v into the F16 caches at pos: rope x2 + kv_store in one launch."""
        n = q.shape[0]
        work = (n_head + n_kv) * (head_dim // 2)
        self._go("fused.cu", "rope_kv", (_cdiv(work, 128), n), (128,),
                 (q, k, v, q_out, kc, vc, pos, ff, n_head, n_kv, head_dim, rope_dim, float(scale), float(freq_scale),
                  int(neox)), stream)

    def quantize_int8(self, vec_dot: GGMLType, x: DeviceArray, xq: DeviceArray, xd: DeviceArray, xs: DeviceArray,
                      stream: Stream) -> None:
        """x quantized to vec_dot (Q8_0/Q8_1/Q8_K) as int8 xq, per-32 scale xd and int sum xs."""
        if vec_dot in (GGMLType.Q8_0, GGMLType.Q8_1):
            nb, name = x.size // 32, "quanti_q8_1"
        elif vec_dot == GGMLType.Q8_K:
            nb, name = x.size // 256, "quanti_q8_k"
        else:
            raise ValueError(f"no int8 activation quantization for {vec_dot.name}")
        self._go("matvec_fast.cu", name, (_cdiv(nb * 32, 128),), (128,), (x, xq, xd, xs, nb), stream)

    def rmsnorm_quanti(self, x, w, out, xq, xd, xs, eps: float, q8k: bool, stream: Stream) -> None:
        """rmsnorm into out and, in the same kernel, out quantized as quantize_int8 would."""
        self.add_rmsnorm_quanti(x, None, None, w, out, xq, xd, xs, eps, 2 if q8k else 1, stream)

    def embed(self, t: GGMLType, table: DeviceArray, ids: DeviceArray, out: DeviceArray, n: int, k: int,
              stream: Stream) -> None:
        units = k // BLOCK_ELEMENTS[t] * (BLOCK_ELEMENTS[t] // 32)
        self._go("matvec.cu", f"embed_{KERNEL_TYPES[t]}", (_cdiv(units, 128), n), (128,), (table, ids, out, k), stream)

    def quantize(self, vec_dot: GGMLType, x: DeviceArray, xq: DeviceArray, s: DeviceArray | None,
                 stream: Stream) -> None:
        """x_hat = x quantized to vec_dot as ggml's CPU does (s: Q8_1 block sums)."""
        total = x.size
        if vec_dot in (GGMLType.Q8_0, GGMLType.Q8_1):
            nb = total // 32  # one warp per block
            self._go("matvec.cu", "quant_q8_1", (_cdiv(nb * 32, 128),), (128,),
                     (x, xq, s if vec_dot == GGMLType.Q8_1 else None, nb), stream)
        elif vec_dot == GGMLType.Q8_K:
            nb = total // 256
            self._go("matvec.cu", "quant_q8_k", (_cdiv(nb * 32, 128),), (128,), (x, xq, nb), stream)
        elif vec_dot in (GGMLType.F16, GGMLType.BF16):
            name = "round_f16" if vec_dot == GGMLType.F16 else "round_bf16"
            self._go("matvec.cu", name, (_cdiv(total, 256),), (256,), (x, xq, total), stream)
        else:
            raise ValueError(f"no activation quantization for {vec_dot.name}")

    # --- element-wise and row ops -------------------------------------------------------
    def rmsnorm(self, x: DeviceArray, w: DeviceArray, out: DeviceArray, eps: float, stream: Stream) -> None:
        n, k = x.shape
        self._go("ops.cu", "rmsnorm", (n,), (NORM_THREADS,), (x, w, out, k, float(eps)), stream)

    def rope(self, x, out, pos, ff, n_heads, head_dim, rope_dim, scale, freq_scale, neox, stream) -> None:
        n = x.shape[0]
        work = n_heads * (head_dim // 2)
        self._go("ops.cu", "rope", (_cdiv(work, 128), n), (128,),
                 (x, out, pos, ff, n_heads, head_dim, rope_dim, float(scale), float(freq_scale), int(neox)), stream)

    def swiglu(self, g, u, out, stream) -> None:
        self._go("ops.cu", "swiglu", (_cdiv(g.size, 256),), (256,), (g, u, out, g.size), stream)

    def add(self, a, b, out, stream) -> None:
        self._go("ops.cu", "add", (_cdiv(a.size, 256),), (256,), (a, b, out, a.size, b.size), stream)

    def kv_store(self, k, v, kc, vc, pos, kv_dim, stream) -> None:
        n = k.shape[0]
        self._go("ops.cu", "kv_store", (_cdiv(kv_dim, 128), n), (128,), (k, v, kc, vc, pos, kv_dim), stream)

    def argmax(self, x, out, stream, feed: tuple | None = None, hist=None) -> None:
        """out = argmax(x); feed = (ids, pos) device int32 arrays: also ids[0] = out, pos[0] += 1, and
        hist[pos[0]] = out where hist (HostSlots, with feed) is given."""
        ids, pos = feed if feed is not None else (None, None)
        self._go("ops.cu", "argmax", (1,), (1024,), (x, x.size, out, ids, pos, hist if feed else None), stream)

    def attention(self, q, kc, vc, out, pos, n_head, n_kv, head_dim, n_ctx, scale, stream) -> None:
        n = q.shape[0]
        # whole warps (the block reductions) and whole heads (the p.V groups): head_dim 80 -> 160
        unit = math.lcm(head_dim, 32)
        if unit > 1024:
            from ntx_common.errors import CudaError

            raise CudaError(f"attention: head_dim {head_dim} needs blocks of {unit} threads (at most 1024)")
        threads = unit * max(1, ATTN_THREADS // unit)
        smem = 32 * 8 + 4 * (32 + head_dim + threads + n_ctx)
        self._allow_smem("attention.cu", "attention", smem)
        self._go("attention.cu", "attention", (n_head, n), (threads,),
                 (q, kc, vc, out, pos, n_head, n_kv, head_dim, float(scale)), stream, smem)

    def attention_gqa(self, q, kc, vc, out, pos, n_head, n_kv, head_dim, n_ctx, scale, scratch, stream,
                      quant=None) -> None:
        """Split-K decode attention of one token, a block per (chunk, KV head) for the head's whole
        GQA group (attn_gqa_scores, attn_gqa_pv; see gqa_split_ok). scratch = (scores (n_head,
        n_ctx), cmax (n_head, nchunk), part (n_head, nchunk, head_dim) float32, two (n_kv) uint32
        arrival counters that must start at zero (the kernels leave them so), gmax (n_head)
        float32, gsum (n_head) float64). quant: (xq, xd, xs, qmode) to also quantize out for the
        next matmul (qmode 1: Q8_0/Q8_1 blocks, 2: Q8_K), or None."""
        nchunk = _cdiv(n_ctx, ATTN_CHUNK)
        scores, cmax, part, count_s, count_p, gmax, gsum = scratch
        xq, xd, xs, qmode = quant if quant is not None else (None, None, None, 0)
        grid, block, v = (nchunk, n_kv), (ATTN_SPLIT_THREADS,), head_dim // 32
        self._go("attention.cu", f"attn_gqa_scores_{v}", grid, block,
                 (q, kc, scores, cmax, pos, n_head, n_kv, n_ctx, float(scale), count_s, gmax, gsum), stream)
        self._go("attention.cu", f"attn_gqa_pv_{v}", grid, block,
                 (scores, gmax, gsum, vc, part, out, pos, n_head, n_kv, n_ctx, count_p, xq, xd, xs, int(qmode)),
                 stream)

    def grid_per_sm(self, n_head: int, n_kv: int, head_dim: int, n_ctx: int) -> int:
        """Blocks an SM the grid attention may use: 2 when the occupancy calculator says two of
        its blocks (with the shared memory of that shape) fit an SM, else 1; NTX_CUDA_GRID_PER_SM
        caps it (1 or 2)."""
        text = os.environ.get("NTX_CUDA_GRID_PER_SM", "2")
        if text not in ("1", "2"):
            from ntx_common.errors import UsageError

            raise UsageError(f"NTX_CUDA_GRID_PER_SM must be 1 or 2, not {text!r}")
        cap = int(text)
        shape = grid_attn_shape(n_head, n_kv, head_dim, n_ctx, self.device.sm_count, self.device.max_smem_optin, 2)
        if cap == 1 or shape is None:
            return 1
        name, smem = grid_attn_kernel(n_head, n_kv, head_dim, self.grid_fixed), 4 * (n_head // n_kv) * shape[1]
        self._allow_smem("attn_grid.cu", name, smem, GRID_STATIC_SMEM)
        fits = check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn("attn_grid.cu", name),
                                                                          ATTN_SPLIT_THREADS, smem),
                     f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")
        return 2 if int(fits) >= 2 else 1

    def attention_grid(self, q, kc, vc, out, pos, n_head, n_kv, head_dim, shape, scale, scratch, stream,
                       quant=None, rope=None, cluster: int = 0) -> None:
        """Decode attention of one token in one launch (attn_grid.cu), grid (nb, n_kv) for
        shape = (nb, rmax, minr) from grid_attn_shape. scratch = (cmax (n_head, nb) float32, psum
        (n_head, nb) float64, part (n_head, nb, head_dim) float32, 2 * n_kv uint32 counters that
        start at zero (the kernel leaves them so)); quant as attention_gqa's. rope = (k, v, ff,
        rope_dim, scale, freq_scale, neox): q, k, v are the token's rows before RoPE, and the kernel
        also does rope_kv's work (the caches get the new position); None: q is rotated and stored.
        cluster: the cluster form's blocks a KV head (== nb; grid_cluster_size), 0 for the grid form
        (the cluster form leaves cmax, psum, part and the counters alone)."""
        nb, rmax, minr = shape
        cmax, psum, part, counters = scratch
        xq, xd, xs, qmode = quant if quant is not None else (None, None, None, 0)
        rk, rv, ff, rope_dim, rscale, freq_scale, neox = rope if rope is not None else (None, None, None, 0, 0.0, 0.0, 0)
        name, smem = grid_attn_kernel(n_head, n_kv, head_dim, self.grid_fixed, cluster), 4 * (n_head // n_kv) * rmax
        self._allow_smem("attn_grid.cu", name, smem, CLUSTER_STATIC_SMEM if cluster else GRID_STATIC_SMEM)
        if cluster > 8 and name not in self._nonportable:  # 8 blocks is the portable cluster size
            drv = driver()
            check(drv.cuFuncSetAttribute(self.fn("attn_grid.cu", name),
                                         drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1),
                  f"cuFuncSetAttribute({name}, non-portable cluster size)")
            self._nonportable.add(name)
        self._go("attn_grid.cu", name, (nb, n_kv), (ATTN_SPLIT_THREADS,),
                 (q, kc, vc, out, pos, n_head, n_kv, nb, rmax, minr, float(scale), cmax, psum, part, counters, xq, xd,
                  xs, int(qmode), rk, rv, ff, int(rope_dim), float(rscale), float(freq_scale), int(neox)), stream, smem)

    def _reg_go(self, name: str, wk: int, rows: int, args: tuple, stream: Stream) -> None:
        """A matvec_reg.cu launch: WK x (8 / WK) warps a block, as many blocks as are resident at
        once (the occupancy calculator's count for every SM) and no more than have rows."""
        teams = REG_WARPS // wk
        block = 32 * wk * teams
        per_sm = self._reg_per_sm.get((name, block))
        if per_sm is None:
            per_sm = max(1, int(check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(
                self.fn("matvec_reg.cu", name), block, 0), f"cuOccupancyMaxActiveBlocksPerMultiprocessor({name})")))
            self._reg_per_sm[(name, block)] = per_sm
        grid = max(1, min(self.device.sm_count * per_sm, _cdiv(rows, teams)))
        self._go("matvec_reg.cu", name, (grid,), (block,), args, stream)

    def _allow_smem(self, source: str, name: str, smem: int, static: int = 0) -> None:
        """Opt the kernel in to `smem` bytes of dynamic shared memory next to its `static` bytes
        (48 KiB in all need no opt-in)."""
        if smem + static <= 48 * 1024 or smem <= self._smem_limits.get((source, name), 0):
            return
        if smem + static > self.device.max_smem_optin:
            from ntx_common.errors import CudaError

            raise CudaError(f"attention needs {smem} bytes of shared memory for this context; the GPU allows "
                            f"{self.device.max_smem_optin}: use a smaller n_ctx")
        drv = driver()
        check(drv.cuFuncSetAttribute(self.fn(source, name),
                                     drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem),
              f"cuFuncSetAttribute({name}, max dynamic smem {smem})")
        self._smem_limits[(source, name)] = smem
