#include <cmath>
#include <numbers>

#include "kernels/cpu/partition.h"
#include "loom/kernels.h"

namespace loom::cpu {

void rope_inv_freq(float* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling) {
  // transformers builds these as float32 tensors with Python scalars, which
  // torch rounds to float32 before each operation; every line below is one
  // such operation, so the rounding follows theirs step by step. `a / tensor`
  // is reciprocal(tensor) * a in torch.
  const int64_t half = head_dim / 2;
  const auto f = [](double x) { return static_cast<float>(x); };
  const float base = f(theta), dim = f(static_cast<double>(head_dim));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = f(static_cast<double>(2 * i)) / dim;
    const float power = f(std::pow(static_cast<double>(base), static_cast<double>(exponent)));
    inv_freq[i] = 1.0f / power;
  }
  if (scaling.type == RopeScalingType::linear) {
    for (int64_t i = 0; i < half; ++i) inv_freq[i] /= f(scaling.factor);
  } else if (scaling.type == RopeScalingType::llama3) {
    const double old_len = static_cast<double>(scaling.original_max_position_embeddings);
    const float factor = f(scaling.factor), low = f(scaling.low_freq_factor);
    const float low_freq_wavelen = f(old_len / scaling.low_freq_factor);
    const float high_freq_wavelen = f(old_len / scaling.high_freq_factor);
    const float factor_gap = f(scaling.high_freq_factor - scaling.low_freq_factor);
    for (int64_t i = 0; i < half; ++i) {
      const float inv = inv_freq[i];
      const float wavelen = (1.0f / inv) * f(2.0 * std::numbers::pi);
      const float llama = wavelen > low_freq_wavelen ? inv / factor : inv;
      const float smooth = ((1.0f / wavelen) * f(old_len) - low) / factor_gap;
      const float smoothed = (1.0f - smooth) * llama / factor + smooth * llama;
      const bool medium = !(wavelen < high_freq_wavelen) && !(wavelen > low_freq_wavelen);
      inv_freq[i] = medium ? smoothed : llama;
    }
  }
}

void rope_tables(float* cos, float* sin, const float* inv_freq, int64_t T, int64_t half, int64_t pos0) {
#pragma omp parallel for schedule(static) if (T * half >= kMinParallelWork / 16)
  for (int64_t t = 0; t < T; ++t) {
    const float position = static_cast<float>(pos0 + t);
    for (int64_t i = 0; i < half; ++i) {
      const float angle = inv_freq[i] * position;
      cos[t * half + i] = std::cos(angle);
      sin[t * half + i] = std::sin(angle);
    }
  }
}

namespace {

// out = x rotated by +angle (sign 1) or -angle (sign -1), written or added.
void rotate(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T, int64_t n_heads,
            int64_t head_dim, int64_t stride, float sign, bool overwrite) {
  const int64_t half = head_dim / 2;
#pragma omp parallel for collapse(2) schedule(static) if (B * T * n_heads * head_dim >= kMinParallelWork)
  for (int64_t bt = 0; bt < B * T; ++bt) {
    for (int64_t h = 0; h < n_heads; ++h) {
      const float* c = cos + (bt % T) * half;
      const float* s = sin + (bt % T) * half;
      const float* x = inp + bt * stride + h * head_dim;
      float* y = out + bt * stride + h * head_dim;
      // Both halves are read before either is written, so out may be inp.
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half], sn = sign * s[i];
        const float y1 = x1 * c[i] - x2 * sn;
        const float y2 = x2 * c[i] + x1 * sn;
        y[i] = overwrite ? y1 : y[i] + y1;
        y[i + half] = overwrite ? y2 : y[i + half] + y2;
      }
    }
  }
}

}  // namespace

void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T,
                  int64_t n_heads, int64_t head_dim, int64_t stride) {
  rotate(out, inp, cos, sin, B, T, n_heads, head_dim, stride, 1.0f, true);
}

void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t B, int64_t T,
                   int64_t n_heads, int64_t head_dim, int64_t stride, GradWrite dinp_write) {
  rotate(dinp, dout, cos, sin, B, T, n_heads, head_dim, stride, -1.0f, dinp_write == GradWrite::overwrite);
}

}  // namespace loom::cpu
