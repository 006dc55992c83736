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
  std::vector<TokenLogit> sorted(static_cast<size_t>(keep));
  for (size_t i = 0; i < sorted.size(); ++i) sorted[i] = {logits[order[i]], order[i]};
  return sample_candidates(sorted, opts, draw);
}

int32_t sample_candidates(std::span<const TokenLogit> sorted, const SampleOptions& opts, uint64_t draw) {
  if (opts.temperature <= 0.0f) return sorted.front().id;
  const size_t keep = opts.top_k > 0 ? std::min(static_cast<size_t>(opts.top_k), sorted.size()) : sorted.size();
  std::vector<double> p(keep);
  const double max_logit = sorted[0].logit;
  double sum = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    p[i] = std::exp((sorted[i].logit - max_logit) / opts.temperature);
    sum += p[i];
  }
  // Nucleus: the smallest prefix whose probability reaches top_p.
  size_t n = keep;
  if (opts.top_p < 1.0f) {
    double acc = 0.0;
    for (size_t i = 0; i < keep; ++i) {
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
    if (u < acc) return sorted[i].id;
  }
  return sorted[n - 1].id;
}

}  // namespace loom
