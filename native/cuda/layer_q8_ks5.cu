// The K-quant build of the stack decode kernel (layer_q8_ks.cu) with the Q5_K dot (NTX_LQ_Q5): a module of its own,
// which cuda_layers.StackDecode loads for the models with Q5_K matrices (llama.cpp's Q5_K_M and Q4_K_S files:
// cuda_layers.stack_source). In the one K-quant build the Q5_K dot's branch at the dots' shared call site cost Q4_K_M
// models 2 % (session 28: 405.1 / 405.1 against 413.1 / 412.4 tok/s without it, an H100).
#ifndef NTX_LQ_Q5
#define NTX_LQ_Q5 1
#endif
#include "layer_q8_ks.cu"
