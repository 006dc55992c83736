#include <algorithm>
#include <optional>

#include "loom/config.h"
#include "loom/hf.h"
#include "loom/nn.h"

namespace loom {

namespace {

struct Preset {
  const char* name;
  GPTConfig config;
};

GPTConfig gpt2_shape(int64_t n_layer, int64_t n_head, int64_t n_embd, int64_t vocab_size, int64_t block_size) {
  GPTConfig c;
  c.n_layer = n_layer;
  c.n_head = n_head;
  c.n_embd = n_embd;
  c.vocab_size = vocab_size;
  c.block_size = block_size;
  return c;
}

struct LlamaShape {
  int64_t n_layer, n_head, n_kv_head, n_embd, intermediate, vocab_size, block_size;
  double rope_theta;
  bool tied;
};

GPTConfig llama_shape(const LlamaShape& s, const cpu::RopeScaling& scaling = {}) {
  GPTConfig c = gpt2_shape(s.n_layer, s.n_head, s.n_embd, s.vocab_size, s.block_size);
  c.norm = NormKind::rmsnorm;
  c.positions = PositionKind::rope;
  c.rope_theta = s.rope_theta;
  c.rope_scaling = scaling;
  c.mlp = MlpKind::swiglu;
  c.intermediate_size = s.intermediate;
  c.n_kv_head = s.n_kv_head;
  c.packed_qkv = false;
  c.attention_bias = c.mlp_bias = false;
  c.tied_embeddings = s.tied;
  return c;
}

// GPT-2 sizes as published (Radford et al. 2019) and the LLaMA shapes of
// their Hugging Face config.json files; "tiny" and "llama-tiny" are for
// tests (llama-tiny: grouped-query attention and an intermediate size that is
// not 4 * n_embd, so both are exercised).
const std::vector<Preset>& presets() {
  static const std::vector<Preset> table = [] {
    cpu::RopeScaling llama3;
    llama3.type = cpu::RopeScalingType::llama3;
    llama3.factor = 32.0;
    llama3.low_freq_factor = 1.0;
    llama3.high_freq_factor = 4.0;
    llama3.original_max_position_embeddings = 8192;
    return std::vector<Preset>{
        {"tiny", gpt2_shape(2, 4, 64, 256, 64)},
        {"gpt2", gpt2_shape(12, 12, 768, 50257, 1024)},
        {"gpt2-medium", gpt2_shape(24, 16, 1024, 50257, 1024)},
        {"gpt2-large", gpt2_shape(36, 20, 1280, 50257, 1024)},
        {"gpt2-xl", gpt2_shape(48, 25, 1600, 50257, 1024)},
        {"llama-tiny", llama_shape({2, 4, 2, 64, 160, 256, 64, 10000.0, false})},
        {"llama3.2-1b", llama_shape({16, 32, 8, 2048, 8192, 128256, 131072, 500000.0, true}, llama3)},
        {"llama2-7b", llama_shape({32, 32, 32, 4096, 11008, 32000, 4096, 10000.0, false})},
        {"llama3-8b", llama_shape({32, 32, 8, 4096, 14336, 128256, 8192, 500000.0, false})},
        {"llama2-70b", llama_shape({80, 64, 8, 8192, 28672, 32000, 4096, 10000.0, false})},
        {"llama3-70b", llama_shape({80, 64, 8, 8192, 28672, 128256, 8192, 500000.0, false})},
    };
  }();
  return table;
}

}  // namespace

namespace {
constexpr struct {
  const char* name;
  cpu::RopeScalingType type;
} kRopeScalings[] = {{"none", cpu::RopeScalingType::none},
                     {"linear", cpu::RopeScalingType::linear},
                     {"llama3", cpu::RopeScalingType::llama3}};
}  // namespace

const char* rope_scaling_name(cpu::RopeScalingType type) {
  for (const auto& r : kRopeScalings)
    if (r.type == type) return r.name;
  LOOM_CHECK(false, "RoPE scaling type ", static_cast<int>(type));
  return "";
}

cpu::RopeScalingType rope_scaling_from_name(std::string_view name) {
  for (const auto& r : kRopeScalings)
    if (name == r.name) return r.type;
  throw Error(str("unknown RoPE scaling '", name, "': use none, linear or llama3"));
}

GPTConfig GPTConfig::preset(std::string_view name) {
  for (const Preset& p : presets())
    if (name == p.name) return p.config;
  std::string names;
  for (const Preset& p : presets()) names += str(names.empty() ? "" : ", ", p.name);
  throw Error(str("unknown model preset '", name, "': use one of ", names, ", or 'custom' with explicit sizes"));
}

std::vector<std::string> GPTConfig::preset_names() {
  std::vector<std::string> names;
  for (const Preset& p : presets()) names.emplace_back(p.name);
  return names;
}

GPTConfig GPTConfig::from_hf(const HFModelConfig& hf) {
  GPTConfig c;
  c.n_layer = hf.num_hidden_layers;
  c.n_head = hf.num_attention_heads;
  c.n_embd = hf.hidden_size;
  if (hf.head_dim * hf.num_attention_heads != hf.hidden_size) c.head_size = hf.head_dim;
  c.vocab_size = hf.vocab_size;
  c.block_size = hf.max_position_embeddings;
  const bool gpt2 = hf.arch == HFArch::gpt2;
  c.norm = gpt2 ? NormKind::layernorm : NormKind::rmsnorm;
  c.norm_eps = static_cast<float>(hf.norm_eps);
  c.positions = gpt2 ? PositionKind::learned : PositionKind::rope;
  c.rope_theta = hf.rope_theta;
  c.rope_scaling = hf.rope_scaling;
  // GPT-2's MLP is fc, GELU, proj; LLaMA's is SwiGLU (silu on the gate).
  const HFActivation expected = gpt2 ? HFActivation::gelu_tanh : HFActivation::silu;
  if (hf.hidden_act != expected)
    throw Error(str("config.json: ", gpt2 ? "activation_function" : "hidden_act", " = \"", hf.hidden_act_name,
                    "\" with ", hf.architecture, ": loom runs ", hf.architecture, " with ",
                    gpt2 ? "gelu_new or gelu_pytorch_tanh" : "silu (SwiGLU)"));
  c.mlp = gpt2 ? MlpKind::gelu : MlpKind::swiglu;
  c.intermediate_size = hf.intermediate_size;
  c.n_kv_head = hf.num_key_value_heads;
  c.packed_qkv = gpt2;
  c.attention_bias = hf.attention_bias;
  c.mlp_bias = hf.mlp_bias;
  c.tied_embeddings = hf.tie_word_embeddings;
  c.validate();
  return c;
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
  if (head_size < 0)
    throw Error(str("model.head_dim = ", head_size, ": must be positive, or 0 for n_embd / n_head"));
  if (head_size == 0 && n_embd % n_head != 0) {
    int64_t lo = n_embd / n_head * n_head, hi = lo + n_head;
    throw Error(str("model.n_embd = ", n_embd, " is not divisible by model.n_head = ", n_head,
                    ": use n_embd = ", lo > 0 ? str(lo, " or ") : std::string(), hi,
                    ", change n_head, or set model.head_dim"));
  }
  if (vocab_size > INT32_MAX) throw Error(str("model.vocab_size = ", vocab_size, ": must fit in int32 token ids"));
  if (!(dropout >= 0.0f && dropout < 1.0f))
    throw Error(str("model.dropout = ", dropout, ": must be in [0, 1)"));
  if (n_kv_head < 0 || (n_kv_head > 0 && n_head % n_kv_head != 0))
    throw Error(str("model.n_kv_head = ", n_kv_head, " does not divide model.n_head = ", n_head,
                    ": use a divisor of n_head (n_head: multi-head, 1: multi-query attention), or 0 for n_head"));
  if (packed_qkv && kv_heads() != n_head)
    throw Error(str("model.n_kv_head = ", n_kv_head, " with model.packed_qkv = true: GPT-2's packed c_attn holds ",
                    "as many kv heads as query heads; set packed_qkv = false (separate q, k, v) or n_kv_head = 0"));
  if (intermediate_size < 0)
    throw Error(str("model.intermediate_size = ", intermediate_size, ": must be positive, or 0 for 4 * n_embd"));
  if (norm == NormKind::layernorm && norm_eps != 1e-5f)
    throw Error(str("model.norm_eps = ", norm_eps,
                    " with model.norm = layernorm: loom's LayerNorm uses eps 1e-5; set norm_eps = 1e-5"));
  if (norm == NormKind::rmsnorm && !(norm_eps > 0.0f))
    throw Error(str("model.norm_eps = ", norm_eps, ": RMSNorm needs a positive eps (LLaMA uses 1e-5 or 1e-6)"));
  if (positions == PositionKind::rope) {
    if (head_dim() % 2 != 0)
      throw Error(str("model.positions = rope needs an even head dimension; ",
                      head_size > 0 ? "model.head_dim" : "n_embd / n_head", " = ", head_dim(),
                      ": change n_embd, n_head or head_dim"));
    if (!(rope_theta > 0.0)) throw Error(str("model.rope_theta = ", rope_theta, ": must be positive"));
    if (rope_scaling.type != cpu::RopeScalingType::none && !(rope_scaling.factor > 0.0))
      throw Error(str("model.rope_scaling_factor = ", rope_scaling.factor, ": must be positive"));
    if (rope_scaling.type == cpu::RopeScalingType::llama3 &&
        !(rope_scaling.low_freq_factor > 0.0 && rope_scaling.high_freq_factor > rope_scaling.low_freq_factor &&
          rope_scaling.original_max_position_embeddings > 0))
      throw Error(str("model.rope_scaling = llama3 needs 0 < low_freq_factor (", rope_scaling.low_freq_factor,
                      ") < high_freq_factor (", rope_scaling.high_freq_factor,
                      ") and a positive original_max_position_embeddings (",
                      rope_scaling.original_max_position_embeddings, ")"));
  }
  validate_lora();
}

std::vector<BlockLinear> GPTConfig::block_linears() const {
  const int64_t C = n_embd, I = intermediate(), q = q_dim(), kv = kv_heads() * head_dim();
  std::vector<BlockLinear> out;
  if (packed_qkv)
    out.push_back({"attn.c_attn", "", C, 3 * q});
  else
    out.insert(out.end(), {{"attn.q", "", C, q}, {"attn.k", "", C, kv}, {"attn.v", "", C, kv}});
  // LLaMA's output projections answer to their HF names too (o_proj,
  // down_proj), which is how PEFT users name them.
  const bool hf_names = !packed_qkv;
  out.push_back({"attn.c_proj", hf_names ? "o" : "", q, C});
  if (mlp == MlpKind::swiglu)
    out.insert(out.end(), {{"mlp.gate", "", C, I}, {"mlp.up", "", C, I}});
  else
    out.push_back({"mlp.c_fc", "", C, I});
  out.push_back({"mlp.c_proj", hf_names ? "down" : "", I, C});
  return out;
}

std::array<MatrixShape, 4> GPTConfig::block_matmuls() const {
  const int64_t C = n_embd, I = intermediate(), q = q_dim(), kv = kv_heads() * head_dim();
  return {{{q + 2 * kv, C}, {C, q}, {(mlp == MlpKind::swiglu ? 2 : 1) * I, C}, {C, I}}};
}

namespace {

// Whether target `t` names block linear `l`: its name, a suffix of it after
// a dot ("c_proj" of "attn.c_proj"), or its alias.
bool names(const std::string& t, const BlockLinear& l) {
  const bool suffix = l.name.size() > t.size() && l.name.ends_with(t) && l.name[l.name.size() - t.size() - 1] == '.';
  return l.name == t || suffix || (!l.alias.empty() && l.alias == t);
}

}  // namespace

LoRAConfig GPTConfig::adapter(std::string_view name) const {
  if (!lora.enabled()) return {};
  for (const BlockLinear& l : block_linears())
    if (l.name == name)
      for (const std::string& t : lora.targets)
        if (names(t, l)) return lora;
  return {};
}

void GPTConfig::validate_lora() const {
  if (lora.r < 0) throw Error(str("lora.r = ", lora.r, ": must be 0 (no adapters) or a positive rank"));
  if (lora.r == 0) return;
  if (!(lora.alpha > 0.0f))
    throw Error(str("lora.alpha = ", lora.alpha, ": must be positive (the scale is alpha / r)"));
  if (!(lora.dropout >= 0.0f && lora.dropout < 1.0f))
    throw Error(str("lora.dropout = ", lora.dropout,
                    ": must be in [0, 1) (the probability of dropping an adapter input element; 0: none)"));
  // The names a target may use: each linear's last component, its full name
  // within the block and its alias.
  const std::vector<BlockLinear> linears = block_linears();
  std::vector<std::string> valid;
  for (const BlockLinear& l : linears)
    for (const std::string& n : {l.name.substr(l.name.rfind('.') + 1), l.name, l.alias})
      if (!n.empty() && std::find(valid.begin(), valid.end(), n) == valid.end()) valid.push_back(n);
  if (lora.targets.empty())
    throw Error(str("lora.r = ", lora.r, " with no lora.targets: name the linear layers to adapt (", joined(valid),
                    ")"));
  for (const std::string& t : lora.targets)
    if (std::none_of(linears.begin(), linears.end(), [&](const BlockLinear& l) { return names(t, l); })) {
      const std::optional<std::string> near = did_you_mean(t, valid);
      throw Error(str("lora.targets names \"", t, "\", which is no linear layer of this model",
                      near ? str(" (did you mean \"", *near, "\"?)") : std::string(), "; valid: ", joined(valid)));
    }
}

int64_t GPTConfig::num_params() const {
  const int64_t C = n_embd, I = intermediate(), q = q_dim(), kv = kv_heads() * head_dim();
  const int64_t norm_params = norm == NormKind::layernorm ? 2 * C : C;
  const int64_t attn = (q + 2 * kv) * C + q * C + (attention_bias ? q + C + 2 * kv : 0);
  const int64_t in_rows = mlp == MlpKind::swiglu ? 2 * I : I;  // gate and up, or c_fc
  const int64_t mlp_params = in_rows * C + C * I + (mlp_bias ? in_rows + C : 0);
  const int64_t per_block = 2 * norm_params + attn + mlp_params;
  return vocab_size * C * (tied_embeddings ? 1 : 2) + (positions == PositionKind::learned ? block_size * C : 0) +
         n_layer * per_block + norm_params + num_adapter_params();
}

int64_t GPTConfig::num_adapter_params() const {
  // LoRA adds r (in + out) per adapted linear of every block.
  int64_t per_block = 0;
  for (const BlockLinear& l : block_linears())
    if (adapter(l.name).enabled()) per_block += lora.r * (l.in + l.out);
  return n_layer * per_block;
}

}  // namespace loom
