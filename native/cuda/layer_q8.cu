// The whole decode step of a model's layers in ONE persistent launch ("stack" decode): Q8_0, Q4_K and
// Q6_K matrices, in at most LQ_KINDS type mixes, a layer's named by its descriptor (LqLayer::kind, lq_mts).
//
// The one-kernel-per-op step (fused.cu, attn_grid.cu, matvec_fast.cu) pays, at every op, a
// launch, a ramp-up and a drain, and its latency-bound ops (the norms, the attention) leave HBM
// idle. Here one block an SM runs every layer: each block owns a fixed slice of every matrix's
// rows (gate/up and down: all but the last NTX_LQ_POOL % of them, a pool of chunks that the blocks
// which stream faster claim at a counter), and a ring of shared-memory slots (LQ_SLOTS x LQ_SLOT
// bytes) is kept filled with the block's next weight rows by bulk copies (cp.async.bulk on a "full"
// mbarrier a slot), in the order the block will multiply them, across matrices and layers. The
// copies are issued by a producer warp of their own, from a list of one layer's chunks made once,
// which refills a slot as soon as the consumers (16 warps in two groups taking alternate slots, the
// arithmetic) arrive on its "empty" mbarrier, and tells them which rows a slot holds (s.desc). A
// weight never depends on the token, so the ring streams during the norms, the attention and the
// waits between the ops: when one ends, the next matrix's first ~139 KB an SM are already on chip
// (NTX_LQ_HOLD: except while the grid meets before a phase, see lq_release).
//
// A layer: (1) every block forms the RMSNorm of the residual and its Q8_1 quantization in its own
// shared memory (the same values in every block); (2) q/k/v rows; (3) attention, one block a
// (KV head, context chunk): RoPE of the group's q and of the new k, the new K/V row into the cache,
// scores, softmax over the chunk and p.V; the last chunk of a head to finish combines the chunks
// (flash-decoding: out = sum_c e^(m_c - M) o_c / sum_c e^(m_c - M) l_c) and quantizes them (Q8_1, whole
// 32-value blocks: a head's); (4) every block copies the quantized attention output and multiplies its o
// rows, adding the residual; (5) the second norm;
// (6) gate/up rows, silu(g) * u; (7) each block quantizes a slice of that, every block copies the
// whole quantized row and multiplies its down rows, adding the residual (layer_q8_ks.cu's build: Q6_K down rows come
// through the ring as 2048-value K slices of 16 rows, their sums kept in registers from slice to slice; see LQ_KSV).
// Between the steps a block
// waits on a counter in global memory that the producing blocks increment (release) after their
// stores; nothing else synchronizes the grid.
// The counters are zeroed before each launch (cuda_layers.StackDecode).
//
// Rounding: the matvec units are fast_units.cuh's (FastQ8_0, FastQ4_K, FastQ6_K: the block's scales
// times the int dot, times the activation's fp16 scale), summed per row in a fixed order (lane, then
// warp parts); every matrix reads Q8_1 activations (32-value blocks, as ggml's CUDA mmvq does; the
// op-by-op step gives Q4_K and Q6_K ggml's CPU Q8_K, 256-value blocks); the norm and the activation
// quantization are ggml's (rmsnorm.cuh, act_quant.cuh); q and the new k are rounded
// to fp16 as in the other attention kernels, p is not (float softmax per chunk), so the step is
// held to the numpy backend and to the one-kernel-per-op step within tolerances, not bit for bit.
//
// Every block of the grid must be resident at once (one an SM: its shared memory allows no
// second); a block waits at most LQ_DEADLINE_NS at a counter before trapping (the launch then
// fails with an error instead of hanging). sm_90 only (bulk copies); the host checks.
#include "ntx_half.cuh"
#include "warp.cuh"
#include "rmsnorm.cuh"
#include "act_quant.cuh"
#include "attn_common.cuh"
#include "ops.cuh"

#define LQ_THREADS 512     // the consumers: every step's arithmetic
#define LQ_WARPS (LQ_THREADS / 32)
#define LQ_BLOCK (LQ_THREADS + 32)  // + the producer warp, which only issues the ring's bulk copies
// A barrier of the consumer threads alone (the producer warp never waits for them).
#define LQ_SYNC() asm volatile("bar.sync 1, %0;" ::"n"(LQ_THREADS) : "memory")
#define LQ_SLOTS 4         // slots of shared memory (the ring uses NTX_LQ_SLOTS of them)
#ifndef NTX_LQ_SLOTS
#define NTX_LQ_SLOTS 4
#endif
#define LQ_MAX_LAYERS 96   // layer descriptors kept in shared memory
#define LQ_GROUPS 2        // consumer warp groups: chunk i is read by group i % LQ_GROUPS
#define LQ_GW (LQ_WARPS / LQ_GROUPS)
// A group reuses only its own slots: with another group's chunk last in a slot, a group running ahead
// could find that slot's "full" phase parity already flipped by a copy two rounds back and read it early.
static_assert(NTX_LQ_SLOTS % LQ_GROUPS == 0 && NTX_LQ_SLOTS <= LQ_SLOTS, "the ring's slots per group");
#define LQ_SLOT 34832      // bytes a ring slot (16 of them padding: a unit is read as nine aligned words)
#define LQ_KMAX 16384      // the longest activation row (int8 values in shared memory)
#define LQ_ACT (LQ_KMAX + 8 * (LQ_KMAX / 32))  // Q8_1 values, scales and sums; the attention's scores alias it
#define LQ_ACT_OFF (LQ_SLOTS * LQ_SLOT)  // where the activations start in the dynamic shared memory (after the ring)
#define LQ_NV 16           // norm values a thread (rows of at most LQ_NV * LQ_THREADS)
#define LQ_GMAX 8          // query heads a KV head
#define LQ_DEADLINE_NS 2000000000ull
#define LQ_NCTR 10         // counters a layer before the KV heads' chunk counters
#define LQ_POOLCTR 6       // counter LQ_POOLCTR + ph of a layer: the chunks of phase ph's pool claimed
// NTX_LQ_POOL: percent of a phase's rows (its last, in whole chunks) that no block owns: the producers claim
// them chunk by chunk at a counter a phase once their own are issued, so the blocks that stream faster take
// more (HBM serves the SMs unevenly: a phase's last block ended gate/up 2.6 us after the median one, 0.5 with
// the pool). NTX_LQ_POOLPH: the phases with a pool (bit ph), gate/up and down (in q/k/v and o it cost more
// than it evened out).
#ifndef NTX_LQ_POOL
#define NTX_LQ_POOL 10
#endif
#ifndef NTX_LQ_POOLPH
#define NTX_LQ_POOLPH 12
#endif
#define LQ_BQ 34           // bytes of a Q8_0 block
#define LQ_MARKS 14        // trace points a layer
#define LQ_KVS 32768       // bytes of shared memory for the attention chunk's first K and V rows
// NTX_LQ_PROBE (a benchmark's probe, default 0): 1 leaves the rows' arithmetic out, 2 the activation
// quantization's, 3 the weight copies (the producer marks a slot full without filling it), 7 both 1 and 3, 4 the attention
// chunk's scores, softmax and p.V, 5 the chunks' combine, 6 the counters' release and acquire (garbage out)
#ifndef NTX_LQ_PROBE
#define NTX_LQ_PROBE 0
#endif
// NTX_LQ_ATRACE (a benchmark's probe, default 0): trace marks 4..13 at the attention's stages (wait for
// q/k/v, RoPE, K/V copies, scores, exponentials, p.V, partial and count, combine, wait for the output,
// its quantization) instead of the layer's later stages; NTX_LQ_CLK: the marks in SM clock cycles, not ns
#ifndef NTX_LQ_ATRACE
#define NTX_LQ_ATRACE 0
#endif
#ifndef NTX_LQ_CLK
#define NTX_LQ_CLK 0
#endif
// NTX_LQ_RELIST (a benchmark's probe, default 0): every launch lists the producer's chunks again (as before a.lists)
#ifndef NTX_LQ_RELIST
#define NTX_LQ_RELIST 0
#endif
// NTX_LQ_PTRACE (a benchmark's probe, default 0): layer 0's marks at the launch's start instead (0 entry, 1 set up,
// 2 the producer's list made, 3 its first copies issued, 4 the consumers past griddepcontrol.wait, 5 layer 0's norm,
// 6 its q/k/v rows); scripts/bench_stack_trace.py --start reads them
#ifndef NTX_LQ_PTRACE
#define NTX_LQ_PTRACE 0
#endif
#define LQ_PMARK(k) do { if (NTX_LQ_PTRACE && a.trace != nullptr && (threadIdx.x & 31) == 0) a.trace[(size_t)(k) * gridDim.x + blockIdx.x] = global_ns(); } while (0)
// Trace mark k of a layer (a.trace, cuda_layers.StackDecode.start_trace): the block's thread 0 writes the clock.
#define LQ_TMARK(layer, k)                                                                              \
    do {                                                                                                \
        if (!NTX_LQ_RTRACE && a.trace != nullptr && threadIdx.x == 0 && (!NTX_LQ_PTRACE || (layer) > 0)) \
            a.trace[((size_t)(layer) * LQ_MARKS + (k)) * gridDim.x + blockIdx.x] = NTX_LQ_CLK ? clock64() : global_ns(); \
    } while (0)
#define LQ_AMARK(k) do { if (NTX_LQ_ATRACE) LQ_TMARK(layer, k); } while (0)
// NTX_LQ_RTRACE (a benchmark's probe, default 0): instead of the marks, the ring's timing in layer
// LQ_RT_LAYER: for the block's chunk k of that layer, a.trace[(4 k + e) * blocks + block] holds e = 0 when the
// producer issued its copies, 1 when the group's first warp saw it full, 2 when the producer saw its slot
// read (empty) again, 3 its phase (scripts/bench_stack_ring.py reads them)
#ifndef NTX_LQ_RTRACE
#define NTX_LQ_RTRACE 0
#endif
#define LQ_RT_LAYER 5
#define LQ_RT_MAX 100
#define LQ_RMARK(k, e, v)                                                                                   \
    do {                                                                                                    \
        if (NTX_LQ_RTRACE && a.trace != nullptr && (unsigned)(k) < LQ_RT_MAX &&                             \
            4 * (k) + (e) < a.n_layers * LQ_MARKS) /* within start_trace's buffer */                         \
            a.trace[(size_t)(4 * (k) + (e)) * gridDim.x + blockIdx.x] = (v);                                \
    } while (0)
#ifndef NTX_LQ_EVICT_FIRST
#define NTX_LQ_EVICT_FIRST 1
#endif
// NTX_LQ_SUMS (a benchmark's probe, default 0): 1 keeps the activations' half sums where every matrix is Q8_0 (which
// reads none of them)
#ifndef NTX_LQ_SUMS
#define NTX_LQ_SUMS 0
#endif

struct LqLayer {  // cuda_layers.LAYER_FIELDS, in this order
    const uint8_t *wq, *wk, *wv, *wo, *wg, *wu, *wd;
    const float *attn_norm, *ffn_norm;
    uint16_t *kc, *vc;
    unsigned long long kind;  // the layer's type mix: lq_mts[kind] (a.types, a.types1)
};
// Type mixes a launch takes: llama.cpp's Q4_K_M gives attn_v and ffn_down Q6_K in half the layers and Q4_K in the
// others (its use_more_bits), so a real Q4_K_M file has two.
#define LQ_KINDS 2

struct LqArgs {
    const LqLayer* layers;
    int n_layers;
    const float* x0;  // the embedded token (the first layer's residual)
    float *xa, *xb;   // the residual after the attention / after the FFN (xb: the step's output)
    float *qkv, *hid, *part;  // q|k|v, silu(g) * u, the attention chunks' partials
    int8_t* hq;       // silu(g) * u quantized (Q8_1 values; scales in hqd), a slice by each block
    float* hqd;
    unsigned* ctr;    // n_layers * (LQ_NCTR + n_kv), zero at launch
    const int* pos;
    const float* rope_ff;
    int rope_dim;
    float rope_scale, freq_scale;
    int neox;
    int D, F, n_head, n_kv, chunks;
    float eps, scale;
    unsigned types, types1;  // nibble m: matrix m's weight type (LqLayer's order; LQ_Q8_0, LQ_Q4_K, LQ_Q6_K) in kind 0, 1
    unsigned long long* trace;
    unsigned long long* lists;  // [blocks][LQ_KINDS][LQ_CMAX + 1] the producers' chunk lists, made by the first launch (lq_step)
};

#define LQ_PARAMS                                                                                                 \
    const LqLayer *layers, int n_layers, const float *x0, float *xa, float *xb, float *qkv, float *hid,             \
        float *part, int8_t *hq, float *hqd, unsigned *ctr, const int *pos, const float *rope_ff, int rope_dim, float rope_scale,           \
        float freq_scale, int neox, int D, int F, int n_head, int n_kv, int chunks, float eps, float scale,     \
        unsigned types, unsigned types1, unsigned long long *trace, unsigned long long *lists

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900

__device__ __forceinline__ unsigned lq_smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void lq_expect(uint64_t* bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(lq_smem(bar)), "r"(bytes) : "memory");
}

// The weights pass through L2 once a step: marked evict-first, so they do not push out what the
// latency-bound steps read from L2 (the activations other blocks just wrote, this kernel's code).
__device__ __forceinline__ unsigned long long lq_policy() {
    unsigned long long pol = 0;
#if NTX_LQ_EVICT_FIRST
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#endif
    return pol;
}
__device__ __forceinline__ void lq_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar, unsigned long long pol) {
#if NTX_LQ_EVICT_FIRST
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                 ::"r"(lq_smem(dst)), "l"(src), "r"(bytes), "r"(lq_smem(bar)), "l"(pol)
                 : "memory");
#else
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(lq_smem(dst)), "l"(src), "r"(bytes), "r"(lq_smem(bar))
                 : "memory");
#endif
}

__device__ __forceinline__ bool lq_try(uint64_t* bar, unsigned parity) {
    unsigned ok;
    asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                 "selp.u32 %0, 1, 0, p;\n\t}"
                 : "=r"(ok)
                 : "r"(lq_smem(bar)), "r"(parity)
                 : "memory");
    return ok;
}

// Wait for phase `parity` of an mbarrier; the clock is read only once the first try failed.
__device__ __forceinline__ void lq_wait_bar(uint64_t* bar, unsigned parity) {
    if (lq_try(bar, parity)) return;
    const unsigned long long t0 = global_ns();
    while (!lq_try(bar, parity))
        if (global_ns() - t0 > LQ_DEADLINE_NS) __trap();
}

// NTX_LQ_HOLD (bit ph): the producer issues the first chunk of phase ph only once the consumers have
// passed the grid-wide wait before that phase (o rows: the attention's wait for q/k/v), so those
// waits are not queued behind a burst of bulk copies; the chunks then stream during the norm or the
// attention after the wait. The down rows (bit 3) are held until silu(g) * u's quantization has met, except
// their first NTX_LQ_PRE3 chunks: with the pool the blocks end gate/up together, and each SM's burst of
// copies then delayed the grid's meeting after it (its poll's answer queued behind the SM's incoming
// bytes): the wait after gate/up 3.8 -> 1.5 us. Two chunks ahead (one a consumer group) instead of one: Q4_K_M's
// layer 68.4 -> 67.5 us (Q6_K down rows: the first chunk of each group on chip), Q8_0's the same (79.8 / 80.0).
#ifndef NTX_LQ_HOLD
#define NTX_LQ_HOLD 15
#endif
#ifndef NTX_LQ_PRE3
#define NTX_LQ_PRE3 2
#endif
// NTX_LQ_PRE0 / NTX_LQ_PRE2: as NTX_LQ_PRE3, the first chunks of q|k|v (the next layer's) and of gate/up issued
// before the grid's wait before that phase. One q|k|v chunk: its phase starts on chip after the norm (Q8_0 79.15 ->
// 78.85 us a layer, 366.5 / 364.4 -> 368.2 / 368.9 tok/s); gate/up's cost more than they gain (362.8 at 1, 360.0 at 2).
#ifndef NTX_LQ_PRE0
#define NTX_LQ_PRE0 1
#endif
#ifndef NTX_LQ_PRE2
#define NTX_LQ_PRE2 0
#endif

// The grid's counters: release adds after a block's stores, acquire loads before its reads (NTX_LQ_PROBE 6:
// all relaxed, no fences: stale data possible, garbage out).
#if NTX_LQ_PROBE == 6
#define LQ_REL "relaxed"
#define LQ_ACQ "relaxed"
#define LQ_ACQ_REL "relaxed"
#else
#define LQ_REL "release"
#define LQ_ACQ "acquire"
#define LQ_ACQ_REL "acq_rel"
#endif

// The block's stores before it are visible to the blocks that wait for *c after it: the barrier orders
// the consumers' stores before thread 0's release (cumulative), which lq_wait's acquire pairs with.
__device__ __forceinline__ void lq_signal(unsigned* c) {
    LQ_SYNC();
    if (threadIdx.x == 0) asm volatile("red." LQ_REL ".gpu.global.add.u32 [%0], 1;" ::"l"(c) : "memory");
}

// Thread 0's release add returning the count before it, with acquire (the last of a head's chunks
// reads the others' partials after it, past the consumers' barrier).
__device__ __forceinline__ unsigned lq_arrive_count(unsigned* c) {
    unsigned v;
    asm volatile("atom." LQ_ACQ_REL ".gpu.global.add.u32 %0, [%1], 1;" : "=r"(v) : "l"(c) : "memory");
    return v;
}

__device__ __forceinline__ unsigned lq_ld_count(const unsigned* c) {
    unsigned v;
    asm volatile("ld." LQ_ACQ ".gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
    return v;
}

__device__ __forceinline__ void lq_wait(const unsigned* c, unsigned target) {
    if (threadIdx.x == 0 && lq_ld_count(c) < target) {
        const unsigned long long t0 = global_ns();
        while (lq_ld_count(c) < target) {
            if (global_ns() - t0 > LQ_DEADLINE_NS) __trap();  // a block that never came: fail, not hang
        }
    }
    LQ_SYNC();
}

// ntx_block_total over the consumer threads.
__device__ __forceinline__ double lq_block_total(double v, double* part) {
    return ntx_warps_total(v, part, LQ_WARPS, [] { LQ_SYNC(); });
}

// The K (and V) rows of a layer: n_kv heads of D / n_head values.
__device__ __forceinline__ int lq_kvd(const LqArgs& a) { return a.n_kv * (a.D / a.n_head); }

// Phases of a layer: 0 q|k|v rows, 1 o rows, 2 gate/up row pairs, 3 down rows.
__device__ __forceinline__ int lq_rows(const LqArgs& a, int ph) {
    const int kvd = lq_kvd(a);
    return ph == 0 ? a.D + 2 * kvd : ph == 2 ? a.F : a.D;
}
// The weight types a matrix may have (cuda_layers.TYPE_CODES), and what the ring and the consumers need of
// each matrix of a type mix (lq_mts[kind], filled once by lq_mat_init): its row bytes, 32-value units a row, type, rows a chunk and
// log2 of the warps a row (gate: its chunk holds as many up rows, up has gate's type).
#define LQ_Q8_0 0
#define LQ_Q4_K 1  // 144-byte blocks of 256 values: d, dmin, 12 bytes of 6-bit scales and mins, 128 of nibbles
#define LQ_Q6_K 2  // 210-byte blocks of 256 values: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d
#define LQ_Q5_K 3  // 176-byte blocks of 256 values: d, dmin, Q4_K's 12 bytes of scales and minimums, 32 of high bits, 128 of nibbles
// NTX_LQ_Q5 1: a build with the Q5_K dot (layer_q8_ks5.cu's; the others trap on a Q5_K matrix: cuda_layers.stack_source)
#ifndef NTX_LQ_Q5
#define NTX_LQ_Q5 0
#endif
struct LqMat {
    int rb, units, type, rpc, pair, lw;  // pair: lq_phase's items are row pairs, lw: log2 of the warps an item
};
#ifndef NTX_LQ_KS
#define NTX_LQ_KS 0  // layer_q8_ks.cu: 4
#endif
// NTX_LQ_Q8 0: a build without the Q8_0 dot (layer_q8_ks.cu, for models of K-quant matrices only: cuda_layers.ks_fits);
// its phase loops are ~11 KB shorter (code the layer runs once is fetched cold: docs/cuda.md, sessions 23, 25)
#ifndef NTX_LQ_Q8
#define NTX_LQ_Q8 1
#endif
// [kind][m]: [7] the down rows' K slices (NTX_LQ_KS; rpc 0: off). The functions below take a kind's row (mt).
__shared__ LqMat lq_mts[LQ_KINDS][NTX_LQ_KS ? 8 : 7];

// NTX_LQ_KS (bit t: weight type t; 4, Q6_K, in layer_q8_ks.cu's build, 0 in this file's): the down rows go through the ring as K slices (LQ_KSV values of
// LQ_KSR rows a chunk: 16 Q6_K rows' 1680 bytes) instead of whole rows. A consumer group takes every slice of its 16
// rows in turn (the producer interleaves two row groups' slices, one a group), each warp two rows, and keeps the
// rows' lane sums in registers from slice to slice: the warp sums, the parts' combine through shared memory and the
// residual come once a row group, not once a chunk (a whole-row down chunk: 1.71 us of a group's time of which its
// dots 0.77, session 23). No pool: the blocks own even shares of the row groups. A chunk's 16 row copies go out from
// 16 lanes of the producer warp (from one lane, the down rows took 20.4 us against 17.7 whole). Q4_K_M (Q6_K down
// rows): 474.8 / 475.8 against 452.5 / 452.7 tok/s, the down rows 17.3 -> 14.0 us (session 24); Q8_0 (bit 0) the
// same as whole rows (388.3 / 388.7 against 389.2 / 388.9): not built.
#define LQ_KSV 2048  // values a K slice (8 K-quant blocks, 64 Q8_0 blocks: 16-byte multiples)
#define LQ_KSR 16    // rows a K-slice chunk (two a warp)
#define LQ_KSMAT 7   // the chunk's "matrix" (LqChunk.mat): rows row.. of down, slice n1

__device__ __forceinline__ int lq_ph_mat(int ph) { return ph == 0 ? 0 : ph == 1 ? 3 : ph == 2 ? 4 : 6; }
// Rows a chunk (a ring slot) of rows of rb bytes (per 2: gate rows, each with its up row): as many as fit a slot
// where that gives the 8 warps of a group 7 or 8 row pairs (lq_phase), else the largest power of two that fits
// (a row pair then split evenly among 2, 4 or 8 warps).
__device__ int lq_fit_rows(int rb, int per) {
    const int r = (LQ_SLOT - 16) / (rb * per);
    if (r * per >= 2 * LQ_GW - 2) return min(r, 2 * LQ_GW / per);
    int p = 1;
    while (2 * p <= r) p *= 2;
    return p;
}
// lq_mts[kind] from its types word (thread 0, before the block's first barrier).
__device__ void lq_mat_init(const LqArgs& a, int kind) {
    LqMat* mt = lq_mts[kind];
    const unsigned types = kind ? a.types1 : a.types;
    for (int m = 0; m < 7; ++m) {
        const int k = m == 6 ? a.F : a.D, type = (int)(types >> (4 * m)) & 15, per = m == 4 ? 2 : 1;
        if (!NTX_LQ_Q8 && type == LQ_Q8_0) __trap();  // a Q8_0 matrix in the K-quant build: fail, not garbage
        if (!NTX_LQ_Q5 && type == LQ_Q5_K) __trap();  // a Q5_K matrix in the other build
        const int rb = type == LQ_Q4_K ? k / 256 * 144 : type == LQ_Q5_K ? k / 256 * 176 : type == LQ_Q6_K ? k / 256 * 210
                                                                                                       : k / 32 * LQ_BQ;
        const int rpc = lq_fit_rows(rb, per);
        // items: gate/up row pairs, pairs of rows where they outnumber the warps of a group, else single rows
        const int pair = per == 2 || rpc > LQ_GW, items = per == 2 ? rpc : pair ? (rpc + 1) / 2 : rpc;
        int lw = 0;
        while ((2 << lw) * items <= LQ_GW) ++lw;
        mt[m] = {rb, k / 32, type, rpc, pair, lw};
    }
#if NTX_LQ_KS
    const int t6 = mt[6].type, sb = a.F >= LQ_KSV ? mt[6].rb / (a.F / LQ_KSV) : 0;
    const bool ks = ((NTX_LQ_KS >> t6) & 1) && sb > 0 && a.F % LQ_KSV == 0 && a.D % LQ_KSR == 0 && LQ_KSR * sb <= LQ_SLOT - 16;
    mt[LQ_KSMAT] = {sb, LQ_KSV / 32, t6, ks ? LQ_KSR : 0, 1, 0};
#endif
}
__device__ __forceinline__ bool lq_ks(const LqMat* mt) { return NTX_LQ_KS && mt[LQ_KSMAT].rpc != 0; }
// Rows a chunk of phase ph (of q|k|v: of q's).
__device__ __forceinline__ int lq_rpc(const LqMat* mt, int ph) { return mt[lq_ph_mat(ph)].rpc; }
// Chunks of a phase in its pool (its last rows), and the rows before them, which the blocks own in even shares.
__device__ __forceinline__ int lq_pool(const LqArgs& a, const LqMat* mt, int ph) {
    // (a q|k|v pool only where q, k and v have one type: its chunks may cross a matrix boundary)
    if (ph == 0 && (mt[1].type != mt[0].type || mt[2].type != mt[0].type)) return 0;
#if NTX_LQ_KS
    if (ph == 3 && lq_ks(mt)) return 0;
#endif
    return (NTX_LQ_POOLPH >> ph) & 1 ? lq_rows(a, ph) * NTX_LQ_POOL / 100 / lq_rpc(mt, ph) : 0;
}
__device__ __forceinline__ int lq_owned(const LqArgs& a, const LqMat* mt, int ph) {
    return lq_rows(a, ph) - lq_pool(a, mt, ph) * lq_rpc(mt, ph);
}
// Where block b's rows of phase ph start. Where q, k and v rows differ in size (Q4_K_M: v is Q6_K) the blocks take
// even shares of the q|k|v bytes, not of the rows: by rows, the blocks owning v rows streamed 46 % more bytes and
// ended q/k/v ~2.4 us after the others, in every layer, with the attention waiting for them. NTX_LQ_Q6W: a Q6_K
// byte counts as that many hundredths of another type's (its arithmetic costs more): 100 here, 130 in layer_q8_ks.cu.
#ifndef NTX_LQ_Q6W
#define NTX_LQ_Q6W 100
#endif
__device__ __forceinline__ long long lq_row_cost(const LqMat& m) { return (long long)m.rb * (m.type == LQ_Q6_K ? NTX_LQ_Q6W : 100); }
__device__ __forceinline__ int lq_r0(const LqArgs& a, const LqMat* mt, int ph, int b) {
    if (ph == 0 && (mt[1].rb != mt[0].rb || mt[2].rb != mt[0].rb)) {
        const long long kvd = lq_kvd(a), cq = lq_row_cost(mt[0]), ck = lq_row_cost(mt[1]), cv = lq_row_cost(mt[2]);
        const long long bq = a.D * cq, bk = kvd * ck, at = (long long)b * (bq + bk + kvd * cv) / gridDim.x;  // the share's start
        return at < bq ? (int)(at / cq) : at < bq + bk ? a.D + (int)((at - bq) / ck) : a.D + (int)kvd + (int)((at - bq - bk) / cv);
    }
#if NTX_LQ_KS
    if (ph == 3 && lq_ks(mt)) return LQ_KSR * (int)((unsigned)b * (unsigned)(a.D / LQ_KSR) / gridDim.x);  // whole row groups
#endif
    return (int)((unsigned)b * (unsigned)lq_owned(a, mt, ph) / gridDim.x);
}
// Where the matrix holding row `row` of phase ph ends (q, k and v are three matrices).
__device__ __forceinline__ int lq_mat_end(const LqArgs& a, int ph, int row) {
    if (ph != 0) return lq_rows(a, ph);
    const int kvd = lq_kvd(a);
    return row < a.D ? a.D : row < a.D + kvd ? a.D + kvd : a.D + 2 * kvd;
}
// NTX_LQ_XMAT (default 1): a q|k|v chunk may cross from q to k or k to v (two copies into one slot); with 0
// a chunk ends at its matrix's end, so the two blocks whose rows straddle a boundary take a chunk more.
#ifndef NTX_LQ_XMAT
#define NTX_LQ_XMAT 1
#endif
// The matrix (LqLayer's order) holding row `row` of phase ph.
__device__ __forceinline__ int lq_row_mat(const LqArgs& a, int ph, int row) {
    const int kvd = lq_kvd(a);
    return ph == 0 ? (row < a.D ? 0 : row < a.D + kvd ? 1 : 2) : lq_ph_mat(ph);
}
// Rows of the chunk that starts at row `row` of a block's phase rows ending at r1 (it crosses into the next
// matrix only where that has the same type).
__device__ __forceinline__ int lq_chunk_rows(const LqArgs& a, const LqMat* mt, int ph, int row, int r1) {
    const int m = lq_row_mat(a, ph, row), n = min(mt[m].rpc, r1 - row);
    const bool cross = NTX_LQ_XMAT && m < 2 && mt[m + 1].type == mt[m].type;
    return cross ? n : min(n, lq_mat_end(a, ph, row) - row);
}
// A ring chunk of a layer: rows row .. row + n0 + n1 - 1 of its phase (q|k|v: of the three matrices' rows in
// turn), n0 of them in weight matrix mat (LqLayer's order: q, k, v, o, gate, up, down), n1 in matrix mat + 1 (a
// q|k|v chunk that crosses into the next matrix); a gate chunk also holds the same rows of up, after its gate
// rows. n0 = n1 = 0: the end of a phase for the group that reads it.
struct LqChunk {
    unsigned row;
    unsigned short n0;
    unsigned char mat, n1;
};
#define LQ_CMAX 256  // chunks a layer a block at most (cuda_layers.CHUNK_MAX)

// The chunk of n rows of phase ph from row `row`.
__device__ __forceinline__ LqChunk lq_chunk(const LqArgs& a, int ph, int row, int n) {
    const int n0 = min(n, lq_mat_end(a, ph, row) - row), mat = lq_row_mat(a, ph, row);
    return {(unsigned)row, (unsigned short)n0, (unsigned char)mat, (unsigned char)(n - n0)};
}

// The block's chunks in consumption order (layer, phase, rows), one slot each, in layers of type mix mt: the producer
// lists one layer's (every layer of a kind has the same) once, before it starts.
struct LqFill {
    const LqMat* mt;
    int layer, ph, row, r1;

    __device__ void skip_empty(const LqArgs& a) {
        while (layer < a.n_layers && row >= r1) {
            if (++ph == 4) { ph = 0; ++layer; }
            row = lq_r0(a, mt, ph, blockIdx.x);
            r1 = lq_r0(a, mt, ph, blockIdx.x + 1);
        }
    }
    __device__ void start(const LqArgs& a, const LqMat* kind_mt) {
        mt = kind_mt;
        layer = 0; ph = 0;
        row = lq_r0(a, mt, 0, blockIdx.x);
        r1 = lq_r0(a, mt, 0, blockIdx.x + 1);
        skip_empty(a);
    }
    // The chunk at the fill point (rows row.. of phase ph), and the fill point past it.
    __device__ LqChunk next(const LqArgs& a) {
        const LqChunk e = lq_chunk(a, ph, row, lq_chunk_rows(a, mt, ph, row, r1));
        row += e.n0 + e.n1;
        skip_empty(a);
        return e;
    }
};

// The block's chunks of one layer of type mix mt in consumption order (the producer's list, LqFill; the first launch
// only).
// NTX_LQ_KS: the down rows' K slices, the block's row groups two at a time with their slices interleaved (ring chunk
// i goes to consumer group i % 2, so each group takes every slice of one row group); an odd last group's slices
// alternate with empty chunks. (A function of its own, out of the code the layers run; the build without K slices
// lists the chunks in line, as the whole-row list alone compiles to other code when called.)
#if NTX_LQ_KS
__device__ __noinline__ int lq_list(const LqArgs& a, const LqMat* mt, LqChunk* chunks) {
    LqFill f;
    f.start(a, mt);
    int nc = 0;
    while (f.layer == 0 && nc < LQ_CMAX) {
        if (lq_ks(mt) && f.ph == 3) {
            const int nk = a.F / LQ_KSV;
            if (nc + 2 * nk * ((f.r1 - f.row + 2 * LQ_KSR - 1) / (2 * LQ_KSR)) > LQ_CMAX) __trap();
            for (int g = f.row; g < f.r1; g += 2 * LQ_KSR)
                for (int k = 0; k < nk; ++k)
                    for (int h = 0; h < 2; ++h)
                        chunks[nc++] = {(unsigned)(g + h * LQ_KSR), (unsigned short)(g + h * LQ_KSR < f.r1 ? LQ_KSR : 0),
                                        (unsigned char)LQ_KSMAT, (unsigned char)k};
            f.row = f.r1;
            f.skip_empty(a);
            break;
        }
        chunks[nc++] = f.next(a);
    }
    if (f.layer == 0) __trap();  // more chunks than the list holds (cuda_layers.stack_unfit checks)
    return nc;
}
#endif

__device__ __forceinline__ int lq_lds_vol(unsigned addr) {
    int v;
    asm volatile("ld.volatile.shared.s32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long lq_lds64(unsigned addr) {
    unsigned long long v;
    asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(addr));
    return v;
}

// The second word of an LqChunk (as the list holds it), and the chunk's phase from it (q|k|v 0, o 1, gate/up
// 2, down 3).
__device__ __forceinline__ unsigned lq_chunk_w1(LqChunk e) { return (unsigned)e.n0 | (unsigned)e.mat << 16 | (unsigned)e.n1 << 24; }
__device__ __forceinline__ int lq_chunk_ph(unsigned w1) {
    const int mat = (int)((w1 >> 16) & 0xffu);
    return mat < 3 ? 0 : (NTX_LQ_KS ? mat >= 6 : mat == 6) ? 3 : mat - 2;
}

// Issue the chunk whose LqChunk words are row, w1 (row: of the phase) for the layer whose LqLayer sits at shared address lyr
// into slot: no divisions, shared-memory loads only. mt: the layer's type mix; pol: the copies' L2 policy; pl: the
// producer warp's lane (a K-slice chunk's row r from lane r, any other chunk from lane 0).
__device__ __forceinline__ void lq_issue(unsigned row, unsigned w1, unsigned lyr, const LqMat* mt, int D, int kvd,
                                         uint8_t* slot, uint64_t* bar, unsigned long long pol, int pl) {
    const int n0 = (int)(w1 & 0xffffu), mat = (int)((w1 >> 16) & 0xffu), n1 = (int)(w1 >> 24);
    if (NTX_LQ_KS && mat == LQ_KSMAT) {  // slice n1 of down rows row .. row + n0 - 1: a copy a row, from lane r
        const int rb = mt[6].rb, sb = mt[LQ_KSMAT].rb;
        if (NTX_LQ_PROBE == 3 || NTX_LQ_PROBE == 7) {
            if (pl == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(lq_smem(bar)) : "memory");
            return;
        }
        if (pl == 0) lq_expect(bar, (unsigned)(n0 * sb));
        const uint8_t* w = reinterpret_cast<const uint8_t*>(lq_lds64(lyr + 8u * 6u)) + (size_t)row * rb + n1 * sb;
        if (pl < n0) lq_copy(slot + pl * sb, w + (size_t)pl * rb, (unsigned)sb, bar, pol);
        return;
    }
    if (pl != 0) return;
    row -= mat == 1 ? D : mat == 2 ? D + kvd : 0;  // the row in its matrix
    const int rb = mt[mat].rb;  // (a chunk crossing into the next matrix: the same type)
    const unsigned bytes = (unsigned)((n0 + n1) * rb);
    if (NTX_LQ_PROBE == 3 || NTX_LQ_PROBE == 7) {
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(lq_smem(bar)) : "memory");
        return;
    }
    lq_expect(bar, mat == 4 ? 2 * bytes : bytes);
    const uint8_t* w = reinterpret_cast<const uint8_t*>(lq_lds64(lyr + 8u * (unsigned)mat));
    lq_copy(slot, w + (size_t)row * rb, (unsigned)(n0 * rb), bar, pol);
    if (n1) lq_copy(slot + n0 * rb, reinterpret_cast<const uint8_t*>(lq_lds64(lyr + 8u * (unsigned)(mat + 1))),
                    (unsigned)(n1 * rb), bar, pol);
    if (mat == 4) lq_copy(slot + bytes, reinterpret_cast<const uint8_t*>(lq_lds64(lyr + 40u)) + (size_t)row * rb, bytes, bar, pol);
}

// NTX_LQ_L2GU (a tuning build, default 0): once its o rows' chunks are issued (the attention's wait for q/k/v has
// passed; HBM then idles through the attention, its combine and the o rows), the producer asks L2 for the block's first
// NTX_LQ_L2GU gate/up chunks of the layer (cp.async.bulk.prefetch.L2), so the ring's copies of them later read L2: on
// the H100 the gate/up rows are bound by HBM (~21 us a layer; ~14 without the copies on the H200, whose SM clock is the
// same: session 22). The prefetches are evict-first, as the ring's copies (lq_policy): with the default policy
// (session 33, H100) gate/up took 1.1 us less, but the q/k/v rows and the attention 1.1 and 1.8 us more (the code and
// the activations they read from L2 pushed out, or their loads queued behind the prefetches).
#ifndef NTX_LQ_L2GU
#define NTX_LQ_L2GU 0
#endif
#if NTX_LQ_L2GU
static_assert(NTX_LQ_EVICT_FIRST, "NTX_LQ_L2GU's prefetches take the ring's evict-first policy");
// The chunks tab[c..nc) of the layer whose LqLayer sits at shared address lyr: the first NTX_LQ_L2GU of gate/up asked of
// L2, the gate rows from lane 0 and the up rows from lane 1 (both from lane 0 in the whole-row build, whose producer is
// lane 0 alone: pl 0). pl: the producer warp's lane.
__device__ __noinline__ void lq_l2_ahead(unsigned tab, int c, int nc, unsigned lyr, const LqMat* mt, int pl) {
    const unsigned long long pol = lq_policy();
    const int rb = mt[4].rb;  // (gate and up: one type, lq_issue's copies)
    for (int n = 0; c < nc && n < NTX_LQ_L2GU; ++c) {
        unsigned row, w1;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(row), "=r"(w1) : "r"(tab + 8u * (unsigned)c) : "memory");
        if (lq_chunk_ph(w1) != 2) break;  // (c: the layer's first gate/up chunk; the down chunks after them)
        ++n;
        const unsigned bytes = (w1 & 0xffffu) * (unsigned)rb;
        for (int e = 0; e < 2; ++e)
            if (pl == (NTX_LQ_KS ? e : 0))
                asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;"
                             ::"l"(reinterpret_cast<const uint8_t*>(lq_lds64(lyr + 8u * (4u + (unsigned)e))) + (size_t)row * rb),
                               "r"(bytes), "l"(pol) : "memory");
    }
}
#endif

// The dynamic shared memory: the ring's slots first, then the activation row (lq_step's layout).
extern __shared__ __align__(128) uint8_t lq_dyn[];

struct LqShared {
    LqLayer* layers;  // the layer descriptors
    LqChunk* chunks;  // [LQ_KINDS][LQ_CMAX] the block's chunks of a layer of each kind (the producer's lists)
    uint8_t* ring;
    uint64_t* full;   // a slot's bulk copies landed
    uint64_t* empty;  // a slot was read
    int8_t* aq;  // the activation row's Q8_1 values
    float* ad;   // and its fp16-rounded scales
    int* as;     // and the sums of its 32-value blocks' int8 values, a 16-value half's each (null: every matrix Q8_0)
    float* sc;   // the attention's scores (aliases aq / ad)
    float* qa;   // the group's rotated q, fp16-rounded
    uint16_t *knew, *vnew;
    uint16_t* kv;  // [LQ_KVS / 2] the chunk's first K rows, then as many V rows
    float* red_o;  // the p.V sums of the position groups
    float* red_l;  // [NPG][G] the attention's exp sums of the position groups
    double* part;  // the norm's warp totals
    float* stat;   // [2][LQ_GMAX] the attention's running maxima (order-preserving ints)
    uint2* desc;   // [LQ_SLOTS] the LqChunk a slot holds (the producer writes it before the slot's copies)
    float* cpart;  // [LQ_SLOTS][LQ_WARPS] a chunk's row parts (row r's part p at r * wpr + p; gate/up: gate rows first)
    int* ccnt;     // [LQ_SLOTS][LQ_WARPS] the parts of a chunk's item written (the last writer adds them)
    float* resv;  // [LQ_WARPS][2] a warp's residual values of its rows (lq_phase: copied in while the rows are multiplied)
    int* flag;  // [0] the attention's last-chunk flag, [1] the phases released to the producer, [2] [3] the ring
                // trace's first chunk and layer, [4 + g] where consumer group g read its end of a phase
};

// The consumers have passed the grid's wait before phase q (4 layer + phase): the producer may issue it.
__device__ __forceinline__ void lq_release(const LqShared& s, int q) {
    if (NTX_LQ_HOLD && threadIdx.x == 0) *reinterpret_cast<volatile int*>(s.flag + 1) = q;
}

// Where the int8 values 4c..4c+3 of an activation row sit (bytes): each group of 8 units (32-value
// blocks) keeps its units' first 16 bytes, then their last 16, so the 8 lanes that read 8 units'
// halves at once (lq_row_dot) read 128 contiguous bytes: no bank conflicts.
__device__ __forceinline__ int lq_aq_off(int c) { return (c >> 6) * 256 + (c & 4) * 32 + ((c >> 3) & 7) * 16 + (c & 3) * 4; }

// Four values of a 32-value Q8_1 block (quanti_q8_1_value's values; the block's int8 sum into as unless
// as is null): every lane of the warp calls it, the 8 lanes 8m..8m+7 holding one block (float4
// c of the row: values 4c..4c+3, block c / 8); only active lanes store. Warp-uniform callers only.
__device__ __forceinline__ void lq_quant4(float4 v, bool active, int c, int8_t* aq, float* ad, int* as) {
    if (NTX_LQ_PROBE == 2) {  // the probe without the quantization's arithmetic (garbage out)
        if (active) *reinterpret_cast<char4*>(aq + lq_aq_off(c)) = make_char4(v.x > 0.f, v.y > 0.f, v.z > 0.f, v.w > 0.f);
        if (active && c % 8 == 0) ad[c / 8] = 1.f;
        if (active && c % 8 == 0 && as != nullptr) as[c / 8] = 0;
        return;
    }
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float d, inv;
    ntx_q8_scale(m, &d, &inv);
    const int q0 = (int)ntx_q8_q(v.x, inv), q1 = (int)ntx_q8_q(v.y, inv), q2 = (int)ntx_q8_q(v.z, inv),
              q3 = (int)ntx_q8_q(v.w, inv);
    if (active) {
        *reinterpret_cast<char4*>(aq + lq_aq_off(c)) = make_char4((signed char)q0, (signed char)q1, (signed char)q2, (signed char)q3);
        if (c % 8 == 0) ad[c / 8] = ntx_round_f16(d);
    }
    if (as != nullptr) {  // lanes 8m..8m+3 hold the block's first 16 values, 8m+4..8m+7 its last
        int t = q0 + q1 + q2 + q3;
        t += __shfl_xor_sync(0xffffffffu, t, 1);
        t += __shfl_xor_sync(0xffffffffu, t, 2);
        const int other = __shfl_xor_sync(0xffffffffu, t, 4);
        if (active && c % 8 == 0) as[c / 8] = (t & 0xffff) | (other << 16);
    }
}

__device__ __forceinline__ float4 lq_f4(const float* x, int c, bool active) {
    return active ? __ldcg(reinterpret_cast<const float4*>(x) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
}

// A Q8_1 row another block quantized (xq in lq_aq_off's layout, xd its scales) copied into aq / ad, its
// blocks' sums into as (16-byte piece i holds half of block 8 (i / 16) + i % 8: i and i ^ 8 are its halves).
// Every thread's loads (at most two 16-byte pieces and a scale: k <= LQ_KMAX) are issued before any store, so the copy
// costs one L2 round trip, not three (session 21: silu(g) * u's copy 3.74 -> 2.13 us).
__device__ __forceinline__ void lq_act_piece(int i, bool on, int4 v, const LqShared& s) {
    if (on) reinterpret_cast<int4*>(s.aq)[i] = v;
    if (s.as == nullptr) return;  // (warp-uniform: every matrix Q8_0)
    const int t = __dp4a(v.x, 0x01010101, __dp4a(v.y, 0x01010101, __dp4a(v.z, 0x01010101, __dp4a(v.w, 0x01010101, 0))));
    const int other = __shfl_xor_sync(0xffffffffu, t, 8);
    if (on && !(i & 8)) s.as[(i >> 4) * 8 + (i & 7)] = (t & 0xffff) | (other << 16);
}
__device__ __forceinline__ void lq_load_act(const int8_t* xq, const float* xd, int k, const LqShared& s) {
    const int n = k / 16, lane = threadIdx.x & 31;
    const int i0 = threadIdx.x, i1 = threadIdx.x + LQ_THREADS;
    const int4 z = make_int4(0, 0, 0, 0);
    const int4 v0 = i0 < n ? __ldcg(reinterpret_cast<const int4*>(xq) + i0) : z;
    const int4 v1 = i1 < n ? __ldcg(reinterpret_cast<const int4*>(xq) + i1) : z;
    const float d = (int)threadIdx.x < k / 32 ? __ldcg(xd + threadIdx.x) : 0.f;
    if (i0 - lane < n) lq_act_piece(i0, i0 < n, v0, s);
    if (i1 - lane < n) lq_act_piece(i1, i1 < n, v1, s);
    if ((int)threadIdx.x < k / 32) s.ad[threadIdx.x] = d;
    LQ_SYNC();
}

// x (k values) quantized once over the grid: block b quantizes its share of the 32-value blocks
// into xq / xd (global), the blocks meet at *done, and each copies the whole row into aq / ad. For a
// long row (the down projection's 14336 values) that is cheaper than every block quantizing it all.
__device__ __noinline__ void lq_quant_share(const float* x, int k, int8_t* xq, float* xd, unsigned* done,
                                            const LqShared& s, int q) {
    const int nsb = k / 32;
    const int c0 = 8 * (int)((unsigned)blockIdx.x * (unsigned)nsb / gridDim.x);
    const int c1 = 8 * (int)((unsigned)(blockIdx.x + 1) * (unsigned)nsb / gridDim.x);
    for (int c = c0 + (int)threadIdx.x; c - (int)(threadIdx.x & 31) < c1; c += LQ_THREADS)
        lq_quant4(lq_f4(x, c, c < c1), c < c1, c, xq, xd, nullptr);
    lq_signal(done);
    lq_wait(done, gridDim.x);
    lq_release(s, q);  // the grid has met: the producer may fetch the next phase
    lq_load_act(xq, xd, k, s);
}

// rmsnorm(x) * w (rmsnorm.cuh's rounding; the squares summed in another order) quantized into aq /
// ad: thread t the float4s t + LQ_THREADS j of x and w, all loaded first.
__device__ __noinline__ void lq_norm_row(const float* x, const float* __restrict__ w, int k, float eps, const LqShared& s) {
    float4 v[LQ_NV / 4], wv[LQ_NV / 4];
    double ss = 0.0;
#pragma unroll
    for (int j = 0; j < LQ_NV / 4; ++j) {
        const int c = threadIdx.x + LQ_THREADS * j;
        v[j] = lq_f4(x, c, c < k / 4);
        wv[j] = c < k / 4 ? __ldg(reinterpret_cast<const float4*>(w) + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < LQ_NV / 4; ++j) {
        ss += (double)v[j].x * (double)v[j].x;
        ss += (double)v[j].y * (double)v[j].y;
        ss += (double)v[j].z * (double)v[j].z;
        ss += (double)v[j].w * (double)v[j].w;
    }
    const float scale = ntx_norm_scale(lq_block_total(ss, s.part), k, eps);
#pragma unroll
    for (int j = 0; j < LQ_NV / 4; ++j) {
        const int c = threadIdx.x + LQ_THREADS * j;
        if (c - (int)(threadIdx.x & 31) < k / 4) {
            const float4 y = make_float4(__fmul_rn(__fmul_rn(v[j].x, scale), wv[j].x), __fmul_rn(__fmul_rn(v[j].y, scale), wv[j].y),
                                         __fmul_rn(__fmul_rn(v[j].z, scale), wv[j].z), __fmul_rn(__fmul_rn(v[j].w, scale), wv[j].w));
            lq_quant4(y, c < k / 4, c, s.aq, s.ad, s.as);
        }
    }
    LQ_SYNC();
}

// The dot products of one row of a slot with the activations by a warp's lane, one form a weight type: units
// (32 values) pt * 32 + lane, step 32 wpr (the row's wpr warps, this one part pt), each times the unit's
// activation scale. The row and the activations are addressed from lq_dyn, so the loads are shared-memory
// loads (not generic ones). The unit decodes are fast_units.cuh's (FastQ8_0, FastQ4_K, FastQ6_K).
#define LQ_AQ (lq_dyn + LQ_ACT_OFF)
#define LQ_AD reinterpret_cast<const float*>(lq_dyn + LQ_ACT_OFF + LQ_KMAX)
#define LQ_AS reinterpret_cast<const int*>(LQ_AD + LQ_KMAX / 32)
// A unit's activation sums (LqShared::as): its first 16 values' (low half) and its last 16's (high half).
__device__ __forceinline__ int lq_sum_lo(int v) { return (int)(short)(v & 0xffff); }
__device__ __forceinline__ int lq_sum_hi(int v) { return v >> 16; }

// The 32 int8 activations of unit u as 8 words (lq_aq_off's layout).
__device__ __forceinline__ void lq_ldx(int u, int4& xa, int4& xb) {
    const uint8_t* xp = LQ_AQ + (u >> 3) * 256 + (u & 7) * 16;
    xa = *reinterpret_cast<const int4*>(xp);
    xb = *reinterpret_cast<const int4*>(xp + 128);
}
// Four weight words against four activation words (16 values), added to d.
__device__ __forceinline__ int lq_dot4(const uint32_t* q, int4 x, int d) {
    d = __dp4a((int)q[0], x.x, d); d = __dp4a((int)q[1], x.y, d);
    d = __dp4a((int)q[2], x.z, d); d = __dp4a((int)q[3], x.w, d);
    return d;
}
__device__ __forceinline__ int lq_dot8(const uint32_t* q, int4 xa, int4 xb) {
    return lq_dot4(q + 4, xb, lq_dot4(q, xa, 0));
}
// lq_dot8 with unsigned weight bytes (dp4a.u32.s32: bytes 0..255 times the signed activations).
__device__ __forceinline__ int lq_dot8u(const uint32_t* q, int4 xa, int4 xb) {
    const int x[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    int d = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) asm("dp4a.u32.s32 %0, %1, %2, %0;" : "+r"(d) : "r"(q[i]), "r"(x[i]));
    return d;
}
// Each form takes NR (1 or 2) rows of a slot at once (byte offsets oa, ob: a gate row and its up row, or two
// rows of one matrix), so a unit's activations are read once for both.
template <int NR>
__device__ __forceinline__ float2 lq_dot_q8_0(int oa, int ob, int units, int pt, int wpr) {
    const int lane = threadIdx.x & 31;
    float r[2] = {0.f, 0.f};
    for (int u = pt * 32 + lane; u < units; u += 32 * wpr) {
        int4 xa, xb;
        lq_ldx(u, xa, xb);
        const float d = LQ_AD[u];
#pragma unroll
        for (int e = 0; e < NR; ++e) {
            // the unit's 34 bytes (fp16 scale, 32 int8) start 2-byte aligned at o: nine aligned words
            // from o & ~3 hold them; the quants are those words shifted by 16 bits (o % 4 == 0) or not
            const int o = (e ? ob : oa) + u * LQ_BQ, sh = (o & 2) ? 32 : 16;
            const uint32_t* wa = reinterpret_cast<const uint32_t*>(lq_dyn + (o & ~3));
            uint32_t w[9], q[8];
#pragma unroll
            for (int i = 0; i < 9; ++i) w[i] = wa[i];
#pragma unroll
            for (int i = 0; i < 8; ++i) q[i] = __funnelshift_rc(w[i], w[i + 1], sh);
            r[e] += d * (ntx_h2f((uint16_t)(w[0] >> (sh - 16))) * (float)lq_dot8(q, xa, xb));
        }
    }
    return make_float2(r[0], r[1]);
}

// The K-quant forms loop over a lane's blocks: a lane's items it = pt 32 + lane + 32 wpr n (two units each) all have
// the same it % 4 (32 wpr is a multiple of 4), so the same units of a block (Q4_K: 2m, 2m + 1; Q6_K: j, j + 2) and, for
// Q6_K, the same block parity (210-byte blocks: the same 2-byte misalignment); every offset and shift that depends on
// it % 4 is found once and a block's offsets are the last one's plus a stride (the per-item form found them again for
// every item: Q6_K 186 -> 159 instructions an item, Q4_K row pairs 205 -> 153; gate/up without copies 14.7 -> 13.9 us).

// Q4_K: unit j of a block is nibble j % 2 of its bytes 16 + 32 (j / 2) ..; its scale and minimum are 6-bit (the block's
// 12 bytes at 4); the minimum's term takes the activations' sum. A lane takes units 2m and 2m + 1 (the low and high
// nibbles of the same 32 bytes) of blocks b = (pt 32 + lane) / 4 + 8 wpr n; both units' scale and minimum come as
// 16-bit pairs: m < 2 their 6 bits are bytes 2m % 4 .. of the scale and min words; m >= 2 the low 4 bits are the
// nibbles of the third word's bytes, the high 2 bits the first (second) word's top bits.
// Q5 (NTX_LQ_Q5 builds): Q5_K, 176-byte blocks (Q4_K's 16-byte head, 32 bytes qh, the nibbles at 48): unit j's values
// are its nibbles plus 16 x bit j of qh[l] (value l), 0..31, so both units' values fit signed bytes.
template <int NR, bool Q5>
__device__ __forceinline__ float2 lq_dot_k45(int oa, int ob, int units, int pt, int wpr) {
    constexpr int BB = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;  // block bytes, where the nibbles start
    const int i0 = pt * 32 + (int)(threadIdx.x & 31), m = i0 & 3, nb = units / 8, step = 8 * wpr;
    float r[2] = {0.f, 0.f};
    const bool hs = m >= 2;
    const unsigned b0 = 16u * (unsigned)(m & 1), sy = hs ? b0 + 4u : b0, ma = hs ? 0x0F0Fu : 0x3F3Fu, mb = hs ? 0x3030u : 0u;
    const unsigned u0 = 2u * (unsigned)m;  // Q5: the qh bit of unit 2m (2m + 1: the next)
    int b = i0 >> 2;
    const uint8_t* xp = LQ_AQ + b * 256 + 32 * m;       // unit 8b + 2m's activations (lq_ldx), 8b + 2m + 1's at + 16
    const float* dp = LQ_AD + 8 * b + 2 * m;
    const int* sp = LQ_AS + 8 * b + 2 * m;
    const uint8_t* wp = lq_dyn + oa + b * BB;
    const int dw = ob - oa;
    for (; b < nb; b += step, xp += 256 * step, dp += 8 * step, sp += 8 * step, wp += BB * step) {
        const int4 x0a = *reinterpret_cast<const int4*>(xp), x0b = *reinterpret_cast<const int4*>(xp + 128);
        const int4 x1a = *reinterpret_cast<const int4*>(xp + 16), x1b = *reinterpret_cast<const int4*>(xp + 144);
        const float d0 = dp[0], d1 = dp[1];
        const int p0 = sp[0], p1 = sp[1], s0 = lq_sum_lo(p0) + lq_sum_hi(p0), s1 = lq_sum_lo(p1) + lq_sum_hi(p1);
#pragma unroll
        for (int e = 0; e < NR; ++e) {
            const uint8_t* w = wp + (e ? dw : 0);
            const uint4 h = *reinterpret_cast<const uint4*>(w);  // d | dmin, scale bytes 0..3, 4..7, 8..11
            const uint4 qa = *reinterpret_cast<const uint4*>(w + QS + 32 * m);
            const uint4 qb = *reinterpret_cast<const uint4*>(w + QS + 16 + 32 * m);
            const unsigned sc = ((hs ? h.w : h.y) >> b0 & ma) | (h.y >> (b0 + 2u) & mb);
            const unsigned mn = ((hs ? h.w : h.z) >> sy & ma) | (h.z >> (b0 + 2u) & mb);
            const uint32_t q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            uint32_t lo[8], hi[8];
            if (Q5) {
                const uint4 ha = *reinterpret_cast<const uint4*>(w + 16), hb = *reinterpret_cast<const uint4*>(w + 32);
                const uint32_t qh[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    lo[i] = (q[i] & 0x0F0F0F0Fu) | ((qh[i] >> u0) & 0x01010101u) << 4;
                    hi[i] = (q[i] >> 4 & 0x0F0F0F0Fu) | ((qh[i] >> (u0 + 1u)) & 0x01010101u) << 4;
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    lo[i] = q[i] & 0x0F0F0F0Fu;
                    hi[i] = q[i] & 0xF0F0F0F0u;
                }
            }
            // the scale times the int dot and the minimum times the activations' sum in ints (exact: < 2^24), then
            // one product by d (dmin); Q4_K's high nibbles' dot is 16 x theirs: d / 16 (exact)
            const float dd = ntx_h2f((uint16_t)(h.x & 0xffffu)), dm = ntx_h2f((uint16_t)(h.x >> 16));
            const int hdot = Q5 ? lq_dot8(hi, x1a, x1b) : lq_dot8u(hi, x1a, x1b);
            const float t0 = dd * (float)((int)(sc & 0xffu) * lq_dot8(lo, x0a, x0b)) - dm * (float)((int)(mn & 0xffu) * s0);
            const float t1 = (Q5 ? dd : dd * 0.0625f) * (float)((int)(sc >> 8) * hdot) - dm * (float)((int)(mn >> 8) * s1);
            r[e] += d0 * t0 + d1 * t1;
        }
    }
    return make_float2(r[0], r[1]);
}
// The Q4_K dot, and in NTX_LQ_Q5 builds Q5_K's (type): one function, so a phase loop calls both from one call site (code
// a layer never runs, in its hot loops, cost time through the instruction cache: sessions 23, 25).
template <int NR>
__device__ __noinline__ float2 lq_dot_q4_k(int oa, int ob, int units, int pt, int wpr, int type) {
#if NTX_LQ_Q5
    if (type == LQ_Q5_K) return lq_dot_k45<NR, true>(oa, ob, units, pt, wpr);
#endif
    return lq_dot_k45<NR, false>(oa, ob, units, pt, wpr);
}

// Q6_K: unit j of a block (half j / 4, s = j % 4) takes nibble s / 2 of the half's low bytes 32 (s % 2) .. and bit pair
// s of its 32 high bytes, minus 32 (taken off as 32 x the activations' sums); two int8 scales of 16 values each, and
// the block's d. A lane takes units j = 4 hh + s and j + 2 (s < 2: the low and high nibbles of the same 32 low bytes,
// and the same high bytes) of blocks b = (pt 32 + lane) / 4 + 8 wpr n. The blocks are 2-byte aligned; the lane's all
// have the same b % 2, so the same shift joins the aligned words.
template <int NR>
__device__ __noinline__ float2 lq_dot_q6_k(int oa, int ob, int units, int pt, int wpr) {
    const int i0 = pt * 32 + (int)(threadIdx.x & 31), k = i0 & 3, hh = k >> 1, s = k & 1, j = 4 * hh + s;
    const int nb = units / 8, step = 8 * wpr;
    float r[2] = {0.f, 0.f};
    int b = i0 >> 2;
    const unsigned hs = 2u * (unsigned)s, sh = (b & 1) ? 16u : 0u;  // oa, ob: 16-byte aligned (rows of whole pieces)
    const uint8_t* xp = LQ_AQ + b * 256 + 16 * j;  // unit 8b + j's activations, 8b + j + 2's at + 32
    const float* dp = LQ_AD + 8 * b + j;
    const int* sp = LQ_AS + 8 * b + j;
    int wo = oa + b * 210;  // the block's offset in lq_dyn (2-byte aligned)
    const int dw = ob - oa;
    for (; b < nb; b += step, xp += 256 * step, dp += 8 * step, sp += 8 * step, wo += 210 * step) {
        const int4 x0a = *reinterpret_cast<const int4*>(xp), x0b = *reinterpret_cast<const int4*>(xp + 128);
        const int4 x1a = *reinterpret_cast<const int4*>(xp + 32), x1b = *reinterpret_cast<const int4*>(xp + 160);
        const float d0 = dp[0], d1 = dp[2];
        const int p0 = sp[0], p1 = sp[2];  // the q - 32 of the weights: 32 x the halves' sums off
#pragma unroll
        for (int e = 0; e < NR; ++e) {
            const int o = wo + (e ? dw : 0);
            const uint8_t* w = lq_dyn + o;
            const uint32_t* wl = reinterpret_cast<const uint32_t*>(lq_dyn + ((o + hh * 64 + s * 32) & ~3));
            const uint32_t* wh = reinterpret_cast<const uint32_t*>(lq_dyn + ((o + 128 + hh * 32) & ~3));
            uint32_t q0[8], q1[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const uint32_t lo = __funnelshift_r(wl[i], wl[i + 1], sh), hi = __funnelshift_r(wh[i], wh[i + 1], sh);
                q0[i] = (lo & 0x0F0F0F0Fu) | ((hi << (4u - hs)) & 0x30303030u);  // q, 0..63
                q1[i] = ((lo >> 4) & 0x0F0F0F0Fu) | ((hi >> hs) & 0x30303030u);
            }
            const int a0 = lq_dot4(q0, x0a, 0), a1 = lq_dot4(q0 + 4, x0b, 0), c0 = lq_dot4(q1, x1a, 0), c1 = lq_dot4(q1 + 4, x1b, 0);
            const unsigned sa = *reinterpret_cast<const uint16_t*>(w + 192 + 2 * j);
            const unsigned sb = *reinterpret_cast<const uint16_t*>(w + 196 + 2 * j);  // unit j + 2's
            const int i0s = (int)(int8_t)(sa & 0xffu) * (a0 - 32 * lq_sum_lo(p0)) + (int)(int8_t)(sa >> 8) * (a1 - 32 * lq_sum_hi(p0));
            const int i1s = (int)(int8_t)(sb & 0xffu) * (c0 - 32 * lq_sum_lo(p1)) + (int)(int8_t)(sb >> 8) * (c1 - 32 * lq_sum_hi(p1));
            const float d = ntx_h2f(*reinterpret_cast<const uint16_t*>(w + 208));
            r[e] += d0 * (d * (float)i0s) + d1 * (d * (float)i1s);
        }
    }
    return make_float2(r[0], r[1]);
}

// NTX_LQ_KSREL (a tuning build, default 0): a warp releases a Q6_K K-slice down chunk's slot as soon as its weight words
// are in registers, before its arithmetic, so the producer refills the slot while the group computes. Its probes
// (session 24) put the down rows at 10.3 us without the copies and 10.6 without the arithmetic against 14.0 with both:
// a group holds each of its two slots through its arithmetic, and the next copy into it waits for that.
#ifndef NTX_LQ_KSREL
#define NTX_LQ_KSREL 0
#endif
#if NTX_LQ_KSREL
// lq_dot_q6_k<2>'s one pass over slice k of rows oa and ob (a K-slice chunk: the lane's one block, 8 k + lane / 4), the
// same values in the same order, with the slot's "empty" mbarrier (shared address bar) arrived on between the loads and
// the arithmetic. Warp-uniform callers only.
__device__ __noinline__ float2 lq_ks_dot_q6_k(int oa, int ob, int k, unsigned bar) {
    const int lane = (int)(threadIdx.x & 31), hh = (lane & 3) >> 1, s = lane & 1, j = 4 * hh + s, b = 8 * k + (lane >> 2);
    const unsigned hs = 2u * (unsigned)s, sh = (b & 1) ? 16u : 0u;
    const uint8_t* xp = LQ_AQ + b * 256 + 16 * j;
    uint32_t wl[2][9], wh[2][9];
    unsigned sa[2], sb[2], dh[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int o = (e ? ob : oa) + b * 210;
        const uint32_t* pl = reinterpret_cast<const uint32_t*>(lq_dyn + ((o + hh * 64 + s * 32) & ~3));
        const uint32_t* ph = reinterpret_cast<const uint32_t*>(lq_dyn + ((o + 128 + hh * 32) & ~3));
#pragma unroll
        for (int i = 0; i < 9; ++i) {
            wl[e][i] = pl[i];
            wh[e][i] = ph[i];
        }
        sa[e] = *reinterpret_cast<const uint16_t*>(lq_dyn + o + 192 + 2 * j);
        sb[e] = *reinterpret_cast<const uint16_t*>(lq_dyn + o + 196 + 2 * j);
        dh[e] = *reinterpret_cast<const uint16_t*>(lq_dyn + o + 208);
    }
    // the loads before the release (its memory clobber keeps them above it; the arrive's release semantics and the warp
    // barrier order every lane's reads before the producer's next copy into the slot)
    __syncwarp();
    if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
    const int4 x0a = *reinterpret_cast<const int4*>(xp), x0b = *reinterpret_cast<const int4*>(xp + 128);
    const int4 x1a = *reinterpret_cast<const int4*>(xp + 32), x1b = *reinterpret_cast<const int4*>(xp + 160);
    const float d0 = LQ_AD[8 * b + j], d1 = LQ_AD[8 * b + j + 2];
    const int p0 = LQ_AS[8 * b + j], p1 = LQ_AS[8 * b + j + 2];
    float r[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        uint32_t q0[8], q1[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t lo = __funnelshift_r(wl[e][i], wl[e][i + 1], sh), hi = __funnelshift_r(wh[e][i], wh[e][i + 1], sh);
            q0[i] = (lo & 0x0F0F0F0Fu) | ((hi << (4u - hs)) & 0x30303030u);
            q1[i] = ((lo >> 4) & 0x0F0F0F0Fu) | ((hi >> hs) & 0x30303030u);
        }
        const int a0 = lq_dot4(q0, x0a, 0), a1 = lq_dot4(q0 + 4, x0b, 0), c0 = lq_dot4(q1, x1a, 0), c1 = lq_dot4(q1 + 4, x1b, 0);
        const int i0s = (int)(int8_t)(sa[e] & 0xffu) * (a0 - 32 * lq_sum_lo(p0)) + (int)(int8_t)(sa[e] >> 8) * (a1 - 32 * lq_sum_hi(p0));
        const int i1s = (int)(int8_t)(sb[e] & 0xffu) * (c0 - 32 * lq_sum_lo(p1)) + (int)(int8_t)(sb[e] >> 8) * (c1 - 32 * lq_sum_hi(p1));
        const float d = ntx_h2f((uint16_t)dh[e]);
        r[e] = 0.f + (d0 * (d * (float)i0s) + d1 * (d * (float)i1s));
    }
    return make_float2(r[0], r[1]);
}
#endif

// Rows oa and ob (two) or oa alone.
__device__ __forceinline__ float2 lq_row_dot(int oa, int ob, bool two, int units, int pt, int wpr, int type) {
    if (NTX_LQ_PROBE == 1 || NTX_LQ_PROBE == 7) return make_float2(0.f, 0.f);
    if (type == LQ_Q4_K || (NTX_LQ_Q5 && type == LQ_Q5_K))
        return two ? lq_dot_q4_k<2>(oa, ob, units, pt, wpr, type) : lq_dot_q4_k<1>(oa, ob, units, pt, wpr, type);
    if (!NTX_LQ_Q8 || type == LQ_Q6_K)
        return two ? lq_dot_q6_k<2>(oa, ob, units, pt, wpr) : lq_dot_q6_k<1>(oa, ob, units, pt, wpr);
    return two ? lq_dot_q8_0<2>(oa, ob, units, pt, wpr) : lq_dot_q8_0<1>(oa, ob, units, pt, wpr);
}

#ifndef NTX_LQ_CU
#define NTX_LQ_CU 0  // layer_q8_ks.cu: 1 (Q8_0's gate/up and down chunks take these loops: 389.7 unrolled, 378.3 not)
#endif

// A phase's chunks (of a layer of type mix mt) against the activations in aq / ad, chunk by chunk from the ring, until each group
// reads its end of the phase: the block's own rows, then the pool's chunks its producer claimed (NTX_LQ_POOL).
// Chunk i is read by warp group i % LQ_GROUPS alone (LQ_GW warps): each warp waits for the slot, reads which
// rows it holds (s.desc), computes its part of them and releases the slot itself (the "empty" mbarrier
// counts a group's warps), so no barrier a chunk and the groups overlap. A chunk's rows (gate/up: its gate
// rows, then its up rows) go to the group's warps as items (lq_mat_init): row pairs (a gate row with its up
// row; two rows where they outnumber the warps) or single rows, wpr warps an item; where an item takes several
// parts (wpr > 1) the warp that writes the last of them adds them in a fixed order. out(row, total, up total,
// res[row]) gets each output row. it: the ring's running
// chunk count (slot it % NTX_LQ_SLOTS, parity (it / NTX_LQ_SLOTS) & 1), past the phase's ends on return.
template <class Out>
__device__ void lq_phase(const LqArgs& a, const LqMat* mt, int ph, const LqShared& s, unsigned& it, const float* res, Out out) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, grp = warp / LQ_GW, wi = warp % LQ_GW;
    const int per = ph == 2 ? 2 : 1;
    unsigned i = it + (unsigned)((grp - (int)(it % LQ_GROUPS) + LQ_GROUPS) % LQ_GROUPS);  // the group's first chunk
    float2 acc = make_float2(0.f, 0.f);  // NTX_LQ_KS: the warp's two rows' lane sums over their slices so far
    for (;; i += LQ_GROUPS) {
        const int slot = i % NTX_LQ_SLOTS;
        lq_wait_bar(s.full + slot, (i / NTX_LQ_SLOTS) & 1);
        if (NTX_LQ_RTRACE && wi == 0 && lane == 0 && s.flag[3]) LQ_RMARK((int)(i - s.flag[2]), 1, global_ns());
        unsigned row, w1;
        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(row), "=r"(w1) : "r"(lq_smem(s.desc + slot)) : "memory");
        if (NTX_LQ_KS && ph == 3 && ((w1 >> 16) & 0xffu) == LQ_KSMAT) {
            // slice k of rows row .. row + 15 (none: a group's turn skipped, where the block has an odd number of row
            // groups): this warp's rows row + wi and row + wi + 8, their sums kept from slice to slice
            const int k = (int)(w1 >> 24), nk = a.F / LQ_KSV;
            bool rel = false;  // NTX_LQ_KSREL: the slot already released
            if ((w1 & 0xffffu) != 0) {
                const LqMat& m = mt[LQ_KSMAT];
                float* rv = s.resv + 2 * warp;
                if (k == 0) {
                    acc = make_float2(0.f, 0.f);
                    if (lane == 0) {
                        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(lq_smem(rv)), "l"(res + row + wi) : "memory");
                        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(lq_smem(rv + 1)), "l"(res + row + wi + 8) : "memory");
                        asm volatile("cp.async.commit_group;" ::: "memory");
                    }
                }
                // the slot's rows against units 64 k .. of the activations: the dots' block (unit) index runs from
                // slice k's first, so the rows' offsets are taken back by k slices (one pass of each lane's loop)
                const int o = slot * LQ_SLOT + wi * m.rb - k * m.rb;
                const int ob = o + 8 * m.rb, nu = (k + 1) * m.units;
                float2 t = make_float2(0.f, 0.f);  // (only the types NTX_LQ_KS names are built in)
                if (NTX_LQ_PROBE == 1 || NTX_LQ_PROBE == 7)
                    ;
#if NTX_LQ_KSREL
                else if ((NTX_LQ_KS & (1 << LQ_Q6_K)) && m.type == LQ_Q6_K) {
                    t = lq_ks_dot_q6_k(o, ob, k, lq_smem(s.empty + slot));
                    rel = true;
                }
#endif
                else if ((NTX_LQ_KS & (1 << LQ_Q6_K)) && m.type == LQ_Q6_K)
                    t = lq_dot_q6_k<2>(o, ob, nu, k, 1);
                else if ((NTX_LQ_KS & (1 << LQ_Q4_K)) && m.type == LQ_Q4_K)
                    t = lq_dot_q4_k<2>(o, ob, nu, k, 1, LQ_Q4_K);
                else if (NTX_LQ_KS & (1 << LQ_Q8_0))
                    t = lq_dot_q8_0<2>(o, ob, nu, 2 * k, 1);
                acc.x += t.x;
                acc.y += t.y;
                if (k == nk - 1) {
                    const float ta = warp_sum(acc.x), tb = warp_sum(acc.y);
                    if (lane == 0) {
                        asm volatile("cp.async.wait_all;" ::: "memory");
                        out((int)row + wi, ta, 0.f, *reinterpret_cast<volatile float*>(rv));
                        out((int)row + wi + 8, tb, 0.f, *reinterpret_cast<volatile float*>(rv + 1));
                    }
                }
            }
            __syncwarp();
            if (lane == 0 && !rel) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(lq_smem(s.empty + slot)) : "memory");
            continue;
        }
        const int n = (int)(w1 & 0xffffu) + (int)(w1 >> 24);
        const LqMat m = mt[(w1 >> 16) & 0xffu];  // (a chunk crossing into the next matrix: the same type)
        // the chunk's items: row pairs (gate/up: gate row p with up row p; else, where a chunk has more rows than
        // a group warps, rows p and p + np) or single rows (m.pair 0), wpr warps an item
        const int np = !m.pair ? n : per == 2 ? n : (n + 1) >> 1, wpr = 1 << m.lw, pt = wi & (wpr - 1);
        for (int p = wi >> m.lw; p < np; p += LQ_GW >> m.lw) {
            const int ra = p, rb = per == 2 ? n + p : p + np;  // rows of the slot
            const bool two = m.pair && rb < per * n;
            // the rows' residual values (o, down) come into shared memory by cp.async, not into registers: a load
            // pending in a register made the call of the rows' K-quant dot wait for it (an L2 round trip a chunk;
            // Q4_K_M 436-438 -> 443-444 tok/s, the kernel 2.12-2.14 -> 2.08-2.10 ms)
            float* rv = s.resv + 2 * warp;
            if (res != nullptr && lane == 0) {
                asm volatile("cp.async.wait_all;" ::: "memory");  // (an earlier item's copies, into the same words)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(lq_smem(rv)), "l"(res + row + ra) : "memory");
                if (two && per == 1)
                    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(lq_smem(rv + 1)), "l"(res + row + rb) : "memory");
                asm volatile("cp.async.commit_group;" ::: "memory");
            }
            const int o = slot * LQ_SLOT;
            float2 t = lq_row_dot(o + ra * m.rb, o + rb * m.rb, two, m.units, pt, wpr, m.type);
            t.x = warp_sum(t.x);
            if (two) t.y = warp_sum(t.y);  // (the same in the whole warp: a second row's sum only where there is one)
            if (lane == 0) {
                if (wpr > 1) {  // the item's parts: the warp that writes the last adds them in a fixed order
                    float* cp = s.cpart + slot * LQ_WARPS;
                    cp[ra * wpr + pt] = t.x;
                    if (two) cp[rb * wpr + pt] = t.y;
                    __threadfence_block();
                    if (atomicAdd(s.ccnt + slot * LQ_WARPS + p, 1) != wpr - 1) continue;
                    __threadfence_block();
                    const volatile float* vp = cp;
                    t = make_float2(0.f, 0.f);
                    // (NTX_LQ_CU: lane 0's loops over the 2-16 parts not unrolled, ~1100 instructions fewer in the
                    // four phase loops: the K-quant build, whose Q4_K_M chunks never take them)
#if NTX_LQ_CU
#pragma unroll 1
#endif
                    for (int q = 0; q < wpr; ++q) t.x += vp[ra * wpr + q];
                    if (two)
#if NTX_LQ_CU
#pragma unroll 1
#endif
                        for (int q = 0; q < wpr; ++q) t.y += vp[rb * wpr + q];
                    s.ccnt[slot * LQ_WARPS + p] = 0;
                }
                if (per == 2) {
                    out((int)row + p, t.x, t.y, 0.f);
                } else {
                    float va = 0.f, vb = 0.f;
                    if (res != nullptr) {
                        asm volatile("cp.async.wait_all;" ::: "memory");
                        va = *reinterpret_cast<volatile float*>(rv);
                        vb = *reinterpret_cast<volatile float*>(rv + 1);
                    }
                    out((int)row + ra, t.x, 0.f, va);
                    if (two) out((int)row + rb, t.y, 0.f, vb);
                }
            }
        }
        __syncwarp();
        if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(lq_smem(s.empty + slot)) : "memory");
        if (n == 0) break;
    }
    if (wi == 0 && lane == 0) s.flag[4 + grp] = (int)i;
    LQ_SYNC();
    unsigned e = 0;
    for (int g = 0; g < LQ_GROUPS; ++g) e = max(e, (unsigned)s.flag[4 + g]);
    it = e + 1;
}

// NTX_LQ_PVU, NTX_LQ_CBU: the unroll factors of the attention's p.V loop (1) and of its combine's loop over the chunks'
// partials in shared memory (2). Each form of the attention is code the layer runs once, fetched cold (the instruction
// cache, docs/cuda.md session 23); from 4 and 8: 6 KB less code a form, Q8_0 392.1 / 392.3 against 387.4 / 387.1 tok/s,
// Q4_K_M 454.1 / 455.3 against 452.2 / 451.6 (with the code moved by NTX_LQ_PAD=8: 391.6 against 388.9, 453.0 against
// 452.3). (The combine not unrolled at all: 446.4 / 447.7.) The order of the additions is the same at any factor.
#ifndef NTX_LQ_PVU
#define NTX_LQ_PVU 1
#endif
#ifndef NTX_LQ_CBU
#define NTX_LQ_CBU 2
#endif
#define LQ_PRAGMA(x) _Pragma(#x)
#define LQ_UNROLL(n) LQ_PRAGMA(unroll n)
// One (KV head, chunk) of the layer's attention for groups of G <= GM query heads; the head's last
// chunk to finish combines them.
template <int V, int GM>
__device__ __noinline__ void lq_attention(const LqArgs& a, const LqLayer& L, int layer, int unit, const LqShared& s,
                                          const unsigned* qkv_done) {
    constexpr int HD = 32 * V, NPG = LQ_THREADS / (HD / 2);
    static_assert((HD / 16 & (HD / 16 - 1)) == 0, "the scores' dim steps wrap by a mask");
    const int G = a.n_head / a.n_kv, kvd = a.n_kv * HD, C = a.chunks;
    const int h = unit / C, c = unit % C, pos = __ldg(a.pos), T = pos + 1, len = (T + C - 1) / C;
    const int p0 = min(T, c * len), p1 = min(T, p0 + len), np = p1 - p0;
    const size_t col = (size_t)h * HD;
    // The chunk's K and V rows of earlier positions were stored by earlier steps: the first npre of
    // them are copied into shared memory (cp.async, no registers held) before the wait for this
    // step's q, k and v; the scores and p.V read them there, later positions from global memory.
    const int npre = min(np, LQ_KVS / (4 * HD));
    uint16_t *kpre = s.kv, *vpre = s.kv + npre * HD;
    for (int i = threadIdx.x; i < npre * HD / 8; i += LQ_THREADS) {
        const int p = p0 + i / (HD / 8), off = i % (HD / 8) * 8;
        if (p == pos) continue;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(lq_smem(kpre + (p - p0) * HD + off)),
                     "l"(L.kc + (size_t)p * kvd + col + off) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(lq_smem(vpre + (p - p0) * HD + off)),
                     "l"(L.vc + (size_t)p * kvd + col + off) : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    lq_wait(qkv_done, gridDim.x);
    lq_release(s, 4 * layer + 1);  // the o rows' chunks may stream from here (NTX_LQ_HOLD bit 1)
    LQ_AMARK(4);
    auto krow = [&](int p) { return p == pos ? s.knew : p - p0 < npre ? kpre + (p - p0) * HD : L.kc + (size_t)p * kvd + col; };
    auto vrow = [&](int p) { return p == pos ? s.vnew : p - p0 < npre ? vpre + (p - p0) * HD : L.vc + (size_t)p * kvd + col; };
    // q of the group and the new k rotated straight from the q/k/v row (thread i: pair i of the
    // group's q, then of the new k), the new V row stored; the running max of each head's scores
    // (s.stat as order-preserving ints) starts at the least
    const bool mine = p0 <= pos && pos < p1;
    int* mx = reinterpret_cast<int*>(s.stat);
    if (threadIdx.x < G) mx[threadIdx.x] = -2147483647 - 1;  // below every encoded score
    {
        const int nq = G * HD / 2;
        // the new V row's values loaded with RoPE's (one round trip; HD <= LQ_THREADS)
        const float vn = mine && (int)threadIdx.x < HD ? __ldcg(a.qkv + a.D + kvd + col + threadIdx.x) : 0.f;
        for (int i = threadIdx.x; i < nq + (mine ? HD / 2 : 0); i += LQ_THREADS) {
            const bool isk = i >= nq;
            const int j = isk ? i - nq : i, hh = j / (HD / 2), pi = j % (HD / 2);
            const float* x = isk ? a.qkv + a.D + col : a.qkv + (size_t)(h * G + hh) * HD;
            int ia, ib;
            const bool rot = ntx_rope_offsets(pi, a.rope_dim, a.neox, &ia, &ib);
            float o0 = __ldcg(x + ia), o1 = __ldcg(x + ib);
            if (rot) ntx_rope_rotate(o0, o1, pi, pos, a.rope_ff, a.rope_scale, a.freq_scale, &o0, &o1);
            if (isk) {
                s.knew[ia] = L.kc[(size_t)pos * kvd + col + ia] = ntx_f2h(o0);
                s.knew[ib] = L.kc[(size_t)pos * kvd + col + ib] = ntx_f2h(o1);
            } else {
                s.qa[hh * HD + ia] = ntx_round_f16(o0);
                s.qa[hh * HD + ib] = ntx_round_f16(o1);
            }
        }
        if (mine && (int)threadIdx.x < HD) s.vnew[threadIdx.x] = L.vc[(size_t)pos * kvd + col + threadIdx.x] = ntx_f2h(vn);
    }
    LQ_AMARK(5);
    asm volatile("cp.async.wait_all;" ::: "memory");
    LQ_SYNC();
    LQ_AMARK(6);
    // scores: 4 lanes a (position, head) dot product, HD / 4 values each; the heads' maxima by
    // shared atomics on order-preserving ints (exact in any order)
    {
        constexpr int TL = 4;
        const int team = threadIdx.x / TL, tl = threadIdx.x % TL;
        for (int b = 0; b < np * G; b += LQ_THREADS / TL) {
            const int pr = b + team, pi = pr / G, g = pr % G;
            float acc = 0.f;
            if (pr < np * G) {
                const int p = p0 + pi;
                // lane tl takes dims 16 m + 4 tl .. + 3, head g starting at step g: the 16 (head, lane)
                // float4s of q a load reads fall in two halves of the banks, not one quarter
                const uint16_t* kr = krow(p) + 4 * tl;
                const float* qg = s.qa + g * HD + 4 * tl;
#pragma unroll
                for (int m0 = 0; m0 < HD / 16; ++m0) {
                    const int m = (m0 + g) & (HD / 16 - 1);
                    const uint2 kk = *reinterpret_cast<const uint2*>(kr + 16 * m);
                    const float4 q = *reinterpret_cast<const float4*>(qg + 16 * m);
                    acc += q.x * ntx_h2f((uint16_t)(kk.x & 0xffffu)) + q.y * ntx_h2f((uint16_t)(kk.x >> 16));
                    acc += q.z * ntx_h2f((uint16_t)(kk.y & 0xffffu)) + q.w * ntx_h2f((uint16_t)(kk.y >> 16));
                }
            }
            acc += __shfl_xor_sync(0xffffffffu, acc, 1);
            acc += __shfl_xor_sync(0xffffffffu, acc, 2);
            if (pr < np * G && tl == 0) {
                const float v = acc * a.scale;
                s.sc[g * np + pi] = v;
                const int e = __float_as_int(v);
                atomicMax(mx + g, e >= 0 ? e : e ^ 0x7fffffff);
            }
        }
    }
    LQ_SYNC();
    LQ_AMARK(7);
    // the scores become e^(s - m), m the head's chunk max
    for (int i = threadIdx.x; i < np * G; i += LQ_THREADS) {
        const int e = mx[i / np];
        s.sc[i] = expf(s.sc[i] - __int_as_float(e >= 0 ? e : e ^ 0x7fffffff));
    }
    LQ_SYNC();
    LQ_AMARK(8);
    // p.V and the exp sums: thread t the dims 2 dt, 2 dt + 1 of positions p0 + pg + NPG i
    {
        const int dt = threadIdx.x % (HD / 2), pg = threadIdx.x / (HD / 2);
        float acc[GM][2], l[GM];
#pragma unroll
        for (int g = 0; g < GM; ++g) acc[g][0] = acc[g][1] = l[g] = 0.f;
LQ_UNROLL(NTX_LQ_PVU)
        for (int p = p0 + pg; p < p1; p += NPG) {
            const uint32_t w = *reinterpret_cast<const uint32_t*>(vrow(p) + 2 * dt);
            const float v0 = ntx_h2f((uint16_t)(w & 0xffffu)), v1 = ntx_h2f((uint16_t)(w >> 16));
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                if (g >= G) break;
                const float e = s.sc[g * np + (p - p0)];
                acc[g][0] += e * v0;
                acc[g][1] += e * v1;
                l[g] += e;
            }
        }
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            if (g >= G) break;
            s.red_o[(pg * G + g) * HD + 2 * dt] = acc[g][0];
            s.red_o[(pg * G + g) * HD + 2 * dt + 1] = acc[g][1];
            if (dt == 0) s.red_l[pg * G + g] = l[g];
        }
    }
    LQ_SYNC();
    LQ_AMARK(9);
    const int per = 2 * G + G * HD;  // a chunk's partial: max[G], sum[G], o[G][HD]
    float* mypart = a.part + (size_t)unit * per;
    for (int t = threadIdx.x; t < G * HD; t += LQ_THREADS) {
        float o = 0.f;
        for (int pg = 0; pg < NPG; ++pg) o += s.red_o[pg * G * HD + t];
        mypart[2 * G + t] = o;
    }
    if (threadIdx.x < G) {
        float l = 0.f;
        for (int pg = 0; pg < NPG; ++pg) l += s.red_l[pg * G + threadIdx.x];
        const int e = mx[threadIdx.x];
        mypart[threadIdx.x] = np > 0 ? __int_as_float(e >= 0 ? e : e ^ 0x7fffffff) : -3.402823466e38f;
        mypart[G + threadIdx.x] = np > 0 ? l : 0.f;
    }
    // the head's last chunk to arrive combines the head's chunks
    LQ_SYNC();
    if (threadIdx.x == 0)
        s.flag[0] = lq_arrive_count(a.ctr + (size_t)layer * (LQ_NCTR + a.n_kv) + LQ_NCTR + h) == (unsigned)(C - 1);
    LQ_SYNC();
    LQ_AMARK(10);
    if (NTX_LQ_PROBE == 5 && s.flag[0]) {  // the probe without the combine (garbage out)
        lq_signal(a.ctr + (size_t)layer * (LQ_NCTR + a.n_kv) + 1);
        return;
    }
    if (!s.flag[0]) {
        LQ_AMARK(11);
        return;
    }
    const float* hp = a.part + (size_t)h * C * per;
    // thread t's partial outputs (float4 t of every chunk) copied into shared memory (the K/V rows' space, free now)
    // before the chunks' weights are formed: one L2 round trip fewer on the combine's path (G even: 16-byte aligned;
    // where the C G HD floats fit)
    const int nt = G * HD / 4;
    const bool pre = (G & 1) == 0 && C * nt * 16 <= LQ_KVS;
    float4* pv = reinterpret_cast<float4*>(s.kv);  // [C][nt]
    if (pre && (int)threadIdx.x < nt) {
        for (int q = 0; q < C; ++q)
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(lq_smem(pv + q * nt + threadIdx.x)),
                         "l"(reinterpret_cast<const float4*>(hp + (size_t)q * per + 2 * G) + threadIdx.x) : "memory");
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
    float* wt = s.sc;  // the chunks' weights e^(m_c - M) / S (the scores are no longer read)
    for (int i = threadIdx.x; i < C * G; i += LQ_THREADS) {
        const int q = i / G, g = i % G;
        wt[i] = __ldcg(hp + (size_t)q * per + g);
        wt[C * G + i] = __ldcg(hp + (size_t)q * per + G + g);
    }
    LQ_SYNC();
    if ((int)(threadIdx.x >> 5) < G) {  // warp g: head g's chunks, lane q chunk q (C <= 32: cuda_layers.MAX_CHUNKS)
        const int g = threadIdx.x >> 5, q = threadIdx.x & 31;
        const float m = q < C ? wt[q * G + g] : -3.402823466e38f, M = warp_max(m);
        const float e = q < C ? expf(m - M) : 0.f, S = warp_sum(e * (q < C ? wt[C * G + q * G + g] : 0.f));
        if (q < C) wt[2 * C * G + q * G + g] = e / S;
    }
    LQ_SYNC();
    LQ_AMARK(11);
    // thread t: outputs 4t .. 4t + 3 of the head group (one head), quantized into a Q8_1 row after hq (a.hq + F, scales
    // a.hqd + F / 32) that every block copies (lq_load_act)
    for (int t = threadIdx.x; t - (int)(threadIdx.x & 31) < G * HD / 4; t += LQ_THREADS) {
        const bool on = t < G * HD / 4;
        const int g = on ? 4 * t / HD : 0;
        float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
        if (on && pre) {  // (t: threadIdx.x) this thread's copies of the partials
            asm volatile("cp.async.wait_all;" ::: "memory");
LQ_UNROLL(NTX_LQ_CBU)
            for (int q = 0; q < C; ++q) {
                const float w = wt[2 * C * G + q * G + g];
                const float4 v = pv[q * nt + t];
                o.x += w * v.x;
                o.y += w * v.y;
                o.z += w * v.z;
                o.w += w * v.w;
            }
        } else if (on && (G & 1) == 0) {  // float4 loads (a partial's outputs start at a multiple of 4 floats)
            // (this loop and the next not unrolled: ~8 KB less code in each attention form, and the step ran 2 % faster
            // for Q4_K_M, 1.3 % for Q8_0, whose heads take the first path: the instruction cache, session 23)
#pragma unroll 1
            for (int q = 0; q < C; ++q) {
                const float w = wt[2 * C * G + q * G + g];
                const float4 v = __ldcg(reinterpret_cast<const float4*>(hp + (size_t)q * per + 2 * G) + t);
                o.x += w * v.x;
                o.y += w * v.y;
                o.z += w * v.z;
                o.w += w * v.w;
            }
        } else if (on) {
#pragma unroll 1
            for (int q = 0; q < C; ++q) {
                const float w = wt[2 * C * G + q * G + g];
                const float* src = hp + (size_t)q * per + 2 * G + 4 * t;
                o.x += w * __ldcg(src);
                o.y += w * __ldcg(src + 1);
                o.z += w * __ldcg(src + 2);
                o.w += w * __ldcg(src + 3);
            }
        }
        lq_quant4(o, on, h * G * HD / 4 + t, a.hq + a.F, a.hqd + a.F / 32, nullptr);
    }
    lq_signal(a.ctr + (size_t)layer * (LQ_NCTR + a.n_kv) + 1);
}

template <int V>
__device__ void lq_step(const LqArgs& a) {
    constexpr int HD = 32 * V, NPG = LQ_THREADS / (HD / 2);
    const int G = a.n_head / a.n_kv;
    __shared__ LqShared s;  // shared: the helpers take it by reference
#ifdef NTX_LQ_PAD  // (a probe: NTX_LQ_PAD never-run instructions first, moving all the code after them; a change
                   // whose gain moves with it is the instruction cache's placement, not the change: docs/cuda.md, session 23)
    if (a.n_layers < 0) {
        float x = a.eps;
#pragma unroll
        for (int k = 0; k < NTX_LQ_PAD; ++k) asm volatile("add.f32 %0, %0, 0f3F800000;" : "+f"(x));
        a.xb[0] = x;
    }
#endif
    if (threadIdx.x == 0) LQ_PMARK(0);
    if (threadIdx.x == 0) {
        uint8_t* p = lq_dyn;
        s.ring = p; p += LQ_ACT_OFF;
        s.aq = reinterpret_cast<int8_t*>(p);
        s.ad = reinterpret_cast<float*>(p + LQ_KMAX);
        // the sums only where a matrix is a K-quant (Q8_0 reads none; NTX_LQ_SUMS=1 keeps them: a probe)
        s.as = (a.types | a.types1) != 0 || NTX_LQ_SUMS ? reinterpret_cast<int*>(s.ad + LQ_KMAX / 32) : nullptr;
        s.sc = reinterpret_cast<float*>(p);
        p += LQ_ACT;
        s.qa = reinterpret_cast<float*>(p); p += 4 * LQ_GMAX * HD;
        s.red_o = reinterpret_cast<float*>(p); p += 4 * NPG * G * HD;
        s.knew = reinterpret_cast<uint16_t*>(p); p += 2 * HD;
        s.vnew = reinterpret_cast<uint16_t*>(p); p += 2 * HD;
        s.kv = reinterpret_cast<uint16_t*>(p); p += LQ_KVS;
        s.stat = reinterpret_cast<float*>(p); p += 4 * 2 * LQ_GMAX;
        s.part = reinterpret_cast<double*>(p); p += 8 * 32;
        s.flag = reinterpret_cast<int*>(p); p += 32;
        s.desc = reinterpret_cast<uint2*>(p); p += 8 * LQ_SLOTS;
        s.cpart = reinterpret_cast<float*>(p); p += 4 * LQ_SLOTS * LQ_WARPS;
        s.ccnt = reinterpret_cast<int*>(p); p += 4 * LQ_SLOTS * LQ_WARPS;
        s.red_l = reinterpret_cast<float*>(p); p += 4 * NPG * G;
        s.layers = reinterpret_cast<LqLayer*>(p); p += sizeof(LqLayer) * LQ_MAX_LAYERS;
        s.chunks = reinterpret_cast<LqChunk*>(p); p += sizeof(LqChunk) * LQ_CMAX * LQ_KINDS;
        s.full = reinterpret_cast<uint64_t*>(p); p += 8 * LQ_SLOTS;
        s.empty = reinterpret_cast<uint64_t*>(p); p += 8 * LQ_SLOTS;
        s.resv = reinterpret_cast<float*>(p);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < a.n_layers * (int)(sizeof(LqLayer) / 8); i += LQ_BLOCK)
        reinterpret_cast<unsigned long long*>(s.layers)[i] = reinterpret_cast<const unsigned long long*>(a.layers)[i];
    if (threadIdx.x == 0) {
        for (int i = 0; i < NTX_LQ_SLOTS; ++i) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(lq_smem(s.full + i)) : "memory");
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(lq_smem(s.empty + i)), "n"(LQ_GW) : "memory");
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int k = 0; k < LQ_KINDS; ++k) lq_mat_init(a, k);
        s.flag[1] = 0;  // the phases released to the producer (NTX_LQ_HOLD): 4 layer + phase
        for (int i = 0; i < LQ_SLOTS * LQ_WARPS; ++i) s.ccnt[i] = 0;
    }
    __syncthreads();
    if (threadIdx.x == 0) LQ_PMARK(1);
    if (threadIdx.x >= LQ_THREADS) {  // the producer warp: the block's chunks in order, a slot as soon as it is read
        // One layer's chunks of each kind (the same in every layer of a kind), issued layer after layer. Listing them
        // takes ~20 us (the q|k|v byte shares' 64-bit divisions, ~80 chunks by one lane), so the first launch keeps the
        // block's list of each kind its layers have in a.lists ([0]: the count, then the chunks; zero until then) and
        // later ones copy them (the whole warp).
        unsigned used = 0;  // the kinds of the layers (bit k)
        for (int l = 0; l < a.n_layers; ++l) {
            if (s.layers[l].kind >= LQ_KINDS) __trap();  // (the host's table: StackDecode)
            used |= 1u << (unsigned)s.layers[l].kind;
        }
        uint2* gls = reinterpret_cast<uint2*>(a.lists) + (size_t)blockIdx.x * LQ_KINDS * (LQ_CMAX + 1);
        int ncs[LQ_KINDS];
#pragma unroll
        for (int k = 0; k < LQ_KINDS; ++k) {
            const uint2* gl = gls + k * (LQ_CMAX + 1);
            ncs[k] = NTX_LQ_RELIST ? 0 : (int)__ldcg(&gl->x);
            for (int i = (int)(threadIdx.x & 31); i < ncs[k]; i += 32)
                reinterpret_cast<uint2*>(s.chunks + k * LQ_CMAX)[i] = __ldcg(gl + 1 + i);
        }
        __syncwarp();
        // the producer's loop: the whole warp where K-slice chunks' row copies go out from as many lanes (NTX_LQ_KS),
        // else its first lane alone
        const int pl = NTX_LQ_KS ? (int)(threadIdx.x & 31) : 0;
        if (NTX_LQ_KS || threadIdx.x == LQ_THREADS) {
#pragma unroll 1
            for (int k = 0; k < LQ_KINDS; ++k) {  // (one copy of the listing code: it runs once)
                if (pl == 0 && ncs[k] == 0 && ((used >> k) & 1u)) {
                    LqChunk* ch = s.chunks + k * LQ_CMAX;
                    uint2* gl = gls + k * (LQ_CMAX + 1);
                    int nc = 0;
#if NTX_LQ_KS
                    nc = lq_list(a, lq_mts[k], ch);
#else
                    LqFill f;
                    f.start(a, lq_mts[k]);
                    while (f.layer == 0 && nc < LQ_CMAX) ch[nc++] = f.next(a);
                    if (f.layer == 0) __trap();  // more chunks than the list holds (cuda_layers.stack_unfit checks)
#endif
                    for (int i = 0; i < nc; ++i) gl[1 + i] = reinterpret_cast<const uint2*>(ch)[i];
                    __threadfence();  // the chunks before the count (a later launch only reads both after this one)
                    gl->x = (unsigned)nc;
                    ncs[k] = nc;
                }
                if (NTX_LQ_KS) {
                    ncs[k] = __shfl_sync(0xffffffffu, ncs[k], 0);
                    __syncwarp();
                }
            }
            LQ_PMARK(2);
            const unsigned long long pol = lq_policy();
            const int kvd = lq_kvd(a);
            const unsigned rel = lq_smem(s.flag + 1);
            unsigned i = 0;
            int i0 = 0;  // NTX_LQ_RTRACE: the traced layer's first chunk
            int nph = 0;  // chunks of the phase issued
            const LqMat* mt = lq_mts[0];  // the layer's type mix
            // the next chunk (words row, w1) into the next slot once it is read; end: the end of a phase
            auto put = [&](int layer, int ph, unsigned row, unsigned w1, bool end) {
                const int slot = i % NTX_LQ_SLOTS;
                if (i >= NTX_LQ_SLOTS) lq_wait_bar(s.empty + slot, (i / NTX_LQ_SLOTS - 1) & 1);
                if (NTX_LQ_RTRACE && pl == 0 && layer >= LQ_RT_LAYER) LQ_RMARK((int)(i - NTX_LQ_SLOTS) - i0, 2, global_ns());
                // held until the consumers release the phase (lq_release)
                if (!end && ((NTX_LQ_HOLD >> ph) & 1) && nph++ >= (ph == 3 ? NTX_LQ_PRE3 : ph == 0 ? NTX_LQ_PRE0 : ph == 2 ? NTX_LQ_PRE2 : 0)) {
                    const int q = 4 * layer + ph;
                    if (lq_lds_vol(rel) < q) {
                        const unsigned long long t0 = global_ns();
                        while (lq_lds_vol(rel) < q)
                            if (global_ns() - t0 > LQ_DEADLINE_NS) __trap();
                    }
                }
                if (pl == 0) asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(lq_smem(s.desc + slot)), "r"(row), "r"(w1) : "memory");
                if (end) {
                    if (pl == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(lq_smem(s.full + slot)) : "memory");
                } else {
                    lq_issue(row, w1, lq_smem(s.layers + layer), mt, a.D, kvd, s.ring + (size_t)slot * LQ_SLOT,
                             s.full + slot, pol, pl);
                }
                if (NTX_LQ_RTRACE && pl == 0 && layer == LQ_RT_LAYER) {
                    LQ_RMARK((int)i - i0, 0, global_ns());
                    LQ_RMARK((int)i - i0, 3, (unsigned long long)ph);
                }
                ++i;
            };
            for (int layer = 0; layer < a.n_layers; ++layer) {
                if (NTX_LQ_RTRACE && layer == LQ_RT_LAYER) i0 = (int)i;
                unsigned* pools = a.ctr + (size_t)layer * (LQ_NCTR + a.n_kv) + LQ_POOLCTR;
                const int kind = (int)s.layers[layer].kind, nc = ncs[kind];
                const unsigned tab = lq_smem(s.chunks + kind * LQ_CMAX);
                mt = lq_mts[kind];
                int c = 0;
                for (int ph = 0; ph < 4; ++ph) {
                    nph = 0;
                    const int npool = lq_pool(a, mt, ph), pool0 = lq_owned(a, mt, ph), rpc = lq_rpc(mt, ph);
                    for (; c < nc; ++c) {  // the block's own chunks of the phase
                        unsigned row, w1;
                        asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(row), "=r"(w1) : "r"(tab + 8u * (unsigned)c) : "memory");
                        if (lq_chunk_ph(w1) != ph) break;
                        put(layer, ph, row, w1, NTX_LQ_KS && (w1 & 0xffffu) == 0);  // (an empty K-slice chunk: no copy)
                        if (NTX_LQ_PTRACE && layer == 0 && ph == 0 && c == 0) LQ_PMARK(3);
                    }
                    while (npool > 0) {  // the pool's chunks, while there are any
                        unsigned k = 0;
                        if (pl == 0) asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(k) : "l"(pools + ph) : "memory");
                        if (NTX_LQ_KS) k = __shfl_sync(0xffffffffu, k, 0);
                        if ((int)k >= npool) break;
                        const LqChunk e = lq_chunk(a, ph, pool0 + (int)k * rpc, rpc);
                        put(layer, ph, e.row, lq_chunk_w1(e), false);
                    }
#if NTX_LQ_L2GU
                    if (ph == 1) lq_l2_ahead(tab, c, nc, lq_smem(s.layers + layer), mt, pl);
#endif
                    for (int g = 0; g < LQ_GROUPS; ++g) put(layer, ph, 0u, 0u, true);  // each group's end of the phase
                }
            }
        }
        return;
    }
    // the consumers: the weights of the first chunks are on their way before the wait for the
    // kernel before (the embedding)
    asm volatile("griddepcontrol.wait;" ::: "memory");
    if (threadIdx.x == 0) LQ_PMARK(4);
    unsigned it = 0;
    const unsigned P = gridDim.x;
    // a.trace (a benchmark's tool, null otherwise): every block's thread 0
    // writes the GPU clock at LQ_MARKS points of each layer (cuda_layers.StackDecode.trace)
#define LQ_MARK(k) do { if (!NTX_LQ_ATRACE || (k) < 4) LQ_TMARK(layer, k); } while (0)
    for (int layer = 0; layer < a.n_layers; ++layer) {
        const LqLayer& L = s.layers[layer];
        const LqMat* mt = lq_mts[L.kind];
        unsigned* ctr = a.ctr + (size_t)layer * (LQ_NCTR + a.n_kv);
        const float* xin = layer == 0 ? a.x0 : a.xb;
        if (NTX_LQ_RTRACE && threadIdx.x == 0) {  // the consumers' first chunk of the traced layer
            s.flag[2] = (int)it;
            s.flag[3] = layer == LQ_RT_LAYER;
        }
        LQ_MARK(0);
        if (layer > 0) lq_wait(ctr - (LQ_NCTR + a.n_kv) + 4, P);
        lq_release(s, 4 * layer + 0);
        LQ_MARK(1);
        lq_norm_row(xin, L.attn_norm, a.D, a.eps, s);
        if (layer == 0 && threadIdx.x == 0) LQ_PMARK(5);
        LQ_MARK(2);
        lq_phase(a, mt, 0, s, it, nullptr, [&](int r, float t, float, float) { a.qkv[r] = t; });
        LQ_MARK(3);
        if (layer == 0 && threadIdx.x == 0) LQ_PMARK(6);
        lq_signal(ctr + 0);
        if ((int)blockIdx.x < a.n_kv * a.chunks) {  // each waits for every q/k/v row inside
            if (G <= 2)
                lq_attention<V, 2>(a, L, layer, blockIdx.x, s, ctr + 0);
            else if (G <= 4)
                lq_attention<V, 4>(a, L, layer, blockIdx.x, s, ctr + 0);
            else
                lq_attention<V, LQ_GMAX>(a, L, layer, blockIdx.x, s, ctr + 0);
        }
        LQ_MARK(4);
        if (NTX_LQ_ATRACE && (int)blockIdx.x >= a.n_kv * a.chunks)
            for (int k = 4; k < 12; ++k) LQ_TMARK(layer, k);
        if ((int)blockIdx.x >= a.n_kv * a.chunks) lq_release(s, 4 * layer + 1);
        lq_wait(ctr + 1, a.n_kv);
        LQ_MARK(5);
        LQ_AMARK(12);
        lq_load_act(a.hq + a.F, a.hqd + a.F / 32, a.D, s);  // the heads' outputs, quantized by their combining blocks
        LQ_MARK(6);
        LQ_AMARK(13);
        lq_phase(a, mt, 1, s, it, xin, [&](int r, float t, float, float rv) { a.xa[r] = __fadd_rn(rv, t); });
        LQ_MARK(7);
        lq_signal(ctr + 2);
        lq_wait(ctr + 2, P);
        lq_release(s, 4 * layer + 2);
        LQ_MARK(8);
        lq_norm_row(a.xa, L.ffn_norm, a.D, a.eps, s);
        LQ_MARK(9);
        lq_phase(a, mt, 2, s, it, nullptr, [&](int r, float g, float u, float) { a.hid[r] = ntx_swiglu(g, u); });
        LQ_MARK(10);
        lq_signal(ctr + 3);
        lq_wait(ctr + 3, P);
        LQ_MARK(11);
        lq_quant_share(a.hid, a.F, a.hq, a.hqd, ctr + 5, s, 4 * layer + 3);
        LQ_MARK(12);
        lq_phase(a, mt, 3, s, it, a.xa, [&](int r, float t, float, float rv) { a.xb[r] = __fadd_rn(rv, t); });
        LQ_MARK(13);
        lq_signal(ctr + 4);
    }
}

#define LQ_KERNEL(V)                                                                                               \
    extern "C" __global__ void __launch_bounds__(LQ_BLOCK, 1) layer_q8_hd##V(LQ_PARAMS) {                         \
        __shared__ LqArgs sa; /* in shared memory: the helpers take it by reference (no local copy) */          \
        if (threadIdx.x == 0)                                                                                      \
            sa = {layers, n_layers, x0, xa, xb, qkv, hid, part, hq, hqd, ctr, pos, rope_ff, rope_dim,                  \
                  rope_scale, freq_scale, neox, D, F, n_head, n_kv, chunks, eps, scale, types, types1, trace, lists};             \
        __syncthreads();                                                                                           \
        lq_step<V / 32>(sa);                                                                                       \
    }
#else
#define LQ_KERNEL(V) \
    extern "C" __global__ void __launch_bounds__(LQ_BLOCK, 1) layer_q8_hd##V(LQ_PARAMS) {}
#endif

LQ_KERNEL(64)
LQ_KERNEL(128)
