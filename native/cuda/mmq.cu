// Prefill matmul on the int8 tensor cores (mma.sync m16n8k32 s8 x s8 -> s32, sm_80+), straight
// from the GGUF blocks: every 32-value unit of a weight row is one k-step of the MMA against the
// same int8 activations the dp4a kernels use (xq, with the per-32 scale xd and sum xs), and its
// exact int32 dot products are scaled once: Q8_0 d·xd·Σq·q8, Q4_K xd·(d·sc·Σq·q8 − dmin·m·Σq8),
// the dp4a kernels' arithmetic (matvec_fast.cuh) with the sums from the tensor cores.
//
// A block of 4 warps computes 64 rows x 64 tokens; each warp 16 rows x 8 tiles of 8 tokens, so
// the weights are read once per 64 tokens instead of once per 8 (the _n8 matvec). Fragments are
// loaded straight from global memory (the block's warps share the activations through L1).
// Opt-in (NTX_CUDA_MMQ=1): not yet checked on a GPU (tests/cuda/test_mmq_gpu.py).
#include "matvec_fast.cuh"

#define NTX_MMQ_ROWS 64
#define NTX_MMQ_TOKENS 64

__device__ __forceinline__ void ntx_mma_s8(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Four int8 weights of one unit as a word: values tig*4.. (lo) and 16 + tig*4.. (hi) of unit u of
// a row, and the unit's scale d and minimum term m (0 for Q8_0).
struct MmqQ8_0 {
    static const int QK = 32, BYTES = 34;
    static __device__ __forceinline__ void unit(const uint8_t* row, int u, int tig, uint32_t* lo, uint32_t* hi,
                                                float* d, float* m) {
        const uint8_t* b = row + (size_t)u * BYTES;  // quants at b + 2: only 2-byte aligned
        const uint16_t* q = reinterpret_cast<const uint16_t*>(b + 2 + 4 * tig);
        *lo = (uint32_t)q[0] | ((uint32_t)q[1] << 16);
        *hi = (uint32_t)q[8] | ((uint32_t)q[9] << 16);
        *d = ntx_ldh(b);
        *m = 0.f;
    }
};

struct MmqQ4_K {
    static const int QK = 256, BYTES = 144;
    static __device__ __forceinline__ void unit(const uint8_t* row, int u, int tig, uint32_t* lo, uint32_t* hi,
                                                float* d, float* m) {
        const uint8_t* b = row + (size_t)(u / 8) * BYTES;
        const int j = u % 8, shift = 4 * (j % 2);
        const uint32_t* q = reinterpret_cast<const uint32_t*>(b + 16 + 32 * (j / 2) + 4 * tig);  // 4-aligned
        *lo = (q[0] >> shift) & 0x0F0F0F0Fu;
        *hi = (q[4] >> shift) & 0x0F0F0F0Fu;
        int sc, mn;
        ntx_k_scale_min(b + 4, j, &sc, &mn);
        *d = NTX_MUL(ntx_ldh(b), (float)sc);
        *m = NTX_MUL(ntx_ldh(b + 2), (float)mn);
    }
};

template <class F>
__device__ void mmq(const uint8_t* __restrict__ W, const int8_t* __restrict__ xq, const float* __restrict__ xd,
                    const float* __restrict__ xs, float* __restrict__ Y, int rows, int k, int n) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, tig = lane & 3;
    const int r0 = blockIdx.x * NTX_MMQ_ROWS + warp * 16 + g, r1 = r0 + 8;
    const int t0 = blockIdx.y * NTX_MMQ_TOKENS, k32 = k / 32;
    const size_t row_bytes = (size_t)(k / F::QK) * F::BYTES;
    // rows past the end read the last row (in bounds) and are never stored
    const uint8_t* w0 = W + (size_t)min(r0, rows - 1) * row_bytes;
    const uint8_t* w1 = W + (size_t)min(r1, rows - 1) * row_bytes;
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    for (int u = 0; u < k32; ++u) {
        uint32_t a[4];
        float d0, m0, d1, m1;
        F::unit(w0, u, tig, &a[0], &a[2], &d0, &m0);
        F::unit(w1, u, tig, &a[1], &a[3], &d1, &m1);
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            const int tb = t0 + nt * 8 + g;  // the token whose activations this lane feeds in
            uint32_t b0 = 0, b1 = 0;
            if (tb < n) {
                const uint32_t* xp = reinterpret_cast<const uint32_t*>(xq + (size_t)tb * k + 32 * u + 4 * tig);
                b0 = __ldg(xp);
                b1 = __ldg(xp + 4);
            }
            int c[4] = {0, 0, 0, 0};
            ntx_mma_s8(c, a, b0, b1);
            const int tc = t0 + nt * 8 + 2 * tig;  // the tokens of this lane's results: tc, tc + 1
            const float x0 = tc < n ? __ldg(xd + (size_t)tc * k32 + u) : 0.f;
            const float x1 = tc + 1 < n ? __ldg(xd + (size_t)(tc + 1) * k32 + u) : 0.f;
            const float s0 = tc < n ? __ldg(xs + (size_t)tc * k32 + u) : 0.f;
            const float s1 = tc + 1 < n ? __ldg(xs + (size_t)(tc + 1) * k32 + u) : 0.f;
            acc[nt][0] += x0 * (d0 * (float)c[0] - m0 * s0);
            acc[nt][1] += x1 * (d0 * (float)c[1] - m0 * s1);
            acc[nt][2] += x0 * (d1 * (float)c[2] - m1 * s0);
            acc[nt][3] += x1 * (d1 * (float)c[3] - m1 * s1);
        }
    }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const int tc = t0 + nt * 8 + 2 * tig;
        if (r0 < rows && tc < n) Y[(size_t)tc * rows + r0] = acc[nt][0];
        if (r0 < rows && tc + 1 < n) Y[(size_t)(tc + 1) * rows + r0] = acc[nt][1];
        if (r1 < rows && tc < n) Y[(size_t)tc * rows + r1] = acc[nt][2];
        if (r1 < rows && tc + 1 < n) Y[(size_t)(tc + 1) * rows + r1] = acc[nt][3];
    }
}

// Grid: (rows / 64, n / 64) rounded up; 128 threads.
extern "C" __global__ void __launch_bounds__(128) mmq_q8_0(const uint8_t* W, const int8_t* xq, const float* xd,
                                                          const float* xs, float* Y, int rows, int k, int n) {
    NTX_PDL();
    mmq<MmqQ8_0>(W, xq, xd, xs, Y, rows, k, n);
}

extern "C" __global__ void __launch_bounds__(128) mmq_q4_k(const uint8_t* W, const int8_t* xq, const float* xd,
                                                          const float* xs, float* Y, int rows, int k, int n) {
    NTX_PDL();
    mmq<MmqQ4_K>(W, xq, xd, xs, Y, rows, k, n);
}
