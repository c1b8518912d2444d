// The stack decode kernel of layer_q8.cu built with the Q6_K down rows as K slices (NTX_LQ_KS=4, see LQ_KSV there):
// a module of its own, which cuda_layers.StackDecode loads for the models whose down rows can go that way (with Q5_K
// matrices: layer_q8_ks5.cu, this build with the Q5_K dot; cuda_layers.ks_fits, stack_source); the other models load
// layer_q8.cu's build without it. Both forms in one build made a Q8_0 model, which never takes the K slices, 3 % slower
// (session 24: 380.3 / 377.4 against 391.9 / 392.2 tok/s).
// The build takes K-quant matrices only (NTX_LQ_Q8 0: no Q8_0 dot in its phase loops) and keeps the loops adding a
// chunk's row parts, which Q4_K_M chunks never take, not unrolled (NTX_LQ_CU 1): its four phase loops 92.6 -> 64.4 KB
// of code, Q4_K_M 482.1 / 483.9 against 477.1 / 477.2 tok/s (session 25). (cuda_nvrtc.cache_key hashes the .cu files
// a source includes.)
#ifndef NTX_LQ_KS
#define NTX_LQ_KS 4
#endif
#ifndef NTX_LQ_Q8
#define NTX_LQ_Q8 0
#endif
#ifndef NTX_LQ_CU
#define NTX_LQ_CU 1
#endif
// The Q5_K dot (llama.cpp's Q5_K_M and Q4_K_S files) is layer_q8_ks5.cu's build: in this one it cost Q4_K_M 2 % (its
// branch at the K-quant dots' call site; session 28: 405.1 / 405.1 against 413.1 / 412.4 tok/s without it on an H100)
#ifndef NTX_LQ_Q5
#define NTX_LQ_Q5 0
#endif
// A Q6_K v row's byte counts as 1.3 of a Q4_K row's in the blocks' q|k|v shares (lq_r0): the blocks holding v rows
// ended q/k/v last in every layer (1.41 us after the median, the lateness pattern's correlation over layers 0.97), and
// the attention waits for the last. Q4_K_M 487.5 / 489.7 tok/s against 482.2 / 482.6 at 100, 486.0 at 150 (session 25).
#ifndef NTX_LQ_Q6W
#define NTX_LQ_Q6W 130
#endif
#include "layer_q8.cu"
