#include <algorithm>
#include <cmath>
#include <limits>

#include "loom/parallel.h"

namespace loom {

// Exact by dynamic programming over prefixes: best[q][i] is the smallest
// costliest part of the first i layers in q parts. Every part's cost is the
// same difference of prefix sums wherever it is compared, so the optimum is
// found and re-found exactly, without a tolerance.
//
// Among the partitions that reach the optimum, the parts are filled from the
// last one backwards, each taking as many layers as the optimum allows: ties
// put layers on later stages, which under 1F1B hold the activations of fewer
// micro-batches at once (stage s keeps stages - s in flight).
std::vector<int> balance_layers(std::span<const double> costs, int parts) {
  const int n = static_cast<int>(costs.size());
  LOOM_CHECK(parts >= 1, "balancing layers into ", parts, " parts");
  LOOM_CHECK(n >= parts, "balancing ", n, " layers into ", parts, " parts of at least one layer");
  std::vector<double> prefix(static_cast<size_t>(n) + 1, 0.0);
  for (int i = 0; i < n; ++i) {
    const double c = costs[static_cast<size_t>(i)];
    LOOM_CHECK(std::isfinite(c) && c >= 0.0, "layer ", i, " has cost ", c);
    prefix[static_cast<size_t>(i) + 1] = prefix[static_cast<size_t>(i)] + c;
  }
  auto cost = [&](int from, int to) { return prefix[static_cast<size_t>(to)] - prefix[static_cast<size_t>(from)]; };

  constexpr double kInfeasible = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(static_cast<size_t>(parts) + 1,
                                        std::vector<double>(static_cast<size_t>(n) + 1, kInfeasible));
  best[0][0] = 0.0;
  for (int q = 1; q <= parts; ++q)
    for (int i = q; i <= n; ++i)
      for (int k = q - 1; k < i; ++k) {
        double& b = best[static_cast<size_t>(q)][static_cast<size_t>(i)];
        b = std::min(b, std::max(best[static_cast<size_t>(q - 1)][static_cast<size_t>(k)], cost(k, i)));
      }
  const double optimum = best[static_cast<size_t>(parts)][static_cast<size_t>(n)];

  std::vector<int> bounds(static_cast<size_t>(parts) + 1);
  bounds[static_cast<size_t>(parts)] = n;
  for (int q = parts; q >= 1; --q) {
    const int end = bounds[static_cast<size_t>(q)];
    int start = q - 1;
    while (best[static_cast<size_t>(q - 1)][static_cast<size_t>(start)] > optimum || cost(start, end) > optimum)
      ++start;
    bounds[static_cast<size_t>(q - 1)] = start;
  }
  return bounds;
}

}  // namespace loom
