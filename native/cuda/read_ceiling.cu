// Pure streaming reads: the ceiling a decode matvec is measured against (scripts/bench_cuda.py
// read_ceiling_table). Nothing but loads and an XOR, in the two layouts a matvec can use:
//   read_rows_uU: one warp a row of row_chunks 16-byte chunks (the dp4a kernels' layout), each
//                 lane keeping U loads in flight; NTX_FAST_WARPS-like 4 warps a block.
//   read_flat_uU: every thread of a fixed grid strides over the whole buffer, U loads in flight.
// Each writes one word a warp so the loads cannot be dropped; the words are never checked.
#include "ntx_half.cuh"
#include "warp.cuh"

__device__ __forceinline__ uint32_t xor4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint32_t warp_xor(uint32_t v) {
    for (int o = 16; o > 0; o >>= 1) v ^= __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <int U>
__device__ __forceinline__ void read_rows(const uint4* __restrict__ w, int rows, int row_chunks, uint32_t* out) {
    const int lane = threadIdx.x & 31, row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= rows) return;
    const uint4* r = w + (size_t)row * row_chunks;
    uint32_t acc = 0;
    for (int c = lane; c < row_chunks; c += 32 * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c + 32 * u < row_chunks) v[u] = __ldcs(r + c + 32 * u);
            else v[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= xor4(v[u]);
    }
    acc = warp_xor(acc);
    if (lane == 0) out[row] = acc;
}

template <int U>
__device__ __forceinline__ void read_flat(const uint4* __restrict__ w, int chunks, uint32_t* out) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    uint32_t acc = 0;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < (size_t)chunks; c += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c + stride * u < (size_t)chunks) v[u] = __ldcs(w + c + stride * u);
            else v[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= xor4(v[u]);
    }
    acc = warp_xor(acc);
    if ((threadIdx.x & 31) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = acc;
}

#define NTX_READ(U)                                                                                       \
    extern "C" __global__ void __launch_bounds__(128) read_rows_u##U(const uint4* w, int rows, int row_chunks, \
                                                                     uint32_t* out) {                     \
        NTX_PDL();                                                                                        \
        read_rows<U>(w, rows, row_chunks, out);                                                           \
    }                                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) read_flat_u##U(const uint4* w, int chunks, uint32_t* out) { \
        NTX_PDL();                                                                                        \
        read_flat<U>(w, chunks, out);                                                                     \
    }

NTX_READ(1)
NTX_READ(2)
NTX_READ(4)
NTX_READ(8)
