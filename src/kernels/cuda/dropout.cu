#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/philox.cuh"

namespace loom::cuda {

namespace {

__global__ void dropout_forward_kernel(float* out, const float* inp, int64_t n, float p, float keep_scale,
                                       uint64_t key, uint64_t first) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    out[i] = philox_uniform(key, first + static_cast<uint64_t>(i)) >= p ? inp[i] * keep_scale : 0.0f;
}

__global__ void dropout_backward_kernel(float* dinp, const float* dout, int64_t n, float p, float keep_scale,
                                        uint64_t key, uint64_t first) {
  for (int64_t i = grid_start(); i < n; i += grid_step())
    if (philox_uniform(key, first + static_cast<uint64_t>(i)) >= p) dinp[i] += dout[i] * keep_scale;
}

}  // namespace

void dropout_forward(float* out, const float* inp, int64_t n, float p, uint64_t key, uint64_t first,
                     cudaStream_t stream) {
  if (p == 0.0f) {  // every element kept and scaled by 1, as on the CPU
    if (out != inp) copy_bytes(out, inp, static_cast<size_t>(n) * sizeof(float), stream);
    return;
  }
  dropout_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, inp, n, p, 1.0f / (1.0f - p), key, first);
  check_launch();
}

void dropout_backward(float* dinp, const float* dout, int64_t n, float p, uint64_t key, uint64_t first,
                      cudaStream_t stream) {
  if (p == 0.0f) {
    accumulate(dinp, dout, n, stream);
    return;
  }
  dropout_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dinp, dout, n, p, 1.0f / (1.0f - p), key, first);
  check_launch();
}

}  // namespace loom::cuda
