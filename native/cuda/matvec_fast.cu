// Bandwidth-bound matvec for the types of the common quant mixes (Q4_K, Q5_K, Q6_K, Q8_0): integer dot
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
#include "matvec_fast.cuh"

template <class F, int N>
__device__ void matvec_fast(const uint8_t* __restrict__ W, const int8_t* __restrict__ xq,
                            const float* __restrict__ xd, const float* __restrict__ xs,
                            float* __restrict__ Y, int rows, int k, int n, const uint4* pre) {
    __shared__ __align__(16) uint8_t stage[NTX_FAST_WARPS][FastGroup<F>::BYTES + 16];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * NTX_FAST_WARPS + warp;
    if (row >= rows) return;  // the whole warp leaves together
    float acc[N];
    fast_row<F, N, NTX_PRE_WAIT != 0>(W, row, xq, xd, xs, stage[warp], k, n, acc, pre);
#pragma unroll
    for (int t = 0; t < N; ++t)
        if (lane == 0 && t < n) Y[(size_t)t * rows + row] = acc[t];
}

#define NTX_FAST(F, name, N)                                                                        \
    extern "C" __global__ void __launch_bounds__(NTX_FAST_WARPS * 32, (N == 1 ? NTX_FAST_MINB : 1))            \
    matvecf_##name##_n##N(const uint8_t* W, const int8_t* xq, const float* xd, const float* xs,     \
                          float* Y, int rows, int k, int n) {                                        \
        const int row = blockIdx.x * NTX_FAST_WARPS + (threadIdx.x >> 5);                           \
        uint4 pre[NTX_PRE_SLOTS];                                                                   \
        if (NTX_PRE_WAIT && row < rows) fast_row_start<F>(W, row, k, pre);                          \
        NTX_PDL();                                                                                  \
        NTX_SKIP_KIND(8);                                                                           \
        matvec_fast<F, N>(W, xq, xd, xs, Y, rows, k, n, pre);                                       \
    }

NTX_FAST(FastQ4_K, q4_k, 1)
NTX_FAST(FastQ4_K, q4_k, 8)
NTX_FAST(FastQ5_K, q5_k, 1)
NTX_FAST(FastQ5_K, q5_k, 8)
NTX_FAST(FastQ6_K, q6_k, 1)
NTX_FAST(FastQ6_K, q6_k, 8)
NTX_FAST(FastQ8_0, q8_0, 1)
NTX_FAST(FastQ8_0, q8_0, 8)

// --- activations as int8 + per-32 scale and sum (blocks: matvec_fast.cuh) -------------------
extern "C" __global__ void quanti_q8_1(const float* x, int8_t* xq, float* xd, float* xs, int nblocks) {
    NTX_PDL();
    NTX_SKIP_KIND(4);
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b < nblocks) quanti_q8_1_block(x, xq, xd, xs, b, lane);  // b is the same for the whole warp
}

extern "C" __global__ void quanti_q8_k(const float* x, int8_t* xq, float* xd, float* xs, int nblocks) {
    NTX_PDL();
    NTX_SKIP_KIND(4);
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b < nblocks) quanti_q8_k_block(x, xq, xd, xs, b, lane);
}
