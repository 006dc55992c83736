// `loom train`: the main job. Config -> validated plan -> dataset (prepared
// on first use) -> training loop with progress, JSONL metrics, periodic
// validation and checkpoints -> final validation and a sample.
#include <signal.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>

#include "loom/comm.h"
#include "loom/config.h"
#include "loom/data.h"
#include "loom/inference.h"
#include "loom/io.h"
#include "loom/device.h"
#include "loom/planner.h"
#include "loom/trace.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string format_duration(double s) {
  const int64_t t = static_cast<int64_t>(s + 0.5);
  char buf[32];
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(t / 3600),
                  static_cast<long long>(t / 60 % 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(t / 60), static_cast<long long>(t % 60));
  return buf;
}

// data.text must be the text a prepared data.dir was made from: another file
// would otherwise be silently ignored. Compared by content, so the same text
// under another path is accepted. Not compared: a dataset prepared before the
// hashes were recorded (none to compare with: used as it is), fine-tuning data
// (made from examples by `loom prepare --sft`, never from data.text), and a
// data.text that no longer exists (the prepared data is all there is).
void check_prepared_from(const DatasetInfo& info, const fs::path& text) {
  std::error_code ec;
  if (text.empty() || info.mode != DatasetMode::text || info.sources_sha256.empty() || !fs::exists(text, ec)) return;
  if (info.sources_sha256.size() == 1 && info.sources_sha256[0] == sha256_file(text)) return;
  throw Error(str("data.text '", text.string(), "' is not the text the dataset in '", info.dir.string(),
                  "' was prepared from (", joined(info.sources, ", "), "): point data.dir at a new directory to "
                  "prepare data.text there, delete '", info.dir.string(), "' to prepare it again, or set "
                  "data.text = \"\" to train on the prepared data as it is"));
}

// The dataset a config names: data.dir if it holds a prepared dataset, else
// data.text prepared into data.dir, with `tokenizer` when given (one beside
// an imported checkpoint) or a tokenizer trained for it.
DatasetInfo ensure_dataset(const Config& cfg, int64_t seq_len, const std::optional<fs::path>& tokenizer, bool quiet) {
  const fs::path dir = cfg.get<std::string>("data.dir");
  std::error_code ec;
  if (fs::exists(dir / "dataset.json", ec)) {
    DatasetInfo info = DatasetInfo::read(dir);
    check_prepared_from(info, cfg.get<std::string>("data.text"));
    if (tokenizer) {
      if (info.tokenizer_sha256 != sha256_file(*tokenizer))
        throw Error(str("the dataset in '", dir.string(), "' was tokenized with ", info.tokenizer.string(),
                        ", not with ", tokenizer->string(), " beside the checkpoint init.from imports: point "
                        "data.dir at a new directory to prepare the data with the checkpoint's tokenizer"));
      return info;
    }
    const int64_t wanted = cfg.get<int64_t>("data.vocab_size");
    if (info.vocab_size != wanted)
      throw Error(str("the dataset in '", dir.string(), "' was prepared with a vocabulary of ", info.vocab_size,
                      " but data.vocab_size = ", wanted, ": set data.vocab_size = ", info.vocab_size,
                      ", or point data.dir at a new directory to prepare the data again"));
    return info;
  }
  const std::string text = cfg.get<std::string>("data.text");
  if (text.empty())
    throw Error(str("data.dir '", dir.string(), "' holds no prepared dataset (dataset.json) and data.text is empty: "
                    "run `loom prepare` or set data.text to a UTF-8 text file"));
  if (!quiet) std::printf("preparing %s into %s ...\n", text.c_str(), dir.string().c_str());
  PrepareOptions po;
  po.inputs = {text};
  po.out_dir = dir;
  if (tokenizer)
    po.tokenizer = *tokenizer;
  else
    po.vocab_size = static_cast<int>(cfg.get<int64_t>("data.vocab_size"));
  po.val_fraction = cfg.get<double>("data.val_fraction");
  po.seq_len = static_cast<int>(seq_len);
  return prepare_dataset(po);
}

constexpr const char* kMetricsFile = "metrics.jsonl";

// The signal that asked this process's run to stop, 0 while none has. The
// handler only stores it; the ranks read it at the end of each step.
volatile std::sig_atomic_t g_stop_signal = 0;

void on_stop_signal(int signal) { g_stop_signal = signal; }

// The stop signal as the ranks agree on it: a signal may reach one process of
// an MPI job only, or arrive while the rank threads of a local run read the
// flag one after the other, so every rank takes the largest any rank saw and
// all stop after the same step.
int agreed_stop_signal(Communicator* world) {
  int32_t signal = g_stop_signal;
  if (world) world->all_reduce(&signal, 1, DType::i32, ReduceOp::max);
  return signal;
}

const char* signal_name(int signal) { return signal == SIGINT ? "SIGINT" : "SIGTERM"; }

// A fresh run into a directory holding another run's checkpoints would move
// `latest` to its own steps and shadow that run (and retention would then
// delete its checkpoints): refused, before anything is built, unless the user
// says which they mean.
void check_out_dir(const fs::path& out_dir, const RunOptions& run) {
  if (run.resume && run.overwrite)
    throw Error("--resume continues the run in train.out_dir and --overwrite deletes it: give only one of them");
  if (run.resume || run.overwrite) return;
  const std::vector<CheckpointEntry> steps = list_checkpoints(out_dir);
  std::error_code ec;
  if (steps.empty() && !fs::exists(out_dir / kLatestFile, ec)) return;
  const std::string holds = steps.empty() ? str("a '", kLatestFile, "' pointer")
                                          : str(steps.size(), " checkpoint(s), the newest at step ", steps.back().step);
  throw Error(str("train.out_dir '", out_dir.string(), "' already holds a run (", holds,
                  "): pass --resume to continue it, set train.out_dir to another directory, or pass --overwrite "
                  "to delete its checkpoints and start afresh"));
}

// --overwrite: `latest` goes first, so that at every moment it names a
// complete checkpoint or nothing (never a half-removed one); then the old
// steps and metrics. The new run's checkpoints are then committed atomically
// as any run's are.
void remove_run(const fs::path& out_dir) {
  auto remove = [](const fs::path& p) {
    std::error_code ec;
    fs::remove_all(p, ec);
    if (ec) throw Error(str("--overwrite: cannot remove '", p.string(), "': ", ec.message()));
  };
  remove(out_dir / kLatestFile);
  for (const CheckpointEntry& c : list_checkpoints(out_dir)) remove(c.path);
  remove(out_dir / kMetricsFile);
}

class MetricsLog {
 public:
  explicit MetricsLog(const fs::path& path) : out_(path, std::ios::app) {
    if (!out_) throw Error(str("cannot open metrics file '", path.string(), "' for appending"));
  }
  void write(const nlohmann::json& record) {
    out_ << record.dump() << "\n";
    out_.flush();
  }

 private:
  std::ofstream out_;
};

// One rank of a run: `world` holds every rank of the run, or is nullptr for
// the single-rank reference. With tensor or pipeline parallelism the ranks
// form a dp x pp x tp mesh; otherwise the world is the data-parallel
// communicator. World rank 0 prints, writes metrics.jsonl and the sample;
// every rank takes part in every collective (steps, validation, checkpoints,
// the sample's forwards or the gathered state).
RunResult train_rank(const Config& cfg, const TrainPlan& plan, const RunOptions& run, Communicator* world) {
  const bool root = !world || world->rank() == 0;
  const bool quiet = run.quiet || !root;
  const bool tty = isatty(STDOUT_FILENO) && !quiet;
  auto say = [&](const std::string& line) {
    if (!quiet) std::printf("%s\n", line.c_str());
    std::fflush(stdout);
  };
  // The budgets hold for every rank's allocators, under any memory policy.
  Allocator& device = MemoryContext::current().tier(Tier::device);
  Allocator& host = MemoryContext::current().tier(Tier::host);
  device.set_budget(cfg.get_bytes("memory.device_budget"));
  host.set_budget(cfg.get_bytes("memory.host_budget"));

  // Rank 0 prepares the dataset on first use; the others read it once it exists.
  const bool imported = !plan.init_hf.empty();
  const std::optional<fs::path> hf_tokenizer =
      plan.init_tokenizer.empty() ? std::nullopt : std::optional<fs::path>(plan.init_tokenizer);
  DatasetInfo data;
  if (root) data = ensure_dataset(cfg, plan.seq_len, hf_tokenizer, quiet);
  if (world) world->barrier();
  if (!root) data = ensure_dataset(cfg, plan.seq_len, hf_tokenizer, true);
  if (data.vocab_size > plan.model.vocab_size)
    throw Error(str("the dataset in '", data.dir.string(), "' was tokenized with a vocabulary of ", data.vocab_size,
                    " but ",
                    imported ? str("the checkpoint in '", plan.init_hf.string(), "' has vocab_size = ")
                             : std::string("model.vocab_size = "),
                    plan.model.vocab_size, ": ",
                    imported ? std::string("prepare the data with the checkpoint's tokenizer (place it beside "
                                           "config.json) or one of at most that many tokens")
                             : str("set model.vocab_size >= ", data.vocab_size,
                                   " or prepare the data with a smaller vocabulary")));
  const Tokenizer tokenizer = Tokenizer::load(data.tokenizer);

  const std::unique_ptr<DeviceMesh> mesh = world ? plan_mesh(plan, *world) : nullptr;

  // Every tensor- and pipeline-parallel rank of a replica reads the
  // replica's batches.
  LoaderOptions lo;
  lo.shards = {data.train.file};
  lo.masks = data.train.masks();
  lo.seq_len = static_cast<int>(plan.seq_len);
  lo.micro_batch = static_cast<int>(plan.micro_batch);
  lo.global_batch = static_cast<int>(plan.global_batch);
  lo.dp_rank = mesh ? mesh->coord(MeshAxis::dp) : world ? world->rank() : 0;
  lo.dp_size = static_cast<int>(plan.dp);
  lo.seed = plan.options.seed;
  TokenLoader loader(lo);
  loader.check_vocab(static_cast<int>(plan.model.vocab_size));

  const std::unique_ptr<Trainer> trainer_on_rank = mesh ? std::make_unique<Trainer>(plan.model, plan.options, *mesh)
                                                        : std::make_unique<Trainer>(plan.model, plan.options, world);
  Trainer& trainer = *trainer_on_rank;
  // The old run goes only once the new one has passed every check and is built.
  if (root && run.overwrite) remove_run(plan.out_dir);
  if (root) fs::create_directories(plan.out_dir);
  if (run.resume) {
    auto latest = read_latest(plan.out_dir);
    if (!latest)
      throw Error(str("--resume: no checkpoint in '", plan.out_dir.string(),
                      "' (no 'latest' file); start without --resume"));
    CheckpointInfo info = load_checkpoint(*latest, trainer);
    loader.restore(info.fields.at("loader").get<LoaderState>());
    say(str("resumed from ", latest->string(), " at step ", info.step));
  } else if (!plan.init_checkpoint.empty()) {
    load_weights(read_checkpoint_info(plan.init_checkpoint), trainer, plan.options.seed);
    const size_t masked = plan.options.adamw.keep_zeros.size();
    say(str("initialized from ", plan.init_checkpoint.string(),
            masked > 0 ? str(", keeping the zeros of its ", masked, " pruned matrices") : std::string()));
  } else if (imported) {
    const HFImport src(plan.init_hf);
    load_hf_weights(src, trainer);
    say(str("initialized from ", plan.init_hf.string(), " (", src.hf.architecture, ", ",
            src.checkpoint.tensors().size(), " tensors)"));
  }

  if (!plan.distill_teacher.empty()) {
    load_teacher(plan.distill_teacher, trainer);
    const DistillOptions& d = *plan.options.distill;
    say(str("distilling from ", plan.distill_teacher, " (", d.teacher.n_layer, " layers, width ", d.teacher.n_embd,
            "): temperature ", d.loss.temperature, ", alpha ", d.loss.alpha));
  }

  // MFU is against the whole job's peak: each rank measures its own share of
  // the cores at the same time, and the shares add up.
  double sgemm_gflops = ops::measure_gemm_gflops(1024, 3);
  if (world) {
    float share = static_cast<float>(sgemm_gflops);
    world->all_reduce(&share, 1, DType::f32, ReduceOp::sum);
    sgemm_gflops = share;
  }
  const double flops_per_step = training_flops_per_step(plan.model, plan.global_batch, plan.seq_len);
  const int64_t tokens_per_step = plan.global_batch * plan.seq_len;
  say(str("model: ", plan.model.n_layer, " layers, width ", plan.model.n_embd, ", ", plan.model.n_head,
          " heads, vocab ", plan.model.vocab_size, ", context ", plan.model.block_size, " = ",
          static_cast<double>(plan.model.num_params()) / 1e6, "M parameters"));
  if (const LoRAConfig& lora = plan.model.lora; lora.enabled()) {
    say(str("LoRA: r ", lora.r, ", alpha ", lora.alpha, ", dropout ", lora.dropout, " on ", joined(lora.targets, ","), ": ",
            static_cast<double>(plan.model.num_adapter_params()) / 1e6,
            "M trainable parameters; the rest are frozen"));
  }
  say(str("data: ", data.train.tokens, " train / ", data.val.tokens, " val tokens (", data.val.chars_per_token(),
          " chars/token); ", plan.global_batch, " x ", plan.seq_len, " tokens per step in ", plan.accumulation,
          " micro-batches", mesh ? " per replica" : world ? " per rank" : "", "; ", plan.steps, " steps; threads ",
          host_threads(), world ? " per rank" : ""));
  if (data.mode == DatasetMode::sft)
    say(str("fine-tuning: ", data.train.examples, " examples packed into rows of ", data.seq_len, " tokens (",
            data.train.truncated, " truncated), loss on ", data.train.targets, " response tokens"));
  if (mesh) {
    const ModelParallelOptions& mp = plan.options.model_parallel;
    const TensorGrid* grid = mesh->tensor_grid();
    say(str("parallel: ", mesh->shape().describe(), " mesh (", world->backend(), " backend)",
            grid ? str(", tp as a ", grid->q, " x ", grid->q, grid->depth > 1 ? str(" x ", grid->depth) : "",
                       grid->cube ? " (3d)" : grid->depth > 1 ? " (2.5d)" : " (2d)", " grid")
                 : "",
            mp.sequence_parallel ? ", sequence parallel" : "", plan.pp > 1 ? ", schedule " : "",
            plan.pp > 1 ? pipeline_schedule_name(mp.schedule) : "",
            mp.virtual_stages > 1 ? str(" with ", mp.virtual_stages, " virtual stages") : "", ", ZeRO stage ",
            plan.options.zero.stage, ", precision ", cfg.get<std::string>("precision"),
            "; memory figures are rank 0's"));
  } else if (world) {
    say(str("parallel: ", plan.dp, " data-parallel ranks (", world->backend(), " backend), ZeRO stage ",
            plan.options.zero.stage, ", precision ", cfg.get<std::string>("precision"),
            "; memory figures are rank 0's"));
  }
  // Where the bytes live: said once the model state is placed, and again at
  // the end with the step's high-water marks.
  auto say_memory = [&] {
    if (!quiet) {
      std::string text = describe(trainer.memory_report());
      while (!text.empty() && text.back() == '\n') text.pop_back();
      say(text);
    }
  };
  say_memory();

  std::optional<MetricsLog> metrics;
  if (root) metrics.emplace(plan.out_dir / kMetricsFile);
  nlohmann::json checkpoint_fields = {{"config", cfg.to_json()},
                                      {"tokenizer", data.tokenizer.string()},
                                      {"tokenizer_sha256", data.tokenizer_sha256},
                                      {"dataset", data.dir.string()}};
  // A pruned model stays one: what it was pruned as goes into its runs'
  // checkpoints, so fine-tuning them again keeps the same zeros.
  if (!plan.init_checkpoint.empty()) {
    const CheckpointInfo init = read_checkpoint_info(plan.init_checkpoint);
    if (init.fields.contains(kPruningField)) checkpoint_fields[kPruningField] = init.fields.at(kPruningField);
  }
  const int64_t log_interval = cfg.get<int64_t>("train.log_interval");
  const int64_t eval_interval = cfg.get<int64_t>("train.eval_interval");
  // Periodic validation runs train.eval_batches micro-batches in all, spread
  // over the ranks' slices of the split; the final one covers all of it.
  const int64_t eval_batches = (cfg.get<int64_t>("train.eval_batches") + plan.dp - 1) / plan.dp;
  const int64_t ckpt_interval = cfg.get<int64_t>("train.checkpoint_interval");
  const int64_t keep_last = cfg.get<int64_t>("train.keep_last");
  const bool fp16 = plan.options.zero.precision == DType::f16;
  const bool placed = plan.options.memory.policy != MemoryPolicy::none;

  auto validate = [&](int64_t max_batches) {
    return evaluate(trainer, {data.val.file}, plan.seq_len, plan.micro_batch, data.val.chars_per_token(),
                    max_batches, data.val.masks());
  };
  // A checkpoint's outcome is told when it is committed, which under
  // train.checkpoint_async is a few steps after the one it holds.
  CheckpointWriter checkpoints(
      plan.out_dir, trainer, mesh.get(),
      {.keep_last = keep_last,
       .async = cfg.get<bool>("train.checkpoint_async"),
       .stop_on_failure = cfg.get<std::string>("train.checkpoint_failure") == "stop"},
      [&](const CheckpointOutcome& c) {
        if (!c.error.empty()) {
          if (root) metrics->write({{"step", c.step}, {"checkpoint_failed", c.error}});
          say(str("checkpoint of step ", c.step, " FAILED (", c.error, "); training goes on, any earlier "
                  "checkpoint is intact"));
          return;
        }
        if (root) metrics->write({{"step", c.step}, {"checkpoint", c.dir.filename().string()},
                                  {"checkpoint_seconds", c.seconds}});
        say(str("checkpoint ", c.dir.string()));
      });
  auto checkpoint = [&] {
    checkpoint_fields["loader"] = loader.state();
    checkpoints.save(checkpoint_fields);
  };

  // Each rank records its own timeline; every rank writes it (a collective)
  // after the last traced step, or when the run stops inside the range.
  const std::unique_ptr<TraceRecorder> recorder =
      plan.trace_path.empty() ? nullptr : std::make_unique<TraceRecorder>();
  const int64_t last_traced = std::min(plan.trace_steps.last, plan.steps);

  std::vector<int32_t> inputs(static_cast<size_t>(plan.accumulation * plan.micro_batch * plan.seq_len)),
      targets(inputs.size());
  std::vector<MicroBatch> micro(static_cast<size_t>(plan.accumulation));
  const int64_t first_step = trainer.steps_done();
  const double t_start = seconds_now();
  double t_window = t_start;
  int64_t window_steps = 0;
  // Writing the trace is not step time.
  auto write_timeline = [&] {
    report_progress("trace write", last_traced);
    const double t = seconds_now();
    write_trace(plan.trace_path, *recorder, world);
    if (tty) std::printf("\n");
    say(str("trace of steps ", plan.trace_steps.first, "-", last_traced, " written to ", plan.trace_path.string()));
    t_window += seconds_now() - t;
  };
  for (int64_t step = first_step; step < plan.steps; ++step) {
    const int64_t done = step + 1;
    const bool traced = recorder && plan.trace_steps.contains(done);
    const bool logged = root && (done % log_interval == 0 || done == plan.steps || done == first_step + 1);
    // The bytes a logged step moves between tiers: the difference of the
    // manager's cumulative traffic across it.
    TierTraffic before;
    if (logged && placed) before = trainer.memory_report().traffic;
    StepStats st;
    int signal = 0;
    {
      // A traced step starts and ends on every rank together, so that it is
      // one interval of every rank's timeline (the ranks would otherwise
      // begin it as they finish the last one, pipeline stages apart); the
      // wait at its end shows which ranks waited for the others. The wait to
      // start is tracing's own, not step time.
      if (traced && world) {
        const double t = seconds_now();
        world->barrier();
        t_window += seconds_now() - t;
      }
      const TraceStep trace_step(traced ? recorder.get() : nullptr, done);
      report_progress("data load", done);
      {
        const TraceScope load(TraceCategory::data, "load batch");
        for (int64_t m = 0; m < plan.accumulation; ++m) {
          const size_t off = static_cast<size_t>(m * plan.micro_batch * plan.seq_len);
          const std::span<int32_t> in(inputs.data() + off, static_cast<size_t>(plan.micro_batch * plan.seq_len));
          const std::span<int32_t> tg(targets.data() + off, in.size());
          const int64_t first_sequence = loader.next(in, tg);  // within the global batch, so dropout is layout-free
          micro[static_cast<size_t>(m)] = {in.data(), tg.data(), {plan.micro_batch, plan.seq_len}, first_sequence};
        }
      }
      st = trainer.step(micro);
      // Under asynchronous streams the step's last kernels (the optimizer's)
      // may still run when step() returns: a traced step holds them.
      if (traced) ops::synchronize();
      if (run.after_step) run.after_step(done);
      // Whether a signal asks the run to stop after this step: part of the
      // step, so that the step's logged and traced times hold it. A signal
      // that comes later in this iteration (validation, a checkpoint) stops
      // the run after the next step.
      signal = agreed_stop_signal(world);
      if (traced && world) world->barrier();
    }
    // Under asynchronous streams a step's last kernels run into the next
    // step's logged time; a traced step holds only its own work, so the step
    // before it waits for its kernels.
    if (recorder && plan.trace_steps.contains(done + 1)) ops::synchronize();
    checkpoints.poll();
    ++window_steps;
    // A diverging step skipped (train.max_skipped_steps) is always said and
    // recorded, whatever the log interval.
    const bool diverged = st.skip != StepSkip::none && st.skip != StepSkip::overflow;
    if (diverged) {
      if (tty) std::printf("\n");
      say(str("step ", done, " skipped: ",
              st.skip == StepSkip::loss_spike
                  ? str("loss ", st.loss, " is ", st.loss / st.loss_mean, "x the running mean ", st.loss_mean)
              : st.skip == StepSkip::non_finite_loss ? str("loss ", st.loss, " is not finite")
                                                     : str("gradient norm ", st.grad_norm, " is not finite"),
              " (", trainer.loss_watch().skipped_in_a_row, " in a row)"));
    }

    if (logged || (root && diverged)) {
      const double now = seconds_now();
      const double step_time = (now - t_window) / static_cast<double>(window_steps);
      const double tok_s = static_cast<double>(tokens_per_step) / step_time;
      const double mfu = flops_per_step / step_time / 1e9 / sgemm_gflops;
      const double eta = step_time * static_cast<double>(plan.steps - done);
      nlohmann::json record = {{"step", done},
                               {"loss", st.loss},
                               {"lr", st.lr},
                               {"grad_norm", st.grad_norm},
                               {"tokens_per_s", tok_s},
                               {"mfu", mfu},
                               {"device_peak_bytes", device.peak()},
                               {"device_peak_reserved_bytes", device.peak_reserved()},
                               {"host_peak_bytes", host.peak()},
                               {"host_peak_reserved_bytes", host.peak_reserved()},
                               {"elapsed_s", now - t_start},
                               {"eta_s", eta}};
      if (diverged) {
        record["skip"] = step_skip_name(st.skip);
        record["loss_mean"] = st.loss_mean;
      }
      if (placed && logged) {
        const TierTraffic after = trainer.memory_report().traffic;
        auto moved = [&](Tier from, Tier to) { return after.at(from, to) - before.at(from, to); };
        record["host_to_device_bytes"] = moved(Tier::host, Tier::device);
        record["device_to_host_bytes"] = moved(Tier::device, Tier::host);
        record["nvme_read_bytes"] = moved(Tier::nvme, Tier::host) + moved(Tier::nvme, Tier::device);
        record["nvme_write_bytes"] = moved(Tier::host, Tier::nvme) + moved(Tier::device, Tier::nvme);
      }
      std::string line = str("step ", done, "/", plan.steps, "  loss ", st.loss);
      // The loss's parts (distillation: loss_kl, loss_ce).
      for (const auto& [name, mean] : st.loss_parts) {
        record[str("loss_", name)] = mean;
        line += str("  ", name, " ", static_cast<float>(mean));
      }
      if (fp16) {
        // Skipped steps ran but applied no update; the counters say how many.
        const int64_t skipped = trainer.steps_done() - trainer.optimizer_steps();
        record["loss_scale"] = st.loss_scale;
        record["skipped"] = skipped;
        char scale[32];  // powers of two, printed whole up to 2^33
        std::snprintf(scale, sizeof scale, "%.10g", static_cast<double>(st.loss_scale));
        line += str("  scale ", scale, "  skipped ", skipped);
      }
      metrics->write(record);
      line += str("  lr ", st.lr, "  ", static_cast<int64_t>(tok_s), " tok/s  MFU ",
                  static_cast<int>(mfu * 100 + 0.5), "%  mem ", format_bytes(static_cast<double>(device.peak())),
                  placed ? str(" (host ", format_bytes(static_cast<double>(host.peak())), ")") : std::string(),
                  "  ETA ", format_duration(eta));
      if (tty) {
        std::printf("\r\033[K%s", line.c_str());
        std::fflush(stdout);
      } else {
        say(line);
      }
      // Writing the record and the line is not the next step's time.
      t_window = seconds_now();
      window_steps = 0;
    }
    if (recorder && done == last_traced) write_timeline();
    if (eval_interval > 0 && done % eval_interval == 0 && done != plan.steps) {
      const EvalResult ev = validate(eval_batches);
      if (root)
        metrics->write({{"step", done}, {"val_loss", ev.loss_per_token}, {"val_loss_per_char", ev.loss_per_char}});
      if (tty) std::printf("\n");
      say(str("step ", done, "  val loss ", ev.loss_per_token, " per token, ", ev.loss_per_char, " per char"));
    }
    const bool checkpointed = (ckpt_interval > 0 && done % ckpt_interval == 0) || done == plan.steps;
    if (checkpointed) {
      if (tty) std::printf("\n");
      checkpoint();
    }
    // A signal stops the run after any step, the last included: its final
    // validation and sample then run on --resume.
    if (signal != 0 || (run.stop_after > 0 && done >= run.stop_after && done < plan.steps)) {
      if (tty) std::printf("\n");
      if (!checkpointed) checkpoint();
      checkpoints.finish();
      if (recorder && done >= plan.trace_steps.first && done < last_traced) write_timeline();
      if (signal == 0) {
        say(str("stopped after step ", done, " (--stop-after)"));
        return {.final_eval = {}, .steps_done = done};
      }
      const std::string name = checkpoint_dir_name(done);
      if (root) metrics->write({{"step", done}, {"stopped_by", signal_name(signal)}, {"checkpoint", name}});
      say(str("stopped by ", signal_name(signal), " after step ", done, "; checkpoint ", name,
              " written; resume with --resume"));
      return {.final_eval = {}, .steps_done = done, .stop_signal = signal};
    }
  }
  checkpoints.finish();
  if (tty) std::printf("\n");

  const EvalResult final_eval = validate(0);
  if (root)
    metrics->write({{"step", plan.steps},
                    {"final_val_loss", final_eval.loss_per_token},
                    {"final_val_loss_per_char", final_eval.loss_per_char},
                    {"train_seconds", seconds_now() - t_start}});
  say(str("final validation loss: ", final_eval.loss_per_token, " nats/token, ", final_eval.loss_per_char,
          " nats/char over ", final_eval.tokens, " tokens; trained in ", format_duration(seconds_now() - t_start)));
  say_memory();

  const int64_t sample_tokens = cfg.get<int64_t>("train.sample_tokens");
  if (sample_tokens > 0 && !run.quiet) {
    const std::string prompt = cfg.get<std::string>("train.sample_prompt");
    SampleOptions so;
    so.seed = plan.options.seed;
    std::function<void(const std::string&)> print_piece;
    if (root)
      print_piece = [](const std::string& piece) {
        std::fputs(piece.c_str(), stdout);
        std::fflush(stdout);
      };
    if (root) std::printf("--- sample ---\n%s", prompt.c_str());
    if (mesh) {
      // Generation needs the whole model on one rank: every rank gathers the
      // state (collective) and rank 0 generates with it alone.
      const Trainer::State state = trainer.gather_state();
      if (root) {
        GPT whole(plan.model);
        ParamStore params(whole.layout(), plan.options.seed);
        params.flat().copy_from(state.params);
        generate(whole, params, tokenizer, prompt, sample_tokens, so, print_piece);
      }
    } else {
      // Every rank generates in lockstep (under ZeRO-3 each forward gathers
      // the parameters collectively); the draws agree, so rank 0 alone prints.
      generate(trainer.model(), trainer.params(), tokenizer, prompt, sample_tokens, so, print_piece);
    }
    if (root) std::printf("\n--------------\n");
  }
  return {.final_eval = final_eval, .steps_done = plan.steps};
}

// parallel.auto: `given` with its layout keys replaced by the search's
// fastest layout that fits, on as many ranks, priced with this machine's
// calibration.
Config with_searched_layout(const Config& given, bool quiet) {
  const fs::path calibration = default_calibration_path();
  std::error_code ec;
  if (!fs::exists(calibration, ec))
    throw ConfigError(given, "parallel.auto",
                      str("prices the layouts with this machine's calibration, and there is none at ",
                          calibration.string()),
                      "run `loom calibrate` first, or set parallel.auto = false and choose the layout (`loom plan "
                      "--search` ranks them)");
  const MachineRates rates = load_machine_rates(calibration);
  const int64_t world =
      given.get<int64_t>("parallel.dp") * given.get<int64_t>("parallel.tp") * given.get<int64_t>("parallel.pp");
  const LayoutSearch search = search_layouts(given, rates, world, plan_device_budget(given, {}, rates));
  if (search.ranked.empty())
    throw ConfigError(given, "parallel.auto",
                      str("found no layout of ", world, " ranks that fits memory.device_budget = ",
                          format_bytes(search.device_budget), " (", search.too_large, " valid layouts do not fit)"),
                      "raise memory.device_budget or the ranks (parallel.dp); `loom plan --search` lists the "
                      "rejections");
  Config cfg = given;
  std::string chosen;
  for (const std::string& setting : layout_settings(search.ranked.front().layout)) {
    cfg.set_override(setting);
    chosen += " " + setting;
  }
  if (!quiet)
    std::printf("parallel.auto chose%s: predicted %s, the fastest of %zu layouts of %lld ranks that fit\n",
                chosen.c_str(), describe_step_time(search.ranked.front().time).c_str(), search.ranked.size(),
                static_cast<long long>(world));
  return cfg;
}

}  // namespace

RunResult run_training(const Config& given, const RunOptions& run) {
  const Config cfg = given.get<bool>("parallel.auto") ? with_searched_layout(given, run.quiet) : given;
  const TrainPlan plan = plan_training(cfg);
  check_out_dir(plan.out_dir, run);
  // SIGTERM and SIGINT ask the run to stop for as long as it runs.
  // SA_RESETHAND: a second signal of the same kind finds the default action
  // and ends the process at once (a user pressing Ctrl-C twice, a scheduler
  // that will not wait).
  g_stop_signal = 0;
  const ScopedTerminationHandler stop_signals(on_stop_signal, SA_RESTART | SA_RESETHAND);
  // The reference run stays on this thread, exactly as without parallelism,
  // with allocators of its own as every launched rank has: the run's budgets
  // and high-water marks are its own, not the process's.
  if (plan.reference() && plan.backend == "local") {
    MemoryContext memory;
    MemoryContext::Install install(memory);
    RunResult result;
    run_watched(plan.watchdog_timeout, [&] { result = train_rank(cfg, plan, run, nullptr); });
    return result;
  }
  // Every rank ends with the same result (each validates the whole split, and
  // they agree on a stop); under mpi each process returns its own.
  RunResult result;
  std::mutex result_mutex;
  CommOptions options;
  options.watchdog_timeout = plan.watchdog_timeout;
  launch(plan.backend, plan.nproc, [&](Communicator& world) {
    const RunResult r = train_rank(cfg, plan, run, plan.reference() ? nullptr : &world);
    const std::lock_guard lock(result_mutex);
    result = r;
  }, options);
  return result;
}

}  // namespace loom
