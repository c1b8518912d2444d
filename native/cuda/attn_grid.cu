// Decode attention of one token in ONE launch ("grid" attention): the context split over nb
// blocks a KV head (each a contiguous range of positions, serving the whole GQA group), which meet
// at one barrier of their own group inside the kernel instead of at kernel boundaries.
//
// attention.cu's split kernels take two launches a layer, and each is a chain of dependent memory
// round trips (K rows a loop turn, then one block forming the softmax statistics, then the chunk
// sums): ~13 us apiece at 576 positions, a third of an 8B decode step. Here every block issues its
// K rows and V words at once, right after the PDL wait, and the only serial steps are one group
// barrier and the last block's sum of nb partial outputs.
//
// Rounding: q to fp16, scores in float, p = fp16(exp(s - M) / S) with M the global max, as the
// numpy backend and the split kernels. Only S is formed differently: each block sums
// exp(s - m_b) over its positions in double with its own max m_b, and after the barrier every
// block forms S = sum_b exp(m_b - M) S_b in double, in a fixed butterfly order (the same value
// everywhere).
// That is the exact sum up to ~1e-7 relative: a probability's fp16 rounding can differ by one
// unit where exp(s - M) / S lies that close to a rounding boundary (a few of the ~18k a layer of
// Llama-3-8B at 576 positions). p.V sums run in (block, position group, position) order.
//
// RoPE fused (decode, the default where the grid kernel runs): the kernel takes q, k and v before
// RoPE, rotates the group's q itself, and the block holding the new position rotates its k and
// stores k and v into the caches (rope_kv's work; one launch less a layer), all bit for bit as
// rope_kv. The group size may be fixed at compile time (attn_grid_<V>_g<G>): a third of the code.
//
// Cluster form (attn_cl<C>_*, sm_90): the nb = C blocks of a KV head are one thread-block cluster.
// The statistics and the partial p.V sums stay in each block's shared memory and the blocks read
// each other's through the cluster's distributed shared memory after a cluster barrier (hardware),
// instead of global scratch, a counter barrier and a last block: the same values combined in the
// same order, so both forms give the same bits. Each block then sums and quantizes its share of
// the head's output (whole quantization blocks), and no block leaves while another may read it.
//
// The barrier needs every block of the grid resident at once: the host sizes the grid to at most
// the blocks an SM holds (two, by the launch bounds and the occupancy calculator;
// cuda_kernels.grid_attn_shape), and a block waits at most AG_DEADLINE_NS before
// trapping (the launch then fails with an error instead of hanging).
#include "ntx_half.cuh"
#include "matvec_fast.cuh"  // the int8 activation quantizers (fused output quantization)
#include "attn_common.cuh"
#include "ops.cuh"  // ntx_rope_pair: the fused RoPE and KV store of the new position
#include "cluster.cuh"

#define AG_THREADS 256
#define AG_WARPS (AG_THREADS / 32)
#define AG_GMAX 16      // query heads a KV head
#define AG_QMAX 4096    // their values
#define AG_NBMAX 32     // blocks a KV head: one lane each in the statistics
#define AG_VP 16        // V words a thread loads at once
#define AG_DEADLINE_NS 2000000000ull
// NTX_AG_PRE_WAIT (default 1; 0 turns it off): with the RoPE fused (the kernel stores the new
// position's K/V row itself), a block issues its first K and V loads before the PDL wait. The
// cache rows of the earlier positions and the position itself (pos, uploaded before the launch)
// never come from the kernel before (q/k/v's matvec), so their HBM round trip overlaps that
// kernel's tail; the new position's row is read from shared memory as before. Without the fused
// RoPE the kernel before (kv_store or rope_kv) writes the new row, so the wait comes first. The
// same values in the same order either way.
// NTX_AG_PV_TREE (default 1; 0: one block barrier a position group): the position groups' p.V sums
// meet in qa with two barriers; the same additions in the same order.
#ifndef NTX_AG_PV_TREE
#define NTX_AG_PV_TREE 1
#endif
#ifndef NTX_AG_PRE_WAIT
#define NTX_AG_PRE_WAIT 1
#endif

// Arrive at *ctr and wait until `target` blocks have: the block's global writes before it are
// visible to the group's blocks after it (the release add publishes what the block barrier
// ordered before thread 0's arrival; the acquire load orders the reads after it).
__device__ void group_barrier(unsigned int* ctr, unsigned int target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(ctr) : "memory");
        const unsigned long long t0 = global_ns();
        while (ld_acquire(ctr) < target) {
            __nanosleep(32);
            if (global_ns() - t0 > AG_DEADLINE_NS) __trap();  // a block that never came: fail, not hang
        }
    }
    __syncthreads();
}

// K rows of the warp's positions base + warp + AG_WARPS * j (j < KP), lane's V values each.
template <int V, int KP>
__device__ __forceinline__ void k_rows(const uint16_t* kc, size_t col, int kv_dim, int base, int p1, float (*kf)[V]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
    for (int j = 0; j < KP; ++j) {
        const int p = base + warp + AG_WARPS * j;
        if (p < p1) ld_halves<V>(kc + (size_t)p * kv_dim + col + lane * V, kf[j]);
    }
}

// V words (two dims, 2 * dt and 2 * dt + 1) of positions base + pg + PG * j (j < AG_VP).
template <int PG>
__device__ __forceinline__ void v_words(const uint16_t* vc, size_t col, int kv_dim, int base, int p1, int dt, int pg,
                                        uint32_t* vw) {
#pragma unroll
    for (int j = 0; j < AG_VP; ++j) {
        const int p = base + pg + PG * j;
        if (pg < PG && p < p1) vw[j] = *reinterpret_cast<const uint32_t*>(vc + (size_t)p * kv_dim + col + 2 * dt);
    }
}

// Scores of positions p0..p1-1 for the group's G heads into sc[g * rmax + p - p0]; m[g]: the
// thread's running maxima. qa holds the fp16-rounded q of the group.
// pnew: the position whose K row is knew (shared memory; -1: none), not the cache's.
template <int V, int KP, int GM>
__device__ __forceinline__ void scores(const uint16_t* kc, size_t col, int kv_dim, int p0, int p1, const float* qa,
                                       int G, int rmax, float scale, float (*kf)[V], float* sc, float* m, int pnew,
                                       const uint16_t* knew) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int base = p0;;) {
#pragma unroll
        for (int j = 0; j < KP; ++j) {
            const int p = base + warp + AG_WARPS * j;
            if (p >= p1) break;
            if (p == pnew) ld_halves<V>(knew + lane * V, kf[j]);
            float s[GM];
            group_dots<V, GM>(qa, kf[j], G, lane, s);
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                if (g >= G) break;
                const float v = s[g] * scale;
                if (lane == g) sc[g * rmax + p - p0] = v;
                m[g] = fmaxf(m[g], v);
            }
        }
        base += AG_WARPS * KP;
        if (base >= p1) break;
        k_rows<V, KP>(kc, col, kv_dim, base, p1, kf);
    }
}

// Query head g's softmax max gm[g] and double exp sum gs[g] from the warp's lanes' (block lane's)
// maximum m and sum part (lanes >= nact: the lowest float and 0): a fixed butterfly, the same value
// in every block.
__device__ __forceinline__ void group_stat(float m, double part, int g, int nact, float* gm, double* gs) {
    const int lane = threadIdx.x & 31;
    const float M = warp_max(m);
    // a butterfly: 5 dependent steps (was 32 in block order), the same bits in every lane
    const double t = warp_sum_d(lane < nact ? exp((double)m - (double)M) * part : 0.0);
    if (lane == 0) {
        gm[g] = M;
        gs[g] = t;
    }
}

// The group's softmax max gm and double exp sum gs from the nact blocks' maxima m_b and sums
// S_b = sum exp(s - m_b) at vals[(h0 + g) * nb + b]: gm = max m_b, gs = sum_b exp(m_b - gm) S_b
// (group_stat); a warp a query head, a lane a block.
__device__ __forceinline__ void group_stats(const float* cmax, const double* psum, int h0, int G, int nb, int nact,
                                            float* gm, double* gs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < G; g += AG_WARPS) {
        const size_t i = (size_t)(h0 + g) * nb + lane;
        group_stat(lane < nact ? __ldcg(cmax + i) : -3.402823466e38f, lane < nact ? __ldcg(psum + i) : 0.0, g, nact, gm,
                   gs);
    }
    __syncthreads();
}

// group_stats with block b's maximum and sum in its shared memory (bm, bs) instead of global scratch.
__device__ __forceinline__ void group_stats_cl(const float* bm, const double* bs, int G, int nact, float* gm,
                                               double* gs) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int g = warp; g < G; g += AG_WARPS)
        group_stat(lane < nact ? cluster_peer(bm, lane)[g] : -3.402823466e38f,
                   lane < nact ? cluster_peer(bs, lane)[g] : 0.0, g, nact, gm, gs);
    __syncthreads();
}

// The fused RoPE (rope_kv's work for one decode token): the raw k and v rows of the token, the
// frequency factors and the rope parameters (ops.cuh's ntx_rope_pair). k == nullptr: q arrives
// rotated and the cache already holds the new position.
struct RopeIn {
    const float* k;
    const float* v;
    const float* ff;
    int rope_dim;
    float scale, freq_scale;
    int neox;
};

// q of the group's heads (pairs of G heads) rotated for position pos, fp16-rounded, into qa: the
// values rope_kv writes and the attention then rounds.
__device__ __forceinline__ void rope_group(const float* q, int pairs, int hd, int pos, const RopeIn& ri, float* qa) {
    for (int i = threadIdx.x; i < pairs; i += AG_THREADS) {
        int a, b;
        float o0, o1;
        ntx_rope_pair(q, i, hd, ri.rope_dim, pos, ri.ff, ri.scale, ri.freq_scale, ri.neox, &a, &b, &o0, &o1);
        qa[a] = ntx_round_f16(o0);
        qa[b] = ntx_round_f16(o1);
    }
}

// The KV head's new K row (rotated) and V row as fp16 into the caches at position p and into
// knew / vnew: rope_kv's stores, bit for bit.
__device__ __forceinline__ void store_new_kv(const RopeIn& ri, size_t col, int hd, int kv_dim, int p, uint16_t* kc,
                                             uint16_t* vc, uint16_t* knew, uint16_t* vnew) {
    const size_t dst = (size_t)p * kv_dim + col;
    for (int i = threadIdx.x; i < hd / 2; i += AG_THREADS) {
        int a, b;
        float o0, o1;
        ntx_rope_pair(ri.k + col, i, hd, ri.rope_dim, p, ri.ff, ri.scale, ri.freq_scale, ri.neox, &a, &b, &o0, &o1);
        knew[a] = kc[dst + a] = ntx_f2h(o0);
        knew[b] = kc[dst + b] = ntx_f2h(o1);
    }
    for (int i = threadIdx.x; i < hd; i += AG_THREADS) vnew[i] = vc[dst + i] = ntx_f2h(ri.v[col + i]);
}

// The grid form's last step: the block's p.V sums into part, and the head's last block to arrive
// adds every block's parts in block order and quantizes the head's output.
__device__ __forceinline__ void grid_sum(float* qa, int G, int hd, int h0, int nb, int nact, int c, int n_kv,
                                         int kvh, float* part, unsigned int* ctr, float* out, int8_t* xq, float* xd,
                                         float* xs, int qmode) {
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < G * hd; i += AG_THREADS)
        part[((size_t)(h0 + i / hd) * nb + c) * hd + i % hd] = qa[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ctr + n_kv + kvh, 1u) == (unsigned int)(nact - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < G * hd; i += AG_THREADS) {  // the blocks' parts, in block order
        const float* pp = part + (size_t)(h0 + i / hd) * nb * hd + i % hd;
        float v[AG_NBMAX];
#pragma unroll
        for (int b = 0; b < AG_NBMAX; ++b)
            if (b < nact) v[b] = __ldcg(pp + (size_t)b * hd);
        float s = 0.f;
#pragma unroll
        for (int b = 0; b < AG_NBMAX; ++b)
            if (b < nact) s += v[b];
        out[(size_t)h0 * hd + i] = s;
        qa[i] = s;
    }
    if (threadIdx.x == 0) {  // every block of the group is past the barrier: zero for the next launch
        ctr[kvh] = 0u;
        ctr[n_kv + kvh] = 0u;
    }
    if (qmode == 0) return;
    __syncthreads();
    const int per = qmode == 2 ? 256 : 32, b0 = h0 * hd / per, nq = G * hd / per;
    for (int b = warp; b < nq; b += AG_WARPS) {
        if (qmode == 2) quanti_q8_k_from(qa + b * per, xq, xd, xs, b0 + b, lane);
        else quanti_q8_1_from(qa + b * per, xq, xd, xs, b0 + b, lane);
    }
}

// The cluster form's last step: the head's output (len values) as the sum over blocks 0..nact-1, in
// that order, of each block's p.V sums (qa in its shared memory), as the grid form's last block
// adds the parts. Block c takes the whole quantization blocks (256 values for qmode 2, else 32)
// u = c, c + CL, ...: it writes their sums to out and quantizes them from its own buffer. q0: the
// head's first value in the row (its quantization blocks' numbering).
template <int CL>
__device__ __forceinline__ void cluster_sum(const float* qa, int len, int nact, int c, float* out, int q0, int8_t* xq,
                                            float* xd, float* xs, int qmode) {
    __shared__ float res[256];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per = qmode == 2 ? 256 : 32;
    for (int u = c; u * per < len; u += CL) {
        __syncthreads();  // res is free again
        for (int i = threadIdx.x; i < per; i += AG_THREADS) {
            float v[CL];
#pragma unroll
            for (int b = 0; b < CL; ++b)
                if (b < nact) v[b] = cluster_peer(qa, b)[u * per + i];
            float s = 0.f;
#pragma unroll
            for (int b = 0; b < CL; ++b)
                if (b < nact) s += v[b];
            out[u * per + i] = s;
            res[i] = s;
        }
        __syncthreads();
        if (qmode != 0 && warp == 0) {
            if (qmode == 2) quanti_q8_k_from(res, xq, xd, xs, (q0 + u * per) / 256, lane);
            else quanti_q8_1_from(res, xq, xd, xs, (q0 + u * per) / 32, lane);
        }
    }
    cluster_arrive();  // this block reads no other's memory now; it leaves when no other reads its own
    cluster_wait();
}

template <int V, int GC, int CL = 0>
__device__ void grid_attn(const float* __restrict__ q, const uint16_t* __restrict__ kc,
                          const uint16_t* __restrict__ vc, float* out, const int* __restrict__ pos, int n_head,
                          int n_kv, int nb, int rmax, int minr, float scale, float* cmax, double* psum, float* part,
                          unsigned int* ctr, int8_t* xq, float* xd, float* xs, int qmode, const RopeIn ri) {
    // GC: the GQA group size when fixed at compile time (0: n_head / n_kv at run time, up to
    // AG_GMAX): the head loops then have fixed trip counts, a fraction of the generic kernel's code.
    // CL: the cluster form's blocks a KV head (0: the grid form); nb == CL then.
    constexpr int hd = 32 * V, D2 = hd / 2, PG = AG_THREADS / D2, KP = V >= 8 ? 4 : 8, GM = GC ? GC : AG_GMAX;
    extern __shared__ float sc[];  // G * rmax: scores, then exp(s - M), then the fp16 probabilities
    __shared__ float qa[AG_QMAX];  // the group's q (fp16-rounded), later its p.V sums
    __shared__ float wm[AG_WARPS][AG_GMAX], bm[AG_GMAX], gm[AG_GMAX];
    __shared__ double gs[AG_GMAX], bs[AG_GMAX];
    __shared__ __align__(16) uint16_t knew[32 * 8], vnew[32 * 8];  // the new position's K and V rows (fp16)
    const bool pre = NTX_AG_PRE_WAIT && ri.k != nullptr;  // the same in every block
    if (!pre) NTX_PDL();
    const int G = GC ? GC : n_head / n_kv, c = blockIdx.x, kvh = blockIdx.y, h0 = kvh * G, T = pos[0] + 1;
    // positions a block: at least minr (<= rmax), so short contexts use fewer blocks
    const int R = max((T + nb - 1) / nb, minr), nact = (T + R - 1) / R;
    // a short context: fewer blocks, none of them counted (the cluster form's others come along to
    // its barriers with no positions: p0 >= T, so every loop below is empty)
    if (!CL && c >= nact) return;
    const int p0 = c * R, p1 = min(p0 + R, T), n = p1 - p0, kv_dim = n_kv * hd;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, dt = threadIdx.x % D2, pg = threadIdx.x / D2;
    const size_t col = (size_t)kvh * hd;
    // with the RoPE fused (ri.k set), the block holding the new position P = T - 1 stores its K and
    // V rows and reads them from shared memory: its loads of row P may see the cache before the store
    const int pnew = ri.k != nullptr && T - 1 >= p0 && T - 1 < p1 ? T - 1 : -1;
    // every load of the first pass in flight before any arithmetic
    uint32_t vw[AG_VP];
    v_words<PG>(vc, col, kv_dim, p0, p1, dt, pg, vw);
    float kf[KP][V];
    k_rows<V, KP>(kc, col, kv_dim, p0, p1, kf);
    if (pre) NTX_PDL();  // q, k and v of the token come from the kernel before
    NTX_SKIP_KIND(2);
    if (ri.k == nullptr) {
        for (int i = threadIdx.x; i < G * hd; i += AG_THREADS) qa[i] = ntx_round_f16(q[(size_t)h0 * hd + i]);
    } else {
        rope_group(q + (size_t)h0 * hd, G * D2, hd, T - 1, ri, qa);
        if (pnew >= 0) store_new_kv(ri, col, hd, kv_dim, pnew, const_cast<uint16_t*>(kc), const_cast<uint16_t*>(vc),
                                    knew, vnew);
    }
    __syncthreads();
    float m[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) m[g] = -3.402823466e38f;
    scores<V, KP, GM>(kc, col, kv_dim, p0, p1, qa, G, rmax, scale, kf, sc, m, pnew, knew);
    if (lane == 0) {
#pragma unroll
        for (int g = 0; g < GM; ++g) {
            if (g >= G) break;
            wm[warp][g] = m[g];
        }
    }
    __syncthreads();
    if (threadIdx.x < G) {
        float mm = wm[0][threadIdx.x];
        for (int w = 1; w < AG_WARPS; ++w) mm = fmaxf(mm, wm[w][threadIdx.x]);
        bm[threadIdx.x] = mm;
        if (!CL) cmax[(size_t)(h0 + threadIdx.x) * nb + c] = mm;
    }
    __syncthreads();
    for (int g = warp; g < G; g += AG_WARPS) {  // this block's double sum of exp(s - its max)
        double sum = 0.0;
        for (int j = lane; j < n; j += 32) sum += (double)expf(sc[g * rmax + j] - bm[g]);
        sum = warp_sum_d(sum);
        if (lane == 0) {
            if (CL) bs[g] = sum;
            else psum[(size_t)(h0 + g) * nb + c] = sum;
        }
    }
    if (CL) {
        cluster_sync();
        group_stats_cl(bm, bs, G, nact, gm, gs);
    } else {
        group_barrier(ctr + kvh, nact);
        group_stats(cmax, psum, h0, G, nb, nact, gm, gs);
    }
    for (int g = 0; g < G; ++g)  // p = fp16(exp(s - M) / sum), M the global max
        for (int j = threadIdx.x; j < n; j += AG_THREADS)
            sc[g * rmax + j] = ntx_round_f16((float)((double)expf(sc[g * rmax + j] - gm[g]) / gs[g]));
    __syncthreads();
    float a0[GM], a1[GM];
#pragma unroll
    for (int g = 0; g < GM; ++g) a0[g] = a1[g] = 0.f;
    for (int base = p0;;) {
#pragma unroll
        for (int j = 0; j < AG_VP; ++j) {
            const int p = base + pg + PG * j;
            if (pg >= PG || p >= p1) break;
            const uint32_t w = p == pnew ? *reinterpret_cast<const uint32_t*>(vnew + 2 * dt) : vw[j];
            const float v0 = ntx_h2f((uint16_t)(w & 0xffffu)), v1 = ntx_h2f((uint16_t)(w >> 16));
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                if (g >= G) break;
                const float pr = sc[g * rmax + p - p0];
                a0[g] += pr * v0;
                a1[g] += pr * v1;
            }
        }
        base += PG * AG_VP;
        if (base >= p1) break;
        v_words<PG>(vc, col, kv_dim, base, p1, dt, pg, vw);
    }
    if (NTX_AG_PV_TREE && PG * G * hd <= AG_QMAX) {
        // the position groups' sums, in group order, with two block barriers instead of PG: every
        // group's partial sums into its slot of qa, then each value's PG partials added in order
        if (pg < PG) {
#pragma unroll
            for (int g = 0; g < GM; ++g) {
                if (g >= G) break;
                float* dst = qa + (pg * G + g) * hd + 2 * dt;
                dst[0] = a0[g];
                dst[1] = a1[g];
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < G * hd; i += AG_THREADS) {  // value i is slot 0's; only its thread writes it
            float v = qa[i];
            for (int r = 1; r < PG; ++r) v += qa[r * G * hd + i];
            qa[i] = v;
        }
        __syncthreads();
    } else {
        for (int r = 0; r < PG; ++r) {  // the position groups' sums, in group order
            if (pg == r) {
#pragma unroll
                for (int g = 0; g < GM; ++g) {
                    if (g >= G) break;
                    float* dst = qa + g * hd + 2 * dt;
                    dst[0] = r == 0 ? a0[g] : dst[0] + a0[g];
                    dst[1] = r == 0 ? a1[g] : dst[1] + a1[g];
                }
            }
            __syncthreads();
        }
    }
    if constexpr (CL != 0) {
        cluster_sync();  // every block's p.V sums (qa) are in place
        cluster_sum<CL>(qa, G * hd, nact, c, out + (size_t)h0 * hd, h0 * hd, xq, xd, xs, qmode);
    } else {
        grid_sum(qa, G, hd, h0, nb, nact, c, n_kv, kvh, part, ctr, out, xq, xd, xs, qmode);
    }
}


#define NTX_GRID_ATTN(V, GC, name)                                                                                \
    extern "C" __global__ void __launch_bounds__(AG_THREADS, 2)                                                   \
    name(const float* q, const uint16_t* kc, const uint16_t* vc, float* out, const int* pos, int n_head,          \
         int n_kv, int nb, int rmax, int minr, float scale, float* cmax, double* psum, float* part,              \
         unsigned int* ctr, int8_t* xq, float* xd, float* xs, int qmode, const float* rk, const float* rv,        \
         const float* ff, int rope_dim, float rscale, float freq_scale, int neox) {                               \
        const RopeIn ri = {rk, rv, ff, rope_dim, rscale, freq_scale, neox};                                       \
        grid_attn<V, GC>(q, kc, vc, out, pos, n_head, n_kv, nb, rmax, minr, scale, cmax, psum, part, ctr, xq, xd, \
                         xs, qmode, ri);                                                                          \
    }

#define NTX_CLUSTER_ATTN(V, GC, CL, name)                                                                         \
    extern "C" __global__ void __cluster_dims__(CL, 1, 1) __launch_bounds__(AG_THREADS, 2)                        \
    name(const float* q, const uint16_t* kc, const uint16_t* vc, float* out, const int* pos, int n_head,          \
         int n_kv, int nb, int rmax, int minr, float scale, float* cmax, double* psum, float* part,              \
         unsigned int* ctr, int8_t* xq, float* xd, float* xs, int qmode, const float* rk, const float* rv,        \
         const float* ff, int rope_dim, float rscale, float freq_scale, int neox) {                               \
        const RopeIn ri = {rk, rv, ff, rope_dim, rscale, freq_scale, neox};                                       \
        grid_attn<V, GC, CL>(q, kc, vc, out, pos, n_head, n_kv, CL, rmax, minr, scale, cmax, psum, part, ctr, xq, \
                             xd, xs, qmode, ri);                                                                  \
    }

// any GQA group size (n_head / n_kv <= AG_GMAX), by head_dim
NTX_GRID_ATTN(2, 0, attn_grid_2)  // head_dim 64
NTX_GRID_ATTN(3, 0, attn_grid_3)  // 96
NTX_GRID_ATTN(4, 0, attn_grid_4)  // 128
NTX_GRID_ATTN(8, 0, attn_grid_8)  // 256
// the common (head_dim, group) pairs with the group fixed (cuda_kernels.GRID_FIXED_GROUPS):
// Llama-3 8B / Mistral 7B (128, 4), Llama-3 70B (128, 8), SmolLM2 (64, 3)
NTX_GRID_ATTN(4, 4, attn_grid_4_g4)
NTX_GRID_ATTN(4, 8, attn_grid_4_g8)
NTX_GRID_ATTN(2, 3, attn_grid_2_g3)
#if NTX_CLUSTERS
// the cluster form (sm_90) for the same pairs, 8 or 16 blocks a KV head (cuda_kernels.CLUSTER_SIZES)
NTX_CLUSTER_ATTN(4, 4, 8, attn_cl8_4_g4)
NTX_CLUSTER_ATTN(4, 4, 16, attn_cl16_4_g4)
#endif
