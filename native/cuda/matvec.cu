// Quantized matrix-vector products straight from the GGUF blocks, activation quantization and
// embedding lookup. Y (n, rows) = X_hat (n, k) . W (rows, k)^T, X_hat already quantized to the
// weight type's vec_dot_type; one warp per output row, lanes striding over 32-element units.
#include "ntx_quants.cuh"
#include "act_quant.cuh"

#define NTX_WARPS 4  // rows per thread block

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

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

// S: (n, k/32) Q8_1 block sums for HAS_MIN types, else unused. N: tokens per pass (n <= N).
template <class T, int N>
__device__ void matvec_body(const uint8_t* __restrict__ W, const float* __restrict__ X,
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
        const int col = b * T::QK + j * 32;
#pragma unroll
        for (int t = 0; t < N; ++t) {
            if (t < n) {
                float s = dot32(w, X + (size_t)t * k + col);
                if (T::HAS_MIN) s += m * S[(size_t)t * (k / 32) + col / 32];
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < N; ++t) {
        const float v = warp_sum(acc[t]);
        if (lane == 0 && t < n) Y[(size_t)t * rows + row] = v;
    }
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

#define NTX_MATVEC(T, name)                                                                     \
    extern "C" __global__ void __launch_bounds__(NTX_WARPS * 32)                                \
    matvec_##name##_n1(const uint8_t* W, const float* X, const float* S, float* Y, int rows,  \
                       int k, int n) { matvec_body<T, 1>(W, X, S, Y, rows, k, n); }             \
    extern "C" __global__ void __launch_bounds__(NTX_WARPS * 32)                                \
    matvec_##name##_n8(const uint8_t* W, const float* X, const float* S, float* Y, int rows,  \
                       int k, int n) { matvec_body<T, 8>(W, X, S, Y, rows, k, n); }             \
    extern "C" __global__ void embed_##name(const uint8_t* W, const int* ids, float* out,      \
                                            int k) { embed_body<T>(W, ids, out, k); }

NTX_FOR_EACH_TYPE(NTX_MATVEC)

// --- activation quantization: x (total,) -> x_hat (total,) [+ s (total/32,)] ---------------

extern "C" __global__ void quant_q8_1(const float* x, float* x_hat, float* s, int nblocks) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < nblocks) ntx_q8_block(x + 32 * (size_t)b, x_hat + 32 * (size_t)b, s ? s + b : nullptr);
}

extern "C" __global__ void quant_q8_k(const float* x, float* x_hat, int nblocks) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < nblocks) ntx_q8k_block(x + 256 * (size_t)b, x_hat + 256 * (size_t)b);
}

extern "C" __global__ void round_f16(const float* x, float* out, int total) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = ntx_round_f16(x[i]);
}

extern "C" __global__ void round_bf16(const float* x, float* out, int total) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = ntx_round_bf16(x[i]);
}

// Plain per-32 sums of x: the Q4_1/Q5_1 min term when activations stay float32 ("exact" mode).
extern "C" __global__ void block_sum32(const float* x, float* s, int nblocks) {
    const int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= nblocks) return;
    float acc = 0.f;
    for (int i = 0; i < 32; ++i) acc += x[32 * (size_t)b + i];
    s[b] = acc;
}
