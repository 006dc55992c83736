// Shared by the quant suites: the source checkpoint's description and the
// greedy generations quantized models are compared by.
#pragma once

#include <filesystem>
#include <vector>

#include "loom/inference.h"
#include "loom/train.h"
#include "test_util.h"
#include "train/model_json.h"

namespace loom::quant_testing {

// What `loom quantize` reads of a training checkpoint besides the weights.
inline CheckpointInfo source_info(const std::filesystem::path& dir, const GPTConfig& cfg) {
  CheckpointInfo info;
  info.dir = dir;
  info.step = 7;
  info.fields = {{"step", 7}, {"model", model_json(cfg)}, {"tokenizer", "tokenizer.model"}};
  return info;
}

// Greedy requests whose prompts (1, 5 and 12 tokens) and 12 new tokens run
// past a 16-token context, so sequences slide.
inline std::vector<GenerationRequest> greedy_requests(int64_t vocab) {
  std::vector<GenerationRequest> reqs;
  for (int64_t len : {1, 5, 12}) {
    GenerationRequest r;
    r.prompt = testing::random_tokens(len, vocab, 10 + static_cast<uint64_t>(len));
    r.max_tokens = 12;
    r.sample.temperature = 0.0f;
    reqs.push_back(r);
  }
  return reqs;
}

}  // namespace loom::quant_testing
