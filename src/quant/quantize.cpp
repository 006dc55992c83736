// The quantization of one matrix (host code, run once by `loom quantize`)
// and its use through the kernels of kernels.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "loom/device.h"
#include "loom/quant.h"

namespace loom {

namespace {

// round(x / s) in double, so that the quotient's own rounding does not move
// an element to the wrong step.
int64_t steps(float x, float s) { return static_cast<int64_t>(std::nearbyint(static_cast<double>(x) / s)); }

uint8_t clamp4(int64_t v) { return static_cast<uint8_t>(std::clamp<int64_t>(v, 0, 15)); }

// One int4 group's scale, zero point and values (q[i] for w[i], unpacked).
void quantize_group(const float* w, int64_t n, float& scale, uint8_t& zero, uint8_t* q) {
  const auto [lo_it, hi_it] = std::minmax_element(w, w + n);
  const float lo = *lo_it, hi = *hi_it;
  if (lo == hi) {
    // A constant group exactly: one step of |c| from the zero point, on the
    // side of c's sign (an all-zero group: scale 0).
    scale = std::fabs(lo);
    zero = lo < 0.0f ? 1 : 0;
    std::fill(q, q + n, static_cast<uint8_t>(lo > 0.0f ? 1 : 0));
    return;
  }
  // The range includes 0 so that the zero point lies in [0, 15].
  const float min = std::min(lo, 0.0f), max = std::max(hi, 0.0f);
  scale = (max - min) / 15.0f;
  zero = clamp4(steps(-min, scale));
  for (int64_t i = 0; i < n; ++i) q[i] = clamp4(steps(w[i], scale) + zero);
}

}  // namespace

const char* quant_method_name(QuantMethod m) {
  switch (m) {
    case QuantMethod::int8: return "int8";
    case QuantMethod::int4: return "int4";
    case QuantMethod::w8a8: return "w8a8";
  }
  return "?";
}

QuantMethod parse_quant_method(std::string_view name) {
  for (QuantMethod m : {QuantMethod::int8, QuantMethod::int4, QuantMethod::w8a8})
    if (name == quant_method_name(m)) return m;
  throw Error(str("quantization method '", name, "' is not known: choose int8 (per output channel), int4 "
                  "(group-wise, see --group) or w8a8 (int8 weights and activations, needs --data)"));
}

void check_smooth_alpha(double alpha) {
  if (!(alpha >= 0.0 && alpha <= 1.0))
    throw Error(str("--alpha ", alpha, " is outside [0, 1]: SmoothQuant's migration strength (0.5 by default; "
                    "higher moves more of the activations' outliers into the weights)"));
}

void check_quant_group(int64_t group) {
  if (group != 32 && group != 64 && group != 128)
    throw Error(str("int4 group ", group, " is not supported: choose 32, 64 or 128 input columns per scale"));
}

size_t QuantizedWeight::nbytes() const {
  return values.nbytes() + scales.nbytes() + (zeros.defined() ? zeros.nbytes() : 0) +
         (smooth.defined() ? smooth.nbytes() : 0);
}

void check_quantize_options(const QuantizeOptions& options, bool calibrated) {
  if (options.method == QuantMethod::int4) check_quant_group(options.group);
  if (options.method == QuantMethod::w8a8) {
    check_smooth_alpha(options.alpha);
    if (!calibrated)
      throw Error("--method w8a8 smooths each layer by its inputs' ranges (SmoothQuant): give calibration data "
                  "with --data SHARD");
  }
}

QuantizedWeight quantize_int8(const float* w, int64_t rows, int64_t cols, Tier tier) {
  QuantizedWeight q;
  q.method = QuantMethod::int8;
  q.rows = rows;
  q.cols = q.group = cols;
  q.values = Tensor::empty({rows, cols}, DType::i8, tier);
  q.scales = Tensor::empty({rows, 1}, DType::f32, tier);
  const HostSection host;
  int8_t* values = q.values.data<int8_t>();
  float* scales = q.scales.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = w + r * cols;
    float max = 0.0f;
    for (int64_t c = 0; c < cols; ++c) max = std::max(max, std::fabs(row[c]));
    const float s = max / 127.0f;
    scales[r] = s;
    for (int64_t c = 0; c < cols; ++c)
      values[r * cols + c] = s == 0.0f ? 0 : static_cast<int8_t>(std::clamp<int64_t>(steps(row[c], s), -127, 127));
  }
  return q;
}

QuantizedWeight quantize_int4(const float* w, int64_t rows, int64_t cols, int64_t group, Tier tier) {
  check_quant_group(group);
  LOOM_CHECK(cols % group == 0, "int4: ", cols, " columns are not a multiple of the group ", group);
  QuantizedWeight q;
  q.method = QuantMethod::int4;
  q.rows = rows;
  q.cols = cols;
  q.group = group;
  const int64_t groups = cols / group;
  q.values = Tensor::empty({rows, cols / 2}, DType::u8, tier);
  q.scales = Tensor::empty({rows, groups}, DType::f32, tier);
  q.zeros = Tensor::empty({rows, groups}, DType::u8, tier);
  const HostSection host;
  uint8_t* packed = q.values.data<uint8_t>();
  std::vector<uint8_t> unpacked(static_cast<size_t>(group));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t first = g * group;
      quantize_group(w + r * cols + first, group, q.scales.data<float>()[r * groups + g],
                     q.zeros.data<uint8_t>()[r * groups + g], unpacked.data());
      // kernels.h's packing: per block of 32 columns, column j beside j + 16.
      for (int64_t b = 0; b < group; b += cpu::kInt4Block)
        for (int64_t j = 0; j < cpu::kInt4Block / 2; ++j)
          packed[r * (cols / 2) + (first + b) / 2 + j] =
              static_cast<uint8_t>(unpacked[static_cast<size_t>(b + j)] |
                                   (unpacked[static_cast<size_t>(b + j + cpu::kInt4Block / 2)] << 4));
    }
  return q;
}

std::vector<float> smoothing_factors(std::span<const float> input_max, const float* w, int64_t rows, int64_t cols,
                                     double alpha) {
  LOOM_CHECK(static_cast<int64_t>(input_max.size()) == cols, "smoothing: ", input_max.size(),
             " input maxima for ", cols, " columns");
  std::vector<float> wmax(static_cast<size_t>(cols), 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      wmax[static_cast<size_t>(c)] = std::max(wmax[static_cast<size_t>(c)], std::fabs(w[r * cols + c]));
  std::vector<float> s(static_cast<size_t>(cols));
  for (size_t c = 0; c < s.size(); ++c) {
    const double a = input_max[c], m = wmax[c];
    s[c] = a > 0.0 && m > 0.0 ? static_cast<float>(std::pow(a, alpha) / std::pow(m, 1.0 - alpha)) : 1.0f;
  }
  return s;
}

QuantizedWeight quantize_w8a8(const float* w, int64_t rows, int64_t cols, std::span<const float> input_max,
                              double alpha, Tier tier) {
  check_smooth_alpha(alpha);
  const std::vector<float> s = smoothing_factors(input_max, w, rows, cols, alpha);
  std::vector<float> smoothed(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      smoothed[static_cast<size_t>(r * cols + c)] = w[r * cols + c] * s[static_cast<size_t>(c)];
  QuantizedWeight q = quantize_int8(smoothed.data(), rows, cols, tier);
  q.method = QuantMethod::w8a8;
  q.smooth = Tensor::empty({cols}, DType::f32, tier);
  const HostSection host;
  float* inv = q.smooth.data<float>();
  for (int64_t c = 0; c < cols; ++c) inv[c] = 1.0f / s[static_cast<size_t>(c)];
  return q;
}

Tensor dequantize(const QuantizedWeight& w) {
  Tensor out = Tensor::empty({w.rows, w.cols}, DType::f32, w.values.tier());
  if (w.method == QuantMethod::int4) {
    ops::dequantize_int4(out.data<float>(), w.values.data<uint8_t>(), w.scales.data<float>(),
                         w.zeros.data<uint8_t>(), w.rows, w.cols, w.group);
    return out;
  }
  ops::dequantize_int8(out.data<float>(), w.values.data<int8_t>(), w.scales.data<float>(), w.rows, w.cols);
  if (w.method == QuantMethod::w8a8) {
    // Once, where a weight is read as fp32 (export, tests): on the host.
    const HostSection host;
    float* o = out.data<float>();
    const float* inv = w.smooth.data<float>();
    for (int64_t r = 0; r < w.rows; ++r)
      for (int64_t c = 0; c < w.cols; ++c) o[r * w.cols + c] *= inv[c];
  }
  return out;
}

void quantized_embedding_lookup(float* out, const int32_t* tokens, const QuantizedWeight& w, int64_t N) {
  // quantize_params gives the output table a weight-only method.
  LOOM_CHECK(w.method != QuantMethod::w8a8, "a W8A8 token table");
  if (w.method == QuantMethod::int8)
    ops::embedding_lookup_int8(out, tokens, w.values.data<int8_t>(), w.scales.data<float>(), N, w.cols);
  else
    ops::embedding_lookup_int4(out, tokens, w.values.data<uint8_t>(), w.scales.data<float>(),
                               w.zeros.data<uint8_t>(), N, w.cols, w.group);
}

void quantized_linear_forward(float* out, int64_t ldo, const float* in, const QuantizedWeight& w, int64_t first_row,
                              int64_t rows, const float* bias, int64_t N) {
  LOOM_CHECK(first_row >= 0 && first_row + rows <= w.rows, "rows [", first_row, ", ", first_row + rows, ") of a ",
             w.rows, "-row quantized weight");
  const int64_t groups = w.groups();
  const float* scales = w.scales.data<float>() + first_row * groups;
  if (w.method == QuantMethod::int8)
    ops::linear_forward_int8(out, ldo, in, w.values.data<int8_t>() + first_row * w.cols, scales, bias, N, w.cols,
                             rows);
  else if (w.method == QuantMethod::w8a8)
    ops::linear_forward_w8a8(out, ldo, in, w.smooth.data<float>(), w.values.data<int8_t>() + first_row * w.cols,
                             scales, bias, N, w.cols, rows);
  else
    ops::linear_forward_int4(out, ldo, in, w.values.data<uint8_t>() + first_row * (w.cols / 2), scales,
                             w.zeros.data<uint8_t>() + first_row * groups, bias, N, w.cols, rows, w.group);
}

}  // namespace loom
