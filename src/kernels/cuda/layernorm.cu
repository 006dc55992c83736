#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

constexpr float kEps = 1e-5f;

// One block per row; two passes (mean, then squared deviations) as on the CPU.
__global__ void layernorm_forward_kernel(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                                         const float* bias, int64_t C) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* x = inp + row * C;
  const float inv_c = 1.0f / static_cast<float>(C);
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) sum += x[c];
  const float m = block_reduce(sum, Sum{}, 0.0f, scratch) * inv_c;
  float sq = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float d = x[c] - m;
    sq += d * d;
  }
  const float r = 1.0f / sqrtf(block_reduce(sq, Sum{}, 0.0f, scratch) * inv_c + kEps);
  float* o = out + row * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) o[c] = (x[c] - m) * r * weight[c] + bias[c];
  if (threadIdx.x == 0) {
    mean[row] = m;
    rstd[row] = r;
  }
}

// dinp only; dweight and dbias are column sums, reduced separately.
__global__ void layernorm_backward_kernel(float* dinp, const float* dout, const float* inp, const float* weight,
                                          const float* mean, const float* rstd, int64_t C) {
  __shared__ float scratch[32];
  const int64_t row = blockIdx.x;
  const float* x = inp + row * C;
  const float* g = dout + row * C;
  const float m = mean[row], r = rstd[row];
  const float inv_c = 1.0f / static_cast<float>(C);
  // With xhat = (x - m) r and h = g * weight: dx = r (h - mean(h) - xhat mean(h xhat)).
  float sum_h = 0.0f, sum_h_xhat = 0.0f;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float h = g[c] * weight[c];
    sum_h += h;
    sum_h_xhat += h * ((x[c] - m) * r);
  }
  const float mean_h = block_reduce(sum_h, Sum{}, 0.0f, scratch) * inv_c;
  const float mean_h_xhat = block_reduce(sum_h_xhat, Sum{}, 0.0f, scratch) * inv_c;
  float* dx = dinp + row * C;
  for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
    const float xhat = (x[c] - m) * r;
    dx[c] += r * (g[c] * weight[c] - mean_h - xhat * mean_h_xhat);
  }
}

}  // namespace

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C, cudaStream_t stream) {
  if (N == 0) return;
  layernorm_forward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(out, mean, rstd, inp, weight, bias, C);
  check_launch();
}

void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        cudaStream_t stream) {
  if (N == 0) return;
  layernorm_backward_kernel<<<static_cast<unsigned>(N), kThreads, 0, stream>>>(dinp, dout, inp, weight, mean, rstd,
                                                                               C);
  check_launch();
  column_sums(
      dweight, N, C,
      [=] __device__(int64_t i, int64_t c) { return dout[i * C + c] * ((inp[i * C + c] - mean[i]) * rstd[i]); },
      stream);
  column_sums(dbias, N, C, [=] __device__(int64_t i, int64_t c) { return dout[i * C + c]; }, stream);
}

}  // namespace loom::cuda
