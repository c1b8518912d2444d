// The dp4a matvec building blocks shared by matvec_fast.cu (one weight a launch) and fused.cu
// (several weights a launch, fused epilogues): the 16-byte group streaming of one row by one
// warp (fast_row, over the unit decoders of fast_units.cuh) and the per-block int8 activation
// quantizers. See matvec_fast.cu for the layout of the work and the activation format.
#pragma once
#include "ntx_quants.cuh"
#include "act_quant.cuh"
#include "rmsnorm.cuh"
#include "warp.cuh"
#include "fast_units.cuh"
#include "matvec_reg.cuh"

// Launch shape (overridable for tuning runs, cuda_nvrtc.TUNABLE): rows (warps) per block and the
// minimum resident blocks per SM of the n1 kernels (caps their registers); blocks per group and
// the unit decoders: fast_units.cuh.
#ifndef NTX_FAST_WARPS
#define NTX_FAST_WARPS 4
#endif
#ifndef NTX_FAST_MINB
#define NTX_FAST_MINB 8
#endif

// Units a lane decodes at once (an item, decode_items): 2 for the paired Q6_K decode, else 1.
// (Functions, not static members: under -default-device each member would be a symbol of every cubin.)
template <class F>
constexpr int fast_per() { return 1; }
#if NTX_Q6_PAIR
template <>
constexpr int fast_per<FastQ6_K>() { return 2; }
#endif
// The fused kernels (fast_row_any, fast_row_pair_any: every type's decode under one register
// bound) keep the unit Q6_K decode: the paired one holds ~10 more registers (two units'
// activations with 18 ql/qh words) than the multi (64) and swiglu (80) bounds leave, and
// spilled there; matvecf_q6_k_n1 (the Q6_K down projection and output) takes it.
// They decode a lane's units one at a time but in the paired decode's order (fast_pair_order:
// units s and s + 2 of an item, items lane, lane + 32, ...), so a Q6_K row gives the same bits in
// the fused kernels as in matvecf_q6_k (tests/cuda/test_fused_gpu.py holds them to that).
template <class F>
constexpr bool fast_pair_order() { return false; }
#if NTX_Q6_PAIR
struct FastQ6_KFused : FastQ6_K {};
template <>
constexpr int fast_per<FastQ6_KFused>() { return 1; }
template <>
constexpr bool fast_pair_order<FastQ6_KFused>() { return true; }
#define NTX_Q6_ANY FastQ6_KFused
#else
#define NTX_Q6_ANY FastQ6_K
#endif

// The register decode a type's rows take where q4k_reg_order(k) (fast_row, fast_row_start, fast_row_pair): R, none for
// most types; Q4_K's and Q5_K's matvec_reg.cuh's order. PRE: its first pass is loaded before the PDL wait
// (fast_row_start) — Q4_K's; a pass of Q5_K (80 bytes) is more than NTX_PRE_SLOTS' 64, and the fused kernels, which
// pair rows (fast_row_pair), take no Q5_K.
template <class F>
struct FastReg {
    static const bool ON = false, PRE = false;
};
template <>
struct FastReg<FastQ4_K> {
    typedef RegQ4K R;
    static const bool ON = true, PRE = true;
};
template <>
struct FastReg<FastQ5_K> {
    typedef RegQ5K R;
    static const bool ON = true, PRE = false;
};

template <class F>
struct FastGroup {
    static const int BYTES = F::G * F::B::BYTES;
    static const int CHUNKS = BYTES / 16;
    static const int CH = (CHUNKS + 31) / 32;  // 16-byte loads per lane per group
    static_assert(BYTES % 16 == 0, "a group must be whole 16-byte chunks");
};

template <class F>
__device__ __forceinline__ void load_group(uint4* r, const uint8_t* __restrict__ src, int nbytes, int lane) {
#pragma unroll
    for (int c = 0; c < FastGroup<F>::CH; ++c) {
        const int off = 16 * (lane + 32 * c);
        if (off < nbytes) r[c] = __ldcs(reinterpret_cast<const uint4*>(src + off));
    }
}

// This lane's chunks of a group (nbytes of it exist) from registers into the warp's stage.
template <class F>
__device__ __forceinline__ void stage_group(uint8_t* st, const uint4* r, int nbytes, int lane) {
#pragma unroll
    for (int c = 0; c < FastGroup<F>::CH; ++c) {
        const int off = 16 * (lane + 32 * c);
        if (off < nbytes) *reinterpret_cast<uint4*>(st + off) = r[c];
    }
}

// --- the paired decode (NTX_Q6_PAIR) ----------------------------------------------------------
// An item is what one lane decodes at once: PER units of one block. LANE: at most how many items
// a lane takes in a group, a compile-time count, so the loops over them unroll.
template <class F>
struct FastItems {
    static const int PER = fast_per<F>(), PER_BLOCK = F::B::UNITS / PER;
    static const int LANE = (F::G * PER_BLOCK + 31) / 32;
    static_assert(PER > 1 && F::B::UNITS % PER == 0, "an item is several whole units of one block");
    // the block's unit number of unit e of item i
    static __device__ __forceinline__ int unit(int i, int e) { return F::unit_of(i, e); }
    // r[e]: unit e's dot product (F::unit's value)
    static __device__ __forceinline__ void decode(const uint8_t* b, int i, const UnitX* a, float* r) {
        F::pair(b, i, a, r);
    }
};

// The activations of item `it` of the group (blocks g0..) in one activation row (xq, xd, xs at
// that row): x, scale d and sum s of each of its units.
template <class F>
__device__ __forceinline__ void load_item(int g0, int it, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, UnitX* a) {
    typedef FastItems<F> It;
#pragma unroll
    for (int e = 0; e < It::PER; ++e) {
        const int col32 = (g0 + it / It::PER_BLOCK) * (F::B::QK / 32) + It::unit(it % It::PER_BLOCK, e);
        ldx(xq + 32 * (size_t)col32, a[e].x);
        a[e].d = __ldg(xd + col32);
        a[e].s = __ldg(xs + col32);
    }
}

// decode_group in items (lane, lane + 32, ... below `items`). With one activation row (decode)
// every item's activation loads are issued before any arithmetic (the loop of decode_group waits
// on each unit's loads, L1 hits, before its arithmetic). With more rows each item loads a row's
// activations just before its arithmetic (all of them at once would hold N x 8 words an item:
// ~250 registers a thread for N = 8). Each row adds the same terms in the same order for every N,
// so a token's row of an N-row product equals its one-row product bit for bit.
template <class F, int N>
__device__ __forceinline__ void decode_items(const uint8_t* sg, int g0, int nb, const int8_t* __restrict__ xq,
                                             const float* __restrict__ xd, const float* __restrict__ xs, int k,
                                             int k32, int n, int lane, float* acc) {
    typedef FastItems<F> It;
    const int items = min(F::G, nb - g0) * It::PER_BLOCK;
    UnitX a[It::LANE][N][It::PER];
    if constexpr (N == 1) {
#pragma unroll
        for (int i = 0; i < It::LANE; ++i)
            if (lane + 32 * i < items) load_item<F>(g0, lane + 32 * i, xq, xd, xs, a[i][0]);
    }
#pragma unroll
    for (int i = 0; i < It::LANE; ++i) {
        const int it = lane + 32 * i;
#pragma unroll
        for (int t = 0; t < N; ++t) {
            if (it < items && t < n) {
                if constexpr (N > 1)
                    load_item<F>(g0, it, xq + (size_t)t * k, xd + (size_t)t * k32, xs + (size_t)t * k32, a[i][t]);
                float r[It::PER];
                It::decode(sg + it / It::PER_BLOCK * F::B::BYTES, it % It::PER_BLOCK, a[i][t], r);
#pragma unroll
                for (int e = 0; e < It::PER; ++e) acc[t] += a[i][t][e].d * r[e];
            }
        }
    }
}

// Unit j of block bl of the group (blocks g0.., staged at sg) against the n activation rows, added to acc.
template <class F, int N>
__device__ __forceinline__ void unit_terms(const uint8_t* sg, int g0, int bl, int j, const int8_t* __restrict__ xq,
                                           const float* __restrict__ xd, const float* __restrict__ xs, int k, int k32,
                                           int n, float* acc) {
    const int col32 = (g0 + bl) * (F::B::QK / 32) + j;  // global index of the 32 values
#pragma unroll
    for (int t = 0; t < N; ++t) {
        if (t < n) {
            int x[8];
            ldx(xq + (size_t)t * k + 32 * (size_t)col32, x);
            const size_t si = (size_t)t * k32 + col32;
            acc[t] += __ldg(xd + si) * F::unit(sg + bl * F::B::BYTES, j, x, __ldg(xs + si));
        }
    }
}

// The lane's units of a group (blocks g0..) in decoding order, as fn(block, unit): units lane,
// lane + 32, ...; for fast_pair_order types the paired decode's order (items lane, lane + 32, ...,
// units s and s + 2 of each, one at a time: the fused kernels' register bounds).
template <class F, class Fn>
__device__ __forceinline__ void each_unit(int g0, int nb, int lane, Fn fn) {
    if constexpr (fast_pair_order<F>()) {
        constexpr int PB = F::B::UNITS / 2;  // items a block
        const int items = min(F::G, nb - g0) * PB;
        for (int it = lane; it < items; it += 32) {
#pragma unroll 1
            for (int e = 0; e < 2; ++e) fn(it / PB, F::unit_of(it % PB, e));
        }
    } else {
        const int units = min(F::G, nb - g0) * F::B::UNITS;
        for (int u = lane; u < units; u += 32) fn(u / F::B::UNITS, u % F::B::UNITS);
    }
}

// The units of one group (blocks g0.. of the row, staged at sg) against the n activation rows,
// in each_unit's order (k32 = k / 32 comes from the caller).
template <class F, int N>
__device__ __forceinline__ void decode_group(const uint8_t* sg, int g0, int nb, const int8_t* __restrict__ xq,
                                             const float* __restrict__ xd, const float* __restrict__ xs,
                                             int k, int k32, int n, int lane, float* acc) {
    if constexpr (fast_per<F>() > 1) {
        decode_items<F, N>(sg, g0, nb, xq, xd, xs, k, k32, n, lane, acc);
        return;
    }
    each_unit<F>(g0, nb, lane, [&](int bl, int j) { unit_terms<F, N>(sg, g0, bl, j, xq, xd, xs, k, k32, n, acc); });
}

// NTX_PRE_WAIT = P (default 1; 0 turns it off, at most 2): the kernels load the first P groups of
// each warp's row into registers before the PDL wait (a weight never depends on the kernel
// before), so a launch's first HBM round trips overlap the previous kernel's tail; the same sums
// in the same order. P = 1 with NTX_SWIGLU_PAIR on the H200: 8B decode +2.6 % (Q4_K_M), +3.3 % (Q8_0).
#ifndef NTX_PRE_WAIT
#define NTX_PRE_WAIT 1
#endif
static_assert(NTX_PRE_WAIT >= 0 && NTX_PRE_WAIT <= 2, "NTX_PRE_WAIT is 0, 1 or 2 groups");
// A stage that fits every type's group (+ 16 bytes: ld8's ninth word), and the 16-byte chunks a
// lane holds of the largest group.
#define NTX_MAX2(a, b) ((a) > (b) ? (a) : (b))
#define NTX_FAST_STAGE \
    (NTX_MAX2(NTX_MAX2(NTX_G_Q4_K * 144, NTX_G_Q5_K * 176), NTX_MAX2(NTX_G_Q6_K * 210, NTX_G_Q8_0 * 34)) + 16)
#define NTX_CH_MAX ((NTX_FAST_STAGE - 16 + 511) / 512)
#define NTX_PRE_SLOTS (NTX_CH_MAX * (NTX_PRE_WAIT > 1 ? NTX_PRE_WAIT : 1))  // registers a row's preload takes

// The first NTX_PRE_WAIT groups of row `row` of W into r (group i at r + i * NTX_CH_MAX, each
// lane its chunks): fast_row's first loads.
template <class F>
__device__ __forceinline__ void fast_row_start(const uint8_t* __restrict__ W, int row, int k, uint4* r) {
    static_assert(FastGroup<F>::CH <= NTX_CH_MAX, "NTX_CH_MAX too small");
    const int row_bytes = k / F::B::QK * F::B::BYTES, lane = threadIdx.x & 31;
    const uint8_t* wrow = W + (size_t)row * row_bytes;
    if constexpr (FastReg<F>::ON) {
        if (q4k_reg_order(k)) {  // reg_row_n's first pass (without the preload: reg_row_n loads it itself)
            if constexpr (FastReg<F>::PRE) {
                typedef typename FastReg<F>::R R;
                static_assert(sizeof(typename R::W) <= NTX_PRE_SLOTS * sizeof(uint4), "a pass fits the preload");
                R::load(wrow, 0, k / 256, lane, *reinterpret_cast<typename R::W*>(r));
            }
            return;
        }
    }
    load_group<F>(r, wrow, min(FastGroup<F>::BYTES, row_bytes), lane);
    if (NTX_PRE_WAIT > 1 && FastGroup<F>::BYTES < row_bytes)
        load_group<F>(r + NTX_CH_MAX, wrow + FastGroup<F>::BYTES, min(FastGroup<F>::BYTES, row_bytes - FastGroup<F>::BYTES),
                      lane);
}

// The group fast_row streams next after g0: the preloaded second group, or a load.
template <class F, bool PRE>
__device__ __forceinline__ void next_group(uint4* r, const uint4* pre, const uint8_t* wrow, int g0, int row_bytes,
                                           int lane) {
    const int next = (g0 + F::G) * F::B::BYTES;
    if (next >= row_bytes) return;
    if (PRE && NTX_PRE_WAIT > 1 && g0 == 0) {
#pragma unroll
        for (int c = 0; c < FastGroup<F>::CH; ++c) r[c] = pre[NTX_CH_MAX + c];
    } else {
        load_group<F>(r, wrow + next, min(FastGroup<F>::BYTES, row_bytes - next), lane);
    }
}

// Row `row` of W (k columns) times the n <= N activation rows, by one warp: every lane returns
// the totals in acc. st is the warp's stage, at least FastGroup<F>::BYTES + 16 bytes.
// PRE: the caller loaded the row's first group into pre (fast_row_start).
template <class F, int N, bool PRE = false>
__device__ __forceinline__ void fast_row(const uint8_t* __restrict__ W, int row, const int8_t* __restrict__ xq,
                                         const float* __restrict__ xd, const float* __restrict__ xs,
                                         uint8_t* st, int k, int n, float* acc, const uint4* pre = nullptr) {
    if constexpr (FastReg<F>::ON) {
        if (q4k_reg_order(k)) {  // Q4_K / Q5_K rows in matvec_reg.cu's order (its one-row bits)
            typedef typename FastReg<F>::R R;
            reg_row_n<R, N>(W, row, xq, xd, xs, k, n, acc,
                            PRE && FastReg<F>::PRE ? reinterpret_cast<const typename R::W*>(pre) : nullptr, st);
            return;
        }
    }
    const int lane = threadIdx.x & 31;
    const int nb = k / F::B::QK, row_bytes = nb * F::B::BYTES, k32 = k / 32;
    const uint8_t* wrow = W + (size_t)row * row_bytes;
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.f;
    typedef FastGroup<F> Grp;
    uint4 r[Grp::CH];
    if constexpr (PRE) {
#pragma unroll
        for (int c = 0; c < Grp::CH; ++c) r[c] = pre[c];
    } else {
        load_group<F>(r, wrow, min(Grp::BYTES, row_bytes), lane);
    }
    for (int g0 = 0; g0 < nb; g0 += F::G) {
        stage_group<F>(st, r, min(Grp::BYTES, row_bytes - g0 * F::B::BYTES), lane);
        __syncwarp();
        next_group<F, PRE>(r, pre, wrow, g0, row_bytes, lane);
        decode_group<F, N>(st, g0, nb, xq, xd, xs, k, k32, n, lane, acc);
        __syncwarp();
    }
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = warp_sum(acc[t]);
}

// unit_terms for rows A and B (staged at sa and sb) and one activation row, its loads shared.
template <class F>
__device__ __forceinline__ void unit_terms2(const uint8_t* sa, const uint8_t* sb, int g0, int bl, int j,
                                            const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                            const float* __restrict__ xs, float* a, float* b) {
    const int col32 = (g0 + bl) * (F::B::QK / 32) + j;
    int x[8];
    ldx(xq + 32 * (size_t)col32, x);
    const float d = __ldg(xd + col32), sx = __ldg(xs + col32);
    *a += d * F::unit(sa + bl * F::B::BYTES, j, x, sx);
    *b += d * F::unit(sb + bl * F::B::BYTES, j, x, sx);
}

// decode_group for rows A and B of the same type at once: each unit's activations are loaded
// once for both rows (the L1 traffic of the int8 activations is as large as the weights' own for
// Q4_K). Each row adds the same terms in the same order as decode_group.
template <class F>
__device__ __forceinline__ void decode_group2(const uint8_t* sa, const uint8_t* sb, int g0, int nb,
                                              const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                              const float* __restrict__ xs, int lane, float* a, float* b) {
    static_assert(fast_per<F>() == 1, "the paired rows take the unit decode (NTX_Q6_ANY)");
    each_unit<F>(g0, nb, lane, [&](int bl, int j) { unit_terms2<F>(sa, sb, g0, bl, j, xq, xd, xs, a, b); });
}

// Row `row` of Wa and of Wb (same type and k) times one activation row, by one warp, the two
// rows' groups streamed side by side (two stages at st): fast_row's results for each, bit for bit.
// pre: the rows' fast_row_start loads when NTX_PRE_WAIT (row a's at pre, row b's at
// pre + NTX_PRE_SLOTS); unread otherwise.
template <class F>
__device__ __forceinline__ void fast_row_pair(const uint8_t* __restrict__ Wa, const uint8_t* __restrict__ Wb,
                                              int row, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                              const float* __restrict__ xs, uint8_t* st, int k, float* a,
                                              float* b, const uint4* pre) {
    static_assert(FastReg<F>::PRE || !FastReg<F>::ON, "the fused kernels take no Q5_K rows (cuda_kernels.FAST_CODES)");
    if constexpr (FastReg<F>::ON) {
        if (q4k_reg_order(k)) {  // one row after the other, as fast_row gives each
            fast_row<F, 1, NTX_PRE_WAIT != 0>(Wa, row, xq, xd, xs, st, k, 1, a, pre);
            fast_row<F, 1, NTX_PRE_WAIT != 0>(Wb, row, xq, xd, xs, st, k, 1, b, pre + NTX_PRE_SLOTS);
            return;
        }
    }
    typedef FastGroup<F> Grp;
    const int lane = threadIdx.x & 31, nb = k / F::B::QK, row_bytes = nb * F::B::BYTES;
    const uint8_t* ra = Wa + (size_t)row * row_bytes;
    const uint8_t* rb = Wb + (size_t)row * row_bytes;
    uint8_t* sb = st + NTX_FAST_STAGE;
    *a = *b = 0.f;
    constexpr bool PRE = NTX_PRE_WAIT > 0;
    uint4 qa[Grp::CH], qb[Grp::CH];
    if constexpr (PRE) {
#pragma unroll
        for (int c = 0; c < Grp::CH; ++c) qa[c] = pre[c], qb[c] = pre[NTX_PRE_SLOTS + c];
    } else {
        load_group<F>(qa, ra, min(Grp::BYTES, row_bytes), lane);
        load_group<F>(qb, rb, min(Grp::BYTES, row_bytes), lane);
    }
    for (int g0 = 0; g0 < nb; g0 += F::G) {
        const int nbytes = min(Grp::BYTES, row_bytes - g0 * F::B::BYTES);
#pragma unroll
        for (int c = 0; c < Grp::CH; ++c) {  // stage_group for both rows, their stores interleaved
            const int off = 16 * (lane + 32 * c);
            if (off < nbytes) {
                *reinterpret_cast<uint4*>(st + off) = qa[c];
                *reinterpret_cast<uint4*>(sb + off) = qb[c];
            }
        }
        __syncwarp();
        next_group<F, PRE>(qa, pre, ra, g0, row_bytes, lane);
        next_group<F, PRE>(qb, pre + NTX_PRE_SLOTS, rb, g0, row_bytes, lane);
        decode_group2<F>(st, sb, g0, nb, xq, xd, xs, lane, a, b);
        __syncwarp();
    }
    *a = warp_sum(*a);
    *b = warp_sum(*b);
}

// Type codes of the fused kernels (cuda_kernels.FAST_CODES).
#define NTX_FT_Q4_K 0
#define NTX_FT_Q6_K 1
#define NTX_FT_Q8_0 2
static_assert(FastGroup<FastQ4_K>::BYTES + 16 <= NTX_FAST_STAGE && FastGroup<FastQ6_K>::BYTES + 16 <= NTX_FAST_STAGE &&
              FastGroup<FastQ8_0>::BYTES + 16 <= NTX_FAST_STAGE && FastGroup<FastQ5_K>::BYTES + 16 <= NTX_FAST_STAGE,
              "NTX_FAST_STAGE too small");

// fast_row_start for a weight whose type is only known at run time.
__device__ __forceinline__ void fast_row_start_any(int type, const uint8_t* W, int row, int k, uint4* r) {
    if (type == NTX_FT_Q4_K) fast_row_start<FastQ4_K>(W, row, k, r);
    else if (type == NTX_FT_Q6_K) fast_row_start<FastQ6_K>(W, row, k, r);
    else fast_row_start<FastQ8_0>(W, row, k, r);
}

// fast_row_pair for two weights of one run-time type.
__device__ __forceinline__ void fast_row_pair_any(int type, const uint8_t* Wa, const uint8_t* Wb, int row,
                                                  const int8_t* xq, const float* xd, const float* xs, uint8_t* st,
                                                  int k, float* a, float* b, const uint4* pre) {
    if (type == NTX_FT_Q4_K) fast_row_pair<FastQ4_K>(Wa, Wb, row, xq, xd, xs, st, k, a, b, pre);
    else if (type == NTX_FT_Q6_K) fast_row_pair<NTX_Q6_ANY>(Wa, Wb, row, xq, xd, xs, st, k, a, b, pre);
    else fast_row_pair<FastQ8_0>(Wa, Wb, row, xq, xd, xs, st, k, a, b, pre);
}

// fast_row for a weight whose type is only known at run time (warp-uniform branch).
template <int N, bool PRE = false>
__device__ __forceinline__ void fast_row_any(int type, const uint8_t* W, int row, const int8_t* xq, const float* xd,
                                             const float* xs, uint8_t* st, int k, int n, float* acc,
                                             const uint4* pre = nullptr) {
    if (type == NTX_FT_Q4_K) fast_row<FastQ4_K, N, PRE>(W, row, xq, xd, xs, st, k, n, acc, pre);
    else if (type == NTX_FT_Q6_K) fast_row<NTX_Q6_ANY, N, PRE>(W, row, xq, xd, xs, st, k, n, acc, pre);
    else fast_row<FastQ8_0, N, PRE>(W, row, xq, xd, xs, st, k, n, acc, pre);
}

// --- activations as int8 + per-32 scale and sum ------------------------------------------
// The same quantizers as matvec.cu's quant_q8_1 / quant_q8_k (act_quant.cuh's scalar steps), so
// xd * xq equals their x_hat exactly (Q8_0/Q8_1) or before its one float rounding (Q8_K).

// One 32-value block b (Q8_0/Q8_1 scale) by one warp, lane's value v.
__device__ __forceinline__ void quanti_q8_1_value(float v, int8_t* xq, float* xd, float* xs, size_t b, int lane) {
    float d, inv;
    ntx_q8_scale(warp_max(fabsf(v)), &d, &inv);
    const float q = ntx_q8_q(v, inv);
    xq[32 * b + lane] = (int8_t)(int)q;
    const float sum = warp_sum(q);  // small integers: exact in any order
    if (lane == 0) {
        xd[b] = ntx_round_f16(d);
        xs[b] = sum;
    }
}

// One 32-value block b with its values at xb (anywhere: global or shared memory).
__device__ __forceinline__ void quanti_q8_1_from(const float* xb, int8_t* xq, float* xd, float* xs, size_t b,
                                                 int lane) {
    quanti_q8_1_value(xb[lane], xq, xd, xs, b, lane);
}

__device__ __forceinline__ void quanti_q8_1_block(const float* x, int8_t* xq, float* xd, float* xs, size_t b,
                                                  int lane) {
    quanti_q8_1_from(x + 32 * b, xq, xd, xs, b, lane);
}

// One 256-value block b (Q8_K, values at xb) by one warp.
__device__ __forceinline__ void quanti_q8_k_from(const float* xb, int8_t* xq, float* xd, float* xs, size_t b,
                                                 int lane) {
    float v[8];
    const int idx = ntx_q8k_pivot_warp(xb, v, lane);
    float iscale, d;
    ntx_q8k_scale(xb[idx], &iscale, &d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float q = ntx_q8k_q(v[i], iscale);
        xq[256 * b + lane + 32 * i] = (int8_t)(int)q;
        const float sum = warp_sum(q);
        if (lane == 0) {
            xd[8 * b + i] = d;
            xs[8 * b + i] = sum;
        }
    }
}

__device__ __forceinline__ void quanti_q8_k_block(const float* x, int8_t* xq, float* xd, float* xs, size_t b,
                                                  int lane) {
    quanti_q8_k_from(x + 256 * b, xq, xd, xs, b, lane);
}

