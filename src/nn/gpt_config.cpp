#include "loom/nn.h"

namespace loom {

namespace {
struct Preset {
  const char* name;
  int64_t n_layer, n_head, n_embd, vocab_size, block_size;
};
// GPT-2 sizes as published (Radford et al. 2019); "tiny" is for tests.
constexpr Preset kPresets[] = {
    {"tiny", 2, 4, 64, 256, 64},
    {"gpt2", 12, 12, 768, 50257, 1024},
    {"gpt2-medium", 24, 16, 1024, 50257, 1024},
    {"gpt2-large", 36, 20, 1280, 50257, 1024},
    {"gpt2-xl", 48, 25, 1600, 50257, 1024},
};
}  // namespace

GPTConfig GPTConfig::preset(std::string_view name) {
  for (const Preset& p : kPresets) {
    if (name == p.name) {
      GPTConfig c;
      c.n_layer = p.n_layer;
      c.n_head = p.n_head;
      c.n_embd = p.n_embd;
      c.vocab_size = p.vocab_size;
      c.block_size = p.block_size;
      return c;
    }
  }
  std::string names;
  for (const Preset& p : kPresets) names += str(names.empty() ? "" : ", ", p.name);
  throw Error(str("unknown model preset '", name, "': use one of ", names, ", or 'custom' with explicit sizes"));
}

std::vector<std::string> GPTConfig::preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : kPresets) names.emplace_back(p.name);
  return names;
}

void GPTConfig::validate() const {
  auto positive = [](const char* field, int64_t v) {
    if (v <= 0) throw Error(str("model.", field, " = ", v, ": must be a positive integer"));
  };
  positive("n_layer", n_layer);
  positive("n_head", n_head);
  positive("n_embd", n_embd);
  positive("vocab_size", vocab_size);
  positive("block_size", block_size);
  if (n_embd % n_head != 0) {
    int64_t lo = n_embd / n_head * n_head, hi = lo + n_head;
    throw Error(str("model.n_embd = ", n_embd, " is not divisible by model.n_head = ", n_head,
                    ": use n_embd = ", lo > 0 ? str(lo, " or ") : std::string(), hi, ", or change n_head"));
  }
  if (vocab_size > INT32_MAX) throw Error(str("model.vocab_size = ", vocab_size, ": must fit in int32 token ids"));
  if (!(dropout >= 0.0f && dropout < 1.0f))
    throw Error(str("model.dropout = ", dropout, ": must be in [0, 1)"));
}

int64_t GPTConfig::num_params() const {
  const int64_t C = n_embd;
  const int64_t per_block = 12 * C * C + 13 * C;  // ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj
  return vocab_size * C + block_size * C + n_layer * per_block + 2 * C;
}

}  // namespace loom
