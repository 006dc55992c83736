#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "loom/inference.h"

namespace loom {

int32_t sample_token(const float* logits, int64_t V, const SampleOptions& opts, uint64_t draw) {
  if (opts.temperature <= 0.0f) return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  // Candidates by descending logit (ties by id, so the order is total).
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  int64_t keep = opts.top_k > 0 ? std::min(opts.top_k, V) : V;
  auto by_logit = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(order.begin(), order.begin() + keep, order.end(), by_logit);
  order.resize(static_cast<size_t>(keep));

  std::vector<double> p(order.size());
  const double max_logit = logits[order[0]];
  double sum = 0.0;
  for (size_t i = 0; i < order.size(); ++i) {
    p[i] = std::exp((logits[order[i]] - max_logit) / opts.temperature);
    sum += p[i];
  }
  // Nucleus: the smallest prefix whose probability reaches top_p.
  size_t n = order.size();
  if (opts.top_p < 1.0f) {
    double acc = 0.0;
    for (size_t i = 0; i < order.size(); ++i) {
      acc += p[i] / sum;
      if (acc >= opts.top_p) {
        n = i + 1;
        break;
      }
    }
    sum = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(n), 0.0);
  }
  const double u = static_cast<double>(philox_uniform(stream_key(opts.seed, "sample"), draw)) * sum;
  double acc = 0.0;
  for (size_t i = 0; i < n; ++i) {
    acc += p[i];
    if (u < acc) return order[i];
  }
  return order[n - 1];
}

}  // namespace loom
