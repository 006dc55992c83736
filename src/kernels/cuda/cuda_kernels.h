// The CUDA backend's kernels: the contracts of include/loom/kernels.h on
// device memory. Each function takes the same arguments as the loom::cpu
// function of the same name (pointers are device pointers) plus the stream it
// runs on, and keeps its semantics: backward kernels accumulate where the CPU
// ones do, and a run is bit-identical to itself (no floating-point atomics;
// every reduction has a fixed shape and order). Launches are asynchronous
// except where a result comes back to the host (sum_squares).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "loom/kernels.h"

namespace loom::cuda {

using cpu::AdamWStep;

// Through cuBLASLt in fp32 with fp32 accumulation (TF32 off), so results
// match the CPU's within fp32 rounding. Each host thread keeps one cuBLASLt
// handle per device and one workspace per (device, stream).
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaStream_t stream);

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC, cudaStream_t stream);
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, cudaStream_t stream);
void add_bias(float* out, const float* bias, int64_t N, int64_t OC, cudaStream_t stream);

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0, cudaStream_t stream);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0, cudaStream_t stream);

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, cudaStream_t stream);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        cudaStream_t stream);

void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, cudaStream_t stream);

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream);
void accumulate(float* y, const float* x, int64_t n, cudaStream_t stream);
void scale(float* x, int64_t n, float s, cudaStream_t stream);
void copy_bytes(void* dst, const void* src, std::size_t bytes, cudaStream_t stream);
// Waits for the stream: the result is a host value.
double sum_squares(const float* x, int64_t n, cudaStream_t stream);

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       cudaStream_t stream);
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, cudaStream_t stream);

void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len, cudaStream_t stream);

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V, cudaStream_t stream);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V, cudaStream_t stream);

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first, cudaStream_t stream);
void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, cudaStream_t stream);

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s,
                  cudaStream_t stream);

}  // namespace loom::cuda
