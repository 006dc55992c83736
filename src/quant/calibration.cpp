// SmoothQuant's calibration: the per-column maxima of every linear layer's
// input over the calibration tokens.
#include <algorithm>
#include <cmath>

#include "loom/device.h"
#include "loom/quant.h"

namespace loom {

SmoothQuantCalibration::SmoothQuantCalibration()
    : hook_([this](std::span<const int> weights, const float* in, int64_t N, int64_t in_features) {
        // The input is read where the kernels wrote it.
        const HostSection host;
        std::vector<float> max(static_cast<size_t>(in_features), 0.0f);
        for (int64_t t = 0; t < N; ++t)
          for (int64_t j = 0; j < in_features; ++j)
            max[static_cast<size_t>(j)] = std::max(max[static_cast<size_t>(j)], std::fabs(in[t * in_features + j]));
        for (int id : weights) {
          Stats& s = stats_[id];
          s.max.resize(max.size(), 0.0f);
          for (size_t j = 0; j < max.size(); ++j) s.max[j] = std::max(s.max[j], max[j]);
          s.tokens += N;
        }
      }) {}

int64_t SmoothQuantCalibration::tokens(int id) const {
  const auto it = stats_.find(id);
  return it == stats_.end() ? 0 : it->second.tokens;
}

std::span<const float> SmoothQuantCalibration::input_max(int id) const {
  const auto it = stats_.find(id);
  LOOM_CHECK(it != stats_.end(), "SmoothQuant's calibration saw no input of parameter ", id);
  return it->second.max;
}

}  // namespace loom
