// Decode matvecs (one activation row) of Q4_K and Q5_K weights (and Q6_K rows of k <= 4096) with the activations in registers
// (matvec_reg.cuh): the plain product, the gate/up pair with swiglu, and the q/k/v launch, whose
// weights of other types take matvec_fast.cuh's one-warp rows in the same launch. Each gives a row
// the bits matvecr_<type> gives it (and fast_row_any the bits matvecf_* gives a row of another
// type), so the fused kernels equal the unfused chain exactly.
//
// Launch (cuda_kernels.Kernels._reg_go): WK x teams warps a block (teams = 8 / WK), about as many
// blocks as are resident at once; any grid computes the same values.
#include "matvec_fast.cuh"
#include "ops.cuh"

// Shared memory of a block: the teams' slice sums, and each warp's stage (matvecr_multi's one-warp rows).
struct RegSmem {
    float red[NTX_REG_WARPS][2 * NTX_REG_WARPS];
    __align__(16) uint8_t stage[NTX_REG_WARPS][NTX_FAST_STAGE];
};

template <class R, int PPW>
__device__ __forceinline__ void reg_plain(const uint8_t* __restrict__ W, const int8_t* __restrict__ xq,
                                          const float* __restrict__ xd, const float* __restrict__ xs,
                                          float* __restrict__ Y, int rows, int k) {
    __shared__ RegSmem sm;
    if (!reg_block_ok(k)) return;
    const RegTeam t = reg_team<PPW>(k);
    const size_t row_bytes = (size_t)t.nb * R::BYTES;
    const int n = reg_count(t, 0, rows);
    auto ptr = [&](int i) { return W + (size_t)reg_row(t, 0, i) * row_bytes; };
    typename R::W cur[PPW];
    if (n > 0) reg_row_load<R, PPW>(ptr(0), t, cur);
    NTX_PDL();
    NTX_SKIP_KIND(8);
    if (n == 0) return;  // the whole team leaves together
    typename R::template Acts<PPW> a;
    R::template acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
    reg_team_rows<R, PPW>(t, a, n, ptr, [&](int i, float v) { if (t.lane == 0) Y[reg_row(t, 0, i)] = v; }, cur, true,
                          sm.red[t.team], sm.stage[threadIdx.x >> 5]);
}

// Y = swiglu(x . Wg^T, x . Wu^T): the team's rows as gate row r, up row r, gate row r', ...
template <class R, int PPW>
__device__ __forceinline__ void reg_swiglu(const uint8_t* __restrict__ Wg, const uint8_t* __restrict__ Wu,
                                           const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                           const float* __restrict__ xs, float* __restrict__ Y, int rows, int k) {
    __shared__ RegSmem sm;
    if (!reg_block_ok(k)) return;
    const RegTeam t = reg_team<PPW>(k);
    const size_t row_bytes = (size_t)t.nb * R::BYTES;
    const int n = 2 * reg_count(t, 0, rows);
    auto ptr = [&](int i) { return ((i & 1) ? Wu : Wg) + (size_t)reg_row(t, 0, i >> 1) * row_bytes; };
    typename R::W cur[PPW];
    if (n > 0) reg_row_load<R, PPW>(ptr(0), t, cur);
    NTX_PDL();
    NTX_SKIP_KIND(8);
    if (n == 0) return;
    typename R::template Acts<PPW> a;
    R::template acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
    float g = 0.f;
    reg_team_rows<R, PPW>(t, a, n, ptr, [&](int i, float v) {
        if ((i & 1) == 0) g = v;
        else if (t.lane == 0) Y[reg_row(t, 0, i >> 1)] = ntx_swiglu(g, v);
    }, cur, true, sm.red[t.team], sm.stage[threadIdx.x >> 5]);
}

// The team rows of weight W (its rows numbered from `first` in the launch) of type R.
template <class R, int PPW>
__device__ __forceinline__ void reg_multi_weight(const RegTeam& t, const uint8_t* W, float* Y, int rows, int first,
                                                 const int8_t* xq, const float* xd, const float* xs, int k,
                                                 typename R::W* cur, bool preloaded, RegSmem& sm) {
    const size_t row_bytes = (size_t)t.nb * R::BYTES;
    typename R::template Acts<PPW> a;
    R::template acts<PPW>(xq, xd, xs, t.p0, t.nb, t.lane, a);
    reg_team_rows<R, PPW>(t, a, reg_count(t, first, rows),
                          [&](int i) { return W + (size_t)reg_row(t, first, i) * row_bytes; },
                          [&](int i, float v) { if (t.lane == 0) Y[reg_row(t, first, i)] = v; }, cur, preloaded,
                          sm.red[t.team], sm.stage[threadIdx.x >> 5]);
}

__device__ __forceinline__ bool reg_type(int ty, int k) { return ty == NTX_FT_Q4_K && q4k_reg_order(k); }

// Up to three weights on the same activations (q, k, v), rows numbered one weight after another.
// Q4_K weights: the teams, each weight's first row to the team after the previous weight's last;
// other types (NTX_FT_*: Q6_K v in Q4_K_M): one warp a row (fast_row_any), after them.
template <int PPW>
__device__ __forceinline__ void reg_multi(const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0,
                                          float* Y1, float* Y2, int r0, int r1, int r2, int ty0, int ty1, int ty2,
                                          const int8_t* __restrict__ xq, const float* __restrict__ xd,
                                          const float* __restrict__ xs, int k) {
    __shared__ RegSmem sm;
    if (!reg_block_ok(k)) return;
    const uint8_t* Ws[3] = {W0, W1, W2};
    float* Ys[3] = {Y0, Y1, Y2};
    const int rs[3] = {r0, r1, r2}, tys[3] = {ty0, ty1, ty2};
    const RegTeam t = reg_team<PPW>(k);
    // the first Q4_K weight: its first row's loads before the PDL wait
    Q4KW cur[PPW];
    int first = 0, s0 = -1;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (s0 < 0 && rs[s] > 0 && reg_type(tys[s], k)) {
            s0 = s;
            if (reg_count(t, first, rs[s]) > 0)
                reg_row_load<RegQ4K, PPW>(Ws[s] + (size_t)reg_row(t, first, 0) * t.nb * 144, t, cur);
        }
        first += rs[s];
    }
    NTX_PDL();
    NTX_SKIP_KIND(8);
    first = 0;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (rs[s] > 0 && reg_type(tys[s], k))
            reg_multi_weight<RegQ4K, PPW>(t, Ws[s], Ys[s], rs[s], first, xq, xd, xs, k, cur, s == s0, sm);
        first += rs[s];
    }
    const int nw = blockDim.x >> 5, wid = blockIdx.x * nw + (threadIdx.x >> 5), all = gridDim.x * nw;
    first = 0;
#pragma unroll
    for (int s = 0; s < 3; ++s) {
        if (!reg_type(tys[s], k))
            for (int r = (wid - first % all + all) % all; r < rs[s]; r += all) {
                float acc;
                fast_row_any<1>(tys[s], Ws[s], r, xq, xd, xs, sm.stage[threadIdx.x >> 5], k, 1, &acc);
                if (t.lane == 0) Ys[s][r] = acc;
            }
        first += rs[s];
    }
}

#define NTX_REG_TYPE(R, name, PPW)                                                                            \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_##name##_p##PPW(                 \
        const uint8_t* W, const int8_t* xq, const float* xd, const float* xs, float* Y, int rows, int k) {    \
        reg_plain<R, PPW>(W, xq, xd, xs, Y, rows, k);                                                         \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_swiglu_##name##_p##PPW(          \
        const uint8_t* Wg, const uint8_t* Wu, const int8_t* xq, const float* xd, const float* xs, float* Y,   \
        int rows, int k) {                                                                                    \
        reg_swiglu<R, PPW>(Wg, Wu, xq, xd, xs, Y, rows, k);                                                   \
    }

#define NTX_REG_MULTI(PPW)                                                                                    \
    extern "C" __global__ void __launch_bounds__(32 * NTX_REG_WARPS) matvecr_multi_p##PPW(                    \
        const uint8_t* W0, const uint8_t* W1, const uint8_t* W2, float* Y0, float* Y1, float* Y2, int r0,     \
        int r1, int r2, int ty0, int ty1, int ty2, const int8_t* xq, const float* xd, const float* xs, int k) { \
        reg_multi<PPW>(W0, W1, W2, Y0, Y1, Y2, r0, r1, r2, ty0, ty1, ty2, xq, xd, xs, k);                     \
    }

NTX_REG_TYPE(RegQ4K, q4_k, 1)
NTX_REG_TYPE(RegQ4K, q4_k, 2)
NTX_REG_TYPE(RegQ5K, q5_k, 1)
NTX_REG_TYPE(RegQ5K, q5_k, 2)
#if NTX_Q6_PAIR
NTX_REG_TYPE(RegQ6K, q6_k, 2)  // k <= 4096 only (WK = 1)
#endif
NTX_REG_MULTI(1)
NTX_REG_MULTI(2)
