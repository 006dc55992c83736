// The HF <-> loom name and layout tables (include/loom/hf.h lists them): one
// table per architecture, expanded per config, used by import and export.
#include <span>

#include "loom/hf.h"

namespace loom {

namespace {

// A dimension of a parameter, in terms of the config.
enum class Dim { none, vocab, hidden, positions, qkv, q_out, kv_out, inter };
// When a table row is a parameter.
enum class When { always, attention_bias, mlp_bias, untied, tied };

struct Row {
  const char* hf;    // "{i}" stands for the layer index
  const char* loom;  // nullptr: a tensor checkpoints may carry that is no parameter
  Dim rows, cols;    // loom's layout; cols none: a vector
  HFTransform transform = HFTransform::none;
  When when = When::always;
};

struct Table {
  const char* base_prefix;  // what a bare base model's names lack
  std::span<const Row> head, layer, tail, ignored;
};

constexpr HFTransform T = HFTransform::transpose;

constexpr Row kGpt2Head[] = {
    {"transformer.wte.weight", "wte.weight", Dim::vocab, Dim::hidden},
    {"transformer.wpe.weight", "wpe.weight", Dim::positions, Dim::hidden},
};
constexpr Row kGpt2Layer[] = {
    {"transformer.h.{i}.ln_1.weight", "h.{i}.ln_1.weight", Dim::hidden, Dim::none},
    {"transformer.h.{i}.ln_1.bias", "h.{i}.ln_1.bias", Dim::hidden, Dim::none},
    {"transformer.h.{i}.attn.c_attn.weight", "h.{i}.attn.c_attn.weight", Dim::qkv, Dim::hidden, T},
    {"transformer.h.{i}.attn.c_attn.bias", "h.{i}.attn.c_attn.bias", Dim::qkv, Dim::none},
    {"transformer.h.{i}.attn.c_proj.weight", "h.{i}.attn.c_proj.weight", Dim::hidden, Dim::hidden, T},
    {"transformer.h.{i}.attn.c_proj.bias", "h.{i}.attn.c_proj.bias", Dim::hidden, Dim::none},
    {"transformer.h.{i}.ln_2.weight", "h.{i}.ln_2.weight", Dim::hidden, Dim::none},
    {"transformer.h.{i}.ln_2.bias", "h.{i}.ln_2.bias", Dim::hidden, Dim::none},
    {"transformer.h.{i}.mlp.c_fc.weight", "h.{i}.mlp.c_fc.weight", Dim::inter, Dim::hidden, T},
    {"transformer.h.{i}.mlp.c_fc.bias", "h.{i}.mlp.c_fc.bias", Dim::inter, Dim::none},
    {"transformer.h.{i}.mlp.c_proj.weight", "h.{i}.mlp.c_proj.weight", Dim::hidden, Dim::inter, T},
    {"transformer.h.{i}.mlp.c_proj.bias", "h.{i}.mlp.c_proj.bias", Dim::hidden, Dim::none},
};
constexpr Row kGpt2Tail[] = {
    {"transformer.ln_f.weight", "ln_f.weight", Dim::hidden, Dim::none},
    {"transformer.ln_f.bias", "ln_f.bias", Dim::hidden, Dim::none},
    {"lm_head.weight", "lm_head.weight", Dim::vocab, Dim::hidden, HFTransform::none, When::untied},
};
// Causal-mask buffers that older GPT-2 checkpoints (the hub's gpt2) carry.
constexpr Row kGpt2Ignored[] = {
    {"transformer.h.{i}.attn.bias", nullptr, Dim::none, Dim::none},
    {"transformer.h.{i}.attn.masked_bias", nullptr, Dim::none, Dim::none},
    {"lm_head.weight", nullptr, Dim::none, Dim::none, HFTransform::none, When::tied},
};

constexpr Row kLlamaHead[] = {
    {"model.embed_tokens.weight", "wte.weight", Dim::vocab, Dim::hidden},
};
constexpr Row kLlamaLayer[] = {
    {"model.layers.{i}.input_layernorm.weight", "h.{i}.ln_1.weight", Dim::hidden, Dim::none},
    {"model.layers.{i}.self_attn.q_proj.weight", "h.{i}.attn.q.weight", Dim::q_out, Dim::hidden},
    {"model.layers.{i}.self_attn.q_proj.bias", "h.{i}.attn.q.bias", Dim::q_out, Dim::none, HFTransform::none,
     When::attention_bias},
    {"model.layers.{i}.self_attn.k_proj.weight", "h.{i}.attn.k.weight", Dim::kv_out, Dim::hidden},
    {"model.layers.{i}.self_attn.k_proj.bias", "h.{i}.attn.k.bias", Dim::kv_out, Dim::none, HFTransform::none,
     When::attention_bias},
    {"model.layers.{i}.self_attn.v_proj.weight", "h.{i}.attn.v.weight", Dim::kv_out, Dim::hidden},
    {"model.layers.{i}.self_attn.v_proj.bias", "h.{i}.attn.v.bias", Dim::kv_out, Dim::none, HFTransform::none,
     When::attention_bias},
    {"model.layers.{i}.self_attn.o_proj.weight", "h.{i}.attn.c_proj.weight", Dim::hidden, Dim::q_out},
    {"model.layers.{i}.self_attn.o_proj.bias", "h.{i}.attn.c_proj.bias", Dim::hidden, Dim::none, HFTransform::none,
     When::attention_bias},
    {"model.layers.{i}.post_attention_layernorm.weight", "h.{i}.ln_2.weight", Dim::hidden, Dim::none},
    {"model.layers.{i}.mlp.gate_proj.weight", "h.{i}.mlp.gate.weight", Dim::inter, Dim::hidden},
    {"model.layers.{i}.mlp.gate_proj.bias", "h.{i}.mlp.gate.bias", Dim::inter, Dim::none, HFTransform::none,
     When::mlp_bias},
    {"model.layers.{i}.mlp.up_proj.weight", "h.{i}.mlp.up.weight", Dim::inter, Dim::hidden},
    {"model.layers.{i}.mlp.up_proj.bias", "h.{i}.mlp.up.bias", Dim::inter, Dim::none, HFTransform::none,
     When::mlp_bias},
    {"model.layers.{i}.mlp.down_proj.weight", "h.{i}.mlp.c_proj.weight", Dim::hidden, Dim::inter},
    {"model.layers.{i}.mlp.down_proj.bias", "h.{i}.mlp.c_proj.bias", Dim::hidden, Dim::none, HFTransform::none,
     When::mlp_bias},
};
constexpr Row kLlamaTail[] = {
    {"model.norm.weight", "ln_f.weight", Dim::hidden, Dim::none},
    {"lm_head.weight", "lm_head.weight", Dim::vocab, Dim::hidden, HFTransform::none, When::untied},
};
// The rotary table older transformers saved as a buffer.
constexpr Row kLlamaIgnored[] = {
    {"model.layers.{i}.self_attn.rotary_emb.inv_freq", nullptr, Dim::none, Dim::none},
    {"lm_head.weight", nullptr, Dim::none, Dim::none, HFTransform::none, When::tied},
};

constexpr Table kGpt2 = {"transformer.", kGpt2Head, kGpt2Layer, kGpt2Tail, kGpt2Ignored};
constexpr Table kLlama = {"model.", kLlamaHead, kLlamaLayer, kLlamaTail, kLlamaIgnored};
const Table& table_of(HFArch arch) { return arch == HFArch::gpt2 ? kGpt2 : kLlama; }

int64_t size_of(Dim d, const HFModelConfig& c) {
  switch (d) {
    case Dim::none: break;
    case Dim::vocab: return c.vocab_size;
    case Dim::hidden: return c.hidden_size;
    case Dim::positions: return c.max_position_embeddings;
    case Dim::qkv: return 3 * c.hidden_size;
    case Dim::q_out: return c.num_attention_heads * c.head_dim;
    case Dim::kv_out: return c.num_key_value_heads * c.head_dim;
    case Dim::inter: return c.intermediate_size;
  }
  LOOM_CHECK(false, "no size for a missing dimension");
  return 0;
}

bool applies(When w, const HFModelConfig& c) {
  switch (w) {
    case When::always: return true;
    case When::attention_bias: return c.attention_bias;
    case When::mlp_bias: return c.mlp_bias;
    case When::untied: return !c.tie_word_embeddings;
    case When::tied: return c.tie_word_embeddings;
  }
  return false;
}

std::string with_layer(std::string_view pattern, int64_t layer) {
  std::string out(pattern);
  if (auto at = out.find("{i}"); at != std::string::npos) out.replace(at, 3, std::to_string(layer));
  return out;
}

// `name` matches `pattern` with "{i}" standing for a decimal layer index.
bool matches(std::string_view pattern, std::string_view name) {
  const size_t at = pattern.find("{i}");
  if (at == std::string_view::npos) return pattern == name;
  const std::string_view before = pattern.substr(0, at), after = pattern.substr(at + 3);
  if (name.size() <= before.size() + after.size() || !name.starts_with(before) || !name.ends_with(after)) return false;
  const std::string_view digits = name.substr(before.size(), name.size() - before.size() - after.size());
  return digits.find_first_not_of("0123456789") == std::string_view::npos;
}

}  // namespace

Shape HFParam::hf_shape() const {
  return transform == HFTransform::transpose ? Shape{loom_shape[1], loom_shape[0]} : loom_shape;
}

HFParamMap::HFParamMap(const HFModelConfig& c) : config_(c) {
  const Table& t = table_of(c.arch);
  auto add = [&](const Row& row, int64_t layer) {
    if (!applies(row.when, c)) return;
    HFParam p;
    p.hf_name = with_layer(row.hf, layer);
    if (p.hf_name.starts_with(t.base_prefix)) p.hf_alias = p.hf_name.substr(std::string_view(t.base_prefix).size());
    p.loom_name = with_layer(row.loom, layer);
    p.loom_shape = row.cols == Dim::none ? Shape{size_of(row.rows, c)} : Shape{size_of(row.rows, c), size_of(row.cols, c)};
    p.transform = row.transform;
    LOOM_CHECK(by_hf_.emplace(p.hf_name, params_.size()).second, "HF name ", p.hf_name, " mapped twice");
    if (!p.hf_alias.empty()) by_hf_.emplace(p.hf_alias, params_.size());
    LOOM_CHECK(by_loom_.emplace(p.loom_name, params_.size()).second, "loom name ", p.loom_name, " mapped twice");
    params_.push_back(std::move(p));
  };
  for (const Row& row : t.head) add(row, 0);
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    for (const Row& row : t.layer) add(row, i);
  for (const Row& row : t.tail) add(row, 0);
}

const HFParam* HFParamMap::by_hf(std::string_view name) const {
  auto it = by_hf_.find(name);
  return it == by_hf_.end() ? nullptr : &params_[it->second];
}

const HFParam* HFParamMap::by_loom(std::string_view name) const {
  auto it = by_loom_.find(name);
  return it == by_loom_.end() ? nullptr : &params_[it->second];
}

bool HFParamMap::ignorable(std::string_view name) const {
  const Table& t = table_of(config_.arch);
  for (const Row& row : t.ignored) {
    if (!applies(row.when, config_)) continue;
    const std::string_view pattern = row.hf;
    if (matches(pattern, name)) return true;
    if (pattern.starts_with(t.base_prefix) && matches(pattern.substr(std::string_view(t.base_prefix).size()), name))
      return true;
  }
  return false;
}

}  // namespace loom
