"""The "stack" decode: a one-token step's layers in one persistent launch (native/cuda/layer_q8.cu; layer_q8_ks.cu
builds it with Q6_K down rows as K slices for the models ks_fits names, layer_q8_ks5.cu that with the Q5_K dot for
those with Q5_K matrices: stack_source).

One block an SM runs every layer; a ring of shared-memory slots is kept filled with the block's
next weight rows by bulk copies, so the weights stream while the norms, the attention and the
waits between the ops run; the last 10 % of the gate/up and down rows go to the blocks that claim
them first. The blocks meet at counters in global memory, zeroed before each launch. It runs where
every layer matrix is Q8_0, Q4_K, Q5_K or Q6_K, in at most KINDS type mixes (llama.cpp's Q8_0 has one; its Q4_K_M and
Q5_K_M two: attn_v and ffn_down Q6_K in half the layers, Q4_K / Q5_K in the others), and the shapes fit (`stack_unfit`
says why not);
the backend's op-by-op kernels run everything else, and the step's head (final norm, output matmul,
argmax) after it.
"""

from __future__ import annotations

import numpy as np

from ntx_engine.backends.cuda_driver import DeviceArray, check, download, driver, upload
from ntx_engine.backends.cuda_nvrtc import define_value
from ntx_engine.config import ROPE_NEOX, ModelConfig
from ntx_engine.quants import GGMLType, tensor_nbytes

SOURCE = "layer_q8.cu"
KS_SOURCE = "layer_q8_ks.cu"  # the same kernel built with Q6_K down rows as K slices (NTX_LQ_KS=4): ks_fits
KS5_SOURCE = "layer_q8_ks5.cu"  # that build with the Q5_K dot (NTX_LQ_Q5), for models with Q5_K matrices
THREADS = 512  # LQ_THREADS: the consumer threads
BLOCK = THREADS + 32  # LQ_BLOCK: and the producer warp
SLOTS, SLOT = 4, 34832  # LQ_SLOTS, LQ_SLOT: the weight ring
KMAX = 16384  # LQ_KMAX: the longest activation row
ACT_BYTES = KMAX + 8 * (KMAX // 32)  # LQ_ACT: also the attention's scores
GMAX = 8  # LQ_GMAX: query heads a KV head
KVS = 32768  # LQ_KVS: shared memory for the attention chunk's first K and V rows
NORM_MAX = 16 * THREADS  # LQ_NV values a thread
NCTR = 10  # LQ_NCTR: counters a layer before the KV heads' (LQ_POOLCTR = 6..9: the phases' pools)
TRACE_MARKS = 14  # LQ_MARKS: the trace points a layer
MAX_CHUNKS = 32  # context chunks a KV head
MAX_LAYERS = 96  # LQ_MAX_LAYERS: layer descriptors in shared memory
CHUNK_MAX = 256  # LQ_CMAX: ring chunks of a layer a block (the producer's list)
CHUNK_BYTES = 8  # sizeof(LqChunk)
LAYER_BYTES = 8 * 12  # sizeof(LqLayer): 11 pointers and the layer's kind
KINDS = 2  # LQ_KINDS: the type mixes a launch takes (a chunk list each)
STATIC_SMEM = 1024  # at least the kernel's static shared memory (ptxas: 768 bytes)
KS_VALUES, KS_ROWS = 2048, 16  # LQ_KSV, LQ_KSR: a K-slice chunk of the down rows (NTX_LQ_KS)
Q6W_KS = 130  # layer_q8_ks.cu's NTX_LQ_Q6W: a Q6_K byte's weight in the blocks' q|k|v shares (layer_q8.cu's: 100)
GROUPS = 2  # LQ_GROUPS: consumer warp groups (chunk i: group i % GROUPS)
GROUP_WARPS = THREADS // 32 // GROUPS  # LQ_GW
# The weight types of the kernel's matrices (LQ_Q8_0, LQ_Q4_K, LQ_Q6_K, LQ_Q5_K: its `types` word, a nibble a matrix).
TYPE_CODES = {GGMLType.Q8_0: 0, GGMLType.Q4_K: 1, GGMLType.Q6_K: 2, GGMLType.Q5_K: 3}
KS_ONLY = (GGMLType.Q5_K,)  # the types only the K-quant build has a dot for (NTX_LQ_Q5: layer_q8_ks5.cu)
HEAD_DIMS = (64, 128)  # the kernels built (layer_q8_hd64, layer_q8_hd128)
LAYER_FIELDS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "attn_norm", "ffn_norm")  # + k, v caches


def stack_smem(head_dim: int, group: int) -> int:
    """Dynamic shared memory of the kernel for this head shape (lq_step's layout)."""
    npg = THREADS // (head_dim // 2)
    return (SLOTS * SLOT + ACT_BYTES + 4 * GMAX * head_dim + 4 * npg * group * head_dim
            + 2 * 2 * head_dim + KVS + 4 * 2 * GMAX + 8 * 32 + 32 + 8 * SLOTS + 2 * 4 * SLOTS * (THREADS // 32)
            + 4 * npg * group + LAYER_BYTES * MAX_LAYERS + CHUNK_BYTES * CHUNK_MAX * KINDS + 2 * 8 * SLOTS
            + 4 * 2 * (THREADS // 32))


def chunk_rows(row_bytes: int, pair: bool) -> int:
    """Rows a ring chunk of a matrix (lq_fit_rows): as many as fit a slot where that gives the warps of a group
    7 or 8 row pairs, else the largest power of two that fits."""
    per = 2 if pair else 1
    r = (SLOT - 16) // (row_bytes * per)
    if r * per >= 2 * GROUP_WARPS - 2:
        return min(r, 2 * GROUP_WARPS // per)
    p = 1
    while 2 * p <= r:
        p *= 2
    return p


def ks_shape(cfg: ModelConfig, down: GGMLType) -> bool:
    """Whether down rows of this type can go through the ring as K slices, KS_ROWS rows of KS_VALUES values a chunk
    (the kernel's test in lq_mat_init): n_ff a multiple of the slice, n_embd of the rows, a chunk within a slot."""
    return (cfg.n_ff % KS_VALUES == 0 and cfg.n_embd % KS_ROWS == 0
            and KS_ROWS * tensor_nbytes(down, KS_VALUES) <= SLOT - 16)


def ks_fits(cfg: ModelConfig, mixes: list[tuple]) -> bool:
    """Whether the model loads the K-quant build (layer_q8_ks.cu, or layer_q8_ks5.cu with the Q5_K dot: stack_source),
    whose Q6_K down rows go as K slices (Q8_0 rows gained nothing that way) and which alone has the Q5_K dot: a type
    mix with Q6_K down rows of a shape that can or with a Q5_K matrix, and K-quant matrices only in every mix (the build
    has no Q8_0 dot; a mix with Q4_K or Q5_K down rows takes them whole). mixes: the layers' type mixes (layer_mixes),
    each the 7 matrices' types (LAYER_FIELDS[:7]), down last."""
    return (any((t[6] == GGMLType.Q6_K and ks_shape(cfg, t[6])) or any(x in KS_ONLY for x in t) for t in mixes)
            and all(GGMLType.Q8_0 not in t for t in mixes))


def stack_source(cfg: ModelConfig, mixes: list[tuple]) -> str:
    """The build of the stack kernel the model loads: the K-quant build where ks_fits, with the Q5_K dot where a layer
    has a Q5_K matrix (in the one build that dot's branch cost Q4_K_M 2 %), else layer_q8.cu's."""
    if not ks_fits(cfg, mixes):
        return SOURCE
    return KS5_SOURCE if any(x in KS_ONLY for t in mixes for x in t) else KS_SOURCE


def layer_mixes(layers: list) -> tuple[list[tuple], list[int]]:
    """The layers' distinct type mixes (the 7 matrices' types, LAYER_FIELDS' order) in order of first use, and each
    layer's index among them (its kind: LqLayer::kind)."""
    mixes: list[tuple] = []
    kinds = []
    for lw in layers:
        t = tuple(getattr(getattr(lw, n, None), "ggml_type", None) for n in LAYER_FIELDS[:7])
        if t not in mixes:
            mixes.append(t)
        kinds.append(mixes.index(t))
    return mixes, kinds


def qkv_rows(cfg: ModelConfig, sm_count: int, types: tuple) -> int:
    """The q|k|v rows a block owns at most (lq_r0's shares of the rows' cost, a Q6_K byte weighted as either build
    does: NTX_LQ_Q6W), in rows of the cheapest. types: q's, k's and v's (the first 3 of LAYER_FIELDS)."""
    d, kvd = cfg.n_embd, cfg.n_head_kv * cfg.head_dim
    rbs = [tensor_nbytes(t, d) for t in types[:3]]
    rows = 0
    for w in (100, Q6W_KS):
        cost = [rb * (w if t == GGMLType.Q6_K else 100) for rb, t in zip(rbs, types)]
        share = -(-(d * cost[0] + kvd * (cost[1] + cost[2])) // sm_count)
        rows = max(rows, min(d + 2 * kvd, share // min(cost) + 1))
    return rows


def layer_chunks(cfg: ModelConfig, sm_count: int, types: tuple | None = None) -> int:
    """Ring chunks of one layer a block at most (the producer's list, lq_step). q|k|v: a block's rows (qkv_rows) in
    chunks of the fewest rows, + 1 at each matrix boundary; o, gate/up, down: a block's rows in chunks,
    + 1; down, where its rows can go as K slices (ks_shape, of any type: a tuning build, NTX_CUDA_DEFINES=-DNTX_LQ_KS=N,
    may name Q8_0 or Q4_K rows too): a block's row groups in pairs, a chunk a slice of each, if that is more. types:
    the 7 matrices' (LAYER_FIELDS), Q8_0 if None."""
    d, f = cfg.n_embd, cfg.n_ff
    types = types or (GGMLType.Q8_0,) * 7
    rbs = [tensor_nbytes(t, d) for t in types[:3]]
    total = -(-qkv_rows(cfg, sm_count, types) // min(chunk_rows(rb, False) for rb in rbs)) + 3
    for rows, k, t, pair in ((d, d, types[3], False), (f, d, types[4], True), (d, f, types[6], False)):
        total += -(-min(rows, -(-rows // sm_count)) // chunk_rows(tensor_nbytes(t, k), pair)) + 1
    if ks_shape(cfg, types[6]):  # down as K slices (NTX_LQ_KS): the slices of row groups in pairs
        whole = -(-min(d, -(-d // sm_count)) // chunk_rows(tensor_nbytes(types[6], f), False)) + 1
        groups = -(-(d // KS_ROWS) // sm_count)  # a block's row groups, at most
        total += max(0, (groups + 1) // 2 * 2 * (f // KS_VALUES) - whole)
    return total


def stack_chunks(cfg: ModelConfig, sm_count: int) -> int:
    """Context chunks a KV head: one block each (a block an SM), as many as the SMs give every KV head; fewer where
    NTX_CUDA_DEFINES names -DNTX_LQ_ACH=N (a tuning run's cap: fewer, longer chunks and fewer partials to combine; the
    kernel takes the count from its arguments, the macro only keys the build)."""
    chunks = max(1, min(MAX_CHUNKS, sm_count // cfg.n_head_kv))
    value = define_value("NTX_LQ_ACH")
    if value is None:
        return chunks
    if not value.isdigit() or int(value) < 1:
        from ntx_common.errors import CudaError

        raise CudaError(f"NTX_CUDA_DEFINES: -DNTX_LQ_ACH={value} must name a whole number of context chunks, at "
                        "least 1")
    return min(chunks, int(value))


def stack_unfit(cfg: ModelConfig, layers: list, n_ctx: int, cc: tuple[int, int], sm_count: int,
                smem_optin: int, allowed: tuple = tuple(TYPE_CODES), hint: str = "") -> str | None:
    """Why the stack decode cannot run this model (None: it can). allowed: the weight types it may take (the
    kernel's, or fewer: "stack8" takes Q8_0 models only); hint: what a type outside them adds to the reason."""
    d, f, hd = cfg.n_embd, cfg.n_ff, cfg.head_dim
    group = cfg.n_head // max(cfg.n_head_kv, 1)
    if cc < (9, 0):
        return f"needs sm_90 (bulk copies), the GPU is sm_{cc[0]}{cc[1]}"
    if cfg.n_expert or cfg.qkv_bias or cfg.qk_norm:
        return "mixture-of-experts, q/k/v biases and q/k norms are not in the kernel"
    if cfg.q_dim != d or hd not in HEAD_DIMS or cfg.n_head % cfg.n_head_kv or group > GMAX:
        return f"head shape {cfg.n_head}x{hd} / {cfg.n_head_kv} KV heads is not built"
    if d % 256 or f % 256 or d > NORM_MAX or f > KMAX:
        return f"n_embd {d} / n_ff {f} (multiples of 256, at most {NORM_MAX} / {KMAX})"
    for i, lw in enumerate(layers):
        mine = []
        for name in LAYER_FIELDS[:7]:
            w = getattr(lw, name, None)
            t = getattr(w, "ggml_type", None)
            if t not in allowed:
                return (f"{getattr(w, 'name', name)} is {getattr(t, 'name', type(w).__name__)}, not one of the "
                        f"{'kernel' if tuple(allowed) == tuple(TYPE_CODES) else 'step'}'s types "
                        f"({', '.join(x.name for x in allowed)}){hint}")
            k = f if name == "w_down" else d
            if tensor_nbytes(t, k) % 16:
                return (f"{getattr(w, 'name', name)}: a row of {k} {t.name} values is {tensor_nbytes(t, k)} bytes, not a "
                        f"multiple of 16 (the ring's bulk copies)")
            mine.append(t)
        if mine[4] != mine[5]:
            return f"ffn_gate is {mine[4].name} and ffn_up {mine[5].name} (a ring chunk holds both: one type)"
    mixes, kinds = layer_mixes(layers)
    if len(mixes) > KINDS:
        i = kinds.index(KINDS)
        return (f"layer {i}'s matrices are {'/'.join(x.name for x in mixes[KINDS])}, a type mix after "
                f"{' and '.join('/'.join(x.name for x in t) for t in mixes[:KINDS])} (the kernel takes at most "
                f"{KINDS} mixes)")
    if any(x in KS_ONLY for t in mixes for x in t) and not ks_fits(cfg, mixes):
        return (f"{', '.join(x.name for x in KS_ONLY)} matrices are in the K-quant build of the kernel, which has no "
                f"Q8_0 dot: the layers mix them with Q8_0")
    chunks = max(layer_chunks(cfg, sm_count, t) for t in mixes) if mixes else 0
    if len(layers) > MAX_LAYERS or chunks > CHUNK_MAX:
        return (f"{len(layers)} layers, {d} x {f} rows on {sm_count} SMs: {chunks} ring chunks a layer an SM "
                f"(at most {MAX_LAYERS} layers, {CHUNK_MAX} chunks)")
    smem = stack_smem(hd, group)
    if smem + STATIC_SMEM > smem_optin:
        return f"needs {smem} bytes of shared memory a block, the GPU allows {smem_optin}"
    if -(-n_ctx // stack_chunks(cfg, sm_count)) * group * 4 > ACT_BYTES:
        return f"n_ctx {n_ctx} is too long for one chunk's scores"
    return None


class StackDecode:
    """The buffers of one model's stack decode and its launch (CudaBackend.decode_stack)."""

    def __init__(self, backend, layers: list) -> None:
        b, cfg = backend, backend.cfg
        self.b, self.cfg = b, cfg
        self.n_layers = len(layers)
        self.chunks = stack_chunks(cfg, b.device.sm_count)
        self.group = cfg.n_head // cfg.n_head_kv
        self.kernel = f"layer_q8_hd{cfg.head_dim}"
        self.smem = stack_smem(cfg.head_dim, self.group)
        # the build with the K-slice down rows where they apply (the other build runs a Q8_0 model 3 % faster)
        self.mixes, self.kinds = layer_mixes(layers)
        self.source = stack_source(cfg, self.mixes)
        # each kind's types word (a kind the layers do not have: the first's, which the kernel also takes)
        words = [sum(TYPE_CODES[t] << (4 * i) for i, t in enumerate(m)) for m in self.mixes]
        self.types = (words + words[:1] * KINDS)[:KINDS]
        table = np.array([[getattr(lw, n).data.ptr if n.startswith("w") else getattr(lw, n).ptr for n in LAYER_FIELDS]
                          + [b.k_cache[i].ptr, b.v_cache[i].ptr, self.kinds[i]] for i, lw in enumerate(layers)],
                         np.uint64)
        self.table = upload(b.pool, table, b.stream)
        new = b._new
        d, kvd = cfg.n_embd, cfg.kv_dim
        self.xa, self.xb = new(1, d), new(1, d)
        self.qkv, self.hid = new(d + 2 * kvd), new(cfg.n_ff)
        self.hq, self.hqd = new(cfg.n_ff + cfg.n_embd, dtype=np.int8), new((cfg.n_ff + cfg.n_embd) // 32)  # + the attention's row
        self.part = new(cfg.n_head_kv * self.chunks * (2 * self.group + self.group * cfg.head_dim))
        self.ctr = new(self.n_layers * (NCTR + cfg.n_head_kv), dtype=np.uint32)
        k = b.k
        k._allow_smem(self.source, self.kernel, self.smem)
        fn = k.fn(self.source, self.kernel)
        per_sm = check(driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, BLOCK, self.smem),
                       f"cuOccupancyMaxActiveBlocksPerMultiprocessor({self.kernel})")
        if int(per_sm) < 1:
            from ntx_common.errors import CudaError

            raise CudaError(f"{self.kernel} does not fit an SM ({self.smem} bytes of shared memory, {BLOCK} threads)")
        self.blocks = b.device.sm_count
        # each block's ring chunk list of each kind ([0] its count, then CHUNK_MAX chunks of CHUNK_BYTES): the first
        # launch lists them (~20 us of one lane's work a kind), the later ones copy them; zero until then
        self.lists = upload(b.pool, np.zeros(self.blocks * KINDS * (CHUNK_MAX + 1), np.uint64), b.stream)
        # a benchmark's tool (start_trace): a (n_layers, TRACE_MARKS, blocks) uint64 device array that
        # each block's thread 0 fills with the GPU clock (ns) at the kernel's LQ_MARK points; None: off
        self.trace: DeviceArray | None = None

    def start_trace(self) -> None:
        """Have the next launches record every block's clock at the kernel's trace points (read_trace), into
        a zeroed buffer (an NTX_LQ_RTRACE build writes only some of it: scripts/bench_stack_ring.py)."""
        self.trace = upload(self.b.pool, np.zeros(self.n_layers * TRACE_MARKS * self.blocks, np.uint64), self.b.stream)

    def read_trace(self) -> np.ndarray:
        """The last launch's clock marks (ns; SM cycles in an NTX_LQ_CLK build), shaped (layers, TRACE_MARKS,
        blocks); start_trace first."""
        if self.trace is None:
            raise RuntimeError("the stack decode records no trace: call start_trace() before the launch")
        return download(self.trace, self.b.stream).reshape(self.n_layers, TRACE_MARKS, self.blocks)

    def run(self, x: DeviceArray) -> DeviceArray:
        """The residual after every layer for the one token x (1, n_embd) at the staged position."""
        b, c = self.b, self.cfg
        check(driver().cuMemsetD32Async(self.ctr.ptr, 0, self.ctr.size, b.stream.handle),
              f"cuMemsetD32Async({self.ctr.size} counters)")
        scale = float(np.float32(1.0 / np.sqrt(c.head_dim)))
        b.k._go(self.source, self.kernel, (self.blocks,), (BLOCK,),
                (self.table, self.n_layers, x, self.xa, self.xb, self.qkv, self.hid, self.part, self.hq,
                 self.hqd, self.ctr,
                 b.pos_buf, b.rope_ff, c.rope_dim, b.rope_scale, c.rope_freq_scale, int(c.rope_type == ROPE_NEOX),
                 c.n_embd, c.n_ff, c.n_head, c.n_head_kv, self.chunks, float(c.rms_eps), scale, *self.types,
                 self.trace, self.lists),
                b.stream, self.smem,
                # a cooperative grid: the blocks wait on each other at counters, so all must be resident at once (one
                # an SM); the driver schedules it only whole (it waits for SMs another kernel holds), and where the
                # GPU can never hold it (an MPS share of the SMs) the launch fails (decode_stack falls back)
                cooperative=True)
        return self.xb

