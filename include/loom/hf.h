// loom hf: Hugging Face checkpoint directories in and out. config.json is
// parsed into a plain HFModelConfig (GPT-2 and the LLaMA family); a checkpoint
// directory (model.safetensors, or model.safetensors.index.json and its shards)
// is validated and read one tensor, or one row range, at a time as f32; one
// table per architecture maps HF names and layouts to loom's global parameter
// names, for import and export alike; and a writer publishes a directory
// atomically, sharded above a size threshold, in f32, bf16 or f16.
//
// Built on io.h's SafetensorsReader/Writer and AtomicDirWriter: every file is
// checked by the reader (header, offsets, sizes); this layer checks what spans
// files (the index, which tensors exist, their shapes against config.json).
//
// Parameter names (loom's global names; shapes in loom's layout, Linear weights
// [out, in]; C = hidden_size, hd = head_dim, nh / nkv = attention / key-value
// heads, I = intermediate_size, V = vocab_size, P = max_position_embeddings):
//
//   GPT-2 (GPT2LMHeadModel)            | loom                   | loom shape
//   transformer.wte.weight             | wte.weight             | [V, C]
//   transformer.wpe.weight             | wpe.weight             | [P, C]
//   transformer.h.{i}.ln_1.weight/bias | h.{i}.ln_1.weight/bias | [C]
//   transformer.h.{i}.attn.c_attn.*    | h.{i}.attn.c_attn.*    | [3C, C] (T) / [3C]
//   transformer.h.{i}.attn.c_proj.*    | h.{i}.attn.c_proj.*    | [C, C] (T) / [C]
//   transformer.h.{i}.ln_2.weight/bias | h.{i}.ln_2.weight/bias | [C]
//   transformer.h.{i}.mlp.c_fc.*       | h.{i}.mlp.c_fc.*       | [I, C] (T) / [I]
//   transformer.h.{i}.mlp.c_proj.*     | h.{i}.mlp.c_proj.*     | [C, I] (T) / [C]
//   transformer.ln_f.weight/bias       | ln_f.weight/bias       | [C]
//   (T): HF's Conv1D stores the weight [in, out], transposed on the way in and out.
//
//   LLaMA / Mistral (LlamaForCausalLM)           | loom                     | loom shape
//   model.embed_tokens.weight                    | wte.weight               | [V, C]
//   model.layers.{i}.input_layernorm.weight      | h.{i}.ln_1.weight        | [C]
//   model.layers.{i}.self_attn.q_proj.weight     | h.{i}.attn.q.weight      | [nh*hd, C]
//   model.layers.{i}.self_attn.k_proj.weight     | h.{i}.attn.k.weight      | [nkv*hd, C]
//   model.layers.{i}.self_attn.v_proj.weight     | h.{i}.attn.v.weight      | [nkv*hd, C]
//   model.layers.{i}.self_attn.o_proj.weight     | h.{i}.attn.c_proj.weight | [C, nh*hd]
//   model.layers.{i}.post_attention_layernorm.weight | h.{i}.ln_2.weight    | [C]
//   model.layers.{i}.mlp.gate_proj.weight        | h.{i}.mlp.gate.weight    | [I, C]
//   model.layers.{i}.mlp.up_proj.weight          | h.{i}.mlp.up.weight      | [I, C]
//   model.layers.{i}.mlp.down_proj.weight        | h.{i}.mlp.c_proj.weight  | [C, I]
//   model.norm.weight                            | ln_f.weight              | [C]
//   lm_head.weight (untied only)                 | lm_head.weight           | [V, C]
//   With attention_bias, q/k/v/o_proj.bias map to h.{i}.attn.{q,k,v,c_proj}.bias;
//   with mlp_bias, gate/up/down_proj.bias to h.{i}.mlp.{gate,up,c_proj}.bias.
//   No transposes, and no permutation of q_proj/k_proj rows: HF's LLaMA
//   checkpoints are already in the order of rotate-half RoPE (within each head,
//   dimension j pairs with j + hd/2; Meta's interleaved pairs were permuted by
//   the conversion script), so loom's LLaMA must apply rotate-half RoPE to the
//   rows as stored. A checkpoint of the bare base model (GPT2Model, LlamaModel)
//   names tensors without "transformer." / "model."; both spellings are read.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom {

class SafetensorsReader;

// ---------------------------------------------------------------------------
// config.json
// ---------------------------------------------------------------------------

enum class HFArch { gpt2, llama };
enum class HFActivation { gelu_tanh, silu };  // gelu_new / gelu_pytorch_tanh, silu
struct HFModelConfig {
  HFArch arch = HFArch::llama;
  std::string architecture = "LlamaForCausalLM";  // or GPT2LMHeadModel, MistralForCausalLM
  std::string model_type = "llama";               // or gpt2, mistral
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;              // GPT-2: n_embd
  int64_t num_hidden_layers = 0;        // n_layer
  int64_t num_attention_heads = 0;      // n_head
  int64_t num_key_value_heads = 0;      // num_attention_heads unless grouped-query attention
  int64_t head_dim = 0;                 // hidden_size / num_attention_heads unless given
  int64_t intermediate_size = 0;        // GPT-2: n_inner, or 4 * n_embd when null
  int64_t max_position_embeddings = 0;  // n_positions
  HFActivation hidden_act = HFActivation::silu;  // activation_function
  std::string hidden_act_name = "silu";          // as written, so export writes it back
  double norm_eps = 1e-6;                        // rms_norm_eps / layer_norm_epsilon
  double rope_theta = 10000.0;                   // LLaMA only
  cpu::RopeScaling rope_scaling;  // rope_scaling (rope_parameters in transformers 5)
  bool attention_bias = false;  // GPT-2: true
  bool mlp_bias = false;        // GPT-2: true
  bool tie_word_embeddings = false;
  DType dtype = DType::f32;  // torch_dtype (dtype in transformers 5)
  bool operator==(const HFModelConfig&) const = default;
};

// Parses config.json text. Anything loom cannot run faithfully (another
// architecture, rope type dynamic/yarn, another activation, a sliding window,
// GPT-2's layer-index attention scaling, ...) is an Error naming `source`, the
// key, its value and what is supported; so is malformed JSON.
HFModelConfig parse_hf_config(std::string_view json_text, const std::string& source = "config.json");
// dir/config.json.
HFModelConfig read_hf_config(const std::filesystem::path& dir);
// config.json text that transformers (4.x and 5.x) loads as the same model.
std::string hf_config_json(const HFModelConfig& config);

// ---------------------------------------------------------------------------
// Names and layouts
// ---------------------------------------------------------------------------

enum class HFTransform { none, transpose };  // transpose: HF stores [in, out] (Conv1D)

struct HFParam {
  std::string hf_name;    // as GPT2LMHeadModel / LlamaForCausalLM save it
  std::string hf_alias;   // the bare base model's name (prefix dropped); empty if the same
  std::string loom_name;  // loom's global parameter name
  Shape loom_shape;       // loom's layout
  HFTransform transform = HFTransform::none;
  Shape hf_shape() const;
};

// The expansion of an architecture's table (the header comment) for one
// config, in loom's order: embeddings, each layer, final norm, head.
class HFParamMap {
 public:
  explicit HFParamMap(const HFModelConfig& config);
  const std::vector<HFParam>& params() const { return params_; }
  // nullptr when `name` is not a parameter; hf_alias spellings are found too.
  const HFParam* by_hf(std::string_view name) const;
  const HFParam* by_loom(std::string_view name) const;
  // A tensor checkpoints may carry that is not a parameter: GPT-2's causal-mask
  // buffers, LLaMA's rotary inv_freq, an lm_head.weight tied to the embedding.
  bool ignorable(std::string_view hf_name) const;

 private:
  HFModelConfig config_;
  std::vector<HFParam> params_;
  std::map<std::string, size_t, std::less<>> by_hf_, by_loom_;
};

// ---------------------------------------------------------------------------
// Reading a checkpoint directory
// ---------------------------------------------------------------------------

struct HFTensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
  std::filesystem::path file;
};

// Opens dir/<stem>.safetensors, or dir/<stem>.safetensors.index.json and its
// shards ("adapter_model" reads a PEFT adapter). The index must name existing
// shards, each tensor once, and match their contents exactly (a tensor listed
// under another shard, or in a shard but not the index, is an Error naming both
// files). A directory of pytorch_model.bin pickles is an Error saying how to
// convert it. Only headers are read here; tensors are read on demand (pread,
// thread-safe) and converted to f32 from f32, bf16 or f16.
class HFCheckpoint {
 public:
  explicit HFCheckpoint(std::filesystem::path dir, std::string_view stem = "model");
  ~HFCheckpoint();
  HFCheckpoint(const HFCheckpoint&) = delete;
  HFCheckpoint& operator=(const HFCheckpoint&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  bool sharded() const { return sharded_; }
  // Every tensor, sorted by name.
  const std::vector<HFTensorInfo>& tensors() const { return tensors_; }
  bool contains(std::string_view name) const;
  // Error naming the directory and the closest name when absent.
  const HFTensorInfo& tensor(std::string_view name) const;

  // All `numel` elements of `name` into dst.
  void read_f32(std::string_view name, float* dst, int64_t numel) const;
  // Rows [begin, end) of the first dimension: one contiguous byte range (a
  // tensor-parallel rank reads only its rows). dst holds (end - begin) rows.
  void read_rows_f32(std::string_view name, int64_t begin, int64_t end, float* dst) const;
  // Columns [begin, end) of a 2-D tensor, row by row: dst is [rows, end - begin].
  void read_cols_f32(std::string_view name, int64_t begin, int64_t end, float* dst) const;

  // Checks that the checkpoint holds exactly `map`'s parameters with their HF
  // shapes and a floating dtype (ignorable extras aside). Errors name the
  // tensor and its file (or, for a missing one, where it was looked for).
  void check(const HFParamMap& map) const;
  // Parameter `p` in loom's layout (p.loom_shape), whole or rows [begin, end)
  // of it (for a transposed weight, HF's columns).
  void read_param(const HFParam& p, float* dst) const;
  void read_param_rows(const HFParam& p, int64_t begin, int64_t end, float* dst) const;

 private:
  const SafetensorsReader& reader_of(std::string_view name) const;
  const std::string& stored_name(const HFParam& p) const;
  void read_bytes_f32(std::string_view name, uint64_t byte_offset, int64_t numel, float* dst) const;
  std::filesystem::path dir_;
  bool sharded_ = false;
  std::filesystem::path listing_;  // model.safetensors or the index: what errors name
  std::vector<HFTensorInfo> tensors_;
  std::vector<size_t> reader_index_;  // parallel to tensors_: which of readers_ holds it
  std::map<std::string, size_t, std::less<>> index_;
  std::vector<std::unique_ptr<SafetensorsReader>> readers_;
};

// ---------------------------------------------------------------------------
// Writing a checkpoint directory
// ---------------------------------------------------------------------------

struct HFExportOptions {
  DType dtype = DType::f32;                // f32, bf16 or f16 (round to nearest even)
  uint64_t max_shard_bytes = 5'000'000'000;  // "5GB", transformers 4's default max_shard_size
};

// Writes `dir` (replacing it atomically): config.json (with torch_dtype set to
// options.dtype) and model.safetensors, or, when the tensors exceed
// max_shard_bytes, model-0000k-of-0000N.safetensors shards filled in map order
// (a tensor larger than the limit gets a shard of its own) and
// model.safetensors.index.json {"metadata": {"total_size"}, "weight_map"}.
// fill(p, dst) writes parameter p as f32 in loom's layout; one parameter is in
// memory at a time.
void write_hf_checkpoint(const std::filesystem::path& dir, const HFModelConfig& config,
                         const std::function<void(const HFParam& p, float* dst)>& fill,
                         const HFExportOptions& options = {});

}  // namespace loom
