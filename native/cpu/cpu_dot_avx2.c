/* cpu_dot_avx2.c - the x86 dot products built for AVX2 + FMA + F16C (cpu_dot_x86.inc). */
#include "cpu_impl.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "cpu_dot_x86.inc"
#pragma GCC pop_options

void ntx_kernels_fill_avx2(struct ntx_kernels *kt) { fill_x86(kt); }
#else
void ntx_kernels_fill_avx2(struct ntx_kernels *kt) { (void)kt; }
#endif
