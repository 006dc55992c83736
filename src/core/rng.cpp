#include <cmath>

#include "loom/core.h"

namespace loom {

std::array<uint32_t, 4> Philox::block(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
  // Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
  constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
  constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
  uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
  uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
  uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
    uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
    uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
    uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += kWeyl0;
    k1 += kWeyl1;
  }
  return {c0, c1, c2, c3};
}

static uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t stream_key(uint64_t seed, std::string_view name) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : name) h = (h ^ c) * 0x100000001b3ull;
  return splitmix64(seed ^ splitmix64(h));
}

uint64_t stream_key(uint64_t key, uint64_t a, uint64_t b) { return splitmix64(key ^ splitmix64(a ^ splitmix64(b))); }

static float to_unit(uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }

float philox_uniform(uint64_t key, uint64_t index) { return to_unit(Philox::block(key, 0, index)[0]); }

float philox_normal(uint64_t key, uint64_t index) {
  // Box-Muller on one block, computed in double so the value does not depend
  // on how the compiler vectorizes the float math.
  auto b = Philox::block(key, 1, index);
  double u1 = (static_cast<double>(b[0]) + 1.0) / 4294967297.0;  // (0, 1]
  double u2 = static_cast<double>(b[1]) / 4294967296.0;
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

void fill_normal(float* out, int64_t n, uint64_t key, uint64_t first, float mean, float std) {
#pragma omp parallel for if (n > 4096)
  for (int64_t i = 0; i < n; ++i) out[i] = mean + std * philox_normal(key, first + static_cast<uint64_t>(i));
}

}  // namespace loom
