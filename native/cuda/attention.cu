// Causal GQA attention over one layer's F16 KV cache (n_ctx, n_kv*head_dim), for prefill and
// decode alike: one block per (head, query token). Query position = pos[token]; keys 0..pos.
// Rounds as the numpy backend does with an F16 cache: q and the probabilities to fp16 before
// their dot products, the softmax sum in double.
#include "ntx_half.cuh"
#include "matvec_fast.cuh"  // the int8 activation quantizers (fused output quantization)
#include "attn_common.cuh"

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

// --- split attention (flash-decoding) for one decode token: the context in chunks of ATTN_CHUNK
// positions, one block per (chunk, KV head) that serves all the query heads of its GQA group, so
// each K/V row is read once per group and a decode step over a long context uses the whole GPU.
// Same rounding as `attention`: q to fp16, the global max and the double softmax sum formed
// before any probability is rounded to fp16, so each chunk's p.V uses exactly those values.
// The grid spans n_ctx (a captured graph replays at any position); chunks past pos[0] exit.
// The single kernel above needs blockDim a multiple of both 32 and head_dim (cuda_kernels).
// Limits (cuda_kernels.gqa_split_ok): head_dim % 32 == 0, head_dim <= 256, G = n_head/n_kv <= 16,
// G * head_dim <= ATTN_QMAX.
#define ATTN_CHUNK 64
#define ATTN_SPLIT_THREADS 256
#define ATTN_WARPS (ATTN_SPLIT_THREADS / 32)
#define ATTN_GMAX 16
#define ATTN_QMAX 4096

// The softmax statistics of query head h over positions 0..T-1, by one warp: the global max M of
// the used chunk maxima and the double sum of exp(s - M). __ldcg: other SMs wrote these values in
// this kernel, so they are read from L2, never from a stale L1 line.
__device__ void softmax_stats_warp(const float* sc, const float* cm, int used, int T, float* gmax, double* gsum) {
    const int lane = threadIdx.x & 31;
    float m = -3.402823466e38f;
    for (int i = lane; i < used; i += 32) m = fmaxf(m, __ldcg(cm + i));
    m = warp_max(m);
    double sum = 0.0;
    for (int p = lane; p < T; p += 32) sum += (double)expf(__ldcg(sc + p) - m);
    sum = warp_sum_d(sum);
    if (lane == 0) {
        *gmax = m;
        *gsum = sum;
    }
}

// Pass 1: scores (n_head, n_ctx) = scale * fp16(q) . k and cmax (n_head, nchunk), the chunk
// maxima; the last block of each KV head to finish writes gmax/gsum (n_head) of its G query heads
// and resets that head's arrival counter (zero between launches, so a captured graph replays).
// Grid (nchunk, n_kv). One warp a position: lane holds V = hd/32 consecutive values of the K row.
template <int V>
__device__ void gqa_scores(const float* __restrict__ q, const uint16_t* __restrict__ kc, float* scores,
                           float* cmax, const int* __restrict__ pos, int n_head, int n_kv, int n_ctx, float scale,
                           unsigned int* counter, float* gmax, double* gsum) {
    __shared__ float qs[ATTN_QMAX], wmax[ATTN_WARPS][ATTN_GMAX];
    __shared__ bool last;
    const int hd = 32 * V, c = blockIdx.x, kvh = blockIdx.y, nchunk = gridDim.x, G = n_head / n_kv;
    const int T = pos[0] + 1, p0 = c * ATTN_CHUNK, p1 = min(p0 + ATTN_CHUNK, T);
    if (p0 >= T) return;  // the whole block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, kv_dim = n_kv * hd;
    const float* qg = q + (size_t)kvh * G * hd;  // the group's heads are consecutive
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) qs[i] = ntx_round_f16(qg[i]);
    __syncthreads();
    float m[ATTN_GMAX];
#pragma unroll
    for (int g = 0; g < ATTN_GMAX; ++g) m[g] = -3.402823466e38f;
    for (int p = p0 + warp; p < p1; p += ATTN_WARPS) {
        float kf[V], s[ATTN_GMAX];
        ld_halves<V>(kc + (size_t)p * kv_dim + kvh * hd + lane * V, kf);
        group_dots<V, ATTN_GMAX>(qs, kf, G, lane, s);
#pragma unroll
        for (int g = 0; g < ATTN_GMAX; ++g) {
            if (g >= G) break;
            const float v = s[g] * scale;
            if (lane == g) scores[(size_t)(kvh * G + g) * n_ctx + p] = v;  // G lanes store at once
            m[g] = fmaxf(m[g], v);
        }
    }
    if (lane == 0)
        for (int g = 0; g < G; ++g) wmax[warp][g] = m[g];
    __syncthreads();
    if (threadIdx.x < G) {
        float mm = wmax[0][threadIdx.x];
        for (int w = 1; w < ATTN_WARPS; ++w) mm = fmaxf(mm, wmax[w][threadIdx.x]);
        cmax[(size_t)(kvh * G + threadIdx.x) * nchunk + c] = mm;
    }
    const int used = (T + ATTN_CHUNK - 1) / ATTN_CHUNK;
    __threadfence();  // this block's scores and maxima are visible before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter + kvh, 1u) == (unsigned int)(used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int g = warp; g < G; g += ATTN_WARPS) {  // a warp a query head
        const int h = kvh * G + g;
        softmax_stats_warp(scores + (size_t)h * n_ctx, cmax + (size_t)h * nchunk, used, T, gmax + h, gsum + h);
    }
    if (threadIdx.x == 0) counter[kvh] = 0u;
}

// Pass 2: per chunk, p = fp16(exp(s - M) / sum) with pass 1's global M and double sum, and
// part (n_head, nchunk, hd) = p . V over the chunk: a thread holds two dims of the V row for
// PG = 2 * blockDim / hd position groups. The last block of each KV head to finish sums the used
// chunks' parts in chunk order into out (n_head * hd) and, when qmode != 0, quantizes its G * hd
// values for the next matmul as quanti_q8_1 (qmode 1) or quanti_q8_k (qmode 2) would.
template <int V>
__device__ void gqa_pv(const float* __restrict__ scores, const float* __restrict__ gmax,
                       const double* __restrict__ gsum, const uint16_t* __restrict__ vc, float* part,
                       float* out, const int* __restrict__ pos, int n_head, int n_kv, int n_ctx,
                       unsigned int* counter, int8_t* xq, float* xd, float* xs, int qmode) {
    constexpr int hd = 32 * V, D2 = hd / 2, PG = ATTN_SPLIT_THREADS / D2;
    __shared__ float prob[ATTN_GMAX][ATTN_CHUNK], acc_s[ATTN_QMAX];
    __shared__ bool last;
    const int c = blockIdx.x, kvh = blockIdx.y, nchunk = gridDim.x, G = n_head / n_kv;
    const int T = pos[0] + 1, p0 = c * ATTN_CHUNK, p1 = min(p0 + ATTN_CHUNK, T);
    if (p0 >= T) return;
    const int kv_dim = n_kv * hd;
    for (int i = threadIdx.x; i < G * ATTN_CHUNK; i += blockDim.x) {
        const int g = i / ATTN_CHUNK, p = p0 + i % ATTN_CHUNK, h = kvh * G + g;
        if (p < p1)
            prob[g][p - p0] = ntx_round_f16((float)((double)expf(scores[(size_t)h * n_ctx + p] - gmax[h]) / gsum[h]));
    }
    __syncthreads();
    const int dt = threadIdx.x % D2, pg = threadIdx.x / D2;
    float a0[ATTN_GMAX], a1[ATTN_GMAX];
#pragma unroll
    for (int g = 0; g < ATTN_GMAX; ++g) a0[g] = a1[g] = 0.f;
#pragma unroll 4
    for (int p = p0 + pg; pg < PG && p < p1; p += PG) {  // pg < PG: 256 threads need not be whole rows
        const uint32_t w = *reinterpret_cast<const uint32_t*>(vc + (size_t)p * kv_dim + kvh * hd + 2 * dt);
        const float v0 = ntx_h2f((uint16_t)(w & 0xffffu)), v1 = ntx_h2f((uint16_t)(w >> 16));
#pragma unroll
        for (int g = 0; g < ATTN_GMAX; ++g) {
            if (g >= G) break;
            a0[g] += prob[g][p - p0] * v0;
            a1[g] += prob[g][p - p0] * v1;
        }
    }
    // the PG groups' sums, then in group order (deterministic)
    for (int part_pg = 0; part_pg < PG; ++part_pg) {
        if (pg == part_pg)
            for (int g = 0; g < G; ++g) {
                float* dst = acc_s + g * hd + 2 * dt;
                dst[0] = part_pg == 0 ? a0[g] : dst[0] + a0[g];
                dst[1] = part_pg == 0 ? a1[g] : dst[1] + a1[g];
            }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        const int g = i / hd, d = i % hd;
        part[((size_t)(kvh * G + g) * nchunk + c) * hd + d] = acc_s[i];
    }
    const int used = (T + ATTN_CHUNK - 1) / ATTN_CHUNK;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter + kvh, 1u) == (unsigned int)(used - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* og = out + (size_t)kvh * G * hd;
    for (int i = threadIdx.x; i < G * hd; i += blockDim.x) {
        const int g = i / hd, d = i % hd;
        const float* pp = part + (size_t)(kvh * G + g) * nchunk * hd + d;
        float s = 0.f;
        for (int cc = 0; cc < used; ++cc) s += __ldcg(pp + (size_t)cc * hd);
        og[i] = s;
    }
    if (threadIdx.x == 0) counter[kvh] = 0u;
    if (qmode == 0) return;
    __syncthreads();  // the group's outputs, written by the whole block, are visible to every warp
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int per = qmode == 2 ? 256 : 32, b0 = kvh * G * hd / per, nb = G * hd / per;
    for (int b = warp; b < nb; b += ATTN_WARPS) {
        if (qmode == 2) quanti_q8_k_block(out, xq, xd, xs, b0 + b, lane);
        else quanti_q8_1_block(out, xq, xd, xs, b0 + b, lane);
    }
}

#define NTX_GQA(V)                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_SPLIT_THREADS)                                          \
    attn_gqa_scores_##V(const float* q, const uint16_t* kc, float* scores, float* cmax, const int* pos,      \
                        int n_head, int n_kv, int n_ctx, float scale, unsigned int* counter, float* gmax,     \
                        double* gsum) {                                                                       \
        NTX_PDL();                                                                                            \
        gqa_scores<V>(q, kc, scores, cmax, pos, n_head, n_kv, n_ctx, scale, counter, gmax, gsum);             \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(ATTN_SPLIT_THREADS)                                          \
    attn_gqa_pv_##V(const float* scores, const float* gmax, const double* gsum, const uint16_t* vc,          \
                    float* part, float* out, const int* pos, int n_head, int n_kv, int n_ctx,                 \
                    unsigned int* counter, int8_t* xq, float* xd, float* xs, int qmode) {                     \
        NTX_PDL();                                                                                            \
        gqa_pv<V>(scores, gmax, gsum, vc, part, out, pos, n_head, n_kv, n_ctx, counter, xq, xd, xs, qmode);   \
    }

NTX_GQA(2)  // head_dim 64
NTX_GQA(3)  // 96
NTX_GQA(4)  // 128
NTX_GQA(8)  // 256
