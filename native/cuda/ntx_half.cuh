// fp16 / bf16 <-> fp32 conversions usable on the device (PTX cvt) and on the host (bit
// arithmetic), so the host test harness runs the very same block decoders as the kernels.
#pragma once

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned short uint16_t;
typedef short int16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
#else
#include <stdint.h>
#include <string.h>
#include <math.h>
#endif

#ifndef __CUDACC__
#define __host__
#define __device__
#define __forceinline__ inline
#endif

#define NTX_HD __host__ __device__ __forceinline__

// Programmatic dependent launch (Hopper): every kernel first waits for the grid before it in the
// stream to complete (a no-op when launched without the PDL attribute), then lets the next grid
// be scheduled, so its blocks fill the SMs freed in this grid's last wave (launch gap hidden).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define NTX_PDL() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#else
#define NTX_PDL() do {} while (0)
#endif

// NTX_SKIP (a benchmark's tool, default 0): a bit mask of decode kernel kinds that return right
// after their PDL wait, so a graph step timed without a kind's work tells that work's share of the
// step (scripts/bench_engine.py's skip=N variant). 1: the fused norm, 2: the grid attention, 4: the
// activation quantizers, 8: the matvecs. The outputs are then garbage; nothing else reads it.
#ifndef NTX_SKIP
#define NTX_SKIP 0
#endif
#define NTX_SKIP_KIND(bit) do { if (NTX_SKIP & (bit)) return; } while (0)

NTX_HD uint32_t ntx_f32_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    uint32_t u; memcpy(&u, &f, 4); return u;
#endif
}

NTX_HD float ntx_bits_f32(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f; memcpy(&f, &u, 4); return f;
#endif
}

NTX_HD float ntx_h2f(uint16_t h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    if (exp == 0x1F) return ntx_bits_f32(sign | 0x7F800000u | (man << 13));
    if (exp == 0) {
        if (man == 0) return ntx_bits_f32(sign);
        // subnormal half: exact in float32
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    }
    return ntx_bits_f32(sign | ((exp + 112) << 23) | (man << 13));
#endif
}

// float32 -> nearest-even fp16 (what numpy's astype(float16) does)
NTX_HD uint16_t ntx_f2h(float f) {
#ifdef __CUDA_ARCH__
    uint16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    const uint32_t u = ntx_f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    const uint32_t a = u & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return sign | 0x7C00 | (a > 0x7F800000u ? 0x200 : 0);
    if (a >= 0x477FF000u) return sign | 0x7C00;  // rounds to >= 65520: inf
    if (a < 0x38800000u) {  // below the smallest normal half: subnormal or zero
        if (a < 0x33000000u) return sign;  // < 2^-25 rounds to zero
        const uint32_t man = (a & 0x7FFFFF) | 0x800000;
        const int shift = 126 - (int)(a >> 23);  // 14 + (113 - e) ... mantissa bits to drop
        const uint32_t q = man >> shift, rem = man & ((1u << shift) - 1), half = 1u << (shift - 1);
        return sign | (uint16_t)(q + (rem > half || (rem == half && (q & 1))));
    }
    const uint32_t r = a + 0xFFF + ((a >> 13) & 1);  // round the 13 dropped bits to even
    return sign | (uint16_t)((r - 0x38000000u) >> 13);
#endif
}

NTX_HD float ntx_round_f16(float f) { return ntx_h2f(ntx_f2h(f)); }

NTX_HD float ntx_bf2f(uint16_t b) { return ntx_bits_f32((uint32_t)b << 16); }

// float32 -> nearest-even bfloat16, NaNs kept quiet (ggml_compute_fp32_to_bf16)
NTX_HD float ntx_round_bf16(float f) {
    const uint32_t u = ntx_f32_bits(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ntx_bits_f32(((u >> 16) | 64) << 16);
    return ntx_bits_f32(((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16);
}

NTX_HD uint16_t ntx_ld16(const uint8_t* p) { return (uint16_t)(p[0] | (p[1] << 8)); }

NTX_HD float ntx_ldh(const uint8_t* p) { return ntx_h2f(ntx_ld16(p)); }
