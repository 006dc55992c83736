// A linear layer computed as one dot product per output element, with the
// weights read straight from their own layout (fp32, or int8/int4 widened in
// registers): no packed copy of the weights, which BLAS makes on every call
// and which doubles the bytes a batch-1 decode moves.
//
// Every output element is the dot product of its weight row with its input
// row in the Row's column order (column order, except for a Row that widens
// its weights in another order and takes the input reordered to match),
// into one accumulator vector summed at the end, whatever the tiling: tiles of kRows rows x 1 token (decode: independent
// chains, the input block reused for several weight rows) or 1 row x kTokens
// tokens (prefill: the widened weight block reused for several tokens) change
// the order of the work, never the arithmetic of one element. So a result
// depends on its own input row alone: not on N, on the other rows or on the
// thread count (what RowBlocking::fixed asks of generation).
//
// A decode is bound by the bytes of weights it reads, and a tile's rows are
// short streams (a 1024-column int8 row is 1 KB) that the hardware
// prefetcher starts too late for: each tile asks for the next tile's bytes
// (the rows kRows below) while it works, so memory stays busy.
//
// A Row type (one output row of some weight format) provides:
//   kBlockCols              columns per block: kBlock, or a multiple of it
//   vector_cols             columns handled in blocks (a multiple of
//                           group_cols); the rest go through scalar(c)
//   group_cols              columns per group: what a block needs to widen
//                           its weights is set up once per group (group(g)),
//                           and with kScaled the block products of a group
//                           are summed unscaled, then multiplied by scale(g)
//   kScaled                 false when the blocks are already scaled
//   kBlockBytes             bytes of one block of the row in memory
//   address(c)              where column c's block starts
//   row_bytes               bytes from one row to the next
//   group(g) -> Group       per-group state for block()
//   block(c, group, w)      the block of columns from c as kBlockCols /
//                           kLanes float vectors, unscaled when kScaled
//   scale(g), scalar(c)     group g's scale; column c's weight, scaled
//   kReordersInput          whether block() yields its columns out of order;
//                           then reorder_input(x, out, cols) writes an input
//                           row's first cols columns in block() order
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
// GCC 12's AVX-512 intrinsics start some results from _mm512_undefined_*()
// and then warn that those are uninitialized (GCC bug 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#endif

#include "kernels/cpu/partition.h"

namespace loom::cpu::row_linear {

// Columns per block by default: one int4 block (kernels.h's packing), so a
// block never straddles a group.
inline constexpr int64_t kBlock = 32;

#if defined(__AVX512F__)
// 16 float lanes.
using Vec = __m512;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec broadcast(float s) { return _mm512_set1_ps(s); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
#define LOOM_ROW_LINEAR_SIMD 1
#elif defined(__AVX2__) && defined(__FMA__)
// 8 float lanes.
using Vec = __m256;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec broadcast(float s) { return _mm256_set1_ps(s); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float sum(Vec v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}
#define LOOM_ROW_LINEAR_SIMD 1
#endif

#if defined(LOOM_ROW_LINEAR_SIMD)

inline constexpr int kLanes = sizeof(Vec) / sizeof(float);

// An fp32 weight row.
struct F32Row {
  static constexpr bool kScaled = false, kReordersInput = false;
  static constexpr int64_t kBlockCols = kBlock, kBlockBytes = kBlock * sizeof(float);
  const float* w;
  int64_t vector_cols, group_cols, row_bytes;
  const void* address(int64_t c) const { return w + c; }
  struct Group {};
  Group group(int64_t) const { return {}; }
  void block(int64_t c, Group, Vec* v) const {
    for (int k = 0; k < kBlock / kLanes; ++k) v[k] = load(w + c + kLanes * k);
  }
  float scale(int64_t) const { return 1.0f; }
  float scalar(int64_t c) const { return w[c]; }
};

// Output rows in tiles of kRows (decode) and tokens in tiles of kTokens
// (prefill).
inline constexpr int64_t kRows = 4;
inline constexpr int64_t kTokens = 8;

// Asks for the cache lines of column c's block kRows rows below this one
// (into L2: they are used one tile later). Blocks smaller than a line ask
// for it more than once, which costs less than a branch to skip them.
template <typename Row>
void prefetch_next_tile(const Row& row, int64_t c) {
  // As an integer: past the last tile this points beyond the weights, which
  // a prefetch may do and pointer arithmetic may not.
  const uintptr_t next = reinterpret_cast<uintptr_t>(row.address(c)) + static_cast<uintptr_t>(kRows * row.row_bytes);
  for (int64_t b = 0; b < Row::kBlockBytes; b += 64)
    _mm_prefetch(reinterpret_cast<const char*>(next + static_cast<uintptr_t>(b)), _MM_HINT_T1);
}

// out[t, o] for RB rows (rows[r] is output o0 + r) and TB tokens from t0.
template <int RB, int TB, typename Row>
void tile(float* out, int64_t ldo, const float* inp, int64_t C, const Row* rows, int64_t o0, const float* bias,
          int64_t t0) {
  Vec acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = zero();
  const int64_t vc = rows[0].vector_cols, gc = rows[0].group_cols;
  for (int64_t g = 0, g0 = 0; g0 < vc; ++g, g0 += gc) {
    Vec part[RB][TB];
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) part[r][t] = zero();
    typename Row::Group group[RB];
    for (int r = 0; r < RB; ++r) group[r] = rows[r].group(g);
    for (int64_t c = g0; c < g0 + gc; c += Row::kBlockCols) {
      for (int r = 0; r < RB; ++r) {
        prefetch_next_tile(rows[r], c);
        constexpr int kVecs = Row::kBlockCols / kLanes;
        Vec w[kVecs];
        rows[r].block(c, group[r], w);
        for (int t = 0; t < TB; ++t) {
          const float* x = inp + (t0 + t) * C + c;
          for (int k = 0; k < kVecs; ++k) part[r][t] = fma(w[k], load(x + kLanes * k), part[r][t]);
        }
      }
    }
    for (int r = 0; r < RB; ++r)
      for (int t = 0; t < TB; ++t) {
        if constexpr (Row::kScaled)
          acc[r][t] = fma(part[r][t], broadcast(rows[r].scale(g)), acc[r][t]);
        else
          acc[r][t] = add(acc[r][t], part[r][t]);
      }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      float y = sum(acc[r][t]);
      const float* x = inp + (t0 + t) * C;
      for (int64_t c = vc; c < C; ++c) y += rows[r].scalar(c) * x[c];
      if (bias != nullptr) y += bias[o0 + r];
      out[(t0 + t) * ldo + o0 + r] = y;
    }
}

// Output rows in tiles, in parallel (each element written by one thread,
// computed as above). A decode's smallest layer (1024 x 1024 fp32: 4 MB, a
// few hundred microseconds of reading) still pays for a parallel region.
// out[N, :OC] (rows ldo apart) = inp[N, C] @ W^T + bias, W's row o being
// make_row(o).
template <typename MakeRow>
void linear(float* out, int64_t ldo, const float* inp, const float* bias, int64_t N, int64_t C, int64_t OC,
            MakeRow make_row) {
  using Row = decltype(make_row(int64_t{0}));
  std::vector<float> reordered;
  if constexpr (Row::kReordersInput) {
    // Once per call for every row of the weights: the input in the order
    // the blocks widen their columns in, the scalar tail left in place.
    const int64_t vc = make_row(0).vector_cols;
    reordered.resize(static_cast<size_t>(N * C));
    for (int64_t t = 0; t < N; ++t) {
      Row::reorder_input(inp + t * C, reordered.data() + t * C, vc);
      std::copy(inp + t * C + vc, inp + (t + 1) * C, reordered.data() + t * C + vc);
    }
    inp = reordered.data();
  }
  const int64_t tiles = (OC + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (N * OC * C >= 8 * kMinParallelWork)
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t o0 = i * kRows, nr = OC - o0 < kRows ? OC - o0 : kRows;
    Row rows[kRows]{};
    for (int64_t r = 0; r < nr; ++r) rows[r] = make_row(o0 + r);
    int64_t t = 0;
    for (; t + kTokens <= N; t += kTokens)
      for (int64_t r = 0; r < nr; ++r) tile<1, kTokens>(out, ldo, inp, C, rows + r, o0 + r, bias, t);
    for (; t < N; ++t) {
      if (nr == kRows) {
        tile<kRows, 1>(out, ldo, inp, C, rows, o0, bias, t);
      } else {
        for (int64_t r = 0; r < nr; ++r) tile<1, 1>(out, ldo, inp, C, rows + r, o0 + r, bias, t);
      }
    }
  }
}

#endif  // LOOM_ROW_LINEAR_SIMD

}  // namespace loom::cpu::row_linear
