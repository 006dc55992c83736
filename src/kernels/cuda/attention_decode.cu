#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

// Attention of new rows against per-sequence KV caches, as the CPU kernel:
// the new keys and values are copied into the caches first, then one warp per
// (row, query head) runs the online softmax over the positions the row sees,
// the head dimension spread over the lanes (as attention_forward's kernel).
// Each output element is written by one lane in a fixed order: deterministic.
namespace {

constexpr int kMaxPerLane = 8;  // head sizes up to 256
constexpr int kWarpsPerBlock = 8;

struct Shape {
  int64_t S, N, C, NH, NKV, hs, group, C3, max_len;
  float scale;
};

// The sequence whose rows include `row` (row_offsets ascending, S + 1 of them).
__device__ inline int64_t sequence_of(const int32_t* row_offsets, int64_t S, int64_t row) {
  int64_t lo = 0, hi = S - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (row_offsets[mid] <= row)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__global__ void append_kv_kernel(float* const* k_cache, float* const* v_cache, const float* qkv,
                                 const int32_t* cache_lens, const int32_t* row_offsets, Shape s) {
  const int64_t per_row = s.NKV * s.hs;
  for (int64_t e = grid_start(); e < s.N * per_row; e += grid_step()) {
    const int64_t row = e / per_row, i = e % per_row;  // i = g * hs + d
    const int64_t seq = sequence_of(row_offsets, s.S, row);
    const int64_t pos = cache_lens[seq] + row - row_offsets[seq];
    const int64_t at = ((i / s.hs) * s.max_len + pos) * s.hs + i % s.hs;
    k_cache[seq][at] = qkv[row * s.C3 + s.C + i];
    v_cache[seq][at] = qkv[row * s.C3 + s.C + per_row + i];
  }
}

__global__ void attention_decode_kernel(float* out, float* lse, float* const* k_cache, float* const* v_cache,
                                        const float* qkv, const int32_t* cache_lens, const int32_t* row_offsets,
                                        Shape s) {
  const int64_t task = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (task >= s.N * s.NH) return;
  const int64_t row = task / s.NH, h = task % s.NH, g = h / s.group;
  const int64_t seq = sequence_of(row_offsets, s.S, row);
  const int64_t visible = cache_lens[seq] + row - row_offsets[seq] + 1;
  const float* keys = k_cache[seq] + g * s.max_len * s.hs;
  const float* values = v_cache[seq] + g * s.max_len * s.hs;
  const int lane = threadIdx.x % 32;
  float q[kMaxPerLane], acc[kMaxPerLane] = {};
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) q[u] = lane + 32 * u < s.hs ? qkv[row * s.C3 + h * s.hs + lane + 32 * u] : 0.0f;
  float m = -INFINITY, l = 0.0f;  // running max and sum of exp(score - m)
  for (int64_t j = 0; j < visible; ++j) {
    const float* k = keys + j * s.hs;
    float dot = 0.0f;
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) dot += q[u] * k[lane + 32 * u];
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
    const float score = dot * s.scale;
    const float m_new = fmaxf(m, score);
    const float rescale = expf(m - m_new), p = expf(score - m_new);
    l = l * rescale + p;
    const float* v = values + j * s.hs;
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) acc[u] = acc[u] * rescale + p * v[lane + 32 * u];
    m = m_new;
  }
  float* o = out + row * s.C + h * s.hs;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) o[lane + 32 * u] = acc[u] / l;
  if (lse != nullptr && lane == 0) lse[row * s.NH + h] = m + logf(l);
}

}  // namespace

void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len, cudaStream_t stream) {
  LOOM_CHECK(NH > 0 && C % NH == 0 && NKV > 0 && NH % NKV == 0, "attention_decode: C = ", C, ", NH = ", NH,
             ", NKV = ", NKV);
  const int64_t hs = C / NH;
  LOOM_CHECK(hs <= 32 * kMaxPerLane, "attention_decode: head size ", hs, " exceeds the CUDA kernel's ",
             32 * kMaxPerLane);
  if (S == 0 || N == 0) return;
  const Shape s{S, N, C, NH, NKV, hs, NH / NKV, C + 2 * NKV * hs, max_len, 1.0f / std::sqrt(static_cast<float>(hs))};
  append_kv_kernel<<<grid_for(N * NKV * hs), kThreads, 0, stream>>>(k_cache, v_cache, qkv, cache_lens, row_offsets,
                                                                     s);
  check_launch();
  const int64_t tasks = N * NH;
  attention_decode_kernel<<<static_cast<unsigned>((tasks + kWarpsPerBlock - 1) / kWarpsPerBlock),
                            32 * kWarpsPerBlock, 0, stream>>>(out, lse, k_cache, v_cache, qkv, cache_lens,
                                                              row_offsets, s);
  check_launch();
}

}  // namespace loom::cuda
