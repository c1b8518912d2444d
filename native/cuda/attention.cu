// Causal GQA attention over one layer's F16 KV cache (n_ctx, n_kv*head_dim), for prefill and
// decode alike: one block per (head, query token). Query position = pos[token]; keys 0..pos.
// Rounds as the numpy backend does with an F16 cache: q and the probabilities to fp16 before
// their dot products, the softmax sum in double.
#include "ntx_half.cuh"

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ float block_max(float v, float* red) {
    v = warp_max(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = red[0];
    for (int i = 1; i < (int)(blockDim.x >> 5); ++i) m = fmaxf(m, red[i]);
    __syncthreads();
    return m;
}

__device__ double block_sum_d(double v, double* red) {
    v = warp_sum_d(v);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += red[i];
    __syncthreads();
    return s;
}

// Dynamic shared memory: (head_dim + blockDim + n_ctx) floats + 32 doubles.
// q, out: (n, n_head*head_dim) float32; blockDim a multiple of head_dim (<= 1024).
extern "C" __global__ void attention(const float* __restrict__ q, const uint16_t* __restrict__ kc,
                                     const uint16_t* __restrict__ vc, float* __restrict__ out,
                                     const int* __restrict__ pos, int n_head, int n_kv, int hd,
                                     float scale) {
    extern __shared__ double smem_d[];
    double* red_d = smem_d;                      // 32
    float* red = reinterpret_cast<float*>(smem_d + 32);
    float* qs = red + 32;                        // hd
    float* part = qs + hd;                       // blockDim
    float* sc = part + blockDim.x;               // n_ctx
    const int h = blockIdx.x, t = blockIdx.y, kvh = h / (n_head / n_kv);
    const int kv_dim = n_kv * hd, T = pos[t] + 1;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const float* qh = q + ((size_t)t * n_head + h) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = ntx_round_f16(qh[d]);
    __syncthreads();
    for (int p = warp; p < T; p += nw) {
        const uint16_t* kr = kc + (size_t)p * kv_dim + kvh * hd;
        float s = 0.f;
        for (int d = lane; d < hd; d += 32) s += qs[d] * ntx_h2f(kr[d]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) sc[p] = s * scale;
    }
    __syncthreads();
    float m = -3.402823466e38f;
    for (int p = threadIdx.x; p < T; p += blockDim.x) m = fmaxf(m, sc[p]);
    m = block_max(m, red);
    double sum = 0.0;
    for (int p = threadIdx.x; p < T; p += blockDim.x) {
        const float e = expf(sc[p] - m);
        sc[p] = e;
        sum += (double)e;
    }
    sum = block_sum_d(sum, red_d);
    for (int p = threadIdx.x; p < T; p += blockDim.x) sc[p] = ntx_round_f16((float)((double)sc[p] / sum));
    __syncthreads();
    const int d = threadIdx.x % hd, g = threadIdx.x / hd, G = blockDim.x / hd;
    float acc = 0.f;
    for (int p = g; p < T; p += G) acc += sc[p] * ntx_h2f(vc[(size_t)p * kv_dim + kvh * hd + d]);
    part[threadIdx.x] = acc;
    __syncthreads();
    if (g == 0) {
        float s = 0.f;
        for (int i = 0; i < G; ++i) s += part[i * hd + d];
        out[((size_t)t * n_head + h) * hd + d] = s;
    }
}
