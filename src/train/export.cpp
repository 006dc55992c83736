// Export to the Hugging Face GPT-2 layout, so loom's weights load in other
// GPT-2 implementations: same names, Conv1D weights stored [in, out].
#include <nlohmann/json.hpp>

#include "loom/hf.h"
#include "loom/io.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

void export_hf_gpt2(const GPT& model, const ParamStore& params, const fs::path& out_dir) {
  const GPTConfig& c = model.config();
  const ParamLayout& layout = model.layout();
  // loom's Linear weights are [out, in] (nn.Linear); GPT-2's Conv1D is [in, out].
  auto transposed = [&](const ParamSpec& p) {
    return p.shape.size() == 2 && p.name.starts_with("h.") && p.name.ends_with(".weight");
  };
  // LoRA adapters are merged into their base weights (W + (alpha / r) B A)
  // rather than written: the export is a plain GPT-2.
  const LoRAConfig& lora = c.lora;
  const auto is_adapter = [](const ParamSpec& p) { return p.name.find(".lora_") != std::string::npos; };
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params())
    if (!is_adapter(p)) specs.push_back({p.name, DType::f32, transposed(p) ? Shape{p.shape[1], p.shape[0]} : p.shape});

  fs::create_directories(out_dir.parent_path().empty() ? fs::path(".") : out_dir.parent_path());
  AtomicDirWriter dir(out_dir);
  {
    SafetensorsWriter w(dir.path("model.safetensors"), specs, {{"format", "pt"}});
    for (int id = 0; id < static_cast<int>(layout.params().size()); ++id) {
      const ParamSpec& p = layout.param(id);
      if (is_adapter(p)) continue;
      const Tensor t = params.param(id).clone(Tier::host);
      const std::string module = p.name.substr(0, p.name.rfind('.'));
      if (const int a = layout.find(module + ".lora_A.weight"); a >= 0 && p.name.ends_with(".weight")) {
        const Tensor A = params.param(a).clone(Tier::host);
        const Tensor B = params.param(layout.find(module + ".lora_B.weight")).clone(Tier::host);
        const int64_t out = p.shape[0], in = p.shape[1];
        const float s = lora.alpha / static_cast<float>(lora.r);
        float* w = t.data<float>();  // a host copy
        for (int64_t o = 0; o < out; ++o)
          for (int64_t k = 0; k < lora.r; ++k) {
            const float b = s * B.data<float>()[o * lora.r + k];
            for (int64_t i = 0; i < in; ++i) w[o * in + i] += b * A.data<float>()[k * in + i];
          }
      }
      if (!transposed(p)) {
        w.write(p.name, t.raw());
        continue;
      }
      const int64_t rows = p.shape[0], cols = p.shape[1];
      std::vector<float> tr(static_cast<size_t>(p.numel()));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t k = 0; k < cols; ++k) tr[static_cast<size_t>(k * rows + r)] = t.data<float>()[r * cols + k];
      w.write(p.name, tr.data());
    }
    w.finish();
  }
  nlohmann::json cfg = {{"model_type", "gpt2"},
                        {"architectures", {"GPT2LMHeadModel"}},
                        {"n_layer", c.n_layer},
                        {"n_head", c.n_head},
                        {"n_embd", c.n_embd},
                        {"vocab_size", c.vocab_size},
                        {"n_positions", c.block_size},
                        {"n_ctx", c.block_size},
                        {"n_inner", nullptr},
                        {"activation_function", "gelu_new"},
                        {"layer_norm_epsilon", 1e-5},
                        {"tie_word_embeddings", true},
                        {"resid_pdrop", c.dropout},
                        {"embd_pdrop", c.dropout},
                        {"attn_pdrop", 0.0}};
  dir.write_file("config.json", cfg.dump(2) + "\n");
  dir.commit();
}

namespace {

// The Hugging Face description of a GPT-2 shaped GPTConfig.
HFModelConfig hf_gpt2_config(const GPTConfig& c) {
  HFModelConfig hf;
  hf.arch = HFArch::gpt2;
  hf.architecture = "GPT2LMHeadModel";
  hf.model_type = "gpt2";
  hf.vocab_size = c.vocab_size;
  hf.hidden_size = c.n_embd;
  hf.num_hidden_layers = c.n_layer;
  hf.num_attention_heads = c.n_head;
  hf.num_key_value_heads = c.n_head;
  hf.head_dim = c.n_embd / c.n_head;
  hf.intermediate_size = 4 * c.n_embd;
  hf.max_position_embeddings = c.block_size;
  hf.hidden_act = HFActivation::gelu_tanh;
  hf.hidden_act_name = "gelu_new";
  hf.norm_eps = 1e-5;
  hf.attention_bias = hf.mlp_bias = true;
  hf.tie_word_embeddings = true;
  return hf;
}

}  // namespace

void export_peft_adapter(const GPT& model, const ParamStore& params, const fs::path& out_dir) {
  const LoRAConfig& lora = model.config().lora;
  if (!lora.enabled())
    throw Error(str("export of LoRA adapters to '", out_dir.string(), "': the model has none (lora.r = 0)"));
  const ParamLayout& layout = model.layout();
  const HFParamMap map(hf_gpt2_config(model.config()));
  // Each adapter factor under its base layer's Hugging Face module path.
  std::vector<std::pair<int, std::string>> adapters;
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params()) {
    for (const char* factor : {".lora_A.weight", ".lora_B.weight"}) {
      if (!p.name.ends_with(factor)) continue;
      const std::string module = p.name.substr(0, p.name.size() - std::string_view(factor).size());
      const HFParam* base = map.by_loom(module + ".weight");
      LOOM_CHECK(base != nullptr, "no Hugging Face name for ", module, ".weight");
      const std::string hf_module = base->hf_name.substr(0, base->hf_name.size() - std::string_view(".weight").size());
      adapters.emplace_back(layout.find(p.name), "base_model.model." + hf_module + factor);
      specs.push_back({adapters.back().second, DType::f32, p.shape});
    }
  }
  fs::create_directories(out_dir.parent_path().empty() ? fs::path(".") : out_dir.parent_path());
  AtomicDirWriter dir(out_dir);
  {
    SafetensorsWriter w(dir.path("adapter_model.safetensors"), specs, {{"format", "pt"}});
    for (const auto& [id, name] : adapters) w.write(name, params.param(id).clone(Tier::host).raw());
    w.finish();
  }
  // GPT-2's layers are Conv1D, whose weights PEFT reads as [in, out]
  // (fan_in_fan_out); the adapters themselves are plain [r, in], [out, r].
  const nlohmann::json cfg = {{"peft_type", "LORA"},
                              {"task_type", nullptr},
                              {"base_model_name_or_path", nullptr},
                              {"auto_mapping", {{"base_model_class", "GPT2LMHeadModel"},
                                                {"parent_library", "transformers.models.gpt2.modeling_gpt2"}}},
                              {"r", lora.r},
                              {"lora_alpha", lora.alpha},
                              {"lora_dropout", lora.dropout},
                              {"target_modules", lora.targets},
                              {"fan_in_fan_out", true},
                              {"bias", "none"},
                              {"inference_mode", true},
                              {"init_lora_weights", true},
                              {"use_rslora", false},
                              {"use_dora", false},
                              {"modules_to_save", nullptr},
                              {"rank_pattern", nlohmann::json::object()},
                              {"alpha_pattern", nlohmann::json::object()}};
  dir.write_file("adapter_config.json", cfg.dump(2) + "\n");
  dir.commit();
}

}  // namespace loom
