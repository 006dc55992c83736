// Weight-only quantized linear: the weights stay int8/int4 in memory and are
// widened to fp32 in registers, a block of 32 input columns at a time, so a
// batch-1 decode reads a quarter (int8) or an eighth (int4) of fp32's bytes.
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

using row_linear::kBlockVecs;
using row_linear::Vec;
static_assert(row_linear::kBlock == kInt4Block);

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
  static constexpr bool kScaled = true;
  static constexpr int64_t kBlockBytes = kInt4Block;
  const int8_t* q;
  float s;
  int64_t vector_cols, group_cols, row_bytes;
  const void* address(int64_t c) const { return q + c; }
  struct Group {};
  Group group(int64_t) const { return {}; }
  void block(int64_t c, Group, Vec w[kBlockVecs]) const {
    for (int k = 0; k < kBlockVecs; ++k) w[k] = widen_i8(q + c + row_linear::kLanes * k);
  }
  float scale(int64_t) const { return s; }
  float scalar(int64_t c) const { return static_cast<float>(q[c]) * s; }
};

// One int4 weight row: a scale and a zero point per group of columns. The
// blocks come out scaled, each weight exactly its dequantized value
// (q - zero) * scale: the same numbers the fp32 kernel would read.
struct Int4Row {
  static constexpr bool kScaled = false;
  static constexpr int64_t kBlockBytes = kInt4Block / 2;
  const uint8_t* q;  // the row's packed bytes
  const float* s;    // the row's group scales
  const uint8_t* z;  // and zero points
  int64_t group_size;
  int64_t vector_cols, group_cols, row_bytes;
  const void* address(int64_t c) const { return q + c / 2; }
#if defined(__AVX512F__)
  // The 16 weights a nibble can stand for in group g: a nibble widened to
  // a 32-bit lane becomes its weight in one permute (vpermps reads the low
  // 4 bits of each index), where widening it to float and scaling it would
  // take three instructions.
  struct Group {
    __m512 table;
  };
  Group group(int64_t g) const {
    const __m512i nibbles = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i centred = _mm512_sub_epi32(nibbles, _mm512_set1_epi32(z[g]));
    return {_mm512_mul_ps(_mm512_cvtepi32_ps(centred), _mm512_set1_ps(s[g]))};
  }
  void block(int64_t c, Group g, Vec w[kBlockVecs]) const {
    // Byte j of the block holds column c + j (low nibble) and c + 16 + j.
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2)));
    w[0] = _mm512_permutexvar_ps(bytes, g.table);
    w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), g.table);
  }
#else
  struct Group {
    __m256i zero;
    __m256 scale;
  };
  Group group(int64_t g) const { return {_mm256_set1_epi32(z[g]), _mm256_set1_ps(s[g])}; }
  void block(int64_t c, Group g, Vec w[kBlockVecs]) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);                     // columns c .. c+15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // columns c+16 .. c+31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), g.zero)), g.scale);
  }
#endif
  float scale(int64_t g) const { return s[g]; }
  float scalar(int64_t c) const { return int4_weight(q, s, z, c, group_size); }
};

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
  row_linear::linear(out, ldo, inp, bias, N, C, OC, [=](int64_t o) {
    return Int4Row{w + o * (C / 2), scale + o * groups, zero + o * groups, group, C, group, C / 2};
  });
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
