// W8A8 linear: the activations quantized per token, an exact int8 x int8 ->
// int32 GEMM, and one fp32 epilogue. The two GEMMs (oneDNN's and the own
// AVX2 one) only have to agree on integers, which they do exactly, so the
// path is a matter of speed: the own kernel for few rows (decode, where
// oneDNN's per-call setup dominates), oneDNN for prefill-sized batches
// (bench/compression_bench prints both).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(LOOM_WITH_ONEDNN)
#include <oneapi/dnnl/dnnl.hpp>
#endif

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

namespace {

// Where Int8Gemm::fastest takes oneDNN: from this many rows, and for a
// product worth a parallel region (oneDNN opens one on every call; on a
// loaded machine a tiny model's many small products then wait on
// descheduled threads). Below, the own kernel's lack of setup wins
// (compression_bench's "w8a8 GEMM" lines measure both).
constexpr int64_t kOneDnnMinRows = 2;
bool onednn_pays(int64_t N, int64_t C, int64_t OC) { return N >= kOneDnnMinRows && N * C * OC >= 64 * kMinParallelWork; }

#if defined(LOOM_WITH_ONEDNN)

// oneDNN's int8 products sum exactly only with VNNI (vpdpbusd): without it
// its AVX2/AVX-512 kernels go through vpmaddubsw, whose int16 pair sums
// saturate.
bool onednn_exact() {
  static const bool exact = [] {
    const unsigned isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    constexpr unsigned avx512_vnni = dnnl_cpu_isa_avx512_core_vnni & ~dnnl_cpu_isa_avx512_core;
    constexpr unsigned avx2_vnni = dnnl_cpu_isa_avx2_vnni & ~dnnl_cpu_isa_avx2;
    return (isa & (avx512_vnni | avx2_vnni)) != 0;
  }();
  return exact;
}

// One matmul primitive per shape, created once (creation costs far more than
// a small product). Each call brings its own scratchpad, so ranks running the
// same primitive at once share no memory.
struct OneDnnMatmul {
  dnnl::matmul prim;
  size_t scratch_bytes = 0;
};

struct OneDnn {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  std::mutex mutex;
  std::map<std::tuple<int64_t, int64_t, int64_t, int64_t>, OneDnnMatmul> matmuls;
};

OneDnn& onednn() {
  static OneDnn d;
  return d;
}

// acc[N, OC] (rows lda apart) = qx[N, C] @ w[OC, C]^T.
void onednn_gemm(int32_t* acc, int64_t lda, const int8_t* qx, const int8_t* w, int64_t N, int64_t C, int64_t OC) {
  using dnnl::memory;
  OneDnn& d = onednn();
  const memory::desc src({N, C}, memory::data_type::s8, memory::dims{C, 1});
  const memory::desc wei({C, OC}, memory::data_type::s8, memory::dims{1, C});
  const memory::desc dst({N, OC}, memory::data_type::s32, memory::dims{lda, 1});
  OneDnnMatmul m;
  {
    const std::lock_guard<std::mutex> lock(d.mutex);
    const auto key = std::make_tuple(N, C, OC, lda);
    auto it = d.matmuls.find(key);
    if (it == d.matmuls.end()) {
      // Generation's prefills come in many sizes: a bounded cache.
      if (d.matmuls.size() >= 64) d.matmuls.clear();
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(src, wei, dst), attr, d.engine);
      it = d.matmuls.emplace(key, OneDnnMatmul{dnnl::matmul(pd), pd.scratchpad_desc().get_size()}).first;
    }
    m = it->second;
  }
  std::vector<uint8_t> scratch(m.scratch_bytes);
  dnnl::stream stream(d.engine);
  memory src_m(src, d.engine, const_cast<int8_t*>(qx));
  memory wei_m(wei, d.engine, const_cast<int8_t*>(w));
  memory dst_m(dst, d.engine, acc);
  memory scratch_m(memory::desc({static_cast<int64_t>(m.scratch_bytes)}, memory::data_type::u8, memory::dims{1}),
                   d.engine, scratch.data());
  m.prim.execute(stream, {{DNNL_ARG_SRC, src_m},
                          {DNNL_ARG_WEIGHTS, wei_m},
                          {DNNL_ARG_DST, dst_m},
                          {DNNL_ARG_SCRATCHPAD, scratch_m}});
  stream.wait();
}

#endif

#if defined(__AVX2__)

// 16 int8 widened to int16.
inline __m256i widen(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline int32_t hsum(__m256i v) {
  const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, _MM_SHUFFLE(2, 3, 0, 1))));
}

// acc[t, o] for RB weight rows from o0 and TB tokens from t0: int16 pairs
// multiplied and summed into int32 lanes (vpmaddwd; 127 * 127 * 2 fits).
template <int RB, int TB>
void tile(int32_t* acc, int64_t lda, const int8_t* qx, const int8_t* w, int64_t C, int64_t o0, int64_t t0) {
  __m256i s[RB][TB];
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) s[r][t] = _mm256_setzero_si256();
  const int64_t vc = C - C % 16;
  for (int64_t c = 0; c < vc; c += 16) {
    __m256i x[TB];
    for (int t = 0; t < TB; ++t) x[t] = widen(qx + (t0 + t) * C + c);
    for (int r = 0; r < RB; ++r) {
      const __m256i wv = widen(w + (o0 + r) * C + c);
      for (int t = 0; t < TB; ++t) s[r][t] = _mm256_add_epi32(s[r][t], _mm256_madd_epi16(wv, x[t]));
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int t = 0; t < TB; ++t) {
      int32_t y = hsum(s[r][t]);
      const int8_t* xr = qx + (t0 + t) * C;
      const int8_t* wr = w + (o0 + r) * C;
      for (int64_t c = vc; c < C; ++c) y += static_cast<int32_t>(xr[c]) * wr[c];
      acc[(t0 + t) * lda + o0 + r] = y;
    }
}

constexpr int64_t kRows = 4, kTokens = 4;

void own_gemm(int32_t* acc, int64_t lda, const int8_t* qx, const int8_t* w, int64_t N, int64_t C, int64_t OC) {
  const int64_t tiles = (OC + kRows - 1) / kRows;
#pragma omp parallel for schedule(static) if (N * OC * C >= 64 * kMinParallelWork)
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t o0 = i * kRows, nr = std::min(kRows, OC - o0);
    int64_t t = 0;
    if (nr == kRows) {
      for (; t + kTokens <= N; t += kTokens) tile<kRows, kTokens>(acc, lda, qx, w, C, o0, t);
      for (; t < N; ++t) tile<kRows, 1>(acc, lda, qx, w, C, o0, t);
    } else {
      for (int64_t r = 0; r < nr; ++r)
        for (t = 0; t < N; ++t) tile<1, 1>(acc, lda, qx, w, C, o0 + r, t);
    }
  }
}

#else

void own_gemm(int32_t* acc, int64_t lda, const int8_t* qx, const int8_t* w, int64_t N, int64_t C, int64_t OC) {
#pragma omp parallel for schedule(static) if (N * OC * C >= 64 * kMinParallelWork)
  for (int64_t o = 0; o < OC; ++o)
    for (int64_t t = 0; t < N; ++t) {
      int32_t y = 0;
      for (int64_t c = 0; c < C; ++c) y += static_cast<int32_t>(qx[t * C + c]) * w[o * C + c];
      acc[t * lda + o] = y;
    }
}

#endif

}  // namespace

bool onednn_int8_gemm_available() {
#if defined(LOOM_WITH_ONEDNN)
  return onednn_exact();
#else
  return false;
#endif
}

void quantize_activations_int8(int8_t* q, float* xscale, const float* inp, const float* inv_smooth, int64_t N,
                               int64_t C) {
#pragma omp parallel for schedule(static) if (N * C >= kMinParallelWork)
  for (int64_t t = 0; t < N; ++t) {
    const float* x = inp + t * C;
    auto smoothed = [&](int64_t c) { return inv_smooth != nullptr ? x[c] * inv_smooth[c] : x[c]; };
    float max = 0.0f;
    for (int64_t c = 0; c < C; ++c) max = std::max(max, std::fabs(smoothed(c)));
    const float s = max / 127.0f;
    xscale[t] = s;
    int8_t* qt = q + t * C;
    for (int64_t c = 0; c < C; ++c)
      qt[c] = s == 0.0f ? 0 : static_cast<int8_t>(std::clamp(std::nearbyint(smoothed(c) / s), -127.0f, 127.0f));
  }
}

void linear_forward_w8a8(float* out, int64_t ldo, const float* inp, const float* inv_smooth, const int8_t* w,
                         const float* scale, const float* bias, int64_t N, int64_t C, int64_t OC, Int8Gemm gemm) {
  LOOM_CHECK(C <= kW8A8MaxColumns, "w8a8: ", C, " input columns overflow the int32 sums (at most ", kW8A8MaxColumns,
             ")");
  if (N == 0) return;
  std::vector<int8_t> qx(static_cast<size_t>(N * C));
  std::vector<float> xscale(static_cast<size_t>(N));
  quantize_activations_int8(qx.data(), xscale.data(), inp, inv_smooth, N, C);
  // The int32 sums go where their outputs will be (same size, same place),
  // so no scratch of N x OC is allocated (and faulted in) per call; the
  // epilogue converts each element in place.
  auto* acc = reinterpret_cast<int32_t*>(out);
  const bool onednn = onednn_int8_gemm_available() &&
                      (gemm == Int8Gemm::onednn || (gemm == Int8Gemm::fastest && onednn_pays(N, C, OC)));
#if defined(LOOM_WITH_ONEDNN)
  if (onednn) onednn_gemm(acc, ldo, qx.data(), w, N, C, OC);
#endif
  if (!onednn) own_gemm(acc, ldo, qx.data(), w, N, C, OC);
#pragma omp parallel for schedule(static) if (N * OC >= kMinParallelWork)
  for (int64_t t = 0; t < N; ++t)
    for (int64_t o = 0; o < OC; ++o) {
      int32_t sum;
      std::memcpy(&sum, out + t * ldo + o, sizeof(sum));
      float y = static_cast<float>(sum) * xscale[static_cast<size_t>(t)] * scale[o];
      if (bias != nullptr) y += bias[o];
      out[t * ldo + o] = y;
    }
}

}  // namespace loom::cpu
