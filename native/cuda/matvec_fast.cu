// Bandwidth-bound matvec for the types of the common quant mixes (Q4_K, Q6_K, Q8_0): integer dot
// products (__dp4a) of the raw weight quants against int8 activations, with the block scales
// applied once per 32 values. Same function as matvec.cu (ggml's vec_dot on the quantized row),
// rounded differently only in the float32 products and their summation order.
//
// Layout of the work: one warp per output row, NTX_FAST_WARPS rows per thread block. The warp
// streams its row in groups of G blocks (G * BYTES is a multiple of 16 bytes, so every group
// starts 16-byte aligned when the row does): each lane loads up to CH 16-byte chunks of the next
// group into registers while the warp decodes the current group from shared memory, so loads
// stay in flight during the arithmetic. The host only picks these kernels when a row is a
// multiple of 16 bytes and the tensor is 16-byte aligned (cuda_kernels.fast_matvec_ok).
//
// Activations (quanti_*): xq int8 (n, k), xd (n, k/32) the scale of each 32 values (fp16(d) for
// Q8_0/Q8_1, the 256-block's d for Q8_K), xs (n, k/32) the sum of the 32 int8 values.
#include "ntx_quants.cuh"
#include "act_quant.cuh"
#include "rmsnorm.cuh"

#define NTX_FAST_WARPS 4

__device__ __forceinline__ float fwarp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float fwarp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

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

// Each F::unit returns one unit's dot product without the activation scale dx: the caller
// multiplies by dx (and passes sx, the unit's int8 sum, for the block minimum of Q4_K).
struct FastQ4_K {
    typedef BlkQ4_K B;
    static const int G = 8;  // 1152 bytes a group
    static __device__ __forceinline__ float unit(const uint8_t* b, int j, const int* x, float sx) {
        int sc, mn;
        ntx_k_scale_min(b + 4, j, &sc, &mn);
        const uint4* q4 = reinterpret_cast<const uint4*>(b + 16 + 32 * (j / 2));  // 16-aligned
        const uint4 qa = q4[0], qb = q4[1];
        const uint32_t q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const int shift = 4 * (j % 2);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = __dp4a((int)((q[i] >> shift) & 0x0F0F0F0Fu), x[i], s);
        const float d1 = NTX_MUL(ntx_ldh(b), (float)sc), m1 = NTX_MUL(ntx_ldh(b + 2), (float)mn);
        return d1 * (float)s - m1 * sx;
    }
};

struct FastQ6_K {
    typedef BlkQ6_K B;
    static const int G = 8;  // 1680 bytes a group
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
};

struct FastQ8_0 {
    typedef BlkQ8_0 B;
    static const int G = 32;  // 1088 bytes a group
    static __device__ __forceinline__ float unit(const uint8_t* b, int, const int* x, float) {
        uint32_t q[8];
        ld8(b + 2, q);
        int s = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) s = __dp4a((int)q[i], x[i], s);
        return ntx_ldh(b) * (float)s;
    }
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

template <class F, int N>
__device__ void matvec_fast(const uint8_t* __restrict__ W, const int8_t* __restrict__ xq,
                            const float* __restrict__ xd, const float* __restrict__ xs,
                            float* __restrict__ Y, int rows, int k, int n) {
    typedef FastGroup<F> Grp;
    __shared__ __align__(16) uint8_t stage[NTX_FAST_WARPS][Grp::BYTES + 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * NTX_FAST_WARPS + warp;
    if (row >= rows) return;  // the whole warp leaves together
    const int nb = k / F::B::QK, row_bytes = nb * F::B::BYTES, k32 = k / 32;
    const uint8_t* wrow = W + (size_t)row * row_bytes;
    uint8_t* st = stage[warp];
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.f;
    uint4 r[Grp::CH];
    load_group<F>(r, wrow, min(Grp::BYTES, row_bytes), lane);
    for (int g0 = 0; g0 < nb; g0 += F::G) {
        const int nbytes = min(Grp::BYTES, row_bytes - g0 * F::B::BYTES);
#pragma unroll
        for (int c = 0; c < Grp::CH; ++c) {
            const int off = 16 * (lane + 32 * c);
            if (off < nbytes) *reinterpret_cast<uint4*>(st + off) = r[c];
        }
        __syncwarp();
        const int next = (g0 + F::G) * F::B::BYTES;
        if (next < row_bytes) load_group<F>(r, wrow + next, min(Grp::BYTES, row_bytes - next), lane);
        const int units = min(F::G, nb - g0) * F::B::UNITS;
        for (int u = lane; u < units; u += 32) {
            const int bl = u / F::B::UNITS, j = u % F::B::UNITS;
            const int col32 = (g0 + bl) * (F::B::QK / 32) + j;  // global index of the 32 values
#pragma unroll
            for (int t = 0; t < N; ++t) {
                if (t < n) {
                    int x[8];
                    ldx(xq + (size_t)t * k + 32 * (size_t)col32, x);
                    const size_t si = (size_t)t * k32 + col32;
                    acc[t] += __ldg(xd + si) * F::unit(st + bl * F::B::BYTES, j, x, __ldg(xs + si));
                }
            }
        }
        __syncwarp();
    }
#pragma unroll
    for (int t = 0; t < N; ++t) {
        const float v = fwarp_sum(acc[t]);
        if (lane == 0 && t < n) Y[(size_t)t * rows + row] = v;
    }
}

#define NTX_FAST(F, name, N)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTX_FAST_WARPS * 32, (N == 1 ? 8 : 1))            \
    matvecf_##name##_n##N(const uint8_t* W, const int8_t* xq, const float* xd, const float* xs,     \
                          float* Y, int rows, int k, int n) { NTX_PDL(); matvec_fast<F, N>(W, xq, xd, xs, Y, rows, k, n); }

NTX_FAST(FastQ4_K, q4_k, 1)
NTX_FAST(FastQ4_K, q4_k, 8)
NTX_FAST(FastQ6_K, q6_k, 1)
NTX_FAST(FastQ6_K, q6_k, 8)
NTX_FAST(FastQ8_0, q8_0, 1)
NTX_FAST(FastQ8_0, q8_0, 8)

// --- activations as int8 + per-32 scale and sum ------------------------------------------
// The same quantizers as matvec.cu's quant_q8_1 / quant_q8_k (act_quant.cuh's scalar steps), so
// xd * xq equals their x_hat exactly (Q8_0/Q8_1) or before its one float rounding (Q8_K).

// One 32-value block b of x (Q8_0/Q8_1 scale) by one warp.
__device__ __forceinline__ void quanti_q8_1_block(const float* x, int8_t* xq, float* xd, float* xs, size_t b,
                                                  int lane) {
    const float v = x[32 * b + lane];
    float d, inv;
    ntx_q8_scale(fwarp_max(fabsf(v)), &d, &inv);
    const float q = ntx_q8_q(v, inv);
    xq[32 * b + lane] = (int8_t)(int)q;
    const float sum = fwarp_sum(q);  // small integers: exact in any order
    if (lane == 0) {
        xd[b] = ntx_round_f16(d);
        xs[b] = sum;
    }
}

// One 256-value block b of x (Q8_K) by one warp.
__device__ __forceinline__ void quanti_q8_k_block(const float* x, int8_t* xq, float* xd, float* xs, size_t b,
                                                  int lane) {
    const float* xb = x + 256 * b;
    float v[8];
    const int idx = ntx_q8k_pivot_warp(xb, v, lane);
    float iscale, d;
    ntx_q8k_scale(xb[idx], &iscale, &d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float q = ntx_q8k_q(v[i], iscale);
        xq[256 * b + lane + 32 * i] = (int8_t)(int)q;
        const float sum = fwarp_sum(q);
        if (lane == 0) {
            xd[8 * b + i] = d;
            xs[8 * b + i] = sum;
        }
    }
}

extern "C" __global__ void quanti_q8_1(const float* x, int8_t* xq, float* xd, float* xs, int nblocks) {
    NTX_PDL();
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b < nblocks) quanti_q8_1_block(x, xq, xd, xs, b, lane);  // b is the same for the whole warp
}

extern "C" __global__ void quanti_q8_k(const float* x, int8_t* xq, float* xd, float* xs, int nblocks) {
    NTX_PDL();
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b < nblocks) quanti_q8_k_block(x, xq, xd, xs, b, lane);
}

// RMSNorm of row blockIdx.x (ops.cu's arithmetic, rmsnorm.cuh) fused with the int8 quantization
// of the result for the next matmul: q8k != 0 Q8_K blocks (k % 256 == 0), else Q8_0/Q8_1 ones.
extern "C" __global__ void rmsnorm_quanti(const float* __restrict__ x, const float* __restrict__ w,
                                          float* __restrict__ out, int8_t* xq, float* xd, float* xs, int k,
                                          float eps, int q8k) {
    NTX_PDL();
    __shared__ double part[32];
    float* outr = out + (size_t)blockIdx.x * k;
    ntx_rmsnorm_row(x + (size_t)blockIdx.x * k, w, outr, k, eps, part);
    __syncthreads();  // the row's values, written by the whole block, are visible to every warp
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = q8k ? 256 : 32, nb = k / per;
    for (int b = warp; b < nb; b += nw) {
        const size_t gb = (size_t)blockIdx.x * nb + b;
        if (q8k) quanti_q8_k_block(out, xq, xd, xs, gb, lane);
        else quanti_q8_1_block(out, xq, xd, xs, gb, lane);
    }
}
