#include <cmath>
#include <cstring>

#include "loom/core.h"

namespace loom {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u8: return 1;
    case DType::f64: return 8;
    case DType::i8: return 1;
  }
  LOOM_CHECK(false, "unknown dtype");
}

const char* dtype_name(DType dt) {
  switch (dt) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::u8: return "u8";
    case DType::f64: return "f64";
    case DType::i8: return "i8";
  }
  LOOM_CHECK(false, "unknown dtype");
}

DType parse_dtype(std::string_view name) {
  if (name == "f32" || name == "fp32" || name == "float32") return DType::f32;
  if (name == "bf16" || name == "bfloat16") return DType::bf16;
  if (name == "f16" || name == "fp16" || name == "float16") return DType::f16;
  throw Error(str("unknown precision '", name, "': use one of fp32, bf16, fp16"));
}

static uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

static float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint16_t f32_to_bf16(float x) {
  uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  // Adding 0x7fff plus the lowest kept bit rounds to nearest, ties to even;
  // a carry into the exponent correctly rounds up to the next binade or Inf.
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_to_f32(uint16_t x) { return float_of(static_cast<uint32_t>(x) << 16); }

uint16_t f32_to_f16(float x) {
  uint32_t u = bits_of(x);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: Inf
  if (a >= 0x38800000u) {  // normal half (>= 2^-14)
    uint32_t mant_shift = a - 0x38000000u;  // rebias exponent 127 -> 15
    uint32_t round = 0xfffu + ((mant_shift >> 13) & 1u);
    return static_cast<uint16_t>(sign | ((mant_shift + round) >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: +-0
  // Subnormal half: shift the full 24-bit significand into place, RNE.
  uint32_t exp = a >> 23;
  uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  uint32_t shift = 126u - exp;  // value / 2^-24 == mant >> (126 - exp)
  uint32_t kept = mant >> shift;
  uint32_t rem = mant & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (kept & 1u))) kept += 1;
  return static_cast<uint16_t>(sign | kept);
}

float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return float_of(sign);
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  return float_of(sign | ((exp + 112u) << 23) | (mant << 13));
}

namespace {

// One loop per (source, destination) pair: with the dtypes as template
// arguments each loop vectorizes, where a switch per element did not.
template <DType kDt>
float load_f32(const void* src, int64_t i) {
  if constexpr (kDt == DType::f32) return static_cast<const float*>(src)[i];
  if constexpr (kDt == DType::bf16) return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
  if constexpr (kDt == DType::f16) return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
}

template <DType kDt>
void store_f32(void* dst, int64_t i, float x) {
  if constexpr (kDt == DType::f32) static_cast<float*>(dst)[i] = x;
  if constexpr (kDt == DType::bf16) static_cast<uint16_t*>(dst)[i] = f32_to_bf16(x);
  if constexpr (kDt == DType::f16) static_cast<uint16_t*>(dst)[i] = f32_to_f16(x);
}

template <DType kSrc, DType kDst>
void convert_as(const void* src, void* dst, int64_t n) {
#pragma omp parallel for if (n > (1 << 16))
  for (int64_t i = 0; i < n; ++i) store_f32<kDst>(dst, i, load_f32<kSrc>(src, i));
}

// f32, bf16, f16 -> 0, 1, 2.
int float_index(DType dt, const char* what) {
  switch (dt) {
    case DType::f32: return 0;
    case DType::bf16: return 1;
    case DType::f16: return 2;
    default: LOOM_CHECK(false, what, ": not a floating dtype: ", dtype_name(dt));
  }
  return -1;
}

}  // namespace

void convert(const void* src, DType src_dt, void* dst, DType dst_dt, int64_t n) {
  if (src_dt == dst_dt) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(src_dt));
    return;
  }
  using Loop = void (*)(const void*, void*, int64_t);
  constexpr DType f32 = DType::f32, bf16 = DType::bf16, f16 = DType::f16;
  static constexpr Loop kLoops[3][3] = {
      {convert_as<f32, f32>, convert_as<f32, bf16>, convert_as<f32, f16>},
      {convert_as<bf16, f32>, convert_as<bf16, bf16>, convert_as<bf16, f16>},
      {convert_as<f16, f32>, convert_as<f16, bf16>, convert_as<f16, f16>},
  };
  kLoops[float_index(src_dt, "convert")][float_index(dst_dt, "convert")](src, dst, n);
}

void round_to(float* x, int64_t n, DType dt) {
  switch (dt) {
    case DType::f32: return;
    case DType::bf16:
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
      return;
    case DType::f16:
#pragma omp parallel for if (n > (1 << 16))
      for (int64_t i = 0; i < n; ++i) x[i] = f16_to_f32(f32_to_f16(x[i]));
      return;
    default: LOOM_CHECK(false, "round_to: not a floating dtype: ", dtype_name(dt));
  }
}

void fill(void* dst, DType dt, int64_t n, float value) {
  if (n <= 0) return;
  const size_t size = dtype_size(dt);
  convert(&value, DType::f32, dst, dt, 1);
  for (int64_t i = 1; i < n; ++i) std::memcpy(static_cast<char*>(dst) + static_cast<size_t>(i) * size, dst, size);
}

}  // namespace loom
