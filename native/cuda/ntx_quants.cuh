// GGML block decoders, one struct per weight type. Each decodes one 32-element "unit" of a
// block (unit j covers elements 32j .. 32j+31) into w[32] as the d*q values ggml's
// dequantize_row_* produce, and returns the unit's additive block minimum (Q4_1/Q5_1 only;
// llama.cpp applies those through the activation's Q8_1 `s` term, so they stay apart).
// Layouts: ggml-common.h of the llama.cpp vendored in llama-cpp-python 0.3.36.
#pragma once
#include "ntx_half.cuh"

#define NTX_QK_K 256

// Two products with no fused multiply-add, so the device rounds like numpy does.
#ifdef __CUDA_ARCH__
#define NTX_MUL(a, b) __fmul_rn((a), (b))
#define NTX_SUB(a, b) __fsub_rn((a), (b))
#else
#define NTX_MUL(a, b) ((a) * (b))
#define NTX_SUB(a, b) ((a) - (b))
#endif

struct BlkF32 {
    static const int QK = 32, BYTES = 128, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        for (int i = 0; i < 32; ++i) w[i] = ntx_bits_f32((uint32_t)b[4*i] | ((uint32_t)b[4*i+1] << 8) |
                                                        ((uint32_t)b[4*i+2] << 16) | ((uint32_t)b[4*i+3] << 24));
        return 0.f;
    }
};

struct BlkF16 {
    static const int QK = 32, BYTES = 64, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        for (int i = 0; i < 32; ++i) w[i] = ntx_ldh(b + 2*i);
        return 0.f;
    }
};

struct BlkBF16 {
    static const int QK = 32, BYTES = 64, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        for (int i = 0; i < 32; ++i) w[i] = ntx_bf2f(ntx_ld16(b + 2*i));
        return 0.f;
    }
};

struct BlkQ4_0 {  // d, qs[16]: element i is the low nibble of qs[i], i+16 the high nibble
    static const int QK = 32, BYTES = 18, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        const float d = ntx_ldh(b);
        for (int i = 0; i < 16; ++i) {
            w[i] = NTX_MUL(d, (float)((b[2+i] & 15) - 8));
            w[i+16] = NTX_MUL(d, (float)((b[2+i] >> 4) - 8));
        }
        return 0.f;
    }
};

struct BlkQ4_1 {  // d, m, qs[16]
    static const int QK = 32, BYTES = 20, UNITS = 1, HAS_MIN = 1;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        const float d = ntx_ldh(b);
        for (int i = 0; i < 16; ++i) {
            w[i] = NTX_MUL(d, (float)(b[4+i] & 15));
            w[i+16] = NTX_MUL(d, (float)(b[4+i] >> 4));
        }
        return ntx_ldh(b + 2);
    }
};

NTX_HD uint32_t ntx_ld32(const uint8_t* p) {
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}

struct BlkQ5_0 {  // d, qh (bit i = 5th bit of element i), qs[16]
    static const int QK = 32, BYTES = 22, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        const float d = ntx_ldh(b);
        const uint32_t qh = ntx_ld32(b + 2);
        for (int i = 0; i < 16; ++i) {
            w[i] = NTX_MUL(d, (float)((int)((b[6+i] & 15) | (((qh >> i) & 1) << 4)) - 16));
            w[i+16] = NTX_MUL(d, (float)((int)((b[6+i] >> 4) | (((qh >> (i+16)) & 1) << 4)) - 16));
        }
        return 0.f;
    }
};

struct BlkQ5_1 {  // d, m, qh, qs[16]
    static const int QK = 32, BYTES = 24, UNITS = 1, HAS_MIN = 1;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        const float d = ntx_ldh(b);
        const uint32_t qh = ntx_ld32(b + 4);
        for (int i = 0; i < 16; ++i) {
            w[i] = NTX_MUL(d, (float)((b[8+i] & 15) | (((qh >> i) & 1) << 4)));
            w[i+16] = NTX_MUL(d, (float)((b[8+i] >> 4) | (((qh >> (i+16)) & 1) << 4)));
        }
        return ntx_ldh(b + 2);
    }
};

struct BlkQ8_0 {  // d, qs[32] int8
    static const int QK = 32, BYTES = 34, UNITS = 1, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int, float* w) {
        const float d = ntx_ldh(b);
        for (int i = 0; i < 32; ++i) w[i] = NTX_MUL((float)(int8_t)b[2+i], d);
        return 0.f;
    }
};

// Q2_K/Q3_K/Q6_K keep 2-bit fields in 32-byte groups: unit j reads group j/4 at shift 2*(j%4).
struct BlkQ2_K {  // scales[16] (low nibble scale, high nibble min), qs[64], d, dmin
    static const int QK = NTX_QK_K, BYTES = 84, UNITS = 8, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int j, float* w) {
        const float d = ntx_ldh(b + 80), dmin = ntx_ldh(b + 82);
        const uint8_t* qs = b + 16 + (j / 4) * 32;
        const int shift = 2 * (j % 4);
        for (int h = 0; h < 2; ++h) {
            const uint8_t sc = b[2*j + h];
            const float dl = NTX_MUL(d, (float)(sc & 15)), ml = NTX_MUL(dmin, (float)(sc >> 4));
            for (int l = 0; l < 16; ++l)
                w[16*h + l] = NTX_SUB(NTX_MUL(dl, (float)((qs[16*h + l] >> shift) & 3)), ml);
        }
        return 0.f;
    }
};

struct BlkQ3_K {  // hmask[32], qs[64], scales[12] (16 six-bit, offset 32), d
    static const int QK = NTX_QK_K, BYTES = 110, UNITS = 8, HAS_MIN = 0;
    static NTX_HD int scale(const uint8_t* sc, int i) {
        const int low = (sc[i % 8] >> (4 * (i / 8))) & 15;
        const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        return (low | (high << 4)) - 32;
    }
    static NTX_HD float deq32(const uint8_t* b, int j, float* w) {
        const float d = ntx_ldh(b + 108);
        const uint8_t* qs = b + 32 + (j / 4) * 32;
        const int shift = 2 * (j % 4);
        for (int h = 0; h < 2; ++h) {
            const float dl = NTX_MUL(d, (float)scale(b + 96, 2*j + h));
            for (int l = 0; l < 16; ++l) {
                const int e = 16*h + l;  // hmask bit j of byte e: a cleared bit means "subtract 4"
                const int q = ((qs[e] >> shift) & 3) - (((b[e] >> j) & 1) ? 0 : 4);
                w[e] = NTX_MUL(dl, (float)q);
            }
        }
        return 0.f;
    }
};

// Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins packed in 12 bytes
NTX_HD void ntx_k_scale_min(const uint8_t* s, int j, int* sc, int* mn) {
    if (j < 4) {
        *sc = s[j] & 63;
        *mn = s[j + 4] & 63;
    } else {
        *sc = (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4);
        *mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
}

struct BlkQ4_K {  // d, dmin, scales[12], qs[128]: unit j = nibble j%2 of bytes 32*(j/2)..
    static const int QK = NTX_QK_K, BYTES = 144, UNITS = 8, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int j, float* w) {
        int sc, mn;
        ntx_k_scale_min(b + 4, j, &sc, &mn);
        const float d1 = NTX_MUL(ntx_ldh(b), (float)sc), m1 = NTX_MUL(ntx_ldh(b + 2), (float)mn);
        const uint8_t* qs = b + 16 + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) w[l] = NTX_SUB(NTX_MUL(d1, (float)((qs[l] >> shift) & 15)), m1);
        return 0.f;
    }
};

struct BlkQ5_K {  // d, dmin, scales[12], qh[32] (bit j of byte l = 5th bit), qs[128]
    static const int QK = NTX_QK_K, BYTES = 176, UNITS = 8, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int j, float* w) {
        int sc, mn;
        ntx_k_scale_min(b + 4, j, &sc, &mn);
        const float d1 = NTX_MUL(ntx_ldh(b), (float)sc), m1 = NTX_MUL(ntx_ldh(b + 2), (float)mn);
        const uint8_t* qs = b + 48 + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; ++l) {
            const int q = ((qs[l] >> shift) & 15) | (((b[16 + l] >> j) & 1) << 4);
            w[l] = NTX_SUB(NTX_MUL(d1, (float)q), m1);
        }
        return 0.f;
    }
};

struct BlkQ6_K {  // ql[128], qh[64], scales[16] int8, d
    static const int QK = NTX_QK_K, BYTES = 210, UNITS = 8, HAS_MIN = 0;
    static NTX_HD float deq32(const uint8_t* b, int j, float* w) {
        const float d = ntx_ldh(b + 208);
        const int h = j / 4, s = j % 4;
        const uint8_t* ql = b + h * 64 + (s % 2) * 32;
        const uint8_t* qh = b + 128 + h * 32;
        const int lshift = 4 * (s / 2), hshift = 2 * s;
        for (int g = 0; g < 2; ++g) {
            const float dl = NTX_MUL(d, (float)(int8_t)b[192 + 2*j + g]);
            for (int l = 16*g; l < 16*g + 16; ++l) {
                const int q = (((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4)) - 32;
                w[l] = NTX_MUL(dl, (float)q);
            }
        }
        return 0.f;
    }
};

// Every weight type, with the ggml type id and its kernel-name suffix.
#define NTX_FOR_EACH_TYPE(X) \
    X(BlkF32, f32) X(BlkF16, f16) X(BlkBF16, bf16) X(BlkQ4_0, q4_0) X(BlkQ4_1, q4_1) \
    X(BlkQ5_0, q5_0) X(BlkQ5_1, q5_1) X(BlkQ8_0, q8_0) X(BlkQ2_K, q2_k) X(BlkQ3_K, q3_k) \
    X(BlkQ4_K, q4_k) X(BlkQ5_K, q5_k) X(BlkQ6_K, q6_k)
