// The register-activation decode of Q4_K and Q5_K rows (one activation row): every lane decodes the same
// two units of every row its warp streams, so it loads its int8 activations once a launch and
// keeps them in registers (matvec_fast.cuh's lanes re-read a unit's activations from L1 for every
// row: 32 bytes of int8 for each 16 bytes of Q4_K quants, and the wait on them was the Q4_K
// kernels' first stall). The quants come straight from global memory: no shared-memory stage.
//
// Layout (reg_ppw and reg_wk give PPW and WK from k; cuda_kernels.reg_shape is the host's copy):
// - a pass is 8 blocks (2048 values) of a row: lane l decodes block l / 4 of the pass, units 2c
//   and 2c + 1 (c = l % 4: the low and high nibbles of the block's quant bytes 32c..32c+31),
//   from the block's 16-byte header and those 32 bytes (three 16-byte loads);
// - a warp takes PPW passes of a row (its k-slice), WK warps a row (a team); a row's value is the
//   warp sums of its slices added in slice order, so it depends on k alone, never on the launch
//   shape or on which kernel (plain, swiglu, multi) streams it: the fused kernels give the plain
//   kernel's bits;
// - a team streams its rows with the next row's loads in flight while the current one is decoded.
//
// A unit pair's integer sums are combined as ggml's vec_dot_q4_K_q8_K does:
// xd * (d * (sc0 s0 + sc1 s1) - dmin * (m0 xs0 + m1 xs1)), xd the activations' Q8_K scale.
#pragma once
#include "ntx_half.cuh"
#include "warp.cuh"
#include "fast_units.cuh"

#define NTX_REG_WARPS 8  // warps a block: WK x teams (WK <= 8)
// NTX_REG (default 1; 0: the dp4a kernels' own Q4_K order, and the host launches no
// matvec_reg.cu kernel: cuda_kernels.reg_build reads the define). The unit-decode build
// (NTX_Q6_PAIR=0, session 7's decode) is a build without it.
#ifndef NTX_REG
#define NTX_REG 1
#endif
#if !NTX_Q6_PAIR
#undef NTX_REG
#define NTX_REG 0
#endif

// (PPW, WK) for k columns: up to two passes one warp; up to 8 passes one pass a warp; up to 16
// two a warp; wider rows take matvec_fast (wk 0).
__host__ __device__ __forceinline__ int reg_ppw(int k) {
    const int p = (k / 256 + 7) / 8;
    return p <= 2 ? 2 : (p <= 8 ? 1 : 2);
}
__host__ __device__ __forceinline__ int reg_wk(int k) {
    const int p = (k / 256 + 7) / 8, ppw = reg_ppw(k), wk = (p + ppw - 1) / ppw;
    return wk <= NTX_REG_WARPS ? wk : 0;
}

// A lane's loads of one block: Q4_K's header (d, dmin, scales) and quant bytes 32c..32c+15, 32c+16..32c+31; Q5_K's
// (Q5 true: 176-byte blocks, the quant bytes at 48) also its 32 high-bit bytes, of which the lane takes bits 2c, 2c + 1.
template <bool Q5>
struct QKW {
    uint4 h, qa, qb;
};
template <>
struct QKW<true> {
    uint4 h, ha, hb, qa, qb;  // ha, hb: qh bytes 0..15, 16..31
};
typedef QKW<false> Q4KW;
typedef QKW<true> Q5KW;

template <int PPW>
struct Q4KActs {
    int x[PPW][16];  // unit 2c's 8 words, then unit 2c + 1's
    float d[PPW];
    int s[PPW][2];
};

// Whether the lane has a block in pass p0 + e of a row of nb blocks.
__device__ __forceinline__ bool reg_on(int p, int nb, int lane) { return 8 * p + lane / 4 < nb; }

// The lane's activations (Q8_K: xq int8, xd and xs per 32 values).
template <int PPW>
__device__ __forceinline__ void q4k_acts(const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                         const float* __restrict__ xs, int p0, int nb, int lane, Q4KActs<PPW>& a) {
#pragma unroll
    for (int e = 0; e < PPW; ++e) {
        if (!reg_on(p0 + e, nb, lane)) continue;
        const int b = 8 * (p0 + e) + lane / 4;
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int col32 = 8 * b + 2 * (lane & 3) + u;
            ldx(xq + 32 * (size_t)col32, a.x[e] + 8 * u);
            a.s[e][u] = (int)__ldg(xs + col32);
        }
        a.d[e] = __ldg(xd + 8 * b);
    }
}

// Scales and mins of units 2c and 2c + 1 from the header's 12 scale bytes (ggml's
// get_scale_min_k4, four bytes at a time).
__device__ __forceinline__ void q4k_scales(const uint4& h, int c, int* sc, int* mn) {
    uint32_t scw, mw;
    if (c < 2) {
        scw = h.y & 0x3F3F3F3Fu;
        mw = h.z & 0x3F3F3F3Fu;
    } else {
        scw = (h.w & 0x0F0F0F0Fu) | ((h.y >> 2) & 0x30303030u);
        mw = ((h.w >> 4) & 0x0F0F0F0Fu) | ((h.z >> 2) & 0x30303030u);
    }
    const int sh = 16 * (c & 1);
    sc[0] = (scw >> sh) & 0xFF;
    sc[1] = (scw >> (sh + 8)) & 0xFF;
    mn[0] = (mw >> sh) & 0xFF;
    mn[1] = (mw >> (sh + 8)) & 0xFF;
}

// One unit's integer dot product: nibble half `hi` of the 32 quant bytes against its 8 activation words.
__device__ __forceinline__ int q4k_unit_sum(const Q4KW& w, int hi, const int* x) {
    const uint32_t q[8] = {w.qa.x, w.qa.y, w.qa.z, w.qa.w, w.qb.x, w.qb.y, w.qb.z, w.qb.w};
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = __dp4a((int)((q[i] >> (4 * hi)) & 0x0F0F0F0Fu), x[i], s);
    return s;
}

// The pair's term from its two integer sums (h: the block's 16-byte header; Q5_K's is Q4_K's).
__device__ __forceinline__ float q4k_combine(const uint4& h, int c, int s0, int s1, float xd, const int* xs) {
    int sc[2], mn[2];
    q4k_scales(h, c, sc, mn);
    const int isum = sc[0] * s0 + sc[1] * s1, imin = mn[0] * xs[0] + mn[1] * xs[1];
    const float d = ntx_h2f((uint16_t)(h.x & 0xFFFFu)), dmin = ntx_h2f((uint16_t)(h.x >> 16));
    return xd * (d * (float)isum - dmin * (float)imin);
}

__device__ __forceinline__ float qk_pair(const Q4KW& w, int c, const int* x, float xd, const int* xs) {
    return q4k_combine(w.h, c, q4k_unit_sum(w, 0, x), q4k_unit_sum(w, 1, x + 8), xd, xs);
}

// Q5_K: lane c's units 2c and 2c + 1 take their fifth bits from bits 2c and 2c + 1 of all 32 qh bytes.
__device__ __forceinline__ int q5k_unit_sum(const Q5KW& w, int hi, int bit, const int* x) {
    const uint32_t q[8] = {w.qa.x, w.qa.y, w.qa.z, w.qa.w, w.qb.x, w.qb.y, w.qb.z, w.qb.w};
    const uint32_t h[8] = {w.ha.x, w.ha.y, w.ha.z, w.ha.w, w.hb.x, w.hb.y, w.hb.z, w.hb.w};
    int s = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        s = __dp4a((int)(((q[i] >> (4 * hi)) & 0x0F0F0F0Fu) | (((h[i] >> bit) & 0x01010101u) << 4)), x[i], s);
    return s;
}

__device__ __forceinline__ float qk_pair(const Q5KW& w, int c, const int* x, float xd, const int* xs) {
    return q4k_combine(w.h, c, q5k_unit_sum(w, 0, 2 * c, x), q5k_unit_sum(w, 1, 2 * c + 1, x + 8), xd, xs);
}

// --- the types the teams stream: R::W, a pass's loads in flight; R::Acts<PPW>; load, acts, and
// add, a pass's terms onto the lane's sum in the one order every kernel uses; RegQ4K::add_token,
// reg_row_n's form with one token's activations loaded for it)
template <bool Q5>
struct RegQK {
    typedef QKW<Q5> W;
    template <int PPW>
    using Acts = Q4KActs<PPW>;
    static const int BYTES = Q5 ? 176 : 144, QS = Q5 ? 48 : 16;  // block bytes, where its quant bytes start
    static __device__ __forceinline__ void load(const uint8_t* __restrict__ wrow, int p, int nb, int lane, W& w) {
        if (!reg_on(p, nb, lane)) return;
        const uint8_t* blk = wrow + BYTES * (size_t)(8 * p + lane / 4);  // 144, 176: every block 16-byte aligned
        const uint4* b4 = reinterpret_cast<const uint4*>(blk);
        const uint4* q = reinterpret_cast<const uint4*>(blk + QS + 32 * (lane & 3));
        w.h = __ldcs(b4);
        if constexpr (Q5) {
            w.ha = __ldcs(b4 + 1);
            w.hb = __ldcs(b4 + 2);
        }
        w.qa = __ldcs(q);
        w.qb = __ldcs(q + 1);
    }
    template <int PPW>
    static __device__ __forceinline__ void acts(const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                                const float* __restrict__ xs, int p0, int nb, int lane, Acts<PPW>& a) {
        q4k_acts<PPW>(xq, xd, xs, p0, nb, lane, a);
    }
    // pass e of the lane's slice (pass p): acc += the lane's pair of units
    template <int PPW>
    static __device__ __forceinline__ void add(float& acc, const W& w, const Acts<PPW>& a, int e, int p, int nb,
                                               int lane, uint8_t*) {
        if (reg_on(p, nb, lane)) acc += qk_pair(w, lane & 3, a.x[e], a.d[e], a.s[e]);
    }
    static __device__ __forceinline__ void add_token(float& acc, const W& w, const int8_t* __restrict__ xq,
                                                     const float* __restrict__ xd, const float* __restrict__ xs,
                                                     int p, int nb, int lane, const uint8_t*) {
        Acts<1> a;
        q4k_acts<1>(xq, xd, xs, p, nb, lane, a);
        add<1>(acc, w, a, 0, p, nb, lane, nullptr);
    }
};
typedef RegQK<false> RegQ4K;
typedef RegQK<true> RegQ5K;  // Q5_K rows: Q4_K's layout and order (units 2c and 2c + 1 of block lane / 4 of a pass)

#if NTX_Q6_PAIR
// Q6_K rows of at most two 8-block groups (k <= 4096: the output matrix, v; cuda_kernels.reg_shape)
// with one warp a row (WK = 1): a pass is one group (1680 bytes, 16-byte aligned where the row
// is). A 210-byte block is only 2-byte aligned, so the warp loads the group in 16-byte chunks
// (lane, lane + 32, ...) and stages it in its shared memory; lane l decodes item l % 4 of block
// l / 4 (FastQ6_K::pair: units s and s + 2), as matvecf_q6_k's lanes do for such a row, and adds
// the same terms in the same order: the same bits (tests/cuda/test_reg_gpu.py). Wider rows stay
// on matvecf_q6_k, which was faster there (docs/cuda.md, session 9).
#define NTX_Q6_GROUP 1680
struct Q6KW {
    uint4 c[4];  // chunks lane, lane + 32, lane + 64, lane + 96 (< 105) of the group
};

template <int PPW>
struct Q6KActs {
    UnitX u[PPW][2];
};

struct RegQ6K {
    typedef Q6KW W;
    template <int PPW>
    using Acts = Q6KActs<PPW>;
    static const int BYTES = 210;
    static __device__ __forceinline__ void load(const uint8_t* __restrict__ wrow, int p, int nb, int lane, W& w) {
        if (8 * p >= nb) return;  // warp-uniform
        const uint8_t* g = wrow + NTX_Q6_GROUP * (size_t)p;
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (16 * (lane + 32 * c) < NTX_Q6_GROUP) w.c[c] = __ldcs(reinterpret_cast<const uint4*>(g + 16 * (lane + 32 * c)));
    }
    template <int PPW>
    static __device__ __forceinline__ void acts(const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                                const float* __restrict__ xs, int p0, int nb, int lane, Acts<PPW>& a) {
#pragma unroll
        for (int e = 0; e < PPW; ++e) {
            if (8 * (p0 + e) >= nb) continue;
#pragma unroll
            for (int kk = 0; kk < 2; ++kk) {
                const int col32 = 8 * (8 * (p0 + e) + lane / 4) + FastQ6_K::unit_of(lane & 3, kk);
                ldx(xq + 32 * (size_t)col32, a.u[e][kk].x);
                a.u[e][kk].d = __ldg(xd + col32);
                a.u[e][kk].s = __ldg(xs + col32);
            }
        }
    }
    // every lane of the warp calls it (st: the warp's stage, NTX_Q6_GROUP bytes at least)
    template <int PPW>
    static __device__ __forceinline__ void add(float& acc, const W& w, const Acts<PPW>& a, int e, int p, int nb,
                                               int lane, uint8_t* st) {
        if (8 * p >= nb) return;
#pragma unroll
        for (int c = 0; c < 4; ++c)
            if (16 * (lane + 32 * c) < NTX_Q6_GROUP) *reinterpret_cast<uint4*>(st + 16 * (lane + 32 * c)) = w.c[c];
        __syncwarp();
        float r[2];
        FastQ6_K::pair(st + 210 * (lane / 4), lane & 3, a.u[e], r);
        __syncwarp();
        acc += a.u[e][0].d * r[0];
        acc += a.u[e][1].d * r[1];
    }
};
#endif

// Where a warp stands in a register-activation launch: WK warps a team, teams a block.
struct RegTeam {
    int lane, wk, team, slice, p0, nb, gid, nteams;
};

template <int PPW>
__device__ __forceinline__ RegTeam reg_team(int k) {
    RegTeam t;
    t.lane = threadIdx.x & 31;
    t.wk = reg_wk(k);
    const int warp = threadIdx.x >> 5, teams = (blockDim.x >> 5) / t.wk;
    t.team = warp / t.wk;
    t.slice = warp % t.wk;
    t.p0 = t.slice * PPW;
    t.nb = k / 256;
    t.gid = blockIdx.x * teams + t.team;
    t.nteams = gridDim.x * teams;
    return t;
}

// Whether the block is whole teams (the host's shape, Kernels._reg_go): a partial team would
// wait at its named barrier forever, so such a launch writes nothing instead.
__device__ __forceinline__ bool reg_block_ok(int k) {
    const int wk = reg_wk(k);
    return wk > 0 && blockDim.x % (32 * wk) == 0;
}

// The team's i-th row of a segment of rows whose first row goes to team `first`, and how many
// of `rows` it takes.
__device__ __forceinline__ int reg_row(const RegTeam& t, int first, int i) {
    return (t.gid - first % t.nteams + t.nteams) % t.nteams + i * t.nteams;
}
__device__ __forceinline__ int reg_count(const RegTeam& t, int first, int rows) {
    const int r0 = reg_row(t, first, 0);
    return r0 < rows ? (rows - r0 + t.nteams - 1) / t.nteams : 0;
}

// A team's row values: each warp's sum, then (WK > 1) the slices' sums in slice order through
// shared memory (red: 2 x WK floats of the team, alternating by row) at the team's named barrier.
// Every lane of slice 0 returns the row's value; other slices return 0.
__device__ __forceinline__ float reg_row_value(const RegTeam& t, float acc, float* red, int i) {
    acc = warp_sum(acc);
    if (t.wk == 1) return acc;
    float* r = red + (i & 1) * NTX_REG_WARPS;
    if (t.lane == 0) r[t.slice] = acc;
    asm volatile("bar.sync %0, %1;" ::"r"(t.team + 1), "r"(32 * t.wk) : "memory");
    float v = 0.f;
    if (t.slice == 0)
        for (int s = 0; s < t.wk; ++s) v += r[s];
    return v;
}

template <class R, int PPW>
__device__ __forceinline__ void reg_row_load(const uint8_t* wrow, const RegTeam& t, typename R::W* w) {
#pragma unroll
    for (int e = 0; e < PPW; ++e) R::load(wrow, t.p0 + e, t.nb, t.lane, w[e]);
}

// Stream n rows (row_ptr(i): the start of the team's i-th row) with one in flight ahead; emit(i, v)
// on slice 0 with the row's value. cur: row 0's loads when preloaded (reg_row_load before the
// PDL wait). st: the warp's stage (for types that need one).
template <class R, int PPW, class RowPtr, class Emit>
__device__ __forceinline__ void reg_team_rows(const RegTeam& t, const typename R::template Acts<PPW>& a, int n,
                                              RowPtr row_ptr, Emit emit, typename R::W* cur, bool preloaded,
                                              float* red, uint8_t* st) {
    if (n > 0 && !preloaded) reg_row_load<R, PPW>(row_ptr(0), t, cur);
    for (int i = 0; i < n; ++i) {
        typename R::W nxt[PPW];
        if (i + 1 < n) reg_row_load<R, PPW>(row_ptr(i + 1), t, nxt);
        float acc = 0.f;
#pragma unroll
        for (int e = 0; e < PPW; ++e) R::template add<PPW>(acc, cur[e], a, e, t.p0 + e, t.nb, t.lane, st);
        const float v = reg_row_value(t, acc, red, i);
        if (t.slice == 0) emit(i, v);
#pragma unroll
        for (int e = 0; e < PPW; ++e) cur[e] = nxt[e];
    }
}

// One row by one warp against n <= N activation rows, in the order the teams above add it: for
// each slice its passes' terms per lane, the warp's sum, the slices' sums in order. The dp4a
// kernels (matvec_fast.cuh: several-token products, the fused kernels' other paths) stream Q4_K
// rows with it, so a token's row of an N-row product equals its one-row product from
// matvec_reg.cu bit for bit (speculative decoding's verify pass against plain decoding).
// pre: the row's first pass (R::load before the PDL wait), or null. st: a stage for types that need one.
template <class R, int N>
__device__ __forceinline__ void reg_row_n(const uint8_t* __restrict__ W, int row, const int8_t* __restrict__ xq,
                                          const float* __restrict__ xd, const float* __restrict__ xs, int k, int n,
                                          float* v, const typename R::W* pre, uint8_t* st) {
    const int lane = threadIdx.x & 31, nb = k / 256, ppw = reg_ppw(k), wk = reg_wk(k), k32 = k / 32;
    const uint8_t* wrow = W + (size_t)row * nb * R::BYTES;
#pragma unroll
    for (int t = 0; t < N; ++t) v[t] = 0.f;
    for (int s = 0; s < wk; ++s) {
        float acc[N];
#pragma unroll
        for (int t = 0; t < N; ++t) acc[t] = 0.f;
        for (int e = 0; e < ppw; ++e) {
            const int p = s * ppw + e;
            if (!reg_on(p, nb, lane)) continue;  // (add_token would add nothing)
            typename R::W w;
            if (pre != nullptr && p == 0) w = *pre;
            else R::load(wrow, p, nb, lane, w);
#pragma unroll
            for (int t = 0; t < N; ++t) {
                if (t >= n) break;
                R::add_token(acc[t], w, xq + (size_t)t * k, xd + (size_t)t * k32, xs + (size_t)t * k32, p, nb, lane, st);
            }
        }
#pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t >= n) break;
            const float ws = warp_sum(acc[t]);
            v[t] = wk == 1 ? ws : v[t] + ws;
        }
    }
}

// Whether Q4_K rows of k columns take the register kernels' order (else matvec_fast.cuh's own).
__device__ __forceinline__ bool q4k_reg_order(int k) { return NTX_REG && reg_wk(k) > 0; }
