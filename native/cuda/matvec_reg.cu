// Decode matvecs (one activation row) of Q4_K weights with the activations in registers
// (matvec_reg.cuh): the plain product, the gate/up pair with swiglu, and the q/k/v launch, whose
// weights of other types (Q6_K v in Q4_K_M) take matvec_fast.cuh's one-warp rows in the same
// launch. Each gives a row the bits matvecr_q4_k gives it (and fast_row_any the bits matvecf_*
// gives a row of another type), so the fused kernels equal the unfused chain exactly.
//
// Launch (cuda_kernels.Kernels.reg_launch): WK x teams warps a block (teams = 8 / WK), about as
// many blocks as are resident at once; any grid computes the same values.
#include "matvec_reg.cuh"
#include "matvec_fast.cuh"
#include "ops.cuh"

template <int PPW>
__device__ __forceinline__ void reg_plain(const uint8_t* __restrict__ W, const int8_t* __restrict__ xq,
                                          const float* __restrict__ xd, const float* __restrict__ xs,
                                          float* __restrict__ Y, int rows, int k) {
    __shared__ float red[NTX_REG_WARPS][2 * NTX_REG_WARPS];
    if (!reg_block_ok(k)) return;
    const RegTeam t = reg_team<PPW>(k);
    const size_t row_bytes = (size_t)t.nb * 144;
    const int n = reg_count(t, 0, rows);
    auto ptr = [&](int i) { return W + (size_t)reg_row(t, 0, i) * row_bytes; };
    Q4KW cur[PPW];
    if (n > 0) q4k_row_load<PPW>(ptr(0), t.p0, t.nb, t.lane, cur);
    NTX_PDL();
    if (n == 0) return;  // the whole team leaves together
    Q4KActs<PPW> a;
    q4k_acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
    q4k_team_rows<PPW>(t, a, n, ptr, [&](int i, float v) { if (t.lane == 0) Y[reg_row(t, 0, i)] = v; }, cur, true,
                       red[t.team]);
}

// Y = swiglu(x . Wg^T, x . Wu^T): the team's rows as gate row r, up row r, gate row r', ...
template <int PPW>
__device__ __forceinline__ void reg_swiglu(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu,
                                           const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                           const float* __restrict__ xs, float* __restrict__ Y, int rows, int k) {
    __shared__ float red[NTX_REG_WARPS][2 * NTX_REG_WARPS];
    if (!reg_block_ok(k)) return;
    const RegTeam t = reg_team<PPW>(k);
    const size_t row_bytes = (size_t)t.nb * 144;
    const int n = 2 * reg_count(t, 0, rows);
    auto ptr = [&](int i) { return ((i & 1) ? Wu : Wg) + (size_t)reg_row(t, 0, i >> 1) * row_bytes; };
    Q4KW cur[PPW];
    if (n > 0) q4k_row_load<PPW>(ptr(0), t.p0, t.nb, t.lane, cur);
    NTX_PDL();
    if (n == 0) return;
    Q4KActs<PPW> a;
    q4k_acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
    float g = 0.f;
    q4k_team_rows<PPW>(t, a, n, ptr, [&](int i, float v) {
        if ((i & 1) == 0) g = v;
        else if (t.lane == 0) Y[reg_row(t, 0, i >> 1)] = ntx_swiglu(g, v);
    }, cur, true, red[t.team]);
}

// Up to three weights on the same activations (q, k, v), rows numbered one weight after another.
// Q4_K weights: the teams, each weight's first row to the team after the previous weight's last;
// other types (NTX_FT_*): one warp a row (fast_row_any), after the Q4_K rows.
template <int PPW>
__device__ __forceinline__ void reg_multi(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0,
                                          float* Y1, float* Y2, int r0, int r1, int r2, int ty0, int ty1, int ty2,
                                          const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, int k) {
    __shared__ float red[NTX_REG_WARPS][2 * NTX_REG_WARPS];
    __shared__ __align__(16) uint8_t stage[NTX_REG_WARPS][NTX_FAST_STAGE];
    if (!reg_block_ok(k)) return;
    const uint8_t* Ws[3] = {W0, W1, W2};
    float* Ys[3] = {Y0, Y1, Y2};
    const int rs[3] = {r0, r1, r2}, tys[3] = {ty0, ty1, ty2};
    const RegTeam t = reg_team<PPW>(k);
    const size_t row_bytes = (size_t)t.nb * 144;
    int first = 0, s0 = -1, f0 = 0;  // the first Q4_K weight and its first row's number
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (s0 < 0 && rs[s] > 0 && tys[s] == NTX_FT_Q4_K) s0 = s, f0 = first;
        first += rs[s];
    }
    Q4KW cur[PPW];
    first = f0;
    const int n0 = s0 < 0 ? 0 : reg_count(t, first, s0 == 0 ? r0 : s0 == 1 ? r1 : r2);
    if (n0 > 0) q4k_row_load<PPW>((s0 == 0 ? W0 : s0 == 1 ? W1 : W2) + (size_t)reg_row(t, first, 0) * row_bytes, t.p0,
                                  t.nb, t.lane, cur);
    NTX_PDL();
    if (s0 >= 0) {
        Q4KActs<PPW> a;
        q4k_acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
        first = 0;
#pragma unroll
        for (int s = 0; s < 3; ++s) {
            if (tys[s] == NTX_FT_Q4_K && rs[s] > 0) {
                const uint8_t* W = Ws[s];
                float* Y = Ys[s];
                const int f = first;
                q4k_team_rows<PPW>(t, a, reg_count(t, f, rs[s]),
                                   [&](int i) { return W + (size_t)reg_row(t, f, i) * row_bytes; },
                                   [&](int i, float v) { if (t.lane == 0) Y[reg_row(t, f, i)] = v; }, cur, s == s0,
                                   red[t.team]);
            }
            first += rs[s];
        }
    }
    const int nw = blockDim.x >> 5, wid = blockIdx.x * nw + (threadIdx.x >> 5), all = gridDim.x * nw;
    first = 0;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (tys[s] != NTX_FT_Q4_K)
            for (int r = (wid - first % all + all) % all; r < rs[s]; r += all) {
                float acc;
                fast_row_any<1>(tys[s], Ws[s], r, xq, xd, xs, stage[threadIdx.x >> 5], k, 1, &acc);
                if (t.lane == 0) Ys[s][r] = acc;
            }
        first += rs[s];
    }
}

#define NTX_REG_KERNELS(PPW)                                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_q4_k_p##PPW(                    \
        const uint8_t* W, const int8_t* xq, const float* xd, const float* xs, float* Y, int rows, int k) {   \
        reg_plain<PPW>(W, xq, xd, xs, Y, rows, k);                                                           \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_swiglu_q4_k_p##PPW(             \
        const uint8_t* Wg, const uint8_t* Wu, const int8_t* xq, const float* xd, const float* xs, float* Y,  \
        int rows, int k) {                                                                                   \
        reg_swiglu<PPW>(Wg, Wu, xq, xd, xs, Y, rows, k);                                                     \
    }                                                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_multi_p##PPW(                   \
        const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0, float* Y1, float* Y2, int r0,    \
        int r1, int r2, int ty0, int ty1, int ty2, const int8_t* xq, const float* xd, const float* xs, int k) { \
        reg_multi<PPW>(W0, W1, W2, Y0, Y1, Y2, r0, r1, r2, ty0, ty1, ty2, xq, xd, xs, k);                    \
    }

NTX_REG_KERNELS(1)
NTX_REG_KERNELS(2)
