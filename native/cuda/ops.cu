// Element-wise and row-wise transformer ops, rounded the way the numpy backend rounds them.
#include "ntx_half.cuh"
#include "rmsnorm.cuh"
#include "ops.cuh"
#include "warp.cuh"

// out (n, k) = x * (1 / sqrt(mean(x^2) + eps)) * w; the mean is summed in double as ggml does.
extern "C" __global__ void __launch_bounds__(NTX_NORM_THREADS) rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                   float* __restrict__ out, int k, float eps) {
    NTX_PDL();
    __shared__ double part[32];
    ntx_rmsnorm_row(x + (size_t)blockIdx.x * k, w, out + (size_t)blockIdx.x * k, k, eps, part);
}

// RoPE on x (n, n_heads*head_dim) -> out (ops.cuh's ntx_rope_pair). Positions come from device
// memory so a captured graph replays for any position.
extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ out,
                                const int* __restrict__ pos, const float* __restrict__ ff,
                                int n_heads, int head_dim, int rope_dim, float scale,
                                float freq_scale, int neox) {
    NTX_PDL();
    const int t = blockIdx.y;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * (head_dim / 2)) return;
    const size_t row = (size_t)t * n_heads * head_dim;
    int a, b;
    float o0, o1;
    ntx_rope_pair(x + row, idx, head_dim, rope_dim, pos[t], ff, scale, freq_scale, neox, &a, &b, &o0, &o1);
    out[row + a] = o0;
    out[row + b] = o1;
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int total) {
    NTX_PDL();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = ntx_swiglu(g[i], u[i]);
}

// out = a + b, b broadcast over rows when its length (b_len) is shorter than total.
extern "C" __global__ void add(const float* a, const float* b, float* out, int total, int b_len) {
    NTX_PDL();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = __fadd_rn(a[i], b[i % b_len]);
}

// Append k, v (n, kv_dim) float32 at positions pos[0..n) of one layer's F16 caches (n_ctx, kv_dim).
extern "C" __global__ void kv_store(const float* k, const float* v, uint16_t* kc, uint16_t* vc,
                                    const int* pos, int kv_dim) {
    NTX_PDL();
    const int t = blockIdx.y;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= kv_dim) return;
    const size_t dst = (size_t)pos[t] * kv_dim + i;
    kc[dst] = ntx_f2h(k[(size_t)t * kv_dim + i]);
    vc[dst] = ntx_f2h(v[(size_t)t * kv_dim + i]);
}

// Index of the largest logit (the first on ties, as numpy's argmax); one block of 1024.
// feed_ids / feed_pos (both or neither; the decode graph's last kernel): the index is also the next
// step's token id and the step's position advances by one, so the next replay needs no upload
// (cuda_graph.DecodeGraph.greedy_stream; every kernel of the step before this one has finished);
// hist (with them, or null): mapped host memory, hist[position] = the index, so the host reads the
// step's token without a copy in the stream between two steps.
extern "C" __global__ void argmax(const float* x, int n, int* out, int* feed_ids, int* feed_pos, int* hist) {
    NTX_PDL();
    __shared__ float bv[1024];
    __shared__ int bi[1024];
    float best = -3.402823466e38f;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        if (x[i] > best) { best = x[i]; idx = i; }
    bv[threadIdx.x] = best;
    bi[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = bv[threadIdx.x + s];
            const int oi = bi[threadIdx.x + s];
            if (ov > bv[threadIdx.x] || (ov == bv[threadIdx.x] && oi < bi[threadIdx.x])) {
                bv[threadIdx.x] = ov;
                bi[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        *out = bi[0];
        if (feed_ids != nullptr) {
            const int p = *feed_pos;
            if (hist != nullptr) hist[p] = bi[0];
            *feed_ids = bi[0];
            *feed_pos = p + 1;
        }
    }
}

// Busy the stream for `us` microseconds (the per-kernel profile of scripts/bench_cuda.py queues a
// whole decode step behind it, so its CUDA events time the GPU, not Python's launch rate).
extern "C" __global__ void spin_us(int us) {
    const unsigned long long t0 = global_ns();
    do {
        __nanosleep(1000);
    } while (global_ns() - t0 < 1000ull * (unsigned long long)us);
}
