#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

// A straightforward causal attention: one warp per query row (forward, dq) or
// per key row (dk, dv), the head dimension spread over the lanes. Every output
// element is written by one lane and every dot product is a warp butterfly of
// fixed shape, so results are deterministic without atomics. Like the CPU
// kernel it keeps only out and lse; backward recomputes the scores.
namespace {

constexpr int kMaxPerLane = 8;  // head sizes up to 256
constexpr int kWarpsPerBlock = 8;

struct Shape {
  int64_t B, T, C, NH, hs;
  float scale;
  // Offsets of row t's q, k, v of head h of sequence b in qkv[B, T, 3C].
  __device__ int64_t q(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * 3 * C + h * hs; }
  __device__ int64_t k(int64_t b, int64_t h, int64_t t) const { return q(b, h, t) + C; }
  __device__ int64_t v(int64_t b, int64_t h, int64_t t) const { return q(b, h, t) + 2 * C; }
  __device__ int64_t o(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * C + h * hs; }
};

// Loads row x's elements lane, lane + 32, ... (zeros past hs).
__device__ inline void load(float (&r)[kMaxPerLane], const float* x, int64_t hs) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) r[u] = lane + 32 * u < hs ? x[lane + 32 * u] : 0.0f;
}

// The dot product of a register row with row y, the same value in every lane.
__device__ inline float dot(const float (&r)[kMaxPerLane], const float* y, int64_t hs) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < hs) s += r[u] * y[lane + 32 * u];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Row (b, h, t) of this warp, or false past the last one.
__device__ inline bool warp_row(const Shape& s, int64_t& b, int64_t& h, int64_t& t) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= s.B * s.NH * s.T) return false;
  t = row % s.T;
  h = row / s.T % s.NH;
  b = row / (s.T * s.NH);
  return true;
}

__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, Shape s) {
  int64_t b, h, t;
  if (!warp_row(s, b, h, t)) return;
  const int lane = threadIdx.x % 32;
  float q[kMaxPerLane], acc[kMaxPerLane] = {};
  load(q, qkv + s.q(b, h, t), s.hs);
  float m = -INFINITY, l = 0.0f;  // running max and sum of exp(score - m)
  for (int64_t j = 0; j <= t; ++j) {
    const float score = dot(q, qkv + s.k(b, h, j), s.hs) * s.scale;
    const float m_new = fmaxf(m, score);
    const float rescale = expf(m - m_new), p = expf(score - m_new);
    l = l * rescale + p;
    const float* v = qkv + s.v(b, h, j);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) acc[u] = acc[u] * rescale + p * v[lane + 32 * u];
    m = m_new;
  }
  float* o = out + s.o(b, h, t);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) o[lane + 32 * u] = acc[u] / l;
  if (lane == 0) lse[(b * s.NH + h) * s.T + t] = m + logf(l);
}

// dq for query row t, and D[t] = dout . out (the softmax backward's row term),
// which the dk/dv pass reads.
__global__ void attention_backward_dq_kernel(float* dqkv, float* D, const float* dout, const float* out,
                                             const float* lse, const float* qkv, Shape s) {
  int64_t b, h, t;
  if (!warp_row(s, b, h, t)) return;
  const int lane = threadIdx.x % 32;
  float q[kMaxPerLane], g[kMaxPerLane], dq[kMaxPerLane] = {};
  load(q, qkv + s.q(b, h, t), s.hs);
  load(g, dout + s.o(b, h, t), s.hs);
  const int64_t row = (b * s.NH + h) * s.T + t;
  const float d = dot(g, out + s.o(b, h, t), s.hs), l = lse[row];
  for (int64_t j = 0; j <= t; ++j) {
    const float* k = qkv + s.k(b, h, j);
    const float p = expf(dot(q, k, s.hs) * s.scale - l);
    const float ds = p * (dot(g, qkv + s.v(b, h, j), s.hs) - d);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) dq[u] += ds * k[lane + 32 * u];
  }
  float* dst = dqkv + s.q(b, h, t);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) dst[lane + 32 * u] += dq[u] * s.scale;
  if (lane == 0) D[row] = d;
}

// dk and dv for key row j, from every query row t >= j.
__global__ void attention_backward_dkdv_kernel(float* dqkv, const float* D, const float* dout, const float* lse,
                                               const float* qkv, Shape s) {
  int64_t b, h, j;
  if (!warp_row(s, b, h, j)) return;
  const int lane = threadIdx.x % 32;
  float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane] = {}, dv[kMaxPerLane] = {};
  load(k, qkv + s.k(b, h, j), s.hs);
  load(v, qkv + s.v(b, h, j), s.hs);
  const int64_t rows = (b * s.NH + h) * s.T;
  for (int64_t t = j; t < s.T; ++t) {
    const float* q = qkv + s.q(b, h, t);
    const float* g = dout + s.o(b, h, t);
    const float p = expf(dot(k, q, s.hs) * s.scale - lse[rows + t]);
    const float ds = p * (dot(v, g, s.hs) - D[rows + t]);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) {
        dv[u] += p * g[lane + 32 * u];
        dk[u] += ds * q[lane + 32 * u];
      }
  }
  float* dst_k = dqkv + s.k(b, h, j);
  float* dst_v = dqkv + s.v(b, h, j);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) {
      dst_k[lane + 32 * u] += dk[u] * s.scale;
      dst_v[lane + 32 * u] += dv[u];
    }
}

Shape make_shape(int64_t B, int64_t T, int64_t C, int64_t NH) {
  LOOM_CHECK(NH > 0 && C % NH == 0, "attention: C = ", C, " is not a multiple of NH = ", NH);
  const int64_t hs = C / NH;
  LOOM_CHECK(hs <= 32 * kMaxPerLane, "attention: head size ", hs, " exceeds the CUDA kernel's ", 32 * kMaxPerLane);
  return Shape{B, T, C, NH, hs, 1.0f / std::sqrt(static_cast<float>(hs))};
}

unsigned warp_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       cudaStream_t stream) {
  const Shape s = make_shape(B, T, C, NH);
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  attention_forward_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(out, lse, qkv, s);
  check_launch();
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, cudaStream_t stream) {
  const Shape s = make_shape(B, T, C, NH);
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  float* D = nullptr;
  LOOM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&D), static_cast<size_t>(rows) * sizeof(float), stream));
  attention_backward_dq_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(dqkv, D, dout, out, lse, qkv,
                                                                                       s);
  check_launch();
  attention_backward_dkdv_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(dqkv, D, dout, lse, qkv, s);
  check_launch();
  LOOM_CUDA_CHECK(cudaFreeAsync(D, stream));
}

}  // namespace loom::cuda
