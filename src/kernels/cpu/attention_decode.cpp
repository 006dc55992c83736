// Attention of new positions against a KV cache (generation): a packed batch
// of sequences, each with its own cache length. Written as the training
// kernel is: per (sequence, query head, query tile) task, the tile's scores
// against the keys it may see go through GEMMs into a per-thread buffer.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu/causal_softmax.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {
// Query rows per task: a prefill of a long prompt splits over the threads,
// a decode step is one row per sequence.
constexpr int64_t kQueryTile = 64;
}  // namespace

void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len) {
  LOOM_CHECK(row_offsets[S] == N, "attention_decode: ", N, " rows but the offsets end at ", row_offsets[S]);
  const int64_t hs = C / NH, group = NH / NKV, C3 = C + 2 * NKV * hs;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hs));
  // The new keys and values enter the cache first; every query head of the
  // group then reads them there.
#pragma omp parallel for schedule(static) if (S * NKV > 1)
  for (int64_t task = 0; task < S * NKV; ++task) {
    const int64_t s = task / NKV, g = task % NKV;
    for (int64_t r = row_offsets[s]; r < row_offsets[s + 1]; ++r) {
      const int64_t at = (g * max_len + cache_lens[s] + r - row_offsets[s]) * hs;
      std::copy_n(qkv + r * C3 + C + g * hs, hs, k_cache[s] + at);
      std::copy_n(qkv + r * C3 + C + (NKV + g) * hs, hs, v_cache[s] + at);
    }
  }
  // Tasks: (sequence, query tile) units times the heads. Each depends on its
  // own sequence alone, so a sequence's result does not depend on the batch
  // around it nor on the thread count.
  struct Unit {
    int64_t s, tile;
  };
  std::vector<Unit> units;
  int64_t max_keys = 0, max_rows = 0;  // the score buffer's extent
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = row_offsets[s + 1] - row_offsets[s];
    for (int64_t tile = 0; tile * kQueryTile < n; ++tile) units.push_back({s, tile});
    max_keys = std::max<int64_t>(max_keys, cache_lens[s] + n);
    max_rows = std::max(max_rows, std::min(n, kQueryTile));
  }
  const int64_t tasks = static_cast<int64_t>(units.size()) * NH;
#pragma omp parallel if (tasks > 1)
  {
    std::vector<float> scores(static_cast<size_t>(max_rows * max_keys));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const Unit u = units[static_cast<size_t>(task / NH)];
      const int64_t h = task % NH, g = h / group;
      const int64_t r0 = row_offsets[u.s] + u.tile * kQueryTile;
      const int64_t rows = std::min(kQueryTile, row_offsets[u.s + 1] - r0);
      const int64_t pos0 = cache_lens[u.s] + u.tile * kQueryTile;  // the tile's first position
      const int64_t keys = pos0 + rows;                             // causal: it sees keys [0, keys)
      const float* K = k_cache[u.s] + g * max_len * hs;
      const float* V = v_cache[u.s] + g * max_len * hs;
      float* P = scores.data();  // rows x keys
      gemm(false, true, rows, keys, hs, scale, qkv + r0 * C3 + h * hs, C3, K, hs, 0.0f, P, keys);
      for (int64_t r = 0; r < rows; ++r) {
        const float l = causal_softmax_row(P + r * keys, pos0 + r + 1, keys);
        if (lse) lse[(r0 + r) * NH + h] = l;
      }
      gemm(false, false, rows, hs, keys, 1.0f, P, keys, V, hs, 0.0f, out + r0 * C + h * hs, C);
    }
  }
}

}  // namespace loom::cpu
