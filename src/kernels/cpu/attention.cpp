#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "kernels/cpu/causal_softmax.h"
#include "kernels/cpu/simd_exp.h"
#include "loom/kernels.h"

namespace loom::cpu {

// Flash-style causal attention on the CPU. Queries are processed in tiles of
// kQueryTile rows; a tile's scores against the keys it may see (a
// kQueryTile x T block at most) live in a per-thread buffer and are never
// stored, so saved activations are out and lse only. The products go through
// GEMMs on strided views of qkv (leading dimension C + 2 NKV hs), which run
// single-threaded inside the parallel regions here.
namespace {

constexpr int64_t kQueryTile = 64;

// Backward tasks to aim for: enough to load a many-core machine evenly.
constexpr int64_t kTargetTasks = 48;

struct HeadLayout {
  int64_t B, T, C, NH, NKV, group, hs, C3, tiles;
  float scale;
  HeadLayout(int64_t B_, int64_t T_, int64_t C_, int64_t NH_, int64_t NKV_)
      : B(B_),
        T(T_),
        C(C_),
        NH(NH_),
        NKV(NKV_),
        group(NH_ / NKV_),
        hs(C_ / NH_),
        C3(C_ + 2 * NKV_ * (C_ / NH_)),
        tiles((T_ + kQueryTile - 1) / kQueryTile),
        scale(1.0f / std::sqrt(static_cast<float>(C_ / NH_))) {}
  // Batch b, token t: the first element of query head h, of kv head g's key
  // and value, and of query head h's output.
  int64_t q(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * C3 + h * hs; }
  int64_t k(int64_t b, int64_t g, int64_t t) const { return (b * T + t) * C3 + C + g * hs; }
  int64_t v(int64_t b, int64_t g, int64_t t) const { return k(b, g, t) + NKV * hs; }
  int64_t o(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * C + h * hs; }
};

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       int64_t NKV) {
  const HeadLayout s(B, T, C, NH, NKV);
#pragma omp parallel if (B * NH * s.tiles > 1)
  {
    std::vector<float> scores(static_cast<size_t>(kQueryTile * T));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < B * NH * s.tiles; ++task) {
      const int64_t b = task / (NH * s.tiles), h = task / s.tiles % NH, tile = task % s.tiles;
      const int64_t g = h / s.group;
      const int64_t t0 = tile * kQueryTile;
      const int64_t rows = T - t0 < kQueryTile ? T - t0 : kQueryTile;
      const int64_t keys = t0 + rows;  // causal: this tile sees keys [0, keys)
      float* S = scores.data();        // rows x keys
      gemm(false, true, rows, keys, s.hs, s.scale, qkv + s.q(b, h, t0), s.C3, qkv + s.k(b, g, 0), s.C3, 0.0f, S, keys);
      for (int64_t r = 0; r < rows; ++r)
        lse[(b * NH + h) * T + t0 + r] = causal_softmax_row(S + r * keys, t0 + r + 1, keys);
      gemm(false, false, rows, s.hs, keys, 1.0f, S, keys, qkv + s.v(b, g, 0), s.C3, 0.0f, out + s.o(b, h, t0), C);
    }
  }
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv, int64_t B,
                        int64_t T, int64_t C, int64_t NH, int64_t NKV, GradWrite dqkv_write) {
  const HeadLayout s(B, T, C, NH, NKV);
  const int64_t heads = B * NH, kv_heads = B * NKV;
  const bool overwrite = dqkv_write == GradWrite::overwrite;
  // Tasks are (batch, kv head, key range): with few kv heads the keys of each
  // are cut into `splits` contiguous ranges of whole tiles, so every thread
  // has work. A task owns its range's dK and dV, which collect the query
  // tiles in tile order and, within a tile, the group's query heads in head
  // order. dQ sums over every key range: range 0 adds its part straight into
  // dqkv, range r > 0 writes its part to partial r - 1, and a second pass adds
  // the partials in range order. The splits depend on the shape alone, so the
  // result does not depend on the thread count.
  const int64_t splits = std::min(s.tiles, (kTargetTasks + kv_heads - 1) / kv_heads);
  // Range r starts at key tile first_tile[r]; tile k has s.tiles - k query
  // tiles to visit (causal), and the ranges split that work about evenly.
  std::vector<int64_t> first_tile(static_cast<size_t>(splits + 1), s.tiles);
  {
    const int64_t work = s.tiles * (s.tiles + 1) / 2;
    int64_t done = 0, r = 0;
    for (int64_t k = 0; k < s.tiles; ++k) {
      while (r < splits && done * splits >= r * work) first_tile[static_cast<size_t>(r++)] = k;
      done += s.tiles - k;
    }
  }
  const int64_t head_dq = T * s.hs;  // one query head's dQ part in a partial, rows of hs
  std::vector<float> partials(static_cast<size_t>((splits - 1) * heads * head_dq));
#pragma omp parallel if (kv_heads * splits > 1)
  {
    std::vector<float> probs(static_cast<size_t>(kQueryTile * T));
    std::vector<float> dprobs(static_cast<size_t>(kQueryTile * T));
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < kv_heads * splits; ++task) {
      const int64_t bg = task / splits, range = task % splits;
      const int64_t b = bg / NKV, g = bg % NKV;
      const int64_t k0 = first_tile[static_cast<size_t>(range)] * kQueryTile;
      const int64_t k1 = std::min(first_tile[static_cast<size_t>(range + 1)] * kQueryTile, T);
      if (k0 >= k1) continue;  // an empty range
      const float* k = qkv + s.k(b, g, k0);
      const float* v = qkv + s.v(b, g, k0);
      float* dk = dqkv + s.k(b, g, k0);
      float* dv = dqkv + s.v(b, g, k0);
      for (int64_t tile = k0 / kQueryTile; tile < s.tiles; ++tile) {
        const int64_t t0 = tile * kQueryTile;
        const int64_t rows = T - t0 < kQueryTile ? T - t0 : kQueryTile;
        const int64_t keys = std::min(k1, t0 + rows) - k0;  // this range's keys the tile sees
        for (int64_t member = 0; member < s.group; ++member) {
          const int64_t h = g * s.group + member, bh = b * NH + h;
          const float* row_lse = lse + bh * T;
          const float* q = qkv + s.q(b, h, t0);
          const float* dO = dout + s.o(b, h, t0);
          const float* O = out + s.o(b, h, t0);
          float* P = probs.data();    // rows x keys
          float* dS = dprobs.data();  // rows x keys: dP, then dS in place
          gemm(false, true, rows, keys, s.hs, s.scale, q, s.C3, k, s.C3, 0.0f, P, keys);
          gemm(false, true, rows, keys, s.hs, 1.0f, dO, C, v, s.C3, 0.0f, dS, keys);
          for (int64_t r = 0; r < rows; ++r) {
            float* p = P + r * keys;
            float* ds = dS + r * keys;
            const int64_t visible = std::min(t0 + r + 1 - k0, keys);
            const float l = row_lse[t0 + r];
            // D = rowsum(dP * P) = rowsum(dO * O), the cheaper form.
            float D = 0.0f;
            const float* dOr = dO + r * C;
            const float* Or = O + r * C;
#pragma omp simd reduction(+ : D)
            for (int64_t d = 0; d < s.hs; ++d) D += dOr[d] * Or[d];
#pragma omp simd
            for (int64_t j = 0; j < visible; ++j) {
              p[j] = simd_exp(p[j] - l);
              ds[j] = p[j] * (ds[j] - D);
            }
            for (int64_t j = visible; j < keys; ++j) p[j] = ds[j] = 0.0f;
          }
          if (range == 0)
            gemm(false, false, rows, s.hs, keys, s.scale, dS, keys, k, s.C3, overwrite ? 0.0f : 1.0f,
                 dqkv + s.q(b, h, t0), s.C3);
          else  // each query tile is written once per range: no zeroing needed
            gemm(false, false, rows, s.hs, keys, s.scale, dS, keys, k, s.C3, 0.0f,
                 partials.data() + ((range - 1) * heads + bh) * head_dq + t0 * s.hs, s.hs);
          // Keys from t0 on are seen first by this tile's first query head:
          // overwritten there if asked, the earlier ones (and all when
          // accumulating, or for the group's later heads) added to.
          const int64_t seen = overwrite && member == 0 ? std::min(t0 - k0, keys) : keys;
          if (seen > 0) {
            gemm(true, false, seen, s.hs, rows, s.scale, dS, keys, q, s.C3, 1.0f, dk, s.C3);
            gemm(true, false, seen, s.hs, rows, 1.0f, P, keys, dO, C, 1.0f, dv, s.C3);
          }
          if (seen < keys) {
            gemm(true, false, keys - seen, s.hs, rows, s.scale, dS + seen, keys, q, s.C3, 0.0f, dk + seen * s.C3,
                 s.C3);
            gemm(true, false, keys - seen, s.hs, rows, 1.0f, P + seen, keys, dO, C, 0.0f, dv + seen * s.C3, s.C3);
          }
        }
      }
    }
    if (splits > 1) {
      // Query row t has a part from every range that starts at or before its tile.
#pragma omp for schedule(static)
      for (int64_t row = 0; row < heads * T; ++row) {
        const int64_t bh = row / T, t = row % T;
        float* dq = dqkv + s.q(bh / NH, bh % NH, t);
        for (int64_t range = 1; range < splits && first_tile[static_cast<size_t>(range)] <= t / kQueryTile; ++range) {
          if (first_tile[static_cast<size_t>(range)] == first_tile[static_cast<size_t>(range + 1)]) continue;  // empty
          const float* part = partials.data() + ((range - 1) * heads + bh) * head_dq + t * s.hs;
#pragma omp simd
          for (int64_t d = 0; d < s.hs; ++d) dq[d] += part[d];
        }
      }
    }
  }
}

}  // namespace loom::cpu
