// loom train: the training step (micro-batches, gradient accumulation,
// clipping, AdamW) on top of the model and the stores.
#pragma once

#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include <nlohmann/json.hpp>

#include "loom/nn.h"
#include "loom/optim.h"
#include "loom/store.h"

namespace loom {

struct TrainOptions {
  AdamWConfig adamw;
  LRSchedule schedule;
  float grad_clip = 1.0f;  // global-norm clipping; 0 turns it off
  bool checkpoint_activations = false;
  uint64_t seed = 1337;  // initialization and dropout
};

// One micro-batch of the global batch, B sequences of T tokens.
struct MicroBatch {
  const int32_t* tokens = nullptr;
  const int32_t* targets = nullptr;
  BatchShape shape;
  int64_t first_sequence = 0;  // global index of its first sequence, for dropout masks
};

struct StepStats {
  float loss = 0.0f;       // mean over the global batch's target tokens
  double grad_norm = 0.0;  // before clipping
  float lr = 0.0f;
  int64_t tokens = 0;
};

// Single-rank training: the reference path every parallel layout and memory
// strategy is tested against.
class Trainer {
 public:
  Trainer(const GPTConfig& model, const TrainOptions& opts);
  // The stores refer to the model's layout: a Trainer stays where it is built.
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Forward and backward over every micro-batch (gradients accumulate), then
  // clipping and one AdamW update.
  StepStats step(std::span<const MicroBatch> micro_batches);

  GPT& model() { return model_; }
  ParamStore& params() { return *params_; }
  GradStore& grads() { return *grads_; }
  AdamW& optimizer() { return *optim_; }
  int64_t steps_done() const { return optim_->steps(); }

 private:
  TrainOptions opts_;
  GPT model_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<GradStore> grads_;
  std::unique_ptr<AdamW> optim_;
};

}  // namespace loom

// ---------------------------------------------------------------------------
// The main job: config -> data -> training loop with progress, metrics,
// evaluation, checkpoints and a sample.
// ---------------------------------------------------------------------------

namespace loom {

class Config;
class Tokenizer;

// The model a config describes: a preset, or model.* as given for "custom".
GPTConfig model_config_from(const Config& cfg);

// Everything a training run is, derived from a config and validated as a
// whole (cross-field rules) before anything is allocated or read.
struct TrainPlan {
  GPTConfig model;
  TrainOptions options;
  int64_t steps = 0;
  int64_t global_batch = 0;  // sequences per step
  int64_t micro_batch = 0;
  int64_t seq_len = 0;
  int64_t accumulation = 1;  // micro-batches per step
  std::filesystem::path out_dir;
};
// Throws ConfigError naming the field, its origin, the rule and the fix.
TrainPlan plan_training(const Config& cfg);

// Sampling settings: temperature 0 is greedy; top_k 0 and top_p 1 are off.
struct SampleOptions {
  float temperature = 0.8f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 1337;
};
// Draws a token from one row of logits; the draw is a pure function of
// (seed, draw index), so a seeded generation is reproducible.
int32_t sample_token(const float* logits, int64_t V, const SampleOptions& opts, uint64_t draw);

// Generates `max_tokens` tokens after `prompt` with a KV cache (the context
// is capped at the model's block size), calling on_text with each decoded
// piece as it is produced. Returns the generated text (without the prompt).
std::string generate(GPT& model, ParamStore& params, const Tokenizer& tok, const std::string& prompt,
                     int64_t max_tokens, const SampleOptions& opts,
                     const std::function<void(const std::string&)>& on_text = {});

// Checkpoints: <root>/step_XXXXXXXX/{model.safetensors, optimizer.safetensors,
// manifest.json}, committed atomically, then <root>/latest, then retention.
struct CheckpointInfo {
  std::filesystem::path dir;
  int64_t step = 0;
  nlohmann::json fields;  // the manifest's fields (config, loader, ...)
};
std::filesystem::path save_checkpoint(const std::filesystem::path& root, Trainer& trainer,
                                      const nlohmann::json& fields, int64_t keep_last);
// Verifies every file's checksum, then loads weights and optimizer state.
CheckpointInfo load_checkpoint(const std::filesystem::path& dir, Trainer& trainer);
// Weights only (generate, eval, export): verifies the checkpoint and returns
// its info; `load_weights` fills a ParamStore of the model it describes.
CheckpointInfo read_checkpoint_info(const std::filesystem::path& dir);
GPTConfig checkpoint_model_config(const CheckpointInfo& info);
void load_weights(const CheckpointInfo& info, const GPT& model, ParamStore& params);
// Resolves a checkpoint argument: a step directory, or a run directory whose
// `latest` names one.
std::filesystem::path resolve_checkpoint(const std::filesystem::path& path);

// Hugging Face GPT-2 layout: config.json + model.safetensors with
// h.{i}.attn.c_attn.weight etc., Conv1D weights stored [in, out].
void export_hf_gpt2(const GPT& model, const ParamStore& params, const std::filesystem::path& out_dir);

struct EvalResult {
  double loss_per_token = 0.0;
  double loss_per_char = 0.0;
  int64_t tokens = 0;
};
// Mean loss over every window of the shards (chars_per_token converts).
EvalResult evaluate(GPT& model, ParamStore& params, const std::vector<std::filesystem::path>& shards,
                    int64_t seq_len, int64_t micro_batch, double chars_per_token, int64_t max_batches = 0);

struct RunOptions {
  bool resume = false;
  int64_t stop_after = 0;  // stop after this step as if interrupted (tests); 0 = run to the end
  bool quiet = false;
};
// `loom train`. Returns the final validation result.
EvalResult run_training(const Config& cfg, const RunOptions& run);

}  // namespace loom
