// loom::philox_uniform (src/core/rng.cpp) for device code, and for the host
// so a test without a GPU can hold it to the CPU's: word 0 of the
// Philox4x32-10 block (key, counter (0, index)), its top 24 bits scaled to
// [0, 1). Integer arithmetic and an exact float scaling, so dropout masks are
// the CPU's bit for bit.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::cuda {

__host__ __device__ inline float philox_uniform(uint64_t key, uint64_t index) {
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(index), c1 = static_cast<uint32_t>(index >> 32), c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = static_cast<uint64_t>(kMul0) * c0, p1 = static_cast<uint64_t>(kMul1) * c2;
    c0 = static_cast<uint32_t>(p1 >> 32) ^ c1 ^ k0;
    c1 = static_cast<uint32_t>(p1);
    c2 = static_cast<uint32_t>(p0 >> 32) ^ c3 ^ k1;
    c3 = static_cast<uint32_t>(p0);
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return static_cast<float>(c0 >> 8) * (1.0f / 16777216.0f);
}

}  // namespace loom::cuda
