// Fused decode/prefill kernels: each replaces a chain of the one-op kernels with one launch and
// computes bit-for-bit what the chain computes (same helpers, same float32 operations), so the
// tests compare them against the unfused kernels exactly.
//
//   matvecf_multi_n*   up to three dp4a matvecs on the same int8 activations (q, k, v)
//   matvecf_swiglu_n*  gate and up rows by one warp, silu(gate) * up written directly
//   rope_kv            RoPE of q and k, k and v stored into the layer's F16 KV cache
//   add_rmsnorm_quanti residual add, RMSNorm and the next matmul's int8 activation quantization
#include "matvec_fast.cuh"
#include "ops.cuh"

// matvec_multi: rows of W0, W1, W2 numbered one after another; one warp a row as in
// matvec_fast.cu. ty*: the NTX_FT_* code of each weight; all three share k and the activation
// format (vec_dot_type). multi_row picks the warp's weight, output, row within it, that weight's
// row count and type; false past the last row.
struct MultiRow {
    const uint8_t* W;
    float* Y;
    int row, rows, ty;
};

__device__ __forceinline__ bool multi_row(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0,
                                          float* Y1, float* Y2, int r0, int r1, int r2, int ty0, int ty1, int ty2,
                                          MultiRow* m) {
    int row = blockIdx.x * NTX_FAST_WARPS + (threadIdx.x >> 5);
    if (row < r0) { *m = {W0, Y0, row, r0, ty0}; return true; }
    row -= r0;
    if (row < r1) { *m = {W1, Y1, row, r1, ty1}; return true; }
    row -= r1;
    if (row < r2) { *m = {W2, Y2, row, r2, ty2}; return true; }
    return false;
}

template <int N>
__device__ void matvec_multi(const MultiRow& m, const int8_t* xq, const float* xd, const float* xs, int k, int n,
                             const uint4* pre) {
    __shared__ __align__(16) uint8_t stage[NTX_FAST_WARPS][NTX_FAST_STAGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = m.row, rows = m.rows;
    float* Y = m.Y;
    float acc[N];
    fast_row_any<N, NTX_PRE_WAIT != 0>(m.ty, m.W, row, xq, xd, xs, stage[warp], k, n, acc, pre);
#pragma unroll
    for (int t = 0; t < N; ++t)
        if (lane == 0 && t < n) Y[(size_t)t * rows + row] = acc[t];
}

// Y (n, rows) = swiglu(x . Wg^T, x . Wu^T): the warp of row i computes gate row i, then up row i.
// NTX_SWIGLU_PAIR (default 1; 0 turns it off; decode, gate and up of one type, register path):
// the warp streams its gate and up rows side by side and loads each unit's activations once for
// both (fast_row_pair). Alone on the H200: Q4_K 23.1 -> 22.4 us, Q8_0 35.8 -> 34.1 us a layer.
#ifndef NTX_SWIGLU_PAIR
#define NTX_SWIGLU_PAIR 1
#endif
#define NTX_SWIGLU_STAGES (NTX_SWIGLU_PAIR ? 2 : 1)
// resident blocks an SM of matvecf_swiglu_n1: the paired rows need more registers (at 64 a thread
// they spill), and a warp keeps two rows' bytes in flight
#ifndef NTX_SWIGLU_MINB
#define NTX_SWIGLU_MINB (NTX_SWIGLU_PAIR ? 6 : NTX_FAST_MINB)
#endif

__device__ __forceinline__ bool swiglu_paired(int n_max, int tyg, int tyu) {
    return NTX_SWIGLU_PAIR && n_max == 1 && tyg == tyu;
}

template <int N>
__device__ void matvec_swiglu(const uint8_t* Wg, const uint8_t* Wu, int tyg, int tyu, const int8_t* xq,
                              const float* xd, const float* xs, float* Y, int rows, int k, int n, const uint4* pre) {
    __shared__ __align__(16) uint8_t stage[NTX_FAST_WARPS][NTX_SWIGLU_STAGES * NTX_FAST_STAGE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row = blockIdx.x * NTX_FAST_WARPS + warp;
    if (row >= rows) return;
    float g[N], u[N];
    if (swiglu_paired(N, tyg, tyu)) {
        fast_row_pair_any(tyg, Wg, Wu, row, xq, xd, xs, stage[warp], k, g, u, pre);
        if (lane == 0) Y[row] = ntx_swiglu(g[0], u[0]);
        return;
    }
    fast_row_any<N, NTX_PRE_WAIT != 0>(tyg, Wg, row, xq, xd, xs, stage[warp], k, n, g, pre);
    fast_row_any<N>(tyu, Wu, row, xq, xd, xs, stage[warp], k, n, u);
#pragma unroll
    for (int t = 0; t < N; ++t)
        if (lane == 0 && t < n) Y[(size_t)t * rows + row] = ntx_swiglu(g[t], u[t]);
}

#define NTX_FUSED(N)                                                                                       \
    extern "C" __global__ void __launch_bounds__(NTX_FAST_WARPS * 32, (N == 1 ? NTX_FAST_MINB : 1))                   \
    matvecf_multi_n##N(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0, float* Y1,      \
                       float* Y2, int r0, int r1, int r2, int ty0, int ty1, int ty2, const int8_t* xq,     \
                       const float* xd, const float* xs, int k, int n) {                                   \
        MultiRow m;                                                                                        \
        const bool mine = multi_row(W0, W1, W2, Y0, Y1, Y2, r0, r1, r2, ty0, ty1, ty2, &m);                \
        uint4 pre[NTX_PRE_SLOTS];                                                                          \
        if (NTX_PRE_WAIT && mine) fast_row_start_any(m.ty, m.W, m.row, k, pre);                            \
        NTX_PDL();                                                                                         \
        NTX_SKIP_KIND(8);                                                                                  \
        if (mine) matvec_multi<N>(m, xq, xd, xs, k, n, pre);                                               \
    }                                                                                                      \
    extern "C" __global__ void __launch_bounds__(NTX_FAST_WARPS * 32, (N == 1 ? NTX_SWIGLU_MINB : 1))                 \
    matvecf_swiglu_n##N(const uint8_t* Wg, const uint8_t* Wu, int tyg, int tyu, const int8_t* xq,          \
                        const float* xd, const float* xs, float* Y, int rows, int k, int n) {              \
        const int row = blockIdx.x * NTX_FAST_WARPS + (threadIdx.x >> 5);                                  \
        uint4 pre[2 * NTX_PRE_SLOTS];                                                                      \
        if (row < rows) {                                                                                  \
            if (NTX_PRE_WAIT) fast_row_start_any(tyg, Wg, row, k, pre);                                    \
            if (NTX_PRE_WAIT && swiglu_paired(N, tyg, tyu)) fast_row_start_any(tyu, Wu, row, k, pre + NTX_PRE_SLOTS); \
        }                                                                                                  \
        NTX_PDL();                                                                                         \
        NTX_SKIP_KIND(8);                                                                                  \
        matvec_swiglu<N>(Wg, Wu, tyg, tyu, xq, xd, xs, Y, rows, k, n, pre);                                \
    }

NTX_FUSED(1)
NTX_FUSED(8)

// RoPE of q (n, n_head*head_dim) into q_out and of k (n, n_kv*head_dim), whose rotated values go
// straight into the F16 K cache at pos[t], with v's into the V cache: ops.cu's rope (twice) and
// kv_store in one launch. Grid: (pairs of q and k) / blockDim, n.
extern "C" __global__ void rope_kv(const float* __restrict__ q, const float* __restrict__ k,
                                   const float* __restrict__ v, float* __restrict__ q_out, uint16_t* kc,
                                   uint16_t* vc, const int* __restrict__ pos, const float* __restrict__ ff,
                                   int n_head, int n_kv, int head_dim, int rope_dim, float scale, float freq_scale,
                                   int neox) {
    NTX_PDL();
    const int t = blockIdx.y, half_hd = head_dim / 2;
    int idx = blockIdx.x * blockDim.x + threadIdx.x, a, b;
    float o0, o1;
    if (idx < n_head * half_hd) {
        const size_t row = (size_t)t * n_head * head_dim;
        ntx_rope_pair(q + row, idx, head_dim, rope_dim, pos[t], ff, scale, freq_scale, neox, &a, &b, &o0, &o1);
        q_out[row + a] = o0;
        q_out[row + b] = o1;
        return;
    }
    idx -= n_head * half_hd;
    if (idx >= n_kv * half_hd) return;
    const int kv_dim = n_kv * head_dim;
    const size_t row = (size_t)t * kv_dim, dst = (size_t)pos[t] * kv_dim;
    ntx_rope_pair(k + row, idx, head_dim, rope_dim, pos[t], ff, scale, freq_scale, neox, &a, &b, &o0, &o1);
    kc[dst + a] = ntx_f2h(o0);
    kc[dst + b] = ntx_f2h(o1);
    vc[dst + a] = ntx_f2h(v[row + a]);
    vc[dst + b] = ntx_f2h(v[row + b]);
}

// The normalized row held in registers by the NTX_NORM_THREADS (1024) threads (o[j]: element
// threadIdx.x + 1024 j) quantized as quanti_q8_1 quantizes the stored row, bit for bit: warp w
// holds all 32 values of sub-block w + 32 j, so its sub-blocks' reductions run side by side from
// registers (was: 32 warps, one sub-block after another each, from the row re-read). H200, 8B
// Q8_0 decode 316.4-320.6 -> 330.7-331.0 tok/s (session 7, calls 11 and 14). The same for Q8_K
// (each 256-block's pivot from its 8 warps through shared memory) was slower than the warp a
// block it replaced, 4.43 -> 6.32 us alone (call 12): Q8_K keeps quanti_q8_k_block.
__device__ __forceinline__ void quanti_q8_1_regs(const float* o, int k, size_t r, int8_t* xq, float* xd, float* xs) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nsub = k / 32;
#pragma unroll
    for (int j = 0; j < NTX_NORM_REGS; ++j) {
        const int sb = w + 32 * j;
        if (sb < nsub) quanti_q8_1_value(o[j], xq, xd, xs, r * nsub + sb, lane);  // warp-uniform
    }
}

// Row blockIdx.x: s = x + d (skipped when d is null: the norm reads x), out = rmsnorm(s) * w, and
// when qmode != 0 out quantized as quanti_q8_1 (qmode 1, k % 32 == 0) or quanti_q8_k (qmode 2,
// k % 256 == 0) would: ops.cu's add and rmsnorm and matvec_fast.cu's quantizer in one block.
// Rows of at most NTX_NORM_REGS x 1024 values are quantized from registers for Q8_1 (quanti_q8_1_regs).
// NTX_NORM_PRE_WAIT (default 1; 0 turns it off): the norm weights are loaded before the PDL wait
// (a model constant: their HBM round trip overlaps the kernel before), on the register path.
#ifndef NTX_NORM_PRE_WAIT
#define NTX_NORM_PRE_WAIT 1
#endif
extern "C" __global__ void __launch_bounds__(NTX_NORM_THREADS) add_rmsnorm_quanti(const float* __restrict__ x, const float* __restrict__ d,
                                              float* __restrict__ s, const float* __restrict__ w,
                                              float* __restrict__ out, int8_t* xq, float* xd, float* xs, int k,
                                              float eps, int qmode) {
    float wv[NTX_NORM_REGS];
    const bool pre = NTX_NORM_PRE_WAIT && ntx_norm_in_regs(k);
    if (pre) ntx_norm_weights(w, k, wv);
    NTX_PDL();
    NTX_SKIP_KIND(1);
    __shared__ double part[32];
    const size_t r = blockIdx.x;
    if (qmode == 1 && blockDim.x == NTX_NORM_THREADS && k <= NTX_NORM_REGS * NTX_NORM_THREADS) {
        float o[NTX_NORM_REGS];
        ntx_add_rmsnorm_regs(x + r * k, d != nullptr ? d + r * k : nullptr, d != nullptr ? s + r * k : nullptr, w,
                             out + r * k, k, eps, part, o, NTX_NORM_PRE_WAIT ? wv : nullptr);
        quanti_q8_1_regs(o, k, r, xq, xd, xs);
        return;
    }
    ntx_add_rmsnorm_row(x + r * k, d != nullptr ? d + r * k : nullptr, d != nullptr ? s + r * k : nullptr, w,
                        out + r * k, k, eps, part, NTX_NORM_PRE_WAIT ? wv : nullptr);
    if (qmode == 0) return;
    __syncthreads();  // the row's values, written by the whole block, are visible to every warp
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int per = qmode == 2 ? 256 : 32, nb = k / per;
    for (int b = warp; b < nb; b += nw) {
        const size_t gb = r * nb + b;
        if (qmode == 2) quanti_q8_k_block(out, xq, xd, xs, gb, lane);
        else quanti_q8_1_block(out, xq, xd, xs, gb, lane);
    }
}
