#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

// GELU as on the CPU: x * sigmoid(2u) for 0.5 x (1 + tanh(u)).
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kCubic = 0.044715f;

__global__ void add_kernel(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) out[i] = a[i] + b[i];
}

__global__ void accumulate_kernel(float* y, const float* x, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) y[i] += x[i];
}

__global__ void scale_kernel(float* x, int64_t n, float s) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) x[i] *= s;
}

__device__ inline float gelu(float x) {
  const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
  return x / (1.0f + expf(-2.0f * u));
}

// dL/dx given dL/dy at x.
__device__ inline float gelu_gradient(float x, float dy) {
  const float u = kSqrt2OverPi * (x + kCubic * x * x * x);
  const float s = 1.0f / (1.0f + expf(-2.0f * u));
  const float du = kSqrt2OverPi * (1.0f + 3.0f * kCubic * x * x);
  return dy * (s + 2.0f * x * s * (1.0f - s) * du);
}

// GELU reads and writes a large activation once: where the buffers are
// 16-byte aligned a thread moves four elements a word (a quarter of the
// loads and stores in flight for the same bytes), the last n % 4 one by one.
// Each element's value is the same either way.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__global__ void gelu_forward_kernel(float* out, const float* inp, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) out[i] = gelu(inp[i]);
}

__global__ void gelu_forward4_kernel(float* out, const float* inp, int64_t n) {
  const int64_t words = n / 4;
  for (int64_t i = grid_start(); i < words; i += grid_step()) {
    float4 v = reinterpret_cast<const float4*>(inp)[i];
    v = make_float4(gelu(v.x), gelu(v.y), gelu(v.z), gelu(v.w));
    reinterpret_cast<float4*>(out)[i] = v;
  }
  for (int64_t i = 4 * words + grid_start(); i < n; i += grid_step()) out[i] = gelu(inp[i]);
}

__global__ void gelu_backward_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  for (int64_t i = grid_start(); i < n; i += grid_step()) dinp[i] += gelu_gradient(inp[i], dout[i]);
}

__global__ void gelu_backward4_kernel(float* dinp, const float* inp, const float* dout, int64_t n) {
  const int64_t words = n / 4;
  for (int64_t i = grid_start(); i < words; i += grid_step()) {
    const float4 x = reinterpret_cast<const float4*>(inp)[i], dy = reinterpret_cast<const float4*>(dout)[i];
    float4 d = reinterpret_cast<float4*>(dinp)[i];
    d.x += gelu_gradient(x.x, dy.x);
    d.y += gelu_gradient(x.y, dy.y);
    d.z += gelu_gradient(x.z, dy.z);
    d.w += gelu_gradient(x.w, dy.w);
    reinterpret_cast<float4*>(dinp)[i] = d;
  }
  for (int64_t i = 4 * words + grid_start(); i < n; i += grid_step()) dinp[i] += gelu_gradient(inp[i], dout[i]);
}

// Sum of squares in two fixed-shape passes: kSumBlocks blocks each reduce a
// strided share of x in double, then one block adds the partials.
constexpr int kSumBlocks = 1024;

__global__ void sum_squares_partials_kernel(double* partials, const float* x, int64_t n) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int64_t i = grid_start(); i < n; i += grid_step()) s += static_cast<double>(x[i]) * x[i];
  s = block_reduce(s, Sum{}, 0.0, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void sum_partials_kernel(double* out, const double* partials, int n) {
  __shared__ double scratch[32];
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_reduce(s, Sum{}, 0.0, scratch);
  if (threadIdx.x == 0) *out = s;
}

}  // namespace

void add(float* out, const float* a, const float* b, int64_t n, cudaStream_t stream) {
  add_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, a, b, n);
  check_launch();
}

void accumulate(float* y, const float* x, int64_t n, cudaStream_t stream) {
  accumulate_kernel<<<grid_for(n), kThreads, 0, stream>>>(y, x, n);
  check_launch();
}

void scale(float* x, int64_t n, float s, cudaStream_t stream) {
  scale_kernel<<<grid_for(n), kThreads, 0, stream>>>(x, n, s);
  check_launch();
}

void copy_bytes(void* dst, const void* src, size_t bytes, cudaStream_t stream) {
  if (bytes > 0) LOOM_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

double sum_squares(const float* x, int64_t n, cudaStream_t stream) {
  double* partials = nullptr;
  LOOM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&partials), (kSumBlocks + 1) * sizeof(double), stream));
  sum_squares_partials_kernel<<<kSumBlocks, kThreads, 0, stream>>>(partials, x, n);
  check_launch();
  sum_partials_kernel<<<1, 1024, 0, stream>>>(partials + kSumBlocks, partials, kSumBlocks);
  check_launch();
  double total = 0.0;
  LOOM_CUDA_CHECK(cudaMemcpyAsync(&total, partials + kSumBlocks, sizeof(double), cudaMemcpyDeviceToHost, stream));
  LOOM_CUDA_CHECK(cudaFreeAsync(partials, stream));
  LOOM_CUDA_CHECK(cudaStreamSynchronize(stream));
  return total;
}

void gelu_forward(float* out, const float* inp, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16(out) && aligned16(inp))
    gelu_forward4_kernel<<<grid_for((n + 3) / 4), kThreads, 0, stream>>>(out, inp, n);
  else
    gelu_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, inp, n);
  check_launch();
}

void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (aligned16(dinp) && aligned16(inp) && aligned16(dout))
    gelu_backward4_kernel<<<grid_for((n + 3) / 4), kThreads, 0, stream>>>(dinp, inp, dout, n);
  else
    gelu_backward_kernel<<<grid_for(n), kThreads, 0, stream>>>(dinp, inp, dout, n);
  check_launch();
}

}  // namespace loom::cuda
