#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

// loom::philox_uniform (src/core/rng.cpp) on the device: word 0 of the
// Philox4x32-10 block (key, counter (0, index)), its top 24 bits scaled to
// [0, 1). Integer arithmetic and an exact float scaling, so the mask is the
// CPU's bit for bit.
__device__ inline float philox_uniform(uint64_t key, uint64_t index) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t hi0 = __umulhi(kMul0, c0), lo0 = kMul0 * c0;
    const uint32_t hi1 = __umulhi(kMul1, c2), lo1 = kMul1 * c2;
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return static_cast<float>(c0 >> 8) * (1.0f / 16777216.0f);
}

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
