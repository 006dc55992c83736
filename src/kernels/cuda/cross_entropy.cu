#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

constexpr int kRowThreads = 512;

// One block per row: the max, then the sum of exp(logit - max).
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const float* logits, const int32_t* targets,
                                             int64_t V) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  float m = -INFINITY;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) m = fmaxf(m, x[j]);
  m = block_reduce(m, Max{}, -INFINITY, scratch);
  float sum = 0.0f;
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) sum += expf(x[j] - m);
  sum = block_reduce(sum, Sum{}, 0.0f, scratch);
  if (threadIdx.x == 0) {
    const float l = m + logf(sum);
    lse[row] = l;
    losses[row] = targets[row] < 0 ? 0.0f : l - x[targets[row]];
  }
}

// Each element is read and then written by the same thread, so dlogits may
// alias logits.
__global__ void cross_entropy_backward_kernel(float* dlogits, const float* logits, const float* lse,
                                              const int32_t* targets, const float* dloss, int64_t V) {
  const int64_t row = blockIdx.x;
  const float* x = logits + row * V;
  float* d = dlogits + row * V;
  const int64_t t = targets[row];
  const float g = t < 0 ? 0.0f : dloss[row], l = lse[row];
  for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
    // Rounded before the target's -g (no fused multiply-add), as on the CPU.
    const float p = __fmul_rn(g, expf(x[j] - l));
    d[j] = t < 0 ? 0.0f : (j == t ? p - g : p);
  }
}

}  // namespace

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V, cudaStream_t stream) {
  if (N == 0) return;
  cross_entropy_forward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(losses, lse, logits, targets,
                                                                                     V);
  check_launch();
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V, cudaStream_t stream) {
  if (N == 0) return;
  cross_entropy_backward_kernel<<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(dlogits, logits, lse, targets,
                                                                                      dloss, V);
  check_launch();
}

}  // namespace loom::cuda
