// The `loom` command line: prepare, train, generate, serve, eval, export, quantize, prune, calibrate, plan.
#include <CLI/CLI.hpp>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <nlohmann/json.hpp>

#include "loom/comm.h"
#include "loom/config.h"
#include "loom/data.h"
#include "loom/inference.h"
#include "loom/io.h"
#include "loom/planner.h"
#include "loom/prune.h"
#include "loom/quant.h"
#include "loom/train.h"
#include "supervise.h"

namespace fs = std::filesystem;
using namespace loom;

namespace {

// A trained model with its tokenizer: a loom checkpoint (the tokenizer its
// manifest names), or "hf:DIR" (the tokenizer beside config.json).
struct LoadedModel {
  std::optional<CheckpointInfo> info;  // a loom checkpoint's
  std::unique_ptr<HFImport> hf;
  std::unique_ptr<GPT> model;
  std::unique_ptr<ParamStore> params;
  Tokenizer tokenizer;

  // mp: this rank's part of the model (whole by default); the loaders read
  // only its slices of the weights.
  explicit LoadedModel(const std::string& checkpoint, const ModelParallel& mp = {})
      : tokenizer(open(checkpoint, mp)) {
    if (!hf) {
      params = load_inference_weights(*info, *model);  // fp32, or quantized as the checkpoint holds
      return;
    }
    params = std::make_unique<ParamStore>(model->layout(), 0);
    load_hf_weights(*hf, *model, *params);
  }

 private:
  // Validates the checkpoint and describes its model; returns its tokenizer.
  Tokenizer open(const std::string& checkpoint, const ModelParallel& mp) {
    if (const std::optional<fs::path> dir = hf_dir_of(checkpoint)) {
      hf = std::make_unique<HFImport>(*dir);
      model = std::make_unique<GPT>(hf->model, mp);
      Tokenizer tok = Tokenizer::load(*dir);
      if (tok.vocab_size() > hf->model.vocab_size)
        throw Error(str("the tokenizer in '", dir->string(), "' has ", tok.vocab_size(),
                        " tokens but config.json's vocab_size is ", hf->model.vocab_size,
                        ": the tokenizer does not belong to this checkpoint"));
      return tok;
    }
    info = read_checkpoint_info(resolve_checkpoint(checkpoint));
    model = std::make_unique<GPT>(checkpoint_model_config(*info), mp);
    return Tokenizer::load(info->fields.at("tokenizer").get<std::string>());
  }
};

// Checks `loom generate --tp --pp` against the checkpoint's model before any
// rank allocates it: the heads, kv heads, MLP width and vocabulary must split
// over tp ranks as training splits them (planner.h's layout rules), and
// every stage needs a layer. Returns the model.
GPTConfig check_generation_layout(const std::string& checkpoint, int tp, int pp) {
  GPTConfig cfg;
  if (const std::optional<fs::path> dir = hf_dir_of(checkpoint)) {
    cfg = HFImport(*dir).model;
  } else {
    const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(checkpoint));
    if (checkpoint_quantization(info))
      throw Error(str("'", checkpoint,
                      "' is quantized, and quantized checkpoints generate on one rank: drop --tp and --pp, or "
                      "generate from the fp32 checkpoint it was quantized from"));
    cfg = checkpoint_model_config(info);
  }
  auto violation = [&](int t) {
    LayoutProblem problem;
    problem.model = cfg;
    Layout layout;
    layout.tp = t;
    return check_layout(problem, layout);
  };
  if (const std::optional<LayoutViolation> v = violation(tp)) {
    std::string valid;
    for (int t = 1; t <= cfg.n_head; ++t)
      if (!violation(t)) valid += str(valid.empty() ? "" : ", ", t);
    throw Error(str("--tp ", tp, " does not split this model: the number of tensor-parallel ranks ", v->problem,
                    "; valid values for this model: ", valid));
  }
  if (pp > cfg.n_layer)
    throw Error(str("--pp ", pp, " does not split this model: each pipeline stage needs a layer and the model has ",
                    cfg.n_layer, "; valid values for this model: 1 to ", cfg.n_layer));
  return cfg;
}

// The SHA-256 of `m`'s tokenizer (what data prepared for it records).
std::string tokenizer_sha256(const LoadedModel& m) {
  return m.info ? m.info->fields.value("tokenizer_sha256", std::string()) : sha256_file(m.tokenizer.path());
}

// `loom eval`'s evaluation of `params` (m's model) over a token shard (at
// most max_batches batches; 0: all): its dataset.json checks the tokenizer
// and gives chars per token (0 without).
EvalResult evaluate_shard(LoadedModel& m, ParamStore& params, const std::string& shard, int64_t seq_len,
                          int64_t batch, double& chars_per_token, int64_t max_batches = 0) {
  const EvalData d = eval_data(shard, tokenizer_sha256(m), seq_len, m.model->config().block_size);
  chars_per_token = d.chars_per_token;
  return evaluate(*m.model, params, {d.shard}, d.seq_len, batch, d.chars_per_token, max_batches, nullptr, d.masks);
}

// The loss and perplexity before and after a compression (quantize, prune).
void print_loss_change(const EvalResult& before, const EvalResult& after) {
  std::printf("loss %.6f -> %.6f nats/token (%+.3f%%), perplexity %.4f -> %.4f (%+.3f%%) over %lld tokens\n",
              before.loss_per_token, after.loss_per_token, 100.0 * (after.loss_per_token / before.loss_per_token - 1.0),
              std::exp(before.loss_per_token), std::exp(after.loss_per_token),
              100.0 * (std::exp(after.loss_per_token - before.loss_per_token) - 1.0),
              static_cast<long long>(after.tokens));
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config cfg(loom_schema());
  if (!path.empty()) cfg.load_toml(path);
  for (const std::string& o : overrides) cfg.set_override(o);
  return cfg;
}

}  // namespace

int main(int argc, char** argv) {
  // Past a file-size limit (ulimit -f) a write then fails with an error that
  // names the file, and a checkpoint follows train.checkpoint_failure,
  // instead of the signal ending the process.
  std::signal(SIGXFSZ, SIG_IGN);
  CLI::App app{"loom: train GPT-class transformers in C++"};
  app.require_subcommand(1);

  // prepare
  auto* prepare = app.add_subcommand("prepare", "train a tokenizer and write train/val token shards");
  std::vector<std::string> texts, sft;
  std::string prep_out, prep_tokenizer;
  int prep_vocab = 0, prep_seq = 256;
  double prep_val = 0.1;
  std::optional<int32_t> prep_eos;
  auto* text_opt = prepare->add_option("--text", texts, "UTF-8 text file(s)");
  auto* sft_opt = prepare->add_option(
      "--sft", sft,
      "JSONL fine-tuning file(s): {\"prompt\", \"response\"} or {\"messages\"} per line; the loss is on the "
      "responses (needs --tokenizer; docs/data.md)");
  text_opt->excludes(sft_opt);
  prepare->add_option("--eos", prep_eos, "with --sft: the id ending each response (default: the tokenizer's eos)");
  prepare->add_option("--out", prep_out, "output directory")->required();
  prepare->add_option("--tokenizer", prep_tokenizer,
                      "reuse this tokenizer instead of training one: a sentencepiece tokenizer.model, a Hugging "
                      "Face tokenizer.json, or a directory holding one");
  prepare->add_option("--vocab", prep_vocab, "vocabulary size of a new tokenizer");
  prepare->add_option("--val-fraction", prep_val, "share of the corpus (from its end) for validation");
  prepare->add_option("--seq-len", prep_seq,
                      "training context, to check each split is long enough; with --sft the row length examples "
                      "are packed into, which training's seq_len must equal");

  // train
  auto* train = app.add_subcommand(
      "train", "train a model from a TOML config (data parallel, ZeRO and precision: docs/training.md)");
  std::string config_path = "configs/shakespeare.toml";
  std::vector<std::string> overrides;
  bool resume = false, overwrite = false;
  int64_t stop_after = 0;
  train->add_option("--config", config_path, "TOML config")->capture_default_str();
  train->add_option("--set", overrides,
                    "override keys: --set model.n_layer=6 parallel.dp=2 zero.stage=1 precision=bf16 (repeatable)");
  train->add_flag("--resume", resume, "continue from the latest checkpoint in train.out_dir");
  train->add_flag("--overwrite", overwrite,
                  "delete the checkpoints of a run already in train.out_dir and start afresh (without it such a "
                  "directory is refused)");
  train->add_option("--stop-after", stop_after, "stop after this step as if interrupted (checkpoints first)");
  int max_restarts = 0;
  bool elastic = false;
  train->add_option("--max-restarts", max_restarts,
                    "when the run fails (a rank died, was killed or stalled), start it again from its newest "
                    "checkpoint, up to this many times (local ranks, or mpirun under parallel.backend = \"mpi\")");
  train->add_flag("--elastic", elastic,
                  "with --max-restarts: restart on fewer data-parallel ranks, the global batch kept by more gradient "
                  "accumulation");

  // generate
  auto* gen = app.add_subcommand("generate", "sample text from a checkpoint");
  std::string ckpt, prompt = "\n";
  int64_t max_tokens = 200;
  SampleOptions so;
  gen->add_option("--checkpoint", ckpt,
                  "checkpoint directory, a run directory (uses latest), or hf:DIR (a Hugging Face checkpoint)")
      ->required();
  gen->add_option("--prompt", prompt, "text to continue");
  gen->add_option("--tokens", max_tokens, "tokens to generate");
  gen->add_option("--temperature", so.temperature, "0 = greedy")->capture_default_str();
  gen->add_option("--top-k", so.top_k, "keep the k most likely tokens; 0 = all");
  gen->add_option("--top-p", so.top_p, "nucleus: keep the most likely tokens up to this probability");
  gen->add_option("--seed", so.seed, "sampling seed")->capture_default_str();
  std::string prompts_path, results_path;
  int64_t max_batch = 8;
  gen->add_option("--prompts", prompts_path,
                  "generate for every prompt of a file: one per line, or JSONL objects {\"prompt\": ..., "
                  "\"max_tokens\", \"temperature\", \"top_p\", \"top_k\", \"seed\"} (the flags give the rest); "
                  "each stops at the tokenizer's eos token or its max_tokens")
      ->excludes("--prompt");
  gen->add_option("--out", results_path,
                  "with --prompts: write the results here, one JSONL line per prompt in input order (default: "
                  "standard output)");
  gen->add_option("--max-batch", max_batch, "with --prompts: sequences generated together")->capture_default_str();
  int gen_tp = 1, gen_pp = 1;
  gen->add_option("--tp", gen_tp,
                  "split the model's matrices over this many tensor-parallel ranks (local threads), each loading "
                  "its slice of the weights: for a model too large for one rank")
      ->capture_default_str();
  gen->add_option("--pp", gen_pp,
                  "split the model's layers over this many pipeline stages (local threads; times --tp ranks in all)")
      ->capture_default_str();

  // serve
  auto* serve = app.add_subcommand(
      "serve", "serve a checkpoint over HTTP: OpenAI-compatible /v1/completions, /health, /metrics (docs/inference.md)");
  ServeOptions serve_opts;
  serve->add_option("--checkpoint", ckpt,
                    "checkpoint directory, a run directory (uses latest), or hf:DIR (a Hugging Face checkpoint)")
      ->required();
  serve->add_option("--host", serve_opts.host, "address to listen on")->capture_default_str();
  serve->add_option("--port", serve_opts.port, "port to listen on; 0 = any free port")->capture_default_str();
  serve->add_option("--max-batch", serve_opts.max_batch, "sequences generated together")->capture_default_str();

  // eval
  auto* eval = app.add_subcommand("eval", "mean loss of a checkpoint over a token-shard file");
  std::string eval_data;
  int64_t eval_seq = 0, eval_batch = 8;
  eval->add_option("--checkpoint", ckpt,
                   "checkpoint directory, a run directory (uses latest), or hf:DIR (a Hugging Face checkpoint)")
      ->required();
  eval->add_option("--data", eval_data, "token shard (.bin); its dataset.json gives chars per token")->required();
  eval->add_option("--seq-len", eval_seq,
                   "window length; default: the model's context, or a fine-tuning dataset's packing length");
  eval->add_option("--batch", eval_batch, "sequences per forward");

  // export
  auto* exp = app.add_subcommand(
      "export", "write a Hugging Face checkpoint directory (config.json, safetensors, the tokenizer)");
  std::string export_out, export_dtype = "f32", export_shard = "5GB";
  exp->add_option("--checkpoint", ckpt, "checkpoint directory, or a run directory (uses latest)")->required();
  exp->add_option("--out", export_out, "output directory")->required();
  bool export_peft = false;
  exp->add_flag("--peft", export_peft,
                "write a LoRA run's adapters in PEFT's layout (adapter_config.json + adapter_model.safetensors); "
                "without it a LoRA model is exported with its adapters merged into the weights");
  exp->add_option("--dtype", export_dtype, "stored dtype: f32, bf16 or f16 (rounded to nearest even)")
      ->capture_default_str();
  exp->add_option("--max-shard-size", export_shard,
                  "shard the weights above this size (an index lists the shards), e.g. 2GB")
      ->capture_default_str();

  // quantize
  auto* quant = app.add_subcommand(
      "quantize",
      "write a quantized checkpoint (weight-only int8/int4, or W8A8) for generate, eval and serve "
      "(docs/checkpoints.md)");
  std::string quant_out, quant_method = "int8", quant_data;
  int64_t quant_group = 128, quant_calibration_batches = 4;
  double quant_alpha = 0.5;
  quant->add_option("--checkpoint", ckpt, "checkpoint directory, or a run directory (uses latest)")->required();
  quant->add_option("--method", quant_method,
                    "int8 (weights per output channel), int4 (weights group-wise, zero points) or w8a8 (int8 "
                    "weights and per-token int8 activations, SmoothQuant; needs --data)")
      ->capture_default_str();
  quant->add_option("--group", quant_group, "int4: input columns per scale: 32, 64 or 128")->capture_default_str();
  quant->add_option("--alpha", quant_alpha,
                    "w8a8: SmoothQuant's migration strength in [0, 1] (how much of the activations' outliers "
                    "moves into the weights)")
      ->capture_default_str();
  quant->add_option("--out", quant_out, "output checkpoint directory")->required();
  quant->add_option("--data", quant_data,
                    "token shard: report its loss and perplexity before and after; w8a8 calibrates on it");
  quant->add_option("--calibration-batches", quant_calibration_batches,
                    "w8a8: batches of 8 windows from the start of --data to calibrate on")
      ->capture_default_str();

  // prune
  auto* prune = app.add_subcommand(
      "prune", "zero the linear layers' smallest weights, or remove MLP channels or attention heads (docs/pruning.md)");
  std::string prune_out, prune_method = "magnitude", prune_pattern = "unstructured", prune_data;
  double prune_sparsity = 0.5;
  int64_t prune_batches = 0;
  prune->add_option("--checkpoint", ckpt, "checkpoint directory, a run directory (uses latest), or hf:DIR")->required();
  prune->add_option("--method", prune_method,
                    "magnitude (|W|), wanda (|W| times its input's norm), channels (MLP channels) or heads "
                    "(attention heads, whole key/value groups; by ||head output|| ||W_o columns|| over --data, or by "
                    "weights alone without): channels and heads give a smaller dense model")
      ->capture_default_str();
  prune->add_option("--sparsity", prune_sparsity,
                    "share of each matrix's weights (channels: of each MLP's channels; heads: of each layer's heads, "
                    "in key/value groups) to remove")
      ->capture_default_str();
  prune->add_option("--pattern", prune_pattern, "unstructured or 2:4")->capture_default_str();
  prune->add_option("--data", prune_data,
                    "token shard: the loss before and after, and wanda's and heads' calibration");
  prune->add_option("--batches", prune_batches, "with --data: at most this many batches of 8 (0: the whole shard)");
  prune->add_option("--out", prune_out, "new run directory for the pruned checkpoint")->required();

  // calibrate
  auto* calibrate = app.add_subcommand(
      "calibrate", "measure this machine's GEMM, memory, collective (and NVMe) rates for the planner");
  std::string calibration_out = default_calibration_path().string(), calibration_nvme;
  calibrate->add_option("--out", calibration_out, "where the rates go (JSON; a previous calibration is replaced)")
      ->capture_default_str();
  calibrate->add_option("--nvme-dir", calibration_nvme, "also measure sequential read/write in this directory");

  // plan
  auto* plan = app.add_subcommand(
      "plan", "predict a config's memory per rank and step time, or search for the fastest layout that fits "
              "(docs/planning.md)");
  std::vector<std::string> plan_overrides;
  std::string plan_config = "configs/shakespeare.toml", plan_rates, plan_hardware;
  PlanCommandOptions plan_options;
  plan->add_option("--config", plan_config, "TOML config")->capture_default_str();
  plan->add_option("--set", plan_overrides, "override keys, as for train (repeatable)");
  auto* rates_opt = plan->add_option("--rates", plan_rates, "machine rates from `loom calibrate --out FILE`");
  plan->add_option("--hardware", plan_hardware,
                   "a hardware description (hardware/h100-sxm.json); its device memory is the budget unless "
                   "memory.device_budget is set")
      ->excludes(rates_opt);
  plan->add_flag("--search", plan_options.search, "rank every layout of the world size by predicted step time");
  plan->add_option("--top", plan_options.top, "with --search: the layouts to print")->capture_default_str();
  plan->add_option("--ranks", plan_options.ranks,
                   "with --search: the world size (default: parallel.dp * parallel.tp * parallel.pp)");
  plan->add_option("--nodes", plan_options.nodes,
                   "with --hardware: plan for this many machines of the file's ranks_per_node ranks each "
                   "(collectives crossing machines run on its inter_node link)");
  std::string plan_trace;
  plan->add_option("--trace", plan_trace,
                   "write the predicted step of every rank as a Chrome trace to this new file, to open beside "
                   "a measured trace.path (with --search: of the best layout)");

  CLI11_PARSE(app, argc, argv);
  try {
    if (prepare->parsed()) {
      if (texts.empty() && sft.empty()) throw Error("prepare: give the input with --text or --sft");
      PrepareOptions po;
      for (const std::string& t : texts) po.inputs.emplace_back(t);
      for (const std::string& t : sft) po.inputs.emplace_back(t);
      po.sft = !sft.empty();
      po.eos = prep_eos;
      po.out_dir = prep_out;
      po.tokenizer = prep_tokenizer;
      po.vocab_size = prep_vocab;
      po.val_fraction = prep_val;
      po.seq_len = prep_seq;
      const DatasetInfo d = prepare_dataset(po);
      std::printf("wrote %s: vocabulary %d, %lld train and %lld val tokens, %.3f chars/token\n",
                  d.dir.string().c_str(), d.vocab_size, static_cast<long long>(d.train.tokens),
                  static_cast<long long>(d.val.tokens), d.train.chars_per_token());
      if (d.mode == DatasetMode::sft)
        std::printf("fine-tuning: %lld train and %lld val examples in rows of %d tokens, %lld truncated to fit; "
                    "%lld train target tokens\n",
                    static_cast<long long>(d.train.examples), static_cast<long long>(d.val.examples), d.seq_len,
                    static_cast<long long>(d.train.truncated + d.val.truncated),
                    static_cast<long long>(d.train.targets));
    } else if (train->parsed()) {
      RunOptions run;
      run.resume = resume;
      run.overwrite = overwrite;
      run.stop_after = stop_after;
      if (elastic && max_restarts == 0) throw Error("--elastic applies to restarts: give --max-restarts N too");
      if (max_restarts > 0)
        return run_training_with_restarts(load_config(config_path, overrides), {config_path, overrides}, run,
                                          max_restarts, elastic);
      if (run_training(load_config(config_path, overrides), run).stop_signal != 0) return kPreemptedExitStatus;
    } else if (gen->parsed()) {
      if (gen_tp < 1) throw Error(str("--tp ", gen_tp, ": give the number of tensor-parallel ranks, at least 1"));
      if (gen_pp < 1) throw Error(str("--pp ", gen_pp, ": give the number of pipeline stages, at least 1"));
      PromptSpec defaults;
      defaults.max_tokens = max_tokens;
      defaults.sample = so;
      // The file and the layout are checked before the model loads.
      const std::vector<PromptSpec> prompts =
          prompts_path.empty() ? std::vector<PromptSpec>{} : read_prompts(prompts_path, defaults);
      const bool split = gen_tp * gen_pp > 1;
      const GPTConfig split_model = split ? check_generation_layout(ckpt, gen_tp, gen_pp) : GPTConfig{};
      std::ofstream file;
      if (!results_path.empty()) {
        file.open(results_path);
        if (!file) throw Error(str("cannot write the results file '", results_path, "'"));
      }
      std::ostream& out = results_path.empty() ? std::cout : file;
      // Every rank generates the same tokens from its part of the model;
      // rank 0 (`writes`) prints them.
      auto run = [&](LoadedModel& m, Communicator* pipeline, bool writes) {
        if (prompts_path.empty()) {
          if (writes) std::printf("%s", prompt.c_str());
          generate(
              *m.model, *m.params, m.tokenizer, prompt, max_tokens, so,
              [&](const std::string& piece) {
                if (!writes) return;
                std::fputs(piece.c_str(), stdout);
                std::fflush(stdout);
              },
              pipeline);
          if (writes) std::printf("\n");
          return;
        }
        Generator engine(*m.model, *m.params, max_batch, &m.tokenizer, pipeline);
        std::vector<int64_t> ids;
        for (const PromptSpec& p : prompts) {
          GenerationRequest r;
          r.prompt = m.tokenizer.encode(p.prompt);
          r.max_tokens = p.max_tokens;
          r.sample = p.sample;
          if (const std::optional<int32_t> eos = m.tokenizer.eos_id()) r.stop_tokens.push_back(*eos);
          ids.push_back(engine.submit(std::move(r)));
        }
        // Results go out in input order as soon as each is there.
        size_t next = 0;
        auto flush = [&] {
          for (; next < prompts.size(); ++next) {
            std::optional<GenerationResult> r = engine.take(ids[next]);
            if (!r) break;
            if (writes)
              out << result_json_line(static_cast<int64_t>(next), prompts[next].prompt, *r) << '\n' << std::flush;
          }
        };
        while (engine.step()) flush();
        flush();
      };
      if (!split) {
        LoadedModel m(ckpt);
        run(m, nullptr, true);
      } else {
        run_local(gen_tp * gen_pp, [&](Communicator& world) {
          MeshShape shape;
          shape[MeshAxis::pp] = gen_pp;
          shape[MeshAxis::tp] = gen_tp;
          DeviceMesh mesh(world, shape);
          LoadedModel m(ckpt, generation_parallel(mesh, split_model));
          run(m, gen_pp > 1 ? &mesh.group(MeshAxis::pp) : nullptr, world.rank() == 0);
        });
      }
      if (!prompts_path.empty() && !out)
        throw Error(str("writing the results to '", results_path.empty() ? "stdout" : results_path, "' failed"));
    } else if (serve->parsed()) {
      LoadedModel m(ckpt);
      // Responses name the model by its directory unless a request names it.
      fs::path dir(ckpt);
      if (dir.filename().empty()) dir = dir.parent_path();  // a trailing slash
      if (!dir.filename().empty()) serve_opts.model = dir.filename().string();
      Server server(*m.model, *m.params, m.tokenizer, serve_opts);
      std::printf("serving %s on http://%s:%d (POST /v1/completions, GET /health, GET /metrics); Ctrl-C stops\n",
                  ckpt.c_str(), serve_opts.host.c_str(), server.port());
      std::fflush(stdout);
      server.run_until_signal();
      std::printf("stopped\n");
    } else if (eval->parsed()) {
      LoadedModel m(ckpt);
      double chars_per_token = 0.0;
      const EvalResult r = evaluate_shard(m, *m.params, eval_data, eval_seq, eval_batch, chars_per_token);
      std::printf("loss %.6f nats/token", r.loss_per_token);
      if (chars_per_token > 0) std::printf(", %.6f nats/char", r.loss_per_char);
      std::printf(" over %lld tokens\n", static_cast<long long>(r.tokens));
    } else if (exp->parsed()) {
      HFExportOptions eo;
      eo.dtype = parse_dtype(export_dtype);
      if (eo.dtype != DType::f32 && eo.dtype != DType::bf16 && eo.dtype != DType::f16)
        throw Error(str("--dtype ", export_dtype, ": export writes f32, bf16 or f16"));
      eo.max_shard_bytes = parse_bytes(export_shard);
      if (eo.max_shard_bytes == 0) throw Error("--max-shard-size must be positive, e.g. 2GB");
      LoadedModel m(ckpt);
      if (export_peft) {
        export_peft_adapter(*m.model, *m.params, export_out);
        std::printf("wrote %s/adapter_config.json and %s/adapter_model.safetensors\n", export_out.c_str(),
                    export_out.c_str());
      } else {
        export_hf(*m.model, *m.params, export_out, eo);
        // Beside the weights, so that importing the directory finds it.
        fs::copy_file(m.tokenizer.path(), fs::path(export_out) / m.tokenizer.path().filename(),
                      fs::copy_options::overwrite_existing);
        std::printf("wrote %s (%s, %s)\n", export_out.c_str(), dtype_name(eo.dtype),
                    m.tokenizer.path().filename().string().c_str());
      }
    } else if (quant->parsed()) {
      const QuantizeOptions qo{parse_quant_method(quant_method), quant_group, quant_alpha};
      check_quantize_options(qo, !quant_data.empty());  // before the model loads
      if (qo.method == QuantMethod::w8a8 && quant_calibration_batches < 1)
        throw Error(str("--calibration-batches ", quant_calibration_batches, " must be at least 1"));
      LoadedModel m(ckpt);
      if (!m.info) throw Error("quantize reads a loom checkpoint; import an hf: model with `loom train` first");
      std::optional<SmoothQuantCalibration> calibration;
      if (qo.method == QuantMethod::w8a8) {
        calibration.emplace();
        double cpt = 0.0;
        evaluate_shard(m, *m.params, quant_data, 0, 8, cpt, quant_calibration_batches);
      }
      const auto q = quantize_checkpoint(*m.info, m.model->layout(), *m.params, qo, quant_out,
                                         calibration ? &*calibration : nullptr);
      calibration.reset();
      const double fp32 = 4.0 * static_cast<double>(m.model->layout().numel()), size = static_cast<double>(q->nbytes());
      std::printf("wrote %s (%s): weights %.0f bytes, %.1f%% of fp32's %.0f\n", quant_out.c_str(),
                  quant_method_name(qo.method), size, 100.0 * size / fp32, fp32);
      if (!quant_data.empty()) {
        double cpt = 0.0;
        const EvalResult before = evaluate_shard(m, *m.params, quant_data, 0, 8, cpt);
        const EvalResult after = evaluate_shard(m, *q, quant_data, 0, 8, cpt);
        print_loss_change(before, after);
      }
    } else if (prune->parsed()) {
      const PruneOptions po{parse_prune_method(prune_method), parse_sparsity_pattern(prune_pattern), prune_sparsity};
      validate(po);
      check_prune_output(prune_out);
      LoadedModel m(ckpt);
      const bool data = !prune_data.empty();
      double cpt = 0.0;
      auto loss = [&] { return evaluate_shard(m, *m.params, prune_data, 0, 8, cpt, prune_batches); };
      std::optional<WandaCalibration> calibration;
      if ((po.method == PruneMethod::wanda || po.method == PruneMethod::heads) && data) calibration.emplace();
      // Wanda and heads calibrate on the windows the loss before pruning reads.
      const EvalResult before = data ? loss() : EvalResult{};
      const GPTConfig original = m.model->config();
      PruneReport r;
      if (po.method == PruneMethod::channels || po.method == PruneMethod::heads) {
        SmallerModel smaller =
            po.method == PruneMethod::channels
                ? remove_channels(*m.model, *m.params, po.sparsity)
                : remove_heads(*m.model, *m.params, po.sparsity, calibration ? &*calibration : nullptr);
        r = smaller.report;
        m.params = std::move(smaller.params);
        m.model = std::move(smaller.model);
      } else {
        r = prune_model(*m.model, *m.params, po, calibration ? &*calibration : nullptr);
      }
      calibration.reset();
      const fs::path dir = write_pruned_checkpoint(
          prune_out, *m.model, *m.params, po, r,
          {ckpt, m.tokenizer.path(), tokenizer_sha256(m)});
      int64_t pruned = 0, zeros = 0;
      for (const PruneReport::Matrix& x : r.matrices) pruned += x.numel, zeros += x.zeros;
      const GPTConfig& smaller = m.model->config();
      const std::string what =
          po.method == PruneMethod::channels ? str("MLP channels ", original.intermediate(), " -> ",
                                                   smaller.intermediate(), " per layer")
          : po.method == PruneMethod::heads
              ? str("attention heads ", original.n_head, " -> ", smaller.n_head, " per layer (key/value heads ",
                    original.kv_heads(), " -> ", smaller.kv_heads(), ", ", smaller.head_dim(), " wide; scored ",
                    data ? "over --data" : "by weights alone", ")")
              : str(r.matrices.size(), " matrices at ", 100.0 * static_cast<double>(zeros) / static_cast<double>(pruned),
                    "% sparsity (", prune_method_name(po.method), ", ", sparsity_pattern_name(po.pattern), ")");
      std::printf("%s: %s; %lld of %lld parameters nonzero (%.2f%%), %.2f MB dense f32\n", dir.c_str(), what.c_str(),
                  static_cast<long long>(r.nonzeros), static_cast<long long>(r.numel),
                  100.0 * static_cast<double>(r.nonzeros) / static_cast<double>(r.numel),
                  static_cast<double>(r.numel) * 4e-6);
      if (data) print_loss_change(before, loss());
    } else if (plan->parsed()) {
      plan_options.rates = {.rates = plan_rates, .hardware = plan_hardware};
      plan_options.trace = plan_trace;
      run_plan(load_config(plan_config, plan_overrides), plan_options, std::cout);
    } else if (calibrate->parsed()) {
      const fs::path out(calibration_out);
      std::error_code ec;
      // Replacing an earlier calibration is what calibrating again means;
      // any other file is the user's.
      if (fs::exists(out, ec)) {
        try {
          load_machine_rates(out);
        } catch (const Error& e) {
          throw Error(str("--out '", out.string(), "' exists and is not a calibration (", e.what(),
                          "); choose another path"));
        }
      }
      if (out.has_parent_path()) fs::create_directories(out.parent_path());
      CalibrationOptions co;
      co.nvme_dir = calibration_nvme;
      co.progress = [](const std::string& line) { std::printf("  %s\n", line.c_str()); };
      std::printf("calibrating (about half a minute)\n");
      save_machine_rates(calibrate_machine(co), out);
      std::printf("wrote %s\n", out.c_str());
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
