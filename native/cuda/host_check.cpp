// Host build of the kernels' block decoders and activation quantizers (the same headers the
// NVRTC kernels include), for bit-exact tests against the numpy codecs without a GPU.
// g++ -O2 -ffp-contract=off -shared -fPIC -Wall -Wextra host_check.cpp -o libntx_host_check.so
#include "ntx_quants.cuh"
#include "act_quant.cuh"

template <class T>
static void deq_rows(const uint8_t* blocks, long nblocks, float* w, float* mins) {
    for (long b = 0; b < nblocks; ++b)
        for (int j = 0; j < T::UNITS; ++j) {
            const float m = T::deq32(blocks + b * T::BYTES, j, w + b * T::QK + 32 * j);
            if (mins) mins[b] = m;
        }
}

// ggml type id -> decode nblocks 32/256-element blocks; -22 (-EINVAL) for an unknown type.
extern "C" int ntx_host_deq(int type, const uint8_t* blocks, long nblocks, float* w, float* mins) {
    switch (type) {
        case 0: deq_rows<BlkF32>(blocks, nblocks, w, mins); return 0;
        case 1: deq_rows<BlkF16>(blocks, nblocks, w, mins); return 0;
        case 30: deq_rows<BlkBF16>(blocks, nblocks, w, mins); return 0;
        case 2: deq_rows<BlkQ4_0>(blocks, nblocks, w, mins); return 0;
        case 3: deq_rows<BlkQ4_1>(blocks, nblocks, w, mins); return 0;
        case 6: deq_rows<BlkQ5_0>(blocks, nblocks, w, mins); return 0;
        case 7: deq_rows<BlkQ5_1>(blocks, nblocks, w, mins); return 0;
        case 8: deq_rows<BlkQ8_0>(blocks, nblocks, w, mins); return 0;
        case 10: deq_rows<BlkQ2_K>(blocks, nblocks, w, mins); return 0;
        case 11: deq_rows<BlkQ3_K>(blocks, nblocks, w, mins); return 0;
        case 12: deq_rows<BlkQ4_K>(blocks, nblocks, w, mins); return 0;
        case 13: deq_rows<BlkQ5_K>(blocks, nblocks, w, mins); return 0;
        case 14: deq_rows<BlkQ6_K>(blocks, nblocks, w, mins); return 0;
        default: return -22;
    }
}

extern "C" void ntx_host_q8(const float* x, float* x_hat, float* s, long nblocks) {
    for (long b = 0; b < nblocks; ++b) ntx_q8_block(x + 32 * b, x_hat + 32 * b, s ? s + b : nullptr);
}

extern "C" void ntx_host_q8k(const float* x, float* x_hat, long nblocks) {
    for (long b = 0; b < nblocks; ++b) ntx_q8k_block(x + 256 * b, x_hat + 256 * b);
}

extern "C" void ntx_host_round(const float* x, float* out, long n, int bf16) {
    for (long i = 0; i < n; ++i) out[i] = bf16 ? ntx_round_bf16(x[i]) : ntx_round_f16(x[i]);
}
