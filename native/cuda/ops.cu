// Element-wise and row-wise transformer ops, rounded the way the numpy backend rounds them.
#include "ntx_half.cuh"
#include "rmsnorm.cuh"

// out (n, k) = x * (1 / sqrt(mean(x^2) + eps)) * w; the mean is summed in double as ggml does.
extern "C" __global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w,
                                   float* __restrict__ out, int k, float eps) {
    NTX_PDL();
    __shared__ double part[32];
    ntx_rmsnorm_row(x + (size_t)blockIdx.x * k, w, out + (size_t)blockIdx.x * k, k, eps, part);
}

// RoPE on x (n, n_heads*head_dim) -> out. theta_i = pos * scale^i as a running float32 product
// (ggml's rope cache), angle = theta_i / ff[i] * freq_scale. neox != 0 pairs (i, i + rope_dim/2),
// else adjacent (2i, 2i+1). Dimensions past rope_dim are copied. Positions come from device
// memory so a captured graph replays for any position.
extern "C" __global__ void rope(const float* __restrict__ x, float* __restrict__ out,
                                const int* __restrict__ pos, const float* __restrict__ ff,
                                int n_heads, int head_dim, int rope_dim, float scale,
                                float freq_scale, int neox) {
    NTX_PDL();
    const int t = blockIdx.y, half_hd = head_dim / 2;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n_heads * half_hd) return;
    const int h = idx / half_hd, i = idx % half_hd;
    const float* xh = x + ((size_t)t * n_heads + h) * head_dim;
    float* oh = out + ((size_t)t * n_heads + h) * head_dim;
    const int rd2 = rope_dim / 2;
    if (i >= rd2) {
        const int a = neox ? rope_dim + 2 * (i - rd2) : 2 * i;
        oh[a] = xh[a];
        oh[a + 1] = xh[a + 1];
        return;
    }
    float theta = (float)pos[t];
    for (int m = 0; m < i; ++m) theta = __fmul_rn(theta, scale);
    const float angle = __fmul_rn(__fdiv_rn(theta, ff ? ff[i] : 1.0f), freq_scale);
    const float c = cosf(angle), s = sinf(angle);
    const int a = neox ? i : 2 * i, b = neox ? i + rd2 : 2 * i + 1;
    const float x0 = xh[a], x1 = xh[b];
    oh[a] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
    oh[b] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

extern "C" __global__ void swiglu(const float* g, const float* u, float* out, int total) {
    NTX_PDL();
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < total) out[i] = __fmul_rn(__fdiv_rn(g[i], __fadd_rn(1.0f, expf(-g[i]))), u[i]);
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
extern "C" __global__ void argmax(const float* x, int n, int* out) {
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
    if (threadIdx.x == 0) *out = bi[0];
}

// Busy the stream for `us` microseconds (the per-kernel profile of scripts/bench_cuda.py queues a
// whole decode step behind it, so its CUDA events time the GPU, not Python's launch rate).
extern "C" __global__ void spin_us(int us) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < 1000ull * (unsigned long long)us);
}
