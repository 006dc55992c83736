// Export to the Hugging Face GPT-2 layout, so loom's weights load in other
// GPT-2 implementations: same names, Conv1D weights stored [in, out].
#include <nlohmann/json.hpp>

#include "loom/io.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

void export_hf_gpt2(const GPT& model, const ParamStore& params, const fs::path& out_dir) {
  const GPTConfig& c = model.config();
  if (c.norm != NormKind::layernorm || c.positions != PositionKind::learned || c.mlp != MlpKind::gelu ||
      !c.packed_qkv || !c.attention_bias || !c.mlp_bias || !c.tied_embeddings || c.intermediate() != 4 * c.n_embd)
    throw Error("export writes GPT-2 checkpoints, and this model has LLaMA-class variants (model.norm, "
                "positions, mlp, packed_qkv, biases, tied_embeddings or intermediate_size differ from GPT-2's): "
                "export it with the Hugging Face LLaMA writer instead");
  const ParamLayout& layout = model.layout();
  // loom's Linear weights are [out, in] (nn.Linear); GPT-2's Conv1D is [in, out].
  auto transposed = [&](const ParamSpec& p) {
    return p.shape.size() == 2 && p.name.starts_with("h.") && p.name.ends_with(".weight");
  };
  std::vector<SafetensorsSpec> specs;
  for (const ParamSpec& p : layout.params())
    specs.push_back({p.name, DType::f32, transposed(p) ? Shape{p.shape[1], p.shape[0]} : p.shape});

  fs::create_directories(out_dir.parent_path().empty() ? fs::path(".") : out_dir.parent_path());
  AtomicDirWriter dir(out_dir);
  {
    SafetensorsWriter w(dir.path("model.safetensors"), specs, {{"format", "pt"}});
    for (int id = 0; id < static_cast<int>(layout.params().size()); ++id) {
      const ParamSpec& p = layout.param(id);
      const Tensor t = params.param(id).clone(Tier::host);
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

}  // namespace loom
