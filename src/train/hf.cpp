// Hugging Face checkpoint directories (hf.h) as a run's weights and as the
// form loom's weights are exported in: the model config conversion both ways,
// the import into any layout's stores and the export of a whole model.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "hf/staging.h"
#include "loom/device.h"
#include "loom/io.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

namespace {
constexpr std::string_view kHFPrefix = "hf:";

// The shortest decimal that reads back as `x`, as a double: config.json then
// says 1e-05 for loom's float 1e-5f, not 9.99999974738e-06.
double shortest_decimal(float x) {
  char text[32];
  const auto end = std::to_chars(text, text + sizeof text, x).ptr;  // shortest round trip for a float
  return std::strtod(std::string(text, end).c_str(), nullptr);
}
}  // namespace

std::optional<fs::path> hf_dir_of(std::string_view spec) {
  if (!spec.starts_with(kHFPrefix)) return std::nullopt;
  const std::string_view dir = spec.substr(kHFPrefix.size());
  if (dir.empty()) throw Error(str("'", spec, "' names no directory: write hf:DIR, DIR holding config.json"));
  return fs::path(dir);
}

std::optional<fs::path> hf_tokenizer_file(const fs::path& dir) {
  for (const char* name : {"tokenizer.json", "tokenizer.model"}) {
    std::error_code ec;
    if (fs::exists(dir / name, ec)) return dir / name;
  }
  return std::nullopt;
}

GPTConfig gpt_config_from_hf(const HFModelConfig& hf, const fs::path& source) {
  try {
    return GPTConfig::from_hf(hf);
  } catch (const Error& e) {
    throw Error(str("'", (source / "config.json").string(), "': ", e.what()));
  }
}

HFModelConfig hf_config_from_gpt(const GPTConfig& m) {
  // The two Hugging Face architectures loom writes, as the variants each
  // fixes; a model that mixes them has no Hugging Face form.
  const bool gpt2 = m.norm == NormKind::layernorm && m.positions == PositionKind::learned && m.mlp == MlpKind::gelu &&
                    m.packed_qkv && m.attention_bias && m.mlp_bias;
  const bool llama = m.norm == NormKind::rmsnorm && m.positions == PositionKind::rope && m.mlp == MlpKind::swiglu &&
                     !m.packed_qkv && m.attention_bias == m.mlp_bias;
  if (!gpt2 && !llama)
    throw Error(
        "export writes GPT-2 (layernorm, learned positions, gelu MLP, packed q|k|v, biases) or LLaMA (rmsnorm, "
        "rope, swiglu, separate q, k, v) checkpoints; this model mixes their variants (model.norm, "
        "model.positions, model.mlp, model.packed_qkv, model.attention_bias, model.mlp_bias), which no Hugging "
        "Face architecture describes");
  if (gpt2 && m.q_dim() != m.n_embd)
    throw Error(str("export: GPT-2's config.json has no head_dim, so its heads are n_embd / n_head wide; this model's ",
                    m.n_head, " heads of ", m.head_dim(), " (model.head_dim) are ", m.q_dim(), " wide, not n_embd = ",
                    m.n_embd, ": use it as a loom checkpoint, or export a LLaMA-shaped model"));
  HFModelConfig c;
  c.arch = gpt2 ? HFArch::gpt2 : HFArch::llama;
  c.architecture = gpt2 ? "GPT2LMHeadModel" : "LlamaForCausalLM";
  c.model_type = gpt2 ? "gpt2" : "llama";
  c.vocab_size = m.vocab_size;
  c.hidden_size = m.n_embd;
  c.num_hidden_layers = m.n_layer;
  c.num_attention_heads = m.n_head;
  c.num_key_value_heads = m.kv_heads();
  c.head_dim = m.head_dim();
  c.intermediate_size = m.intermediate();
  c.max_position_embeddings = m.block_size;
  c.hidden_act = gpt2 ? HFActivation::gelu_tanh : HFActivation::silu;
  c.hidden_act_name = gpt2 ? "gelu_new" : "silu";
  c.norm_eps = shortest_decimal(m.norm_eps);
  c.rope_theta = m.rope_theta;
  c.rope_scaling = m.rope_scaling;
  c.attention_bias = m.attention_bias;
  c.mlp_bias = m.mlp_bias;
  c.tie_word_embeddings = m.tied_embeddings;
  return c;
}

HFImport::HFImport(const fs::path& dir)
    : hf(read_hf_config(dir)), model(gpt_config_from_hf(hf, dir)), map(hf), checkpoint(dir) {
  checkpoint.check(map);
}

void HFImport::fill(const ParamLayout& layout, FlatRange range, float* params, uint64_t seed) const {
  // Adapters make the rest of the model frozen: only a layout with frozen
  // parameters may have trainable ones the checkpoint lacks.
  const bool adapters = std::any_of(layout.params().begin(), layout.params().end(),
                                    [](const ParamSpec& p) { return !p.trainable; });
  // The rows read from the files, on the host tier: accounted like every
  // other buffer, grown to the largest span and reused.
  Tensor rows;
  for (const ParamSpec& p : layout.params()) {
    if (p.offset < range.begin || p.offset >= range.end) continue;
    float* dst = params + (p.offset - range.begin);
    const HFParam* hp = map.by_loom(p.name);
    if (!hp && adapters && p.trainable) {
      layout.initialize(dst, p.offset, p.numel(), seed);
      continue;
    }
    LOOM_CHECK(hp && hp->loom_shape == p.global_shape, "parameter '", p.name, "' ", shape_str(p.global_shape),
               " is not in the map of the model config.json describes");
    // The piece's runs of consecutive global elements, read as spans of whole
    // global rows: a piece cut along rows (c_attn's q | k | v blocks, the
    // vocabulary) reads only its own rows, one cut along columns every row.
    const int64_t row_len = shape_numel(p.global_shape) / p.global_shape[0];
    struct Run {
      int64_t local, global, n;
    };
    std::vector<Run> runs;
    for (int64_t i = 0; i < p.numel();) {
      int64_t n = 0;
      const int64_t g = p.global_index(i, &n);
      runs.push_back({i, g, n});
      i += n;
    }
    for (size_t k = 0; k < runs.size();) {
      if (runs[k].global < 0) {  // padding
        std::fill_n(dst + runs[k].local, runs[k].n, 0.0f);
        ++k;
        continue;
      }
      // Runs k..end-1 whose rows touch or continue the span [first, last].
      const int64_t first = runs[k].global / row_len;
      int64_t last = (runs[k].global + runs[k].n - 1) / row_len;
      size_t end = k + 1;
      while (end < runs.size() && runs[end].global >= 0 && runs[end].global / row_len >= first &&
             runs[end].global / row_len <= last + 1) {
        last = std::max(last, (runs[end].global + runs[end].n - 1) / row_len);
        ++end;
      }
      const int64_t span = (last + 1 - first) * row_len;
      grow_scratch(rows, span, DType::f32, Tier::host);
      checkpoint.read_param_rows(*hp, first, last + 1, rows.data<float>());
      for (; k < end; ++k)
        std::copy_n(rows.data<float>() + (runs[k].global - first * row_len), runs[k].n, dst + runs[k].local);
    }
  }
}

void load_hf_weights(const HFImport& src, Trainer& trainer) {
  const uint64_t seed = trainer.options().seed;
  trainer.load_weights([&](const ParamLayout& layout, FlatRange r, float* p) { src.fill(layout, r, p, seed); });
}

void load_hf_weights(const HFImport& src, const GPT& model, ParamStore& params) {
  Tensor flat = params.flat();
  // The files are read straight into the parameters, adapters around them
  // kept (a whole parameter at a time).
  const HostSection host;
  const ParamLayout& layout = model.layout();
  for (const ParamSpec& p : layout.params())
    if (src.map.by_loom(p.name)) src.fill(layout, {p.offset, p.offset + p.numel()}, flat.data<float>() + p.offset, 0);
}

namespace {

// The adapter factors (lora_A, lora_B) of a base weight, by PEFT's names
// relative to its module; -1 without an adapter.
std::pair<int, int> adapter_of(const ParamLayout& layout, std::string_view weight_name) {
  const std::string module(weight_name.substr(0, weight_name.rfind(".weight")));
  return {layout.find(module + ".lora_A.weight"), layout.find(module + ".lora_B.weight")};
}

}  // namespace

void export_hf(const GPT& model, const ParamStore& params, const fs::path& out_dir, const HFExportOptions& options) {
  const ParamLayout& layout = model.layout();
  const HostSection host;
  write_hf_checkpoint(
      out_dir, hf_config_from_gpt(model.config()),
      [&](const HFParam& p, float* dst) {
        const int id = layout.find(p.loom_name);
        LOOM_CHECK(id >= 0, "HF parameter '", p.hf_name, "' maps to '", p.loom_name, "', which the model lacks");
        const Tensor t = params.param(id);
        std::copy_n(t.data<float>(), t.numel(), dst);
        // A LoRA adapter is merged into its base weight: W + (alpha / r) B A.
        const auto [a, b] = adapter_of(layout, p.loom_name);
        if (a < 0 || !p.loom_name.ends_with(".weight")) return;
        const LoRAConfig& lora = model.config().lora;
        const float scale = lora.alpha / static_cast<float>(lora.r);
        const float* A = params.param(a).data<float>();
        const float* B = params.param(b).data<float>();
        const int64_t out = p.loom_shape[0], in = p.loom_shape[1], r = lora.r;
        for (int64_t o = 0; o < out; ++o)
          for (int64_t k = 0; k < r; ++k) {
            const float bk = scale * B[o * r + k];
            for (int64_t i = 0; i < in; ++i) dst[o * in + i] += bk * A[k * in + i];
          }
      },
      options);
}

void export_peft_adapter(const GPT& model, const ParamStore& params, const fs::path& out_dir) {
  const LoRAConfig& lora = model.config().lora;
  if (!lora.enabled())
    throw Error(str("export of LoRA adapters to '", out_dir.string(), "': the model has none (lora.r = 0)"));
  const ParamLayout& layout = model.layout();
  const HFModelConfig hf = hf_config_from_gpt(model.config());
  const HFParamMap map(hf);
  // Each adapter factor under its base layer's Hugging Face module path; the
  // modules themselves are PEFT's target_modules (whole paths: a leaf name
  // such as c_proj could name layers without adapters).
  std::vector<std::pair<int, std::string>> adapters;
  std::vector<SafetensorsSpec> specs;
  std::vector<std::string> modules;
  for (const HFParam& base : map.params()) {
    const auto [a, b] = adapter_of(layout, base.loom_name);
    if (a < 0 || !base.loom_name.ends_with(".weight")) continue;
    const std::string module = base.hf_name.substr(0, base.hf_name.rfind(".weight"));
    modules.push_back(module);
    for (const auto& [id, factor] : {std::pair{a, ".lora_A.weight"}, std::pair{b, ".lora_B.weight"}}) {
      adapters.emplace_back(id, "base_model.model." + module + factor);
      specs.push_back({adapters.back().second, DType::f32, layout.param(id).shape});
    }
  }
  fs::create_directories(out_dir.parent_path().empty() ? fs::path(".") : out_dir.parent_path());
  AtomicDirWriter dir(out_dir);
  {
    const HostSection host;
    SafetensorsWriter w(dir.path("adapter_model.safetensors"), specs, {{"format", "pt"}});
    for (const auto& [id, name] : adapters) w.write(name, params.param(id).raw());
    w.finish();
  }
  // GPT-2's layers are Conv1D, whose weights PEFT reads as [in, out]
  // (fan_in_fan_out); the adapters themselves are plain [r, in], [out, r].
  const bool conv1d = hf.arch == HFArch::gpt2;
  const nlohmann::json cfg = {
      {"peft_type", "LORA"},
      {"task_type", nullptr},
      {"base_model_name_or_path", nullptr},
      {"auto_mapping",
       {{"base_model_class", hf.architecture},
        {"parent_library", str("transformers.models.", hf.model_type, ".modeling_", hf.model_type)}}},
      {"r", lora.r},
      {"lora_alpha", shortest_decimal(lora.alpha)},
      {"lora_dropout", shortest_decimal(lora.dropout)},
      {"target_modules", modules},
      {"fan_in_fan_out", conv1d},
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
