// Weight-only quantized linear: the weights stay int8/int4 in memory and are
// widened to fp32 in registers, a block of 32 input columns at a time, so a
// batch-1 decode reads a quarter (int8) or an eighth (int4) of fp32's bytes.
//
// Every output element is one dot product over the input columns in column
// order, into one accumulator vector (8 lanes) summed at the end, whatever
// the tiling: tiles of 4 rows x 1 token (decode: 4 independent chains, the
// input block reused for 4 weight rows) or 1 row x 8 tokens (prefill: the
// dequantized block reused for 8 tokens) change the order of the work, never
// the arithmetic of one element. So the results do not depend on N, on a
// row's neighbours or on the thread count.
#include <bit>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include "kernels/cpu/partition.h"
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

#if defined(__AVX2__) && defined(__FMA__)

// One weight row as the tile loop reads it: block(c, w) widens columns
// [c, c + 32) into w[0..3] (columns c..c+7, c+8..c+15, ...); `vector_cols`
// columns go through blocks, the rest (int8 rows not a multiple of 32 wide)
// through scalar(c).
struct Int8Row {
  const int8_t* q;
  float s;
  int64_t vector_cols;
  void block(int64_t c, __m256 w[4]) const {
    const __m256 scale = _mm256_set1_ps(s);
    for (int k = 0; k < 4; ++k) {
      const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + c + 8 * k));
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scale);
    }
  }
  float scalar(int64_t c) const { return static_cast<float>(q[c]) * s; }
};

struct Int4Row {
  const uint8_t* q;  // the row's packed bytes
  const float* s;    // the row's group scales
  const uint8_t* z;  // and zero points
  int64_t group;
  int group_shift;  // log2(group)
  int64_t vector_cols;
  void block(int64_t c, __m256 w[4]) const {
    const int64_t g = c >> group_shift;
    const __m256 scale = _mm256_set1_ps(s[g]);
    const __m256i zero = _mm256_set1_epi32(z[g]);
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c / 2));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(packed, mask);                     // columns c .. c+15
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);  // columns c+16 .. c+31
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k) {
      const __m256i v = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), zero);
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(v), scale);
    }
  }
  float scalar(int64_t c) const { return int4_weight(q, s, z, c, group); }
};

inline float hsum(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// out[t, o] for RB rows (rows[r] is output o0 + r) and TB tokens from t0.
template <int RB, int TB, typename Row>
void tile(float* out, int64_t ldo, const float* inp, int64_t C, const Row* rows, int64_t o0, const float* bias,
          int64_t t0) {
  __m256 acc[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) acc[r][t] = _mm256_setzero_ps();
  const int64_t vc = rows[0].vector_cols;
  for (int64_t c = 0; c < vc; c += kInt4Block) {
    for (int r = 0; r < RB; ++r) {
      __m256 w[4];
      rows[r].block(c, w);
      for (int t = 0; t < TB; ++t) {
        const float* x = inp + (t0 + t) * C + c;
        for (int k = 0; k < 4; ++k) acc[r][t] = _mm256_fmadd_ps(w[k], _mm256_loadu_ps(x + 8 * k), acc[r][t]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      float y = hsum(acc[r][t]);
      const float* x = inp + (t0 + t) * C;
      for (int64_t c = vc; c < C; ++c) y += rows[r].scalar(c) * x[c];
      if (bias != nullptr) y += bias[o0 + r];
      out[(t0 + t) * ldo + o0 + r] = y;
    }
}

// Output rows in tiles of kRows, in parallel (each element written by one
// thread, computed as above).
constexpr int64_t kRows = 4;
constexpr int64_t kTokens = 8;

template <typename MakeRow>
void quantized_linear(float* out, int64_t ldo, const float* inp, const float* bias, int64_t N, int64_t C, int64_t OC,
                      MakeRow make_row) {
  const int64_t tiles = (OC + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (N * OC * C >= 64 * kMinParallelWork)
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t o0 = i * kRows, nr = OC - o0 < kRows ? OC - o0 : kRows;
    using Row = decltype(make_row(int64_t{0}));
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
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t vector_cols = C - C % kInt4Block;
  quantized_linear(out, ldo, inp, bias, N, C, OC,
                   [=](int64_t o) { return Int8Row{w + o * C, scale[o], vector_cols}; });
#else
  quantized_linear(out, ldo, inp, bias, N, C, OC,
                   [=](int64_t o, int64_t c) { return static_cast<float>(w[o * C + c]) * scale[o]; });
#endif
}

void linear_forward_int4(float* out, int64_t ldo, const float* inp, const uint8_t* w, const float* scale,
                         const uint8_t* zero, const float* bias, int64_t N, int64_t C, int64_t OC, int64_t group) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t groups = C / group;
  const int shift = std::countr_zero(static_cast<uint64_t>(group));
  quantized_linear(out, ldo, inp, bias, N, C, OC, [=](int64_t o) {
    return Int4Row{w + o * (C / 2), scale + o * groups, zero + o * groups, group, shift, C};
  });
#else
  quantized_linear(out, ldo, inp, bias, N, C, OC,
                   [=](int64_t o, int64_t c) {
                     return int4_weight(w + o * (C / 2), scale + o * (C / group), zero + o * (C / group), c, group);
                   });
#endif
}

void dequantize_int8(float* out, const int8_t* w, const float* scale, int64_t OC, int64_t C) {
#pragma omp parallel for schedule(static) if (OC * C >= kMinParallelWork)
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t c = 0; c < C; ++c) out[o * C + c] = static_cast<float>(w[o * C + c]) * scale[o];
}

void dequantize_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t OC, int64_t C,
                     int64_t group) {
#pragma omp parallel for schedule(static) if (OC * C >= kMinParallelWork)
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t c = 0; c < C; ++c)
      out[o * C + c] = int4_weight(w + o * (C / 2), scale + o * (C / group), zero + o * (C / group), c, group);
}

}  // namespace loom::cpu
