// config.json <-> HFModelConfig. The key names differ per architecture
// (GPT-2 keeps its original n_embd, n_layer, ...), so each architecture is a
// row of key names and defaults, and one parser reads them all.
#include <nlohmann/json.hpp>

#include "loom/hf.h"
#include "loom/io.h"

namespace loom {

namespace {

using Json = nlohmann::json;

struct ArchRow {
  const char* architecture;
  const char* model_type;
  HFArch arch;
};
constexpr ArchRow kArchitectures[] = {
    {"GPT2LMHeadModel", "gpt2", HFArch::gpt2},
    {"LlamaForCausalLM", "llama", HFArch::llama},
    {"MistralForCausalLM", "mistral", HFArch::llama},
};

// Key names and defaults of one architecture's config.json.
struct ArchKeys {
  const char* hidden;
  const char* layers;
  const char* heads;
  const char* positions;
  const char* intermediate;  // GPT-2's n_inner may be null: 4 * n_embd
  const char* activation;
  const char* activation_default;
  const char* eps;
  double eps_default;
  bool tied_default;
  bool biases;  // GPT-2 has biases everywhere; LLaMA reads attention_bias / mlp_bias
  bool rope;
};
constexpr ArchKeys kGpt2Keys = {"n_embd", "n_layer", "n_head", "n_positions", "n_inner", "activation_function",
                                "gelu_new", "layer_norm_epsilon", 1e-5, true, true, false};
constexpr ArchKeys kLlamaKeys = {"hidden_size", "num_hidden_layers", "num_attention_heads",
                                 "max_position_embeddings", "intermediate_size", "hidden_act",
                                 nullptr, "rms_norm_eps", 1e-6, false, false, true};
const ArchKeys& keys_of(HFArch arch) { return arch == HFArch::gpt2 ? kGpt2Keys : kLlamaKeys; }

constexpr struct {
  const char* name;
  HFActivation act;
} kActivations[] = {{"silu", HFActivation::silu}, {"gelu_new", HFActivation::gelu_tanh},
                    {"gelu_pytorch_tanh", HFActivation::gelu_tanh}};

constexpr struct {
  const char* name;
  cpu::RopeScalingType type;
} kRopeTypes[] = {{"default", cpu::RopeScalingType::none}, {"linear", cpu::RopeScalingType::linear}, {"llama3", cpu::RopeScalingType::llama3}};

constexpr struct {
  const char* name;
  DType dtype;
} kTorchDtypes[] = {{"float32", DType::f32}, {"bfloat16", DType::bf16}, {"float16", DType::f16}};

template <typename Table>
std::string names_of(const Table& table) {
  std::string out;
  for (const auto& row : table) out += (out.empty() ? "" : ", ") + std::string(row.name);
  return out;
}

// Typed access to one JSON object with errors naming the file and key.
class Reader {
 public:
  Reader(const Json& object, std::string source, std::string prefix = "")
      : j_(object), source_(std::move(source)), prefix_(std::move(prefix)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw Error(str(source_, ": key '", prefix_, key, "' ", problem));
  }
  const std::string& source() const { return source_; }
  bool has(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  int64_t count(const char* key) const {
    if (!has(key)) fail(key, "is missing: it must be a positive integer");
    const Json& v = j_[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0) fail(key, str("is ", v.dump(), ", not a positive integer"));
    return v.get<int64_t>();
  }
  int64_t count_or(const char* key, int64_t fallback) const { return has(key) ? count(key) : fallback; }
  double number_or(const char* key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_number()) fail(key, str("is ", j_[key].dump(), ", not a number"));
    return j_[key].get<double>();
  }
  double positive_number(const char* key) const {
    if (!has(key)) fail(key, "is missing: it must be a positive number");
    const double v = number_or(key, 0.0);
    if (!(v > 0)) fail(key, str("is ", j_[key].dump(), ", not a positive number"));
    return v;
  }
  bool flag_or(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_[key].is_boolean()) fail(key, str("is ", j_[key].dump(), ", not true or false"));
    return j_[key].get<bool>();
  }
  std::string text_or(const char* key, const char* fallback) const {
    if (!has(key)) {
      if (!fallback) fail(key, "is missing");
      return fallback;
    }
    if (!j_[key].is_string()) fail(key, str("is ", j_[key].dump(), ", not a string"));
    return j_[key].get<std::string>();
  }
  // `value` looked up in a table of {name, x}; unknown values name the supported ones.
  template <typename Table>
  auto pick(const char* key, const std::string& value, const Table& table) const {
    for (const auto& row : table)
      if (value == row.name) return row;
    fail(key, str("is \"", value, "\"; loom supports ", names_of(table)));
  }

 private:
  const Json& j_;
  std::string source_;
  std::string prefix_;
};

cpu::RopeScaling parse_rope(const Reader& r, const Json& scaling, const std::string& key) {
  cpu::RopeScaling out;
  if (scaling.is_null()) return out;
  if (!scaling.is_object()) r.fail(key.c_str(), str("is ", scaling.dump(), ", not an object or null"));
  const Reader rs(scaling, r.source(), key + ".");
  const char* type_key = scaling.contains("rope_type") ? "rope_type" : "type";
  const std::string type_name = rs.text_or(type_key, "default");
  const auto row = rs.pick(type_key, type_name, kRopeTypes);
  out.type = row.type;
  if (out.type == cpu::RopeScalingType::none) return out;
  out.factor = rs.positive_number("factor");
  if (out.type == cpu::RopeScalingType::llama3) {
    out.low_freq_factor = rs.positive_number("low_freq_factor");
    out.high_freq_factor = rs.positive_number("high_freq_factor");
    out.original_max_position_embeddings = rs.count("original_max_position_embeddings");
  }
  return out;
}

}  // namespace

HFModelConfig parse_hf_config(std::string_view json_text, const std::string& source) {
  Json j;
  try {
    j = Json::parse(json_text);
  } catch (const Json::exception& e) {
    throw Error(str(source, ": not valid JSON (", e.what(), ")"));
  }
  if (!j.is_object()) throw Error(str(source, ": a JSON ", j.type_name(), ", not an object"));
  const Reader r(j, source);

  HFModelConfig c;
  // The architecture decides the key names; without "architectures" (a config
  // written by hand) model_type decides.
  const bool by_class = r.has("architectures");
  const char* key = by_class ? "architectures" : "model_type";
  const char* ArchRow::*field = by_class ? &ArchRow::architecture : &ArchRow::model_type;
  std::string name;
  if (by_class) {
    const Json& a = j["architectures"];
    if (!a.is_array() || a.size() != 1 || !a[0].is_string())
      r.fail(key, str("is ", a.dump(), ", not a list of one class name"));
    name = a[0].get<std::string>();
  } else {
    name = r.text_or(key, nullptr);
  }
  const ArchRow* found = nullptr;
  std::string supported;
  for (const ArchRow& row : kArchitectures) {
    if (name == row.*field) found = &row;
    supported += (supported.empty() ? "" : ", ") + std::string(row.*field);
  }
  if (!found) r.fail(key, str("is \"", name, "\"; loom supports ", supported));
  c.architecture = found->architecture;
  c.arch = found->arch;
  c.model_type = r.text_or("model_type", found->model_type);
  const ArchKeys& k = keys_of(c.arch);

  c.vocab_size = r.count("vocab_size");
  c.hidden_size = r.count(k.hidden);
  c.num_hidden_layers = r.count(k.layers);
  c.num_attention_heads = r.count(k.heads);
  c.num_key_value_heads = r.count_or("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = r.count(k.positions);
  c.intermediate_size = c.arch == HFArch::gpt2 ? r.count_or(k.intermediate, 4 * c.hidden_size) : r.count(k.intermediate);
  c.head_dim = r.count_or("head_dim", c.hidden_size / c.num_attention_heads);
  if (!r.has("head_dim") && c.hidden_size % c.num_attention_heads != 0)
    r.fail(k.hidden, str("is ", c.hidden_size, ", not a multiple of ", k.heads, " ", c.num_attention_heads));
  if (c.arch == HFArch::gpt2 && c.head_dim * c.num_attention_heads != c.hidden_size)
    r.fail("head_dim", str("is ", c.head_dim, "; GPT-2 needs n_embd / n_head = ", c.hidden_size / c.num_attention_heads));
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.fail("num_key_value_heads", str("is ", c.num_key_value_heads, ", which does not divide ", k.heads, " ",
                                      c.num_attention_heads));

  c.hidden_act_name = r.text_or(k.activation, k.activation_default);
  c.hidden_act = r.pick(k.activation, c.hidden_act_name, kActivations).act;
  c.norm_eps = r.number_or(k.eps, k.eps_default);
  if (!(c.norm_eps > 0)) r.fail(k.eps, str("is ", j[k.eps].dump(), ", not a positive number"));
  c.tie_word_embeddings = r.flag_or("tie_word_embeddings", k.tied_default);
  c.attention_bias = k.biases || r.flag_or("attention_bias", false);
  c.mlp_bias = k.biases || r.flag_or("mlp_bias", false);

  if (k.rope) {
    // transformers 5 writes rope_parameters {rope_type, rope_theta, ...};
    // earlier versions rope_theta and rope_scaling (null when unscaled).
    const bool v5 = r.has("rope_parameters");
    const char* key = v5 ? "rope_parameters" : "rope_scaling";
    const Json& rope = v5 ? j["rope_parameters"] : (r.has("rope_scaling") ? j["rope_scaling"] : Json());
    c.rope_scaling = parse_rope(r, rope, key);
    c.rope_theta = v5 ? Reader(rope, source, "rope_parameters.").number_or("rope_theta", 10000.0)
                      : r.number_or("rope_theta", 10000.0);
    if (!(c.rope_theta > 0)) r.fail("rope_theta", "must be a positive number");
  }
  if (r.has("sliding_window"))
    r.fail("sliding_window", str("is ", j["sliding_window"].dump(), "; loom supports only full causal attention (null)"));
  if (r.flag_or("scale_attn_by_inverse_layer_idx", false))
    r.fail("scale_attn_by_inverse_layer_idx", "is true; loom supports only false");
  if (!r.flag_or("scale_attn_weights", true)) r.fail("scale_attn_weights", "is false; loom supports only true");

  const char* dtype_key = r.has("dtype") ? "dtype" : "torch_dtype";
  if (r.has(dtype_key)) c.dtype = r.pick(dtype_key, r.text_or(dtype_key, nullptr), kTorchDtypes).dtype;
  return c;
}

HFModelConfig read_hf_config(const std::filesystem::path& dir) {
  const std::filesystem::path path = dir / "config.json";
  return parse_hf_config(read_file(path), path.string());
}

std::string hf_config_json(const HFModelConfig& c) {
  const ArchKeys& k = keys_of(c.arch);
  const char* dtype = nullptr;
  for (const auto& row : kTorchDtypes)
    if (row.dtype == c.dtype) dtype = row.name;
  LOOM_CHECK(dtype, "config dtype ", dtype_name(c.dtype), " has no torch_dtype");
  nlohmann::ordered_json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j[k.hidden] = c.hidden_size;
  j[k.layers] = c.num_hidden_layers;
  j[k.heads] = c.num_attention_heads;
  j[k.positions] = c.max_position_embeddings;
  j[k.intermediate] = c.intermediate_size;
  j[k.activation] = c.hidden_act_name;
  j[k.eps] = c.norm_eps;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  if (c.arch == HFArch::gpt2) {
    LOOM_CHECK(c.head_dim * c.num_attention_heads == c.hidden_size && c.num_key_value_heads == c.num_attention_heads &&
                   c.attention_bias && c.mlp_bias && c.rope_scaling.type == cpu::RopeScalingType::none,
               "a GPT-2 config has full heads, biases and no RoPE");
    for (const char* dropout : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) j[dropout] = 0.0;
  } else {
    j["num_key_value_heads"] = c.num_key_value_heads;
    j["head_dim"] = c.head_dim;
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
    j["attention_dropout"] = 0.0;
    // The 4.x spelling: transformers 5 converts it to rope_parameters on load.
    j["rope_theta"] = c.rope_theta;
    const cpu::RopeScaling& s = c.rope_scaling;
    if (s.type == cpu::RopeScalingType::none) {
      j["rope_scaling"] = nullptr;
    } else {
      for (const auto& row : kRopeTypes)
        if (row.type == s.type) j["rope_scaling"]["rope_type"] = row.name;
      j["rope_scaling"]["factor"] = s.factor;
      if (s.type == cpu::RopeScalingType::llama3) {
        j["rope_scaling"]["low_freq_factor"] = s.low_freq_factor;
        j["rope_scaling"]["high_freq_factor"] = s.high_freq_factor;
        j["rope_scaling"]["original_max_position_embeddings"] = s.original_max_position_embeddings;
      }
    }
  }
  j["torch_dtype"] = dtype;
  return j.dump(2) + "\n";
}

}  // namespace loom
