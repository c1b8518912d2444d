// The dp4a decode of one 32-value unit of a weight block against int8 activations, for the types
// of the common quant mixes (Q4_K, Q5_K, Q6_K, Q8_0), and the group sizes the row streaming of
// matvec_fast.cuh stages them in: the unit decoders of fast_row.
#pragma once
#include "ntx_quants.cuh"

// Blocks per group (overridable for tuning runs, cuda_nvrtc.TUNABLE).
#ifndef NTX_G_Q4_K
#define NTX_G_Q4_K 8
#endif
#ifndef NTX_G_Q5_K
#define NTX_G_Q5_K 8
#endif
#ifndef NTX_G_Q6_K
#define NTX_G_Q6_K 8
#endif
#ifndef NTX_G_Q8_0
#define NTX_G_Q8_0 32
#endif
// NTX_Q6_PAIR (default 1; 0: one unit a lane): one lane decodes Q6_K units s and s + 2 of a
// 128-value half, which share their ql bytes (low and high nibbles) and, with the half's other
// units, their qh bytes: one read of each for both, and every activation load of the lane's
// units issued before their arithmetic (decode_items). H200, 4096x14336 alone: 18.8 -> 16.9 us;
// 8B Q4_K_M decode +2-4 % (session 7, calls 6 and 7). Each lane takes other units than with 0,
// so the sums come in another order (within the oracles' bounds, not bit-identical to 0). The
// fused kernels decode one unit at a time in the same order (NTX_Q6_ANY in matvec_fast.cuh: the
// paired decode spilled under their register bounds).
#ifndef NTX_Q6_PAIR
#define NTX_Q6_PAIR 1
#endif

// Eight 32-bit words from a 2-byte aligned shared-memory address: aligned word loads joined with
// a funnel shift (the stage has 16 bytes of padding for the ninth word).
__device__ __forceinline__ void ld8(const uint8_t* p, uint32_t* w) {
    const uint32_t* a = reinterpret_cast<const uint32_t*>((size_t)p & ~(size_t)3);
    const unsigned sh = ((unsigned)(size_t)p & 3u) * 8u;
    uint32_t prev = a[0];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const uint32_t next = a[i + 1];
        w[i] = __funnelshift_r(prev, next, sh);
        prev = next;
    }
}

// The 32 int8 activations of one unit as 8 words (16-byte aligned in global memory).
__device__ __forceinline__ void ldx(const int8_t* __restrict__ x, int* v) {
    const int4 a = __ldg(reinterpret_cast<const int4*>(x)), b = __ldg(reinterpret_cast<const int4*>(x) + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// One unit's activations in one activation row (decode_items): the 32 int8 values as 8 words,
// their scale xd and sum xs.
struct UnitX {
    int x[8];
    float d, s;
};

template <bool C, class A, class B>
struct ntx_cond {
    typedef A T;
};
template <class A, class B>
struct ntx_cond<false, A, B> {
    typedef B T;
};

// Each F::unit returns one unit's dot product without the activation scale dx: the caller
// multiplies by dx (and passes sx, the unit's int8 sum, for the block minimum of Q4_K).
// Q4_K (Q5 false) and Q5_K: a unit's values are nibble j % 2 of the block's quant bytes 32 (j / 2).. (at 16; Q5_K's at
// 48), Q5_K's plus a fifth bit, bit j of qh[l] for value l (qh: the 32 bytes after the 16-byte header, shared by the
// block's 8 units): values 0..15 or 0..31, as int8 for dp4a.
template <bool Q5>
struct FastQK {
    typedef typename ntx_cond<Q5, BlkQ5_K, BlkQ4_K>::T B;
    static const int G = Q5 ? NTX_G_Q5_K : NTX_G_Q4_K;  // 8: 1152 (Q4_K), 1408 (Q5_K) bytes a group
    static __device__ __forceinline__ float unit(const uint8_t* b, int j, const int* x, float sx) {
        int sc, mn;
        ntx_k_scale_min(b + 4, j, &sc, &mn);
        const uint4* q4 = reinterpret_cast<const uint4*>(b + (Q5 ? 48 : 16) + 32 * (j / 2));  // 16-aligned
        const uint4 qa = q4[0], qb = q4[1];
        const uint32_t q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        uint32_t h[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        if constexpr (Q5) {
            const uint4 ha = reinterpret_cast<const uint4*>(b + 16)[0], hb = reinterpret_cast<const uint4*>(b + 16)[1];
            const uint32_t hw[8] = {ha.x, ha.y, ha.z, ha.w, hb.x, hb.y, hb.z, hb.w};
#pragma unroll
            for (int i = 0; i < 8; ++i) h[i] = ((hw[i] >> j) & 0x01010101u) << 4;
        }
        const int shift = 4 * (j % 2);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = __dp4a((int)(((q[i] >> shift) & 0x0F0F0F0Fu) | h[i]), x[i], s);
        const float d1 = NTX_MUL(ntx_ldh(b), (float)sc), m1 = NTX_MUL(ntx_ldh(b + 2), (float)mn);
        return d1 * (float)s - m1 * sx;
    }
};
typedef FastQK<false> FastQ4_K;
typedef FastQK<true> FastQ5_K;

struct FastQ6_K {
    typedef BlkQ6_K B;
    static const int G = NTX_G_Q6_K;  // 8: 1680 bytes a group
    static __device__ __forceinline__ float unit(const uint8_t* b, int j, const int* x, float) {
        const int h = j / 4, s = j % 4;
        uint32_t lo[8], hi[8];
        ld8(b + h * 64 + (s % 2) * 32, lo);
        ld8(b + 128 + h * 32, hi);
        const int lshift = 4 * (s / 2), hshift = 2 * s;
        int s0 = 0, s1 = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const uint32_t q6 = ((lo[i] >> lshift) & 0x0F0F0F0Fu) | (((hi[i] >> hshift) & 0x03030303u) << 4);
            const int q = (int)__vsub4(q6, 0x20202020u);  // per byte: q - 32, as int8
            if (i < 4) s0 = __dp4a(q, x[i], s0);
            else s1 = __dp4a(q, x[i], s1);
        }
        const int isum = (int)(int8_t)b[192 + 2 * j] * s0 + (int)(int8_t)b[193 + 2 * j] * s1;
        return ntx_ldh(b + 208) * (float)isum;
    }
#if NTX_Q6_PAIR
    // Units s and s + 2 of half h (item i: h = i / 2, s = i % 2) are the low and high nibbles of
    // the same 32 ql bytes, and every unit of h takes its top two bits from the same 32 qh bytes:
    // one lane reads each once for both units (unit() reads both for each).
    static __device__ __forceinline__ int unit_of(int i, int k) { return 4 * (i / 2) + i % 2 + 2 * k; }
    static __device__ __forceinline__ void pair(const uint8_t* b, int i, const UnitX* a, float* r) {
        const int h = i / 2, s = i % 2;
        uint32_t lo[8], hi[8];
        ld8(b + h * 64 + s * 32, lo);
        ld8(b + 128 + h * 32, hi);
        int s0[2] = {0, 0}, s1[2] = {0, 0};  // per unit: the sums of its two 16-value scale halves
#pragma unroll
        for (int e = 0; e < 8; ++e) {
#pragma unroll
            for (int k = 0; k < 2; ++k) {  // unit s + 2k: lshift 4k, hshift 2s + 4k
                const uint32_t q6 = ((lo[e] >> (4 * k)) & 0x0F0F0F0Fu) | (((hi[e] >> (2 * s + 4 * k)) & 0x03030303u) << 4);
                const int q = (int)__vsub4(q6, 0x20202020u);
                if (e < 4) s0[k] = __dp4a(q, a[k].x[e], s0[k]);
                else s1[k] = __dp4a(q, a[k].x[e], s1[k]);
            }
        }
        const float d = ntx_ldh(b + 208);
#pragma unroll
        for (int k = 0; k < 2; ++k) {
            const int j = unit_of(i, k);
            const int isum = (int)(int8_t)b[192 + 2 * j] * s0[k] + (int)(int8_t)b[193 + 2 * j] * s1[k];
            r[k] = d * (float)isum;
        }
    }
#endif
};

struct FastQ8_0 {
    typedef BlkQ8_0 B;
    static const int G = NTX_G_Q8_0;  // 32: 1088 bytes a group
    static __device__ __forceinline__ float unit(const uint8_t* b, int, const int* x, float) {
        uint32_t q[8];
        ld8(b + 2, q);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = __dp4a((int)q[i], x[i], s);
        return ntx_ldh(b) * (float)s;
    }
};
