// Mixture-of-experts kernels (ntx_engine/backends/cuda_moe.py): the router's top-k choice and
// the routed matvecs, one launch per projection for every selected expert of every token of a
// layer, reading each expert's rows straight from the 3-D GGUF tensor (experts x rows x k) at
// the chosen expert's offset. Numerics as ntx_engine/moe.py (the numpy oracle): llama.cpp's
// build_moe_ffn. The expert ids stay in device memory, so a decode step with MoE layers can be
// captured in a CUDA graph like a dense one.
#include "ntx_quants.cuh"
#include "warp.cuh"

#define NTX_MOE_WARPS 4          // output rows per thread block of moe_matvec_*
#define NTX_MOE_MAX_EXPERTS 1024 // router width moe_route keeps in shared memory

// logits (n, n_expert) -> ids (n, k) int32 and weights (n, k): softmax (exp in float, the sum in
// double as ggml does), the k largest probabilities (equal ones: the lower id first), divided by
// their sum when norm. One warp per token; grid (n), block (32).
extern "C" __global__ void moe_route(const float* __restrict__ logits, int* __restrict__ ids,
                                     float* __restrict__ w, int n_expert, int k, int norm) {
    NTX_PDL();
    __shared__ float p[NTX_MOE_MAX_EXPERTS];
    const int t = blockIdx.x, lane = threadIdx.x;
    const float* x = logits + (size_t)t * n_expert;
    float m = -__int_as_float(0x7f800000);  // -inf (NVRTC has no <math.h> INFINITY)
    for (int e = lane; e < n_expert; e += 32) m = fmaxf(m, x[e]);
    m = warp_max(m);
    double sum = 0.0;
    for (int e = lane; e < n_expert; e += 32) {
        p[e] = expf(__fsub_rn(x[e], m));
        sum += p[e];
    }
    const float inv = (float)(1.0 / warp_sum_d(sum));
    for (int e = lane; e < n_expert; e += 32) p[e] = __fmul_rn(p[e], inv);
    __syncwarp();
    int* ids_t = ids + (size_t)t * k;
    float* w_t = w + (size_t)t * k;
    for (int s = 0; s < k; ++s) {
        float best = -1.f;  // probabilities are >= 0; taken ones are set to -1
        int bi = n_expert;
        for (int e = lane; e < n_expert; e += 32)
            if (p[e] > best) { best = p[e]; bi = e; }  // e grows: the lowest id wins a tie
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
        }
        if (lane == 0) {
            ids_t[s] = bi;
            w_t[s] = best;
            p[bi] = -1.f;
        }
        __syncwarp();
    }
    if (norm && lane == 0) {
        float total = 0.f;
        for (int s = 0; s < k; ++s) total = __fadd_rn(total, w_t[s]);
        for (int s = 0; s < k; ++s) w_t[s] = __fdiv_rn(w_t[s], total);
    }
}

// Y (n, n_used, rows) = for token t (grid z) and slot s (grid y): W[ids[t, s]] (rows, k) . x^T,
// x = X_hat row t (x_per_slot == 0: gate/up share the token's input) or row t*n_used + s (down:
// one input per slot). X_hat is already quantized to the weight's vec_dot_type; S holds the
// per-32 Q8_1 sums for the types with a block minimum. One warp per output row. A negative id skips
// (t, s): the VRAM expert cache (moe_offload.py) passes cache-slot indices, one group at a time.
template <class T>
__device__ void moe_matvec_body(const uint8_t* __restrict__ W, const float* __restrict__ X,
                                const float* __restrict__ S, const int* __restrict__ ids,
                                float* __restrict__ Y, int rows, int k, int n_used, int x_per_slot) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * NTX_MOE_WARPS + (threadIdx.x >> 5);
    const int slot = blockIdx.y, t = blockIdx.z;
    if (row >= rows) return;
    const int nb = k / T::QK, units = nb * T::UNITS;
    const size_t row_bytes = (size_t)nb * T::BYTES;
    const int e = ids[(size_t)t * n_used + slot];
    if (e < 0) return;  // the expert cache computes a layer's experts in groups: not this group's
    const uint8_t* wrow = W + ((size_t)e * rows + row) * row_bytes;
    const size_t xr = x_per_slot ? (size_t)t * n_used + slot : (size_t)t;
    const float* x = X + xr * k;
    const float* s = T::HAS_MIN ? S + xr * (k / 32) : nullptr;
    float acc = 0.f;
    for (int u = lane; u < units; u += 32) {
        const int b = u / T::UNITS, j = u % T::UNITS;
        float wv[32];
        const float m = T::deq32(wrow + (size_t)b * T::BYTES, j, wv);
        const int col = b * T::QK + j * 32;
        const float4* x4 = reinterpret_cast<const float4*>(x + col);
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float4 v = x4[i];
            d += wv[4*i] * v.x + wv[4*i+1] * v.y + wv[4*i+2] * v.z + wv[4*i+3] * v.w;
        }
        if (T::HAS_MIN) d += m * s[col / 32];
        acc += d;
    }
    acc = warp_sum(acc);
    if (lane == 0) Y[((size_t)t * n_used + slot) * rows + row] = acc;
}

#define NTX_MOE_MATVEC(T, name)                                                                   \
    extern "C" __global__ void __launch_bounds__(NTX_MOE_WARPS * 32)                              \
    moe_matvec_##name(const uint8_t* W, const float* X, const float* S, const int* ids, float* Y,  \
                      int rows, int k, int n_used, int x_per_slot) {                              \
        NTX_PDL();                                                                                 \
        moe_matvec_body<T>(W, X, S, ids, Y, rows, k, n_used, x_per_slot);                         \
    }

NTX_FOR_EACH_TYPE(NTX_MOE_MATVEC)

// out (n, d) = sum over slots, in slot order, of w[t, s] * Y[t, s, :] (ggml multiplies, then
// adds the slots one by one), plus sigmoid(g[t]) * shared[t, :] when shared != nullptr (the
// qwen2moe shared expert). grid (ceil(d / 256), n), block (256).
extern "C" __global__ void moe_combine(const float* __restrict__ Y, const float* __restrict__ w,
                                       const float* __restrict__ shared, const float* __restrict__ g,
                                       float* __restrict__ out, int n_used, int d) {
    NTX_PDL();
    const int t = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= d) return;
    const float* yt = Y + (size_t)t * n_used * d;
    const float* wt = w + (size_t)t * n_used;
    float acc = __fmul_rn(yt[i], wt[0]);
    for (int s = 1; s < n_used; ++s) acc = __fadd_rn(acc, __fmul_rn(yt[(size_t)s * d + i], wt[s]));
    if (shared) {
        const float gate = __fdiv_rn(1.f, __fadd_rn(1.f, expf(-g[t])));
        acc = __fadd_rn(acc, __fmul_rn(shared[(size_t)t * d + i], gate));
    }
    out[(size_t)t * d + i] = acc;
}
