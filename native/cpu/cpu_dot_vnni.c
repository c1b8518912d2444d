/* cpu_dot_vnni.c - the x86 dot products with AVX512-VNNI's vpdpbusd on 256-bit vectors. */
#include "cpu_impl.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512vl,avx512vnni")
#define NTX_VNNI 1
#include "cpu_dot_x86.inc"
#pragma GCC pop_options

void ntx_kernels_fill_vnni(struct ntx_kernels *kt) { fill_x86(kt); }
#else
void ntx_kernels_fill_vnni(struct ntx_kernels *kt) { (void)kt; }
#endif
