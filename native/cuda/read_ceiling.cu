// Pure streaming reads: the ceiling a decode matvec is measured against (scripts/bench_cuda.py
// read_ceiling_table). Nothing but loads and an XOR, in the two layouts a matvec can use:
//   read_rows_uU: one warp a row of row_chunks 16-byte chunks (the dp4a kernels' layout), each
//                 lane keeping U loads in flight; NTX_FAST_WARPS-like 4 warps a block.
//   read_flat_uU: every thread of a fixed grid strides over the whole buffer, U loads in flight.
//   read_chain:   one launch of a fixed grid (every block resident) reading up to four buffers one
//                 after another as read_flat does, at a grid barrier between them or not: what a
//                 persistent decode kernel could stream a layer's matrices at
//                 (scripts/bench_ceiling.py layer_ceiling_table).
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

// The thread's share of a flat grid-stride read of `chunks` 16-byte chunks, XORed into acc.
template <int U>
__device__ __forceinline__ uint32_t read_flat_part(const uint4* __restrict__ w, int chunks, uint32_t acc) {
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t c = (size_t)blockIdx.x * blockDim.x + threadIdx.x; c < (size_t)chunks; c += stride * U) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (c + stride * u < (size_t)chunks) v[u] = __ldcs(w + c + stride * u);
            else v[u] = make_uint4(0, 0, 0, 0);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= xor4(v[u]);
    }
    return acc;
}

// One word a warp, so the loads cannot be dropped.
__device__ __forceinline__ void keep(uint32_t acc, uint32_t* out) {
    acc = warp_xor(acc);
    if ((threadIdx.x & 31) == 0) out[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = acc;
}

template <int U>
__device__ __forceinline__ void read_flat(const uint4* __restrict__ w, int chunks, uint32_t* out) {
    keep(read_flat_part<U>(w, chunks, 0u), out);
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

#define RC_DEADLINE_NS 2000000000ull

// Every block of the grid meets here (all resident: the host sizes the grid so). bar[0] counts
// arrivals, bar[1] is the generation: the last block to arrive zeroes the count and moves the
// generation on, so the barrier resets itself for the next use and the next launch. A block
// waits at most RC_DEADLINE_NS, then traps (the launch fails instead of hanging).
__device__ void grid_sync(unsigned int* bar, unsigned int nblocks) {
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int gen = ld_acquire(bar + 1);
        unsigned int old;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
        if (old == nblocks - 1) {
            bar[0] = 0u;
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 1), "r"(gen + 1u) : "memory");
        } else {
            const unsigned long long t0 = global_ns();
            while (ld_acquire(bar + 1) == gen) {
                __nanosleep(32);
                if (global_ns() - t0 > RC_DEADLINE_NS) __trap();
            }
        }
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(256) read_chain(const uint4* w0, int n0, const uint4* w1, int n1,
                                                             const uint4* w2, int n2, const uint4* w3, int n3,
                                                             int barriers, unsigned int* bar, uint32_t* out) {
    NTX_PDL();
    const uint4* w[4] = {w0, w1, w2, w3};
    const int n[4] = {n0, n1, n2, n3};
    uint32_t acc = 0;
    for (int m = 0; m < 4; ++m) {
        if (n[m] <= 0) break;
        if (m > 0 && barriers) grid_sync(bar, gridDim.x);
        acc = read_flat_part<4>(w[m], n[m], acc);
    }
    keep(acc, out);
}
