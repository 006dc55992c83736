#include <cmath>

#include "loom/core.h"

namespace loom {

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
