#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/philox.cuh"

namespace loom::cuda {

namespace {

// The global index of element i of a [rows, cols] block whose rows are
// `stride` apart.
__device__ inline uint64_t global_index(int64_t i, int64_t cols, int64_t stride, uint64_t first) {
  return first + static_cast<uint64_t>((i / cols) * stride + i % cols);
}

__global__ void dropout_forward_kernel(float* out, const float* inp, int64_t n, int64_t cols, int64_t stride,
                                       float p, float keep_scale, uint64_t key, uint64_t first) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    out[i] = philox_uniform(key, global_index(i, cols, stride, first)) >= p ? inp[i] * keep_scale : 0.0f;
}

__global__ void dropout_backward_kernel(float* dinp, const float* dout, int64_t n, int64_t cols, int64_t stride,
                                        float p, float keep_scale, uint64_t key, uint64_t first) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    if (philox_uniform(key, global_index(i, cols, stride, first)) >= p) dinp[i] += dout[i] * keep_scale;
}

}  // namespace

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (p == 0.0f) {  // every element kept and scaled by 1, as on the CPU
    if (out != inp) copy_bytes(out, inp, static_cast<size_t>(n) * sizeof(float), stream);
    return;
  }
  dropout_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, inp, n, cols, stride, p, 1.0f / (1.0f - p),
                                                                key, first);
  check_launch();
}

void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, cudaStream_t stream) {
  const int64_t n = rows * cols;
  if (p == 0.0f) {
    accumulate(dinp, dout, n, stream);
    return;
  }
  dropout_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dinp, dout, n, cols, stride, p, 1.0f / (1.0f - p),
                                                                 key, first);
  check_launch();
}

}  // namespace loom::cuda
