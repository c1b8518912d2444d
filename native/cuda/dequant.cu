// The prefill GEMM's inputs for cuBLAS (cublas.py): weight rows decoded to fp16 tiles, and
// activations converted to fp16 with a per-row power-of-two scale so no value overflows fp16.
// Y = alpha * W . X^T is then one tensor-core GEMM (fp16 inputs, fp32 accumulation and output),
// and scale_rows multiplies each token's row of Y back by its scale.
#include "ntx_quants.cuh"

// out (rows, k) fp16 = the decoded rows [0, rows) of W (block minimum added back), one thread
// per 32-element unit; each thread writes its 64 bytes as four 16-byte stores.
template <class T>
__device__ void dequant_body(const uint8_t* __restrict__ W, uint16_t* __restrict__ out, int rows, int k) {
    const size_t u = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const int units_per_row = k / T::QK * T::UNITS;
    if (u >= (size_t)rows * units_per_row) return;
    const size_t row = u / units_per_row;
    const int ur = (int)(u % units_per_row), b = ur / T::UNITS, j = ur % T::UNITS;
    float w[32];
    const float m = T::deq32(W + (row * (k / T::QK) + b) * T::BYTES, j, w);
    uint32_t packed[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
        packed[i] = (uint32_t)ntx_f2h(w[2*i] + m) | ((uint32_t)ntx_f2h(w[2*i+1] + m) << 16);
    uint4* o = reinterpret_cast<uint4*>(out + row * k + b * T::QK + j * 32);
#pragma unroll
    for (int i = 0; i < 4; ++i) o[i] = make_uint4(packed[4*i], packed[4*i+1], packed[4*i+2], packed[4*i+3]);
}

#define NTX_DEQUANT(T, name)                                                                    \
    extern "C" __global__ void dequant_f16_##name(const uint8_t* W, uint16_t* out, int rows, int k) { \
        NTX_PDL(); dequant_body<T>(W, out, rows, k); }

NTX_FOR_EACH_TYPE(NTX_DEQUANT)

#define NTX_F16_LIMIT 32768.f  // scaled rows stay below this: fp16's largest finite is 65504

// One block per token row: xh = x / s in fp16, scales[t] = s, where s is the smallest power of
// two (>= 1) that brings the row's largest magnitude under NTX_F16_LIMIT (exact: a power of two).
extern "C" __global__ void to_f16_rows(const float* __restrict__ x, uint16_t* __restrict__ xh,
                                       float* __restrict__ scales, int k) {
    NTX_PDL();
    __shared__ float warp_max[32];
    const float* xr = x + (size_t)blockIdx.x * k;
    float m = 0.f;
    for (int i = threadIdx.x; i < k; i += blockDim.x) m = fmaxf(m, fabsf(xr[i]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? warp_max[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) warp_max[0] = m;
    }
    __syncthreads();
    float s = 1.f;
    // a non-finite row stays non-finite (inf/NaN propagate to Y as in every other matmul path)
    while (isfinite(warp_max[0]) && warp_max[0] / s >= NTX_F16_LIMIT) s *= 2.f;
    if (threadIdx.x == 0) scales[blockIdx.x] = s;
    const float inv = 1.f / s;
    uint16_t* out = xh + (size_t)blockIdx.x * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = ntx_f2h(xr[i] * inv);
}

// y (n, rows) row t *= scales[t]; a row whose scale is 1 is left untouched (the common case
// costs one load per block).
extern "C" __global__ void scale_rows(float* __restrict__ y, const float* __restrict__ scales, int rows) {
    NTX_PDL();
    const float s = scales[blockIdx.x];
    if (s == 1.f) return;
    float* yr = y + (size_t)blockIdx.x * rows;
    for (int i = threadIdx.x; i < rows; i += blockDim.x) yr[i] *= s;
}
