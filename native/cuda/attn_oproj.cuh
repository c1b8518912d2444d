// The o projection inside the cluster form of the decode attention (attn_cl<C>_*_o, sm_90).
//
// A KV head's cluster holds its query heads' whole output (L = G * head_dim values), so it can
// multiply it by its own L columns of W_o: y = sum over KV heads h of W_o[:, h*L:(h+1)*L] . out_h.
// Block c of the cluster takes rows c*RB .. c*RB+RB-1 (RB = rows / C). Its weights do not depend on
// any kernel before, so before the PDL wait the block copies each row's L columns (one contiguous
// chunk of GGUF blocks) into shared memory with asynchronous copies (cp.async): HBM streams them
// while the previous kernel ends and the attention runs, and the separate o-projection launch and
// its trip through HBM leave the chain.
//
// Activations: each block quantizes its share of the head's output as cluster_sum does (the o
// weight's Q8_1 or Q8_K format, the same values and scales as the quantization the unfused
// attention writes for the matvec), into its shared memory; after a cluster barrier every block
// reads each 32-value unit from the block that owns it (distributed shared memory).
//
// Sums: a row's 16 (L / 32) unit products meet in a fixed butterfly inside a half-warp, giving the
// KV head's part of y; the last of the KV heads' blocks c to finish adds the n_kv parts of its rows
// in head order. So y is deterministic, and differs from the unfused matvec's only by the order of
// float additions (tests/cuda/test_attn_oproj_gpu.py holds it to that matvec and to numpy).
#pragma once
#include "matvec_fast.cuh"  // the unit decoders (fast_units.cuh) and activation quantizers
#include "warp.cuh"
#include "cluster.cuh"

#define OP_UNITS 16  // 32-value units of a KV head's output: L = 512 (head_dim 128, 4 query heads)

// What the host passes (Kernels.attention_grid's oproj): the weight (rows x cols GGUF blocks),
// its type (FAST_CODES: 0 Q4_K, 2 Q8_0), y (rows), the KV heads' parts (n_kv x rows, scratch) and
// one arrival counter a cluster rank (zero between launches; the kernel leaves them so).
struct OProj {
    const uint8_t* w;
    int wcode, rows, cols;
    float* y;
    float* part;
    unsigned int* ctr;
};

// Bytes of one row's chunk (L columns) for the weight type, and of the whole row.
__device__ __forceinline__ int op_chunk_bytes(int wcode, int len) {
    return wcode == 0 ? len / 256 * BlkQ4_K::BYTES : len / 32 * BlkQ8_0::BYTES;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

// NTX_OP_MODE (a benchmark's probe, default 0): 1 skips the o rows' arithmetic (after the copies
// land), 2 the copies, 3 both; the output is then garbage.
#ifndef NTX_OP_MODE
#define NTX_OP_MODE 0
#endif

#if NTX_CLUSTERS
// Before the PDL wait: the block's RB row chunks into ws (shared memory, 16-byte aligned) with
// cp.async (16 bytes a copy, every thread's copies in flight at once; op_wait waits for them).
// One bulk copy (cp.async.bulk on an mbarrier) a row instead ran at ~0.75 TB/s over the GPU:
// 256 requests of 288-544 bytes an SM queue at the copy engine (H200, session 13, call 2).
__device__ __forceinline__ void op_issue(const OProj& op, int kvh, int c, int cl, int len, uint8_t* ws) {
    const int rb = op.rows / cl, chunk = op_chunk_bytes(op.wcode, len), row_bytes = op_chunk_bytes(op.wcode, op.cols);
    if (NTX_OP_MODE & 2) return;
    const int per_row = chunk / 16;
    const uint8_t* src = op.w + (size_t)c * rb * row_bytes + (size_t)kvh * chunk;
    for (int i = threadIdx.x; i < rb * per_row; i += blockDim.x) {
        const int r = i / per_row, o = 16 * (i % per_row);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(ws + (size_t)r * chunk + o)),
                     "l"(src + (size_t)r * row_bytes + o)
                     : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// Every thread's copies landed and are visible to the block.
__device__ __forceinline__ void op_wait() {
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
}

// This block's rows of y's KV-head part from the weights in ws and the head's quantized output
// (unit j in block owner(j)'s oq / od / os), then, in the last of the KV heads' blocks c, y itself.
template <class F>
__device__ __forceinline__ void op_rows(const OProj& op, const uint8_t* ws, int kvh, int n_kv, int c, int cl, int len,
                                        int per, const int8_t* oq, const float* od, const float* os) {
    constexpr int UPB = F::B::QK / 32;  // units a weight block
    const int rb = op.rows / cl, chunk = op_chunk_bytes(op.wcode, len);
    if (NTX_OP_MODE & 1) return;
    const int j = threadIdx.x % OP_UNITS, owner = (j * 32 / per) % cl;
    int x[8];
    {
        const int4* px = reinterpret_cast<const int4*>(cluster_peer(oq, owner) + 32 * j);
        const int4 a = px[0], b = px[1];
        x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
    }
    const float dx = cluster_peer(od, owner)[j], sx = cluster_peer(os, owner)[j];
    float* part = op.part + (size_t)kvh * op.rows + (size_t)c * rb;
    const int step = blockDim.x / OP_UNITS;
#pragma unroll 4
    for (int r = threadIdx.x / OP_UNITS; r < rb; r += step) {
        float v = dx * F::unit(ws + (size_t)r * chunk + (j / UPB) * F::B::BYTES, j % UPB, x, sx);
#pragma unroll
        for (int o = OP_UNITS / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (j == 0) part[r] = v;
    }
    __shared__ bool last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(op.ctr + c, 1u) == (unsigned int)(n_kv - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* p0 = op.part + (size_t)c * rb;
    for (int r = threadIdx.x; r < rb; r += blockDim.x) {
        float s = 0.f;
        for (int h = 0; h < n_kv; ++h) s += __ldcg(p0 + (size_t)h * op.rows + r);
        op.y[(size_t)c * rb + r] = s;
    }
    if (threadIdx.x == 0) op.ctr[c] = 0u;  // every KV head's block c has arrived: ready for the next launch
}
#endif
