// Quantized matrix-vector products straight from the GGUF blocks, activation quantization and
// embedding lookup. Y (n, rows) = X_hat (n, k) . W (rows, k)^T, X_hat already quantized to the
// weight type's vec_dot_type; one warp per output row, lanes striding over 32-element units.
#include "ntx_quants.cuh"
#include "act_quant.cuh"
#include "warp.cuh"

#define NTX_WARPS 4  // rows per thread block

__device__ __forceinline__ float dot32(const float* w, const float* x) {
    const float4* x4 = reinterpret_cast<const float4*>(x);
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float4 v = x4[i];
        s += w[4*i] * v.x + w[4*i+1] * v.y + w[4*i+2] * v.z + w[4*i+3] * v.w;
    }
    return s;
}

// Multiply one decoded unit (w, minimum m) by N tokens' activations at column col.
template <class T, int N>
__device__ __forceinline__ void unit_dot(const float* w, float m, const float* __restrict__ X,
                                         const float* __restrict__ S, int col, int k, int n, float* acc) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
        if (t < n) {
            float s = dot32(w, X + (size_t)t * k + col);
            if (T::HAS_MIN) s += m * S[(size_t)t * (k / 32) + col / 32];
            acc[t] += s;
        }
    }
}

template <int N>
__device__ __forceinline__ void write_rows(float* acc, float* __restrict__ Y, int rows, int row, int n) {
#pragma unroll
    for (int t = 0; t < N; ++t) {
        const float v = warp_sum(acc[t]);
        if ((threadIdx.x & 31) == 0 && t < n) Y[(size_t)t * rows + row] = v;
    }
}

// Baseline: each lane decodes its units straight from global memory (byte loads).
// S: (n, k/32) Q8_1 block sums for HAS_MIN types, else unused. N: tokens per pass (n <= N).
template <class T, int N>
__device__ void matvec_direct(const uint8_t* __restrict__ W, const float* __restrict__ X,
                              const float* __restrict__ S, float* __restrict__ Y, int rows, int k, int n) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * NTX_WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    const int nb = k / T::QK, units = nb * T::UNITS;
    const uint8_t* wrow = W + (size_t)row * nb * T::BYTES;
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.f;
    for (int u = lane; u < units; u += 32) {
        const int b = u / T::UNITS, j = u % T::UNITS;
        float w[32];
        const float m = T::deq32(wrow + (size_t)b * T::BYTES, j, w);
        unit_dot<T, N>(w, m, X, S, b * T::QK + j * 32, k, n, acc);
    }
    write_rows<N>(acc, Y, rows, row, n);
}

// Copy nbytes (even) from global to shared memory with the widest loads the alignment allows;
// the whole warp takes the same branch.
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* __restrict__ src, int nbytes, int lane) {
    const size_t a = (size_t)src;
    if ((a & 15) == 0 && (nbytes & 15) == 0) {
        for (int i = lane * 16; i < nbytes; i += 32 * 16)
            *reinterpret_cast<uint4*>(dst + i) = __ldg(reinterpret_cast<const uint4*>(src + i));
    } else if ((a & 3) == 0 && (nbytes & 3) == 0) {
        for (int i = lane * 4; i < nbytes; i += 32 * 4)
            *reinterpret_cast<uint32_t*>(dst + i) = __ldg(reinterpret_cast<const uint32_t*>(src + i));
    } else {
        for (int i = lane * 2; i < nbytes; i += 32 * 2)
            *reinterpret_cast<uint16_t*>(dst + i) = __ldg(reinterpret_cast<const uint16_t*>(src + i));
    }
}

// Staged: the warp copies the blocks of its next 32 units into shared memory with wide,
// coalesced loads, then each lane decodes one unit from there.
template <class T, int N>
__device__ void matvec_staged(const uint8_t* __restrict__ W, const float* __restrict__ X,
                              const float* __restrict__ S, float* __restrict__ Y, int rows, int k, int n) {
    constexpr int CHUNK = 32 / T::UNITS * T::BYTES;  // bytes of the blocks of 32 units
    __shared__ __align__(16) uint8_t stage[NTX_WARPS][CHUNK];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * NTX_WARPS + warp;
    if (row >= rows) return;
    const int nb = k / T::QK, units = nb * T::UNITS;
    const uint8_t* wrow = W + (size_t)row * nb * T::BYTES;
    float acc[N];
#pragma unroll
    for (int t = 0; t < N; ++t) acc[t] = 0.f;
    for (int u0 = 0; u0 < units; u0 += 32) {
        const int b0 = u0 / T::UNITS;
        const int nbytes = min(CHUNK, (nb - b0) * T::BYTES);
        warp_copy(stage[warp], wrow + (size_t)b0 * T::BYTES, nbytes, lane);
        __syncwarp();
        if (u0 + lane < units) {
            const int b = lane / T::UNITS, j = lane % T::UNITS;
            float w[32];
            const float m = T::deq32(stage[warp] + b * T::BYTES, j, w);
            unit_dot<T, N>(w, m, X, S, (b0 + b) * T::QK + j * 32, k, n, acc);
        }
        __syncwarp();
    }
    write_rows<N>(acc, Y, rows, row, n);
}

// out (n, k) float32 rows of table W for token ids (ggml get_rows, minimum added back).
template <class T>
__device__ void embed_body(const uint8_t* __restrict__ W, const int* __restrict__ ids,
                           float* __restrict__ out, int k) {
    const int t = blockIdx.y;
    const int u = blockIdx.x * blockDim.x + threadIdx.x;
    const int nb = k / T::QK;
    if (u >= nb * T::UNITS) return;
    const int b = u / T::UNITS, j = u % T::UNITS;
    float w[32];
    const float m = T::deq32(W + ((size_t)ids[t] * nb + b) * T::BYTES, j, w);
    float* o = out + (size_t)t * k + b * T::QK + j * 32;
#pragma unroll
    for (int i = 0; i < 32; ++i) o[i] = w[i] + m;
}

#define NTX_MATVEC_VARIANT(T, name, variant, body, N)                                          \
    extern "C" __global__ void __launch_bounds__(NTX_WARPS * 32)                                \
    variant##_##name##_n##N(const uint8_t* W, const float* X, const float* S, float* Y, int rows, \
                            int k, int n) { NTX_PDL(); body<T, N>(W, X, S, Y, rows, k, n); }

// matvec_*: staged (the default); matvecd_*: direct, kept as the measured baseline
#define NTX_MATVEC(T, name)                                                                     \
    NTX_MATVEC_VARIANT(T, name, matvec, matvec_staged, 1)                                      \
    NTX_MATVEC_VARIANT(T, name, matvec, matvec_staged, 8)                                      \
    NTX_MATVEC_VARIANT(T, name, matvecd, matvec_direct, 1)                                     \
    NTX_MATVEC_VARIANT(T, name, matvecd, matvec_direct, 8)                                     \
    extern "C" __global__ void embed_##name(const uint8_t* W, const int* ids, float* out,      \
                                            int k) { NTX_PDL(); embed_body<T>(W, ids, out, k); }

NTX_FOR_EACH_TYPE(NTX_MATVEC)

// --- activation quantization: x (total,) -> x_hat (total,) [+ s (total/32,)] ---------------
// One warp per block, lanes over its values (coalesced); the scalar steps are act_quant.cuh's.

// Q8_0 (s == nullptr) and Q8_1 (s: fp16(d * sum(q)) per block)
extern "C" __global__ void quant_q8_1(const float* x, float* x_hat, float* s, int nblocks) {
    NTX_PDL();
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b >= nblocks) return;  // b is the same for the whole warp
    const float v = x[32 * (size_t)b + lane];
    float d, inv;
    ntx_q8_scale(warp_max(fabsf(v)), &d, &inv);
    const float q = ntx_q8_q(v, inv);
    x_hat[32 * (size_t)b + lane] = NTX_MUL(ntx_round_f16(d), q);
    if (s) {
        const float sum = warp_sum(q);  // small integers: exact in any order
        if (lane == 0) s[b] = ntx_round_f16(NTX_MUL(d, sum));
    }
}

extern "C" __global__ void quant_q8_k(const float* x, float* x_hat, int nblocks) {
    NTX_PDL();
    const int b = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    if (b >= nblocks) return;
    const float* xb = x + 256 * (size_t)b;
    float v[8];
    const int idx = ntx_q8k_pivot_warp(xb, v, lane);
    float iscale, d;
    ntx_q8k_scale(xb[idx], &iscale, &d);
#pragma unroll
    for (int i = 0; i < 8; ++i) x_hat[256 * (size_t)b + lane + 32 * i] = NTX_MUL(d, ntx_q8k_q(v[i], iscale));
}

extern "C" __global__ void round_f16(const float* x, float* out, int total) {
    NTX_PDL();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = ntx_round_f16(x[i]);
}

extern "C" __global__ void round_bf16(const float* x, float* out, int total) {
    NTX_PDL();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = ntx_round_bf16(x[i]);
}

// Plain per-32 sums of x: the Q4_1/Q5_1 min term when activations stay float32 ("exact" mode).
extern "C" __global__ void block_sum32(const float* x, float* s, int nblocks) {
    NTX_PDL();
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float acc = 0.f;
    for (int i = 0; i < 32; ++i) acc += x[32 * (size_t)b + i];
    s[b] = acc;
}
