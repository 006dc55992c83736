// Weight-only quantized linear: the weights stay int8/int4 in memory and are
// widened to fp32 in registers, in blocks of 32 input columns (128 for int4
// in groups of 128 or more), so a batch-1 decode reads a quarter (int8) or an
// eighth (int4) of fp32's bytes.
// The tiling and the order of the arithmetic are row_linear.h's. int8's one
// scale multiplies the row's sum of products; int4 widens each nibble straight
// to its dequantized weight, (q - zero) * scale, as dequantize_int4 writes it.
#include <vector>

#include "kernels/cpu/partition.h"
#include "kernels/cpu/row_linear.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {

// Column c of a row of an int4 matrix (kernels.h's packing), from the row's
// packed bytes, group scales and zero points.
inline float int4_weight(const uint8_t* q, const float* scale, const uint8_t* zero, int64_t c, int64_t group) {
  const int64_t j = c % kInt4Block;
  const uint8_t byte = q[(c - j) / 2 + j % 16];
  const int v = j < 16 ? (byte & 0x0f) : (byte >> 4);
  return static_cast<float>(v - zero[c / group]) * scale[c / group];
}

#if defined(LOOM_ROW_LINEAR_SIMD)

using row_linear::kBlock;
using row_linear::kLanes;
using row_linear::Vec;
static_assert(kBlock == kInt4Block);

// int8 integers (exact in fp32) to float lanes.
#if defined(__AVX512F__)
inline Vec widen_i8(const int8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
}
#else
inline Vec widen_i8(const int8_t* q) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
}
#endif

// One int8 weight row: one scale, the whole vectorized width one group.
struct Int8Row {
  static constexpr bool kScaled = true, kReordersInput = false;
  static constexpr int64_t kBlockCols = kBlock, kBlockBytes = kBlock;
  const int8_t* q;
  float s;
  int64_t vector_cols, group_cols, row_bytes;
  const void* address(int64_t c) const { return q + c; }
  struct Group {};
  Group group(int64_t) const { return {}; }
  void block(int64_t c, Group, Vec* w) const {
    for (int k = 0; k < kBlock / kLanes; ++k) w[k] = widen_i8(q + c + kLanes * k);
  }
  float scale(int64_t) const { return s; }
  float scalar(int64_t c) const { return static_cast<float>(q[c]) * s; }
};

// The int4 rows widen each nibble straight to its dequantized weight,
// (q - zero) * scale as dequantize_int4 writes it, so their blocks come out
// scaled. What they share: the packed row, its group scales and zero points.
struct Int4Weights {
  static constexpr bool kScaled = false;
  const uint8_t* q;
  const float* s;
  const uint8_t* z;
  int64_t group_size;
  int64_t vector_cols, group_cols, row_bytes;
  const void* address(int64_t c) const { return q + c / 2; }
  float scalar(int64_t c) const { return int4_weight(q, s, z, c, group_size); }
};

#if defined(__AVX512F__)

// The 16 weights a nibble stands for in one group, (i - zero) * scale for
// i = 0..15: a nibble in the low 4 bits of a 32-bit lane becomes its weight
// in one vpermps (which reads only those bits of each index), where
// widening it to float and scaling it would take three instructions.
struct Int4TableRow : Int4Weights {
  struct Group {
    __m512 table;
  };
  Group group(int64_t g) const {
    const __m512i nibbles = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(nibbles, _mm512_set1_epi32(z[g]))), _mm512_set1_ps(s[g]))};
  }
};

// An int4 row in blocks of 32 columns (any group size). Byte j of a block
// holds column j (low nibble) and 16 + j: widened to 32-bit lanes, the bytes
// index the table once as they are and once shifted right by 4.
struct Int4Row : Int4TableRow {
  static constexpr bool kReordersInput = false;
  static constexpr int64_t kBlockCols = kBlock, kBlockBytes = kBlock / 2;
  void block(int64_t c, Group g, Vec* w) const {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2)));
    w[0] = _mm512_permutexvar_ps(bytes, g.table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), g.table);
  }
};

// An int4 row in blocks of 128 columns, for groups of 128 or more: the
// block's 64 bytes are loaded as 16 32-bit lanes whose 8 nibbles index the
// table after shifts by 0, 4, ..., 28, one permute per 16 weights and no
// widening (Int4Row spends one widening per 32). Lane i's nibble k is
// column col(i, k) of the block, so the input is reordered to match.
struct Int4WideRow : Int4TableRow {
  static constexpr bool kReordersInput = true;
  static constexpr int64_t kBlockCols = 4 * kBlock, kBlockBytes = kBlockCols / 2;
  void block(int64_t c, Group g, Vec* w) const {
    const __m512i lanes = _mm512_loadu_si512(q + c / 2);
    w[0] = _mm512_permutexvar_ps(lanes, g.table);
    for (int k = 1; k < 8; ++k)
      w[k] = _mm512_permutexvar_ps(_mm512_srli_epi32(lanes, static_cast<unsigned>(4 * k)), g.table);
  }
  // Nibble k of lane i is in byte 4i + k/2 of the block (low nibble for
  // even k): column j + 16 * (k % 2) of the 32-column int4 block it is in.
  static int64_t col(int64_t i, int64_t k) {
    const int64_t byte = 4 * i + k / 2;
    return byte / 16 * kBlock + byte % 16 + 16 * (k % 2);
  }
  static void reorder_input(const float* x, float* out, int64_t cols) {
    for (int64_t b = 0; b < cols; b += kBlockCols)
      for (int64_t k = 0; k < 8; ++k)
        for (int64_t i = 0; i < 16; ++i) out[b + 16 * k + i] = x[b + col(i, k)];
  }
};

#else

// An int4 row in blocks of 32 columns (any group size); byte j of a block
// holds column j (low nibble) and 16 + j.
struct Int4Row : Int4Weights {
  static constexpr bool kReordersInput = false;
  static constexpr int64_t kBlockCols = kBlock, kBlockBytes = kBlock / 2;
  struct Group {
    __m256i zero;
    __m256 scale;
  };
  Group group(int64_t g) const { return {_mm256_set1_epi32(z[g]), _mm256_set1_ps(s[g])}; }
  void block(int64_t c, Group g, Vec* w) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);                     // columns c .. c+15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // columns c+16 .. c+31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), g.zero)), g.scale);
  }
};

#endif

#else

// Without AVX2: each row dequantized once into a buffer, then one dot
// product per token in column order.
template <typename Weight>
void quantized_linear(float* out, int64_t ldo, const float* inp, const float* bias, int64_t N, int64_t C, int64_t OC,
                      Weight weight) {
#pragma omp parallel if (N * OC * C >= 64 * kMinParallelWork)
  {
    std::vector<float> w(static_cast<size_t>(C));
#pragma omp for schedule(static)
    for (int64_t o = 0; o < OC; ++o) {
      for (int64_t c = 0; c < C; ++c) w[static_cast<size_t>(c)] = weight(o, c);
      for (int64_t t = 0; t < N; ++t) {
        const float* x = inp + t * C;
        float y = 0.0f;
        for (int64_t c = 0; c < C; ++c) y += w[static_cast<size_t>(c)] * x[c];
        out[t * ldo + o] = bias != nullptr ? y + bias[o] : y;
      }
    }
  }
}

#endif

}  // namespace

void linear_forward_int8(float* out, int64_t ldo, const float* inp, const int8_t* w, const float* scale,
                         const float* bias, int64_t N, int64_t C, int64_t OC) {
#if defined(LOOM_ROW_LINEAR_SIMD)
  const int64_t vector_cols = C - C % kInt4Block;
  row_linear::linear(out, ldo, inp, bias, N, C, OC,
                     [=](int64_t o) { return Int8Row{w + o * C, scale[o], vector_cols, vector_cols, C}; });
#else
  quantized_linear(out, ldo, inp, bias, N, C, OC,
                   [=](int64_t o, int64_t c) { return static_cast<float>(w[o * C + c]) * scale[o]; });
#endif
}

void linear_forward_int4(float* out, int64_t ldo, const float* inp, const uint8_t* w, const float* scale,
                         const uint8_t* zero, const float* bias, int64_t N, int64_t C, int64_t OC, int64_t group) {
#if defined(LOOM_ROW_LINEAR_SIMD)
  const int64_t groups = C / group;
  auto weights = [=](int64_t o) {
    return Int4Weights{w + o * (C / 2), scale + o * groups, zero + o * groups, group, C, group, C / 2};
  };
#if defined(__AVX512F__)
  if (group % Int4WideRow::kBlockCols == 0) {
    row_linear::linear(out, ldo, inp, bias, N, C, OC, [=](int64_t o) { return Int4WideRow{{weights(o)}}; });
    return;
  }
  row_linear::linear(out, ldo, inp, bias, N, C, OC, [=](int64_t o) { return Int4Row{{weights(o)}}; });
#else
  row_linear::linear(out, ldo, inp, bias, N, C, OC, [=](int64_t o) { return Int4Row{weights(o)}; });
#endif
#else
  quantized_linear(out, ldo, inp, bias, N, C, OC,
                   [=](int64_t o, int64_t c) {
                     return int4_weight(w + o * (C / 2), scale + o * (C / group), zero + o * (C / group), c, group);
                   });
#endif
}

namespace {

// Row o of an int8 / int4 matrix into out[C].
void dequantize_row_int8(float* out, const int8_t* w, const float* scale, int64_t o, int64_t C) {
  for (int64_t c = 0; c < C; ++c) out[c] = static_cast<float>(w[o * C + c]) * scale[o];
}
void dequantize_row_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t o, int64_t C,
                         int64_t group) {
  for (int64_t c = 0; c < C; ++c)
    out[c] = int4_weight(w + o * (C / 2), scale + o * (C / group), zero + o * (C / group), c, group);
}

}  // namespace

void dequantize_int8(float* out, const int8_t* w, const float* scale, int64_t OC, int64_t C) {
#pragma omp parallel for schedule(static) if (OC * C >= kMinParallelWork)
  for (int64_t o = 0; o < OC; ++o) dequantize_row_int8(out + o * C, w, scale, o, C);
}

void dequantize_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t OC, int64_t C,
                     int64_t group) {
#pragma omp parallel for schedule(static) if (OC * C >= kMinParallelWork)
  for (int64_t o = 0; o < OC; ++o) dequantize_row_int4(out + o * C, w, scale, zero, o, C, group);
}

void embedding_lookup_int8(float* out, const int32_t* tokens, const int8_t* w, const float* scale, int64_t N,
                           int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) dequantize_row_int8(out + i * C, w, scale, tokens[i], C);
}

void embedding_lookup_int4(float* out, const int32_t* tokens, const uint8_t* w, const float* scale,
                           const uint8_t* zero, int64_t N, int64_t C, int64_t group) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t i = 0; i < N; ++i) dequantize_row_int4(out + i * C, w, scale, zero, tokens[i], C, group);
}

}  // namespace loom::cpu
