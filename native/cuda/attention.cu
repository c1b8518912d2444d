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
    NTX_PDL();
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

// --- split attention (flash-decoding): the context in chunks of ATTN_CHUNK positions, one block
// per (head, chunk, token), so a decode step over a long context uses the whole GPU. Same
// rounding as `attention`: the global max and the double softmax sum are formed before any
// probability is rounded to fp16, so each chunk's p.V uses exactly the probabilities above.
// The grid spans n_ctx (a captured graph replays at any position); chunks past pos[t] exit.
#define ATTN_CHUNK 64
#define ATTN_SPLIT_THREADS 256

// The softmax statistics of one (token, head) over positions 0..T-1: the global max M of the chunk
// maxima and the double sum of exp(s - M), each thread over p = tid, tid + blockDim, ... then a
// block sum. Formed once, by the last chunk's block of attn_scores to finish, so every attn_pv
// block reads the very same bits (this used to be recomputed by each of them). __ldcg: another
// SM wrote these values in this kernel, so they are read from L2, never from a stale L1 line.
__device__ void softmax_stats(const float* sc, const float* cm, int used, int T, float* gmax, double* gsum,
                              float* red, double* red_d) {
    float m = -3.402823466e38f;
    for (int i = threadIdx.x; i < used; i += blockDim.x) m = fmaxf(m, __ldcg(cm + i));
    m = block_max(m, red);
    double sum = 0.0;
    for (int p = threadIdx.x; p < T; p += blockDim.x) sum += (double)expf(__ldcg(sc + p) - m);
    sum = block_sum_d(sum, red_d);
    if (threadIdx.x == 0) {
        *gmax = m;
        *gsum = sum;
    }
}

// Pass 1: scores (n, n_head, n_ctx) = scale * fp16(q) . k; cmax (n, n_head, nchunk) chunk maxima;
// the last block of each (token, head) to finish also writes gmax/gsum (n, n_head) and resets
// that (token, head)'s arrival counter (zero between launches, so a captured graph replays).
extern "C" __global__ void __launch_bounds__(ATTN_SPLIT_THREADS)
attn_scores(const float* __restrict__ q, const uint16_t* __restrict__ kc, float* scores, float* cmax,
            const int* __restrict__ pos, int n_head, int n_kv, int hd, int n_ctx, float scale,
            unsigned int* counter, float* gmax, double* gsum) {
    NTX_PDL();
    __shared__ float qs[256], red[32];
    __shared__ double red_d[32];
    __shared__ bool last;
    const int h = blockIdx.x, c = blockIdx.y, t = blockIdx.z, nchunk = gridDim.y;
    const int T = pos[t] + 1, p0 = c * ATTN_CHUNK, p1 = min(p0 + ATTN_CHUNK, T);
    if (p0 >= T) return;  // the whole block
    const int kvh = h / (n_head / n_kv), kv_dim = n_kv * hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const size_t th = (size_t)t * n_head + h;
    const float* qh = q + th * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) qs[d] = ntx_round_f16(qh[d]);
    __syncthreads();
    float* sc = scores + th * n_ctx;
    float m = -3.402823466e38f;
    // unrolled so the K rows of several positions are in flight at once (each iteration alone is
    // a chain of dependent global loads and shuffles); the arithmetic per position is unchanged
#pragma unroll 4
    for (int p = p0 + warp; p < p1; p += nw) {
        const uint16_t* kr = kc + (size_t)p * kv_dim + kvh * hd;
        float s = 0.f;
        for (int d = lane; d < hd; d += 32) s += qs[d] * ntx_h2f(kr[d]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        s *= scale;
        if (lane == 0) sc[p] = s;
        m = fmaxf(m, s);
    }
    m = block_max(m, red);
    if (threadIdx.x == 0) cmax[th * nchunk + c] = m;
    const int used = (T + ATTN_CHUNK - 1) / ATTN_CHUNK;
    __threadfence();  // this block's scores and maximum are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter + th, 1u) == (unsigned int)(used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    softmax_stats(sc, cmax + th * nchunk, used, T, gmax + th, gsum + th, red, red_d);
    if (threadIdx.x == 0) counter[th] = 0u;
}

// Pass 2: per chunk, p = fp16(exp(s - M) / sum) with pass 1's global M and double sum, then
// part (n, n_head, nchunk, hd) = p . V over the chunk.
extern "C" __global__ void __launch_bounds__(ATTN_SPLIT_THREADS)
attn_pv(const float* __restrict__ scores, const float* __restrict__ gmax, const double* __restrict__ gsum,
        const uint16_t* __restrict__ vc, float* __restrict__ part, const int* __restrict__ pos, int n_head,
        int n_kv, int hd, int n_ctx) {
    NTX_PDL();
    __shared__ float prob[ATTN_CHUNK], acc_s[ATTN_SPLIT_THREADS];
    const int h = blockIdx.x, c = blockIdx.y, t = blockIdx.z, nchunk = gridDim.y;
    const int T = pos[t] + 1, p0 = c * ATTN_CHUNK, p1 = min(p0 + ATTN_CHUNK, T);
    if (p0 >= T) return;
    const size_t th = (size_t)t * n_head + h;
    const float m = gmax[th];
    const double sum = gsum[th];
    const float* sc = scores + th * n_ctx;
    for (int p = p0 + threadIdx.x; p < p1; p += blockDim.x)
        prob[p - p0] = ntx_round_f16((float)((double)expf(sc[p] - m) / sum));
    __syncthreads();
    const int kvh = h / (n_head / n_kv), kv_dim = n_kv * hd;
    const int d = threadIdx.x % hd, g = threadIdx.x / hd, G = blockDim.x / hd;
    float acc = 0.f;
    if (g < G) {
        // unrolled: the V loads of 8 positions issue together (the sum is still in position order)
#pragma unroll 8
        for (int p = p0 + g; p < p1; p += G) acc += prob[p - p0] * ntx_h2f(vc[(size_t)p * kv_dim + kvh * hd + d]);
    }
    acc_s[threadIdx.x] = acc;
    __syncthreads();
    if (g == 0) {
        float s = 0.f;
        for (int i = 0; i < G; ++i) s += acc_s[i * hd + d];
        part[(th * nchunk + c) * hd + d] = s;
    }
}

// Pass 3: out (n, n_head*hd) = the sum of the used chunks' parts, in chunk order (deterministic).
extern "C" __global__ void attn_reduce(const float* __restrict__ part, float* __restrict__ out,
                                       const int* __restrict__ pos, int n_head, int hd, int nchunk) {
    NTX_PDL();
    const int h = blockIdx.x, t = blockIdx.y, d = threadIdx.x;
    if (d >= hd) return;
    const int used = (pos[t] + ATTN_CHUNK) / ATTN_CHUNK;  // ceil((pos + 1) / CHUNK)
    const size_t th = (size_t)t * n_head + h;
    float s = 0.f;
    for (int c = 0; c < used; ++c) s += part[(th * nchunk + c) * hd + d];
    out[th * hd + d] = s;
}
