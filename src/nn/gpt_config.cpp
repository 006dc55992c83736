#include <algorithm>
#include <optional>
#include <tuple>

#include "loom/config.h"
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
  int64_t per_block = 12 * C * C + 13 * C;  // ln_1, c_attn, c_proj, ln_2, c_fc, mlp c_proj
  // LoRA adds r (in + out) per adapted linear: (module, in, out).
  const std::tuple<const char*, int64_t, int64_t> linears[] = {{"h.0.attn.c_attn", C, 3 * C},
                                                                {"h.0.attn.c_proj", C, C},
                                                                {"h.0.mlp.c_fc", C, 4 * C},
                                                                {"h.0.mlp.c_proj", 4 * C, C}};
  if (lora.enabled())
    for (const auto& [module, in, out] : linears)
      if (lora.targets_module(module)) per_block += lora.r * (in + out);
  return vocab_size * C + block_size * C + n_layer * per_block + 2 * C;
}

}  // namespace loom

namespace loom {

namespace {

std::string joined(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

}  // namespace

bool LoRAConfig::targets_module(const std::string& module) const {
  return std::any_of(targets.begin(), targets.end(), [&](const std::string& t) {
    return module == t ||
           (module.size() > t.size() && module.ends_with(t) && module[module.size() - t.size() - 1] == '.');
  });
}

void LoRAConfig::validate(const std::vector<std::string>& linear_modules) const {
  if (r < 0) throw Error(str("lora.r = ", r, ": must be 0 (no adapters) or a positive rank"));
  if (r == 0) return;
  if (!(alpha > 0.0f)) throw Error(str("lora.alpha = ", alpha, ": must be positive (the scale is alpha / r)"));
  if (dropout != 0.0f)
    throw Error(str("lora.dropout = ", dropout, ": dropout on the adapters' input is not supported yet; set it to 0"));
  // The names a target may use: each linear module's last one or two
  // components ("c_proj", "mlp.c_proj").
  std::vector<std::string> valid;
  for (const std::string& m : linear_modules) {
    const size_t last = m.rfind('.');
    const size_t second = last == std::string::npos || last == 0 ? std::string::npos : m.rfind('.', last - 1);
    for (size_t at : {last, second})
      if (at != std::string::npos && std::find(valid.begin(), valid.end(), m.substr(at + 1)) == valid.end())
        valid.push_back(m.substr(at + 1));
  }
  if (targets.empty())
    throw Error(str("lora.r = ", r, " with no lora.targets: name the linear layers to adapt (", joined(valid), ")"));
  for (const std::string& t : targets) {
    LoRAConfig one;
    one.targets = {t};
    if (std::none_of(linear_modules.begin(), linear_modules.end(),
                     [&](const std::string& m) { return one.targets_module(m); })) {
      const std::optional<std::string> near = did_you_mean(t, valid);
      throw Error(str("lora.targets names \"", t, "\", which is no linear layer of this model",
                      near ? str(" (did you mean \"", *near, "\"?)") : std::string(), "; valid: ", joined(valid)));
    }
  }
}

}  // namespace loom
