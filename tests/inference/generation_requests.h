// Requests the generation tests share.
#pragma once

#include <vector>

#include "loom/inference.h"
#include "test_util.h"

namespace loom::testing {

// Prompts of different lengths (one longer than the context) with different
// budgets and sampling settings.
inline std::vector<GenerationRequest> requests(const GPTConfig& cfg, bool greedy) {
  const int64_t lengths[] = {1, 9, 3, 12, 5, 20, 2}, budgets[] = {6, 20, 3, 11, 8, 5, 14};
  std::vector<GenerationRequest> out;
  for (int64_t i = 0; i < 7; ++i) {
    GenerationRequest r;
    r.prompt = random_tokens(lengths[i], cfg.vocab_size, 100 + static_cast<uint64_t>(i));
    r.max_tokens = budgets[i];
    r.sample.temperature = greedy ? 0.0f : 0.9f;
    r.sample.top_k = i % 2 ? 20 : 0;
    r.sample.top_p = i % 3 ? 1.0f : 0.9f;
    r.sample.seed = 100 + static_cast<uint64_t>(i);
    out.push_back(r);
  }
  return out;
}

}  // namespace loom::testing
