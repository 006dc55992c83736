#include "train/model_json.h"

#include <string>
#include <utility>
#include <vector>

namespace loom {

namespace {
// A field with two named values.
template <typename T>
void choice(const nlohmann::json& j, const char* key, T& field, std::pair<const char*, T> a,
            std::pair<const char*, T> b) {
  if (!j.contains(key)) return;
  const nlohmann::json& v = j.at(key);
  if (v == a.first)
    field = a.second;
  else if (v == b.first)
    field = b.second;
  else
    throw Error(str("model.", key, " = ", v.dump(), ": use \"", a.first, "\" or \"", b.first, "\""));
}
}  // namespace

nlohmann::json model_json(const GPTConfig& c) {
  nlohmann::json j = {{"n_layer", c.n_layer},
                      {"n_head", c.n_head},
                      {"n_embd", c.n_embd},
                      {"vocab_size", c.vocab_size},
                      {"block_size", c.block_size},
                      {"dropout", c.dropout},
                      {"norm", c.norm == NormKind::rmsnorm ? "rmsnorm" : "layernorm"},
                      {"norm_eps", c.norm_eps},
                      {"positions", c.positions == PositionKind::rope ? "rope" : "learned"},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", rope_scaling_name(c.rope_scaling.type)},
                      {"rope_scaling_factor", c.rope_scaling.factor},
                      {"rope_low_freq_factor", c.rope_scaling.low_freq_factor},
                      {"rope_high_freq_factor", c.rope_scaling.high_freq_factor},
                      {"rope_original_max_positions", c.rope_scaling.original_max_position_embeddings},
                      {"mlp", c.mlp == MlpKind::swiglu ? "swiglu" : "gelu"},
                      {"intermediate_size", c.intermediate_size},
                      {"n_kv_head", c.n_kv_head},
                      {"head_dim", c.head_size},
                      {"packed_qkv", c.packed_qkv},
                      {"attention_bias", c.attention_bias},
                      {"mlp_bias", c.mlp_bias},
                      {"tied_embeddings", c.tied_embeddings}};
  // Absent without adapters, as in checkpoints from before them.
  if (c.lora.enabled())
    j["lora"] = {{"r", c.lora.r}, {"alpha", c.lora.alpha}, {"dropout", c.lora.dropout}, {"targets", c.lora.targets}};
  return j;
}

GPTConfig model_from_json(const nlohmann::json& j, GPTConfig c) {
  auto read = [&](const char* key, auto& field) {
    if (!j.contains(key)) return;
    try {
      field = j.at(key).get<std::remove_reference_t<decltype(field)>>();
    } catch (const nlohmann::json::exception&) {
      throw Error(str("model.", key, " = ", j.at(key).dump(), " has the wrong type"));
    }
  };
  read("n_layer", c.n_layer);
  read("n_head", c.n_head);
  read("n_embd", c.n_embd);
  read("vocab_size", c.vocab_size);
  read("block_size", c.block_size);
  read("dropout", c.dropout);
  choice(j, "norm", c.norm, {"layernorm", NormKind::layernorm}, {"rmsnorm", NormKind::rmsnorm});
  read("norm_eps", c.norm_eps);
  choice(j, "positions", c.positions, {"learned", PositionKind::learned}, {"rope", PositionKind::rope});
  read("rope_theta", c.rope_theta);
  if (j.contains("rope_scaling")) {
    std::string name;
    read("rope_scaling", name);
    c.rope_scaling.type = rope_scaling_from_name(name);
  }
  read("rope_scaling_factor", c.rope_scaling.factor);
  read("rope_low_freq_factor", c.rope_scaling.low_freq_factor);
  read("rope_high_freq_factor", c.rope_scaling.high_freq_factor);
  read("rope_original_max_positions", c.rope_scaling.original_max_position_embeddings);
  choice(j, "mlp", c.mlp, {"gelu", MlpKind::gelu}, {"swiglu", MlpKind::swiglu});
  read("intermediate_size", c.intermediate_size);
  read("n_kv_head", c.n_kv_head);
  read("head_dim", c.head_size);  // absent before explicit head widths: n_embd / n_head
  read("packed_qkv", c.packed_qkv);
  read("attention_bias", c.attention_bias);
  read("mlp_bias", c.mlp_bias);
  read("tied_embeddings", c.tied_embeddings);
  if (j.contains("lora")) {
    const nlohmann::json& l = j.at("lora");
    try {
      c.lora.r = l.at("r").get<int64_t>();
      c.lora.alpha = l.at("alpha").get<float>();
      c.lora.dropout = l.at("dropout").get<float>();
      c.lora.targets = l.at("targets").get<std::vector<std::string>>();
    } catch (const nlohmann::json::exception&) {
      throw Error(str("model.lora = ", l.dump(), ": needs r, alpha, dropout and targets of the right types"));
    }
  }
  return c;
}

}  // namespace loom
