// The stack decode kernel of layer_q8.cu built with the Q6_K down rows as K slices (NTX_LQ_KS=4, see LQ_KSV there):
// a module of its own, which cuda_layers.StackDecode loads for the models whose down rows can go that way
// (cuda_layers.ks_fits); the other models load layer_q8.cu's build without it. Both forms in one build made a Q8_0
// model, which never takes the K slices, 3 % slower (session 24: 380.3 / 377.4 against 391.9 / 392.2 tok/s).
// The build takes K-quant matrices only (NTX_LQ_Q8 0: no Q8_0 dot in its phase loops) and keeps the loops adding a
// chunk's row parts, which Q4_K_M chunks never take, not unrolled (NTX_LQ_CU 1): its four phase loops 92.6 -> 64.4 KB of
// code, Q4_K_M 482.1 / 483.9 against 477.1 / 477.2 tok/s (session 25). (cuda_nvrtc.cache_key hashes the .cu files a
// source includes.)
#ifndef NTX_LQ_KS
#define NTX_LQ_KS 4
#endif
#ifndef NTX_LQ_Q8
#define NTX_LQ_Q8 0
#endif
#ifndef NTX_LQ_CU
#define NTX_LQ_CU 1
#endif
#include "layer_q8.cu"
