// `loom plan`: the config's predicted figures as the planner computes them,
// the layout search's accounting and ranking, and where the rates come from.
#include <gtest/gtest.h>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <tuple>

#include "test_util.h"
#include "loom/config.h"
#include "loom/data.h"
#include "loom/io.h"
#include "loom/planner.h"
#include "loom/train.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

Config tiny(std::initializer_list<std::string> overrides = {}) {
  Config c(loom_schema());
  c.load_toml(LOOM_SOURCE_DIR "/configs/tiny-test.toml");
  for (const std::string& o : overrides) c.set_override(o);
  return c;
}

// A machine's rates without calibrating: the H100 description, saved as
// `loom calibrate` saves rates and read back as `loom plan --rates` reads them.
MachineRates h100() { return load_machine_rates(LOOM_SOURCE_DIR "/hardware/h100-sxm.json"); }

// What the planner's models take of a validated config.
StepMemoryOptions memory_options_of(const TrainPlan& plan) {
  return {.precision = plan.options.zero.precision,
          .bucket_bytes = plan.options.zero.bucket_bytes,
          .memory = plan.options.memory};
}

std::string plan_output(const Config& cfg, const PlanCommandOptions& options) {
  std::ostringstream out;
  run_plan(cfg, options, out);
  return out.str();
}

std::string rate_text(const StepTimePrediction& t) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.0f tokens/s, MFU %.2f%%", t.tokens_per_s, 100.0 * t.mfu);
  return buf;
}

double worst_device_peak(const std::vector<RankMemory>& ranks) {
  double most = 0.0;
  for (const RankMemory& r : ranks) most = std::max(most, r.peak(Tier::device));
  return most;
}

Config with_layout(const Config& cfg, const Layout& layout) {
  Config c = cfg;
  for (const std::string& s : layout_settings(layout)) c.set_override(s);
  return c;
}

TEST(PlanCommand, PrintsThePlannersMemoryAndTimeOfTheConfigsLayout) {
  TempDir dir;
  save_machine_rates(h100(), dir / "rates.json");
  const Config cfg = tiny({"parallel.dp=2", "parallel.tp=2", "zero.stage=1", "train.batch_size=4"});
  const std::string out = plan_output(cfg, {.rates = {.rates = dir / "rates.json"}});

  const TrainPlan plan = plan_training(cfg);
  const LayoutProblem problem = layout_problem_of(cfg, plan.model);
  const Layout layout = layout_of(cfg);
  const StepMemoryOptions memory = memory_options_of(plan);
  const std::vector<RankMemory> ranks = predict_step_memory(problem, layout, memory);
  ASSERT_EQ(ranks.size(), 4u);
  for (const RankMemory& r : ranks) EXPECT_CONTAINS(out, "device " + format_bytes(r.peak(Tier::device)));
  const StepTimePrediction t = predict_step_time(problem, layout, memory, load_machine_rates(dir / "rates.json"));
  EXPECT_CONTAINS(out, rate_text(t));
  std::string line = "layout: --set";
  for (const std::string& s : layout_settings(layout)) line += " " + s;
  EXPECT_CONTAINS(out, line);
  EXPECT_CONTAINS(out, "device budget unlimited");

  // A hardware file's device memory is the budget unless the config sets one.
  save_machine_rates(h100(), dir / "hw.json");
  EXPECT_CONTAINS(plan_output(cfg, {.rates = {.hardware = dir / "hw.json"}}),
                  "device budget " + format_bytes(h100().device_memory_bytes));
  Config budgeted = cfg;
  budgeted.set_override("memory.device_budget=3MiB");
  EXPECT_CONTAINS(plan_output(budgeted, {.rates = {.hardware = dir / "hw.json"}}), "device budget " + format_bytes(3 << 20));

  // The config is validated as `loom train` validates it.
  EXPECT_CONTAINS(error_of([&] { plan_output(tiny({"train.batch_size=5"}), {.rates = {.rates = dir / "rates.json"}}); }),
                  "train.batch_size");
}

TEST(PlanCommand, SearchAccountsForEveryCandidateAndRanksWhatFitsByTime) {
  TempDir dir;
  save_machine_rates(h100(), dir / "rates.json");
  const MachineRates rates = load_machine_rates(dir / "rates.json");
  const Config base = tiny({"train.batch_size=8"});
  const int64_t world = 4;

  // Unlimited: every valid layout fits. Then a budget that half of them exceed.
  const LayoutSearch all = search_layouts(base, rates, world, std::numeric_limits<double>::infinity());
  ASSERT_GT(all.ranked.size(), 4u);
  EXPECT_EQ(all.too_large, 0);
  std::vector<double> peaks;
  for (const RankedLayout& r : all.ranked) peaks.push_back(r.device_peak);
  std::sort(peaks.begin(), peaks.end());
  const double budget = std::floor(peaks[peaks.size() / 2]);
  Config cfg = base;
  cfg.set_override(str("memory.device_budget=", static_cast<int64_t>(budget)));

  const LayoutSearch s = search_layouts(cfg, rates, world, plan_device_budget(cfg, {}, rates));
  EXPECT_EQ(s.device_budget, budget);
  const LayoutProblem problem = layout_problem_of(cfg, model_config_from(cfg));
  EXPECT_EQ(s.candidates, static_cast<int64_t>(layout_candidates(problem, world).size()));
  int64_t rejected = 0;
  for (const RuleRejections& r : s.rules) {
    EXPECT_GT(r.count, 0);
    rejected += r.count;
  }
  EXPECT_FALSE(s.rules.empty());
  EXPECT_GT(s.too_large, 0);
  EXPECT_GT(s.too_large_least_peak, budget);
  ASSERT_FALSE(s.ranked.empty());
  EXPECT_GT(s.equivalent, 0);
  EXPECT_EQ(rejected + s.equivalent + s.too_large + s.policy_refused + static_cast<int64_t>(s.ranked.size()),
            s.candidates);

  for (size_t i = 0; i < s.ranked.size(); ++i) {
    const RankedLayout& r = s.ranked[i];
    if (i > 0) {
      EXPECT_LE(s.ranked[i - 1].time.step_s, r.time.step_s);
    }
    EXPECT_LE(r.device_peak, budget);
    // Every proposal is a config `loom train` accepts, budget included.
    const Config chosen = with_layout(cfg, r.layout);
    EXPECT_NO_THROW(plan_training(chosen)) << ::testing::PrintToString(layout_settings(r.layout));
    EXPECT_EQ(layout_of(chosen).dp * layout_of(chosen).tp * layout_of(chosen).pp, world);
  }
  // The printed figures are the planner's for the best layouts.
  for (size_t i = 0; i < 3; ++i) {
    const RankedLayout& r = s.ranked[i];
    StepMemoryOptions memory;
    memory.precision = parse_dtype(cfg.get<std::string>("precision"));
    memory.bucket_bytes = cfg.get<int64_t>("zero.bucket_mb") << 20;
    memory.memory.policy = r.layout.memory_policy;
    memory.memory.micro_batches = problem.global_batch / (r.layout.dp * r.layout.micro_batch);
    EXPECT_EQ(r.device_peak, worst_device_peak(predict_step_memory(problem, r.layout, memory)));
    EXPECT_EQ(r.time.step_s, predict_step_time(problem, r.layout, memory, rates).step_s);
  }

  const std::string out =
      plan_output(cfg, {.rates = {.rates = dir / "rates.json"}, .search = true, .top = 3, .ranks = world});
  EXPECT_CONTAINS(out, str(s.candidates, " layouts of 4 ranks"));
  for (const RuleRejections& r : s.rules) EXPECT_CONTAINS(out, str(r.count, " rejected by ", r.rule, ", e.g. "));
  EXPECT_CONTAINS(out, str(s.equivalent, " left out"));
  EXPECT_CONTAINS(out, str(s.too_large, " do not fit"));
  EXPECT_CONTAINS(out, str(s.ranked.size(), " fit; the fastest 3:"));
  // The best three in their order, each with its rates and --set line.
  size_t previous = 0;
  for (size_t i = 0; i < 3; ++i) {
    std::string line = "--set";
    for (const std::string& setting : layout_settings(s.ranked[i].layout)) line += " " + setting;
    const size_t at = out.find(line);
    ASSERT_NE(at, std::string::npos) << line;
    EXPECT_GT(at, previous);
    previous = at;
    EXPECT_CONTAINS(out, rate_text(s.ranked[i].time));
  }
  EXPECT_EQ(out.find("  4. "), std::string::npos);
}

// A memory policy's chunk stores can fit by the memory model's peak and
// still be refused by loom train, whose check counts the chunk manager's
// working buffers all at once (plan_memory). The search holds such layouts
// to that check, so nothing it ranks is refused: here a statically placed
// dp2 ZeRO-3 run at its own predicted peak as the budget.
TEST(PlanCommand, SearchRanksNoMemoryPolicyLayoutThatTrainRefuses) {
  const Config base = tiny({"model.n_layer=4", "model.n_head=4", "model.n_embd=128", "model.vocab_size=1024",
                            "data.vocab_size=1024", "model.block_size=64", "train.seq_len=64",
                            "train.batch_size=16"});
  const Layout chunked{.dp = 2, .micro_batch = 1, .zero_stage = 3, .recompute = true,
                       .memory_policy = MemoryPolicy::fixed};
  const LayoutProblem problem = layout_problem_of(base, model_config_from(base));
  StepMemoryOptions memory;
  memory.memory.policy = MemoryPolicy::fixed;
  memory.memory.micro_batches = problem.global_batch / (chunked.dp * chunked.micro_batch);
  const double budget = std::floor(worst_device_peak(predict_step_memory(problem, chunked, memory)));
  Config cfg = base;
  cfg.set_override(str("memory.device_budget=", static_cast<int64_t>(budget)));
  EXPECT_CONTAINS(error_of([&] { plan_training(with_layout(cfg, chunked)); }), "cannot fit this model");

  const LayoutSearch s = search_layouts(cfg, h100(), 2, budget);
  EXPECT_GT(s.policy_refused, 0);
  EXPECT_CONTAINS(s.policy_refused_example, "cannot fit this model");
  ASSERT_FALSE(s.ranked.empty());
  for (const RankedLayout& r : s.ranked) {
    EXPECT_FALSE(layout_settings(r.layout) == layout_settings(chunked));
    EXPECT_NO_THROW(plan_training(with_layout(cfg, r.layout))) << ::testing::PrintToString(layout_settings(r.layout));
  }
  EXPECT_CONTAINS(plan_output(cfg, {.rates = {.hardware = LOOM_SOURCE_DIR "/hardware/h100-sxm.json"},
                                    .search = true,
                                    .ranks = 2}),
                  str(s.policy_refused, " refused by loom train's check of the chunk stores"));
}

// --nodes plans a cluster of a hardware file's machines: the config's layout
// must fill them, the search covers all their ranks, and what the file does
// not describe (a calibration's machine alone) is refused.
TEST(PlanCommand, NodesPlansACluster) {
  const RatesSource h100_file{.hardware = LOOM_SOURCE_DIR "/hardware/h100-sxm.json"};
  const Config filled = tiny({"parallel.dp=8", "parallel.tp=2", "train.batch_size=16", "train.micro_batch_size=2"});
  const std::string out = plan_output(filled, {.rates = h100_file, .nodes = 2});
  EXPECT_CONTAINS(out, "machines: 2 x 8 ranks = 16 ranks");
  EXPECT_CONTAINS(out, "ranks [0-15] (pipeline stage 0)");

  const std::string search = plan_output(tiny({"train.batch_size=16"}), {.rates = h100_file, .search = true, .nodes = 2});
  EXPECT_CONTAINS(search, "layouts of 16 ranks");

  std::string e = error_of([&] { plan_output(tiny({"parallel.dp=2"}), {.rates = h100_file, .nodes = 2}); });
  EXPECT_CONTAINS(e, "--nodes 2 of 8 ranks");
  EXPECT_CONTAINS(e, "hold 16 ranks, but the layout uses parallel.dp * parallel.tp * parallel.pp = 2");
  EXPECT_CONTAINS(e, "(parallel.dp = 16)");  // tp = pp = 1
  EXPECT_CONTAINS(e, "--search");
  e = error_of([&] { plan_output(filled, {.rates = h100_file, .search = true, .ranks = 16, .nodes = 2}); });
  EXPECT_CONTAINS(e, "not both");
  TempDir dir;
  save_machine_rates(h100(), dir / "rates.json");
  e = error_of([&] { plan_output(filled, {.rates = {.rates = dir / "rates.json"}, .nodes = 2}); });
  EXPECT_CONTAINS(e, "--nodes");
  EXPECT_CONTAINS(e, "pass --hardware FILE");
}

// Offloaded state: the step's split has the exposed transfers, and the plan
// says what a step moves between tiers; NVMe traffic needs NVMe rates.
TEST(PlanCommand, PricesAndPrintsTheTransfersOfOffloadedState) {
  TempDir dir;
  MachineRates rates = h100();
  save_machine_rates(rates, dir / "rates.json");
  const Config cfg =
      tiny({"memory.policy=static", "memory.offload_param_frac=0.5", "memory.offload_optim_frac=0.5"});
  const std::string out = plan_output(cfg, {.rates = {.rates = dir / "rates.json"}});
  const TrainPlan plan = plan_training(cfg);
  const LayoutProblem problem = layout_problem_of(cfg, plan.model);
  const StepTimePrediction t = predict_step_time(problem, layout_of(cfg), memory_options_of(plan), rates);
  EXPECT_GT(t.transfer_s, 0.0);
  EXPECT_CONTAINS(out, rate_text(t));
  EXPECT_CONTAINS(out, ", exposed transfers ");
  EXPECT_CONTAINS(out, "offloaded state moves per step (data-parallel rank 0): " + describe(t.traffic.bytes()));
  EXPECT_CONTAINS(out, "host->device");

  Config on_nvme = cfg;
  on_nvme.set_override(str("memory.nvme_dir=", dir.path().string()));
  EXPECT_CONTAINS(error_of([&] { plan_output(on_nvme, {.rates = {.rates = dir / "rates.json"}}); }),
                  "loom calibrate --nvme-dir");
  rates.nvme_read_bytes_per_s = 5e9;
  rates.nvme_write_bytes_per_s = 3e9;
  save_machine_rates(rates, dir / "nvme.json");
  EXPECT_CONTAINS(plan_output(on_nvme, {.rates = {.rates = dir / "nvme.json"}}), "nvme->host");
}

TEST(PlanCommand, MissingRatesSayToCalibrateOrPassAHardwareFile) {
  TempDir dir;
  const testing::ScopedEnv home("XDG_CACHE_HOME", dir.path().string());
  std::string e = error_of([] { plan_output(tiny(), {}); });
  EXPECT_CONTAINS(e, "loom calibrate");
  EXPECT_CONTAINS(e, "--hardware hardware/h100-sxm.json");
  EXPECT_CONTAINS(e, default_calibration_path().string());

  // parallel.auto refuses to guess, before anything is read or allocated.
  RunOptions quiet;
  quiet.quiet = true;
  e = error_of([&] { run_training(tiny({"parallel.auto=true"}), quiet); });
  EXPECT_CONTAINS(e, "parallel.auto");
  EXPECT_CONTAINS(e, "loom calibrate");

  // The default calibration is where the planner looks without flags.
  std::filesystem::create_directories(default_calibration_path().parent_path());
  save_machine_rates(h100(), default_calibration_path());
  EXPECT_CONTAINS(plan_output(tiny(), {}), "rates: NVIDIA H100");
}

// A Chrome trace's spans per pid: (category, name, depth, ts, dur).
struct TraceEvent {
  std::string cat, name;
  int depth = 0;
  double ts = 0, dur = 0;
};
std::map<int, std::vector<TraceEvent>> trace_events(const std::filesystem::path& path) {
  std::map<int, std::vector<TraceEvent>> out;
  const nlohmann::json trace = nlohmann::json::parse(read_file(path));
  for (const nlohmann::json& e : trace.at("traceEvents"))
    if (e.at("ph") == "X")
      out[e.at("pid").get<int>()].push_back({e.at("cat").get<std::string>(), e.at("name").get<std::string>(),
                                             e.at("args").at("depth").get<int>(), e.at("ts").get<double>(),
                                             e.at("dur").get<double>()});
  return out;
}

// The predicted step of the config's layout as `loom plan --trace` writes
// it: every rank's step span is the printed prediction's step time.
TEST(PlanCommand, TraceWritesThePredictedStepOfEveryRank) {
  TempDir dir;
  save_machine_rates(h100(), dir / "rates.json");
  const Config cfg = tiny({"parallel.dp=2", "parallel.pp=2", "zero.stage=1", "train.batch_size=8"});
  const std::filesystem::path path = dir / "predicted.json";
  const std::string out = plan_output(cfg, {.rates = {.rates = dir / "rates.json"}, .trace = path});
  EXPECT_CONTAINS(out, "trace: wrote " + path.string() + ", the predicted step of the config's layout on its 4 ranks");

  const TrainPlan plan = plan_training(cfg);
  const StepTimePrediction t = predict_step_time(layout_problem_of(cfg, plan.model), layout_of(cfg),
                                                 memory_options_of(plan), load_machine_rates(dir / "rates.json"));
  EXPECT_CONTAINS(out, rate_text(t));
  const std::map<int, std::vector<TraceEvent>> events = trace_events(path);
  ASSERT_EQ(events.size(), 4u);
  for (const auto& [rank, spans] : events) {
    ASSERT_FALSE(spans.empty());
    EXPECT_EQ(spans[0].cat, "step");
    EXPECT_NEAR(spans[0].dur, t.step_s * 1e6, 1e-12 * t.step_s * 1e6) << "rank " << rank;
  }
}

// --trace is checked as trace.path is, before anything is priced: an
// existing file is refused and left as it was, and so is a file in a
// directory that does not exist.
TEST(PlanCommand, TraceRefusesAnExistingFileBeforePricing) {
  TempDir dir;
  // No rates anywhere: the trace's refusal comes first.
  const testing::ScopedEnv home("XDG_CACHE_HOME", (dir / "cache").string());
  const std::filesystem::path taken = dir.write("taken.json", "{\"mine\": 1}");
  std::string e = error_of([&] { plan_output(tiny(), {.trace = taken}); });
  EXPECT_CONTAINS(e, "--trace '" + taken.string() + "' already exists");
  EXPECT_CONTAINS(e, "remove it, or pass --trace a new file");
  EXPECT_EQ(read_file(taken), "{\"mine\": 1}");
  e = error_of([&] { plan_output(tiny(), {.search = true, .trace = taken}); });
  EXPECT_CONTAINS(e, "already exists");
  EXPECT_EQ(read_file(taken), "{\"mine\": 1}");
  const std::filesystem::path nowhere = dir / "missing" / "trace.json";
  e = error_of([&] { plan_output(tiny(), {.trace = nowhere}); });
  EXPECT_CONTAINS(e, "its directory '" + (dir / "missing").string() + "' does not exist");
  EXPECT_FALSE(std::filesystem::exists(nowhere));
}

// With --search the trace is of the best layout, and the output says so.
TEST(PlanCommand, SearchTracesTheBestLayout) {
  TempDir dir;
  save_machine_rates(h100(), dir / "rates.json");
  const MachineRates rates = load_machine_rates(dir / "rates.json");
  const Config cfg = tiny({"train.batch_size=8"});
  const std::filesystem::path path = dir / "best.json";
  const std::string out =
      plan_output(cfg, {.rates = {.rates = dir / "rates.json"}, .search = true, .top = 2, .ranks = 4, .trace = path});
  const LayoutSearch s = search_layouts(cfg, rates, 4, std::numeric_limits<double>::infinity());
  ASSERT_FALSE(s.ranked.empty());
  EXPECT_CONTAINS(out, "trace: wrote " + path.string() + ", the predicted step of the best layout (1. above) on its 4 ranks");
  const std::map<int, std::vector<TraceEvent>> events = trace_events(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_NEAR(events.at(0)[0].dur, s.ranked[0].time.step_s * 1e6, 1e-12 * s.ranked[0].time.step_s * 1e6);
}

// The (category, name) pairs of a trace's compute, communication,
// transfer and optimizer spans, at any depth.
std::set<std::pair<std::string, std::string>> span_names(const std::filesystem::path& path) {
  std::set<std::pair<std::string, std::string>> out;
  for (const auto& [rank, spans] : trace_events(path))
    for (const TraceEvent& e : spans)
      if (e.cat == "compute" || e.cat == "communication" || e.cat == "transfer" || e.cat == "optimizer")
        out.insert({e.cat, e.name});
  return out;
}

std::set<std::pair<std::string, std::string>> minus(const std::set<std::pair<std::string, std::string>>& a,
                                                    const std::set<std::pair<std::string, std::string>>& b) {
  std::set<std::pair<std::string, std::string>> out;
  for (const auto& x : a)
    if (!b.count(x)) out.insert(x);
  return out;
}

// A tiny traced training step and the plan's predicted trace of its layout
// name the same work alike, offloaded state's moves between tiers too. What
// a measured trace alone holds is bookkeeping the time model leaves out
// (besides the data category's "load batch", not compared): the traced
// step's closing "barrier (<world>)" (none on one rank);
// under a pipeline the sender's wait on a delivered asynchronous "send (2)"
// (the model's sends cost the sender nothing), the all-reduces of the
// one-rank data-parallel group (free), and the small all-reduces of the
// stop-signal agreement, the gradient norm and the loss (named as the tied
// embedding's gradient sum over the stages, which the model prices). Each
// rank's modules run in the measured order, each with the collectives the
// run issued inside it.
TEST(PlanCommand, PredictedTraceNamesTheMeasuredTracesSpans) {
  TempDir dir;
  std::ifstream in(LOOM_SOURCE_DIR "/data/tinyshakespeare.txt", std::ios::binary);
  std::string text(80000, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  PrepareOptions po;
  po.inputs = {dir.write("corpus.txt", text)};
  po.out_dir = dir / "data";
  po.vocab_size = 512;
  po.seq_len = 32;
  prepare_dataset(po);
  save_machine_rates(h100(), dir / "rates.json");
  using Names = std::set<std::pair<std::string, std::string>>;
  const std::vector<std::tuple<std::string, std::vector<std::string>, Names>> cases = {
      {"dp2", {"parallel.dp=2"}, Names{{"communication", "barrier (2)"}}},
      {"pp2",
       {"parallel.pp=2"},
       Names{{"communication", "barrier (2)"}, {"communication", "send (2)"}, {"communication", "all_reduce (1)"}}},
      {"tp2 sp",
       {"parallel.tp=2", "parallel.sequence_parallel=true"},
       Names{{"communication", "barrier (2)"}, {"communication", "all_reduce (1)"}}},
      {"tp2 recompute",
       {"parallel.tp=2", "train.activation_checkpointing=true"},
       Names{{"communication", "barrier (2)"}, {"communication", "all_reduce (1)"}}},
      {"2d",
       {"parallel.tp=4", "parallel.tp_mode=2d", "train.activation_checkpointing=true"},
       Names{{"communication", "barrier (4)"}, {"communication", "all_reduce (1)"}, {"communication", "all_reduce (4)"}}},
      {"offload", {"memory.policy=static", "memory.offload_param_frac=1", "memory.offload_optim_frac=0.5"}, Names{}}};
  for (const auto& [name, layout, measured_only] : cases) {
    SCOPED_TRACE(name);
    Config c = tiny({"data.dir=" + (dir / "data").string(), "data.text=" + (dir / "corpus.txt").string(),
                     "train.out_dir=" + (dir / ("run-" + name)).string(), "train.steps=2",
                     "train.checkpoint_interval=0", "train.eval_interval=0", "train.sample_tokens=0",
                     "trace.path=" + (dir / (name + "-measured.json")).string(), "trace.steps=2"});
    for (const std::string& setting : layout) c.set_override(setting);
    RunOptions quiet;
    quiet.quiet = true;
    run_training(c, quiet);
    // The plan of the run's config (whose trace.path, now taken, the plan
    // would refuse as `loom train` does).
    Config planned = c;
    planned.set_override("trace.path=");
    plan_output(planned, {.rates = {.rates = dir / "rates.json"}, .trace = dir / (name + "-predicted.json")});
    const Names measured = span_names(dir / (name + "-measured.json"));
    const Names predicted = span_names(dir / (name + "-predicted.json"));
    EXPECT_EQ(minus(predicted, measured), Names{});
    EXPECT_EQ(minus(measured, predicted), measured_only);
    EXPECT_EQ(predicted.count({"transfer", "chunk move"}), name == "offload" ? 1u : 0u);
    // Each rank runs its modules in the order the run did.
    const auto modules = [](const std::filesystem::path& path) {
      std::map<int, std::vector<std::string>> out;
      for (const auto& [rank, spans] : trace_events(path))
        for (const TraceEvent& e : spans)
          if (e.cat == "compute" && e.depth == 1) out[rank].push_back(e.name);
      return out;
    };
    EXPECT_EQ(modules(dir / (name + "-predicted.json")), modules(dir / (name + "-measured.json")));
    // The collectives inside each module, where it first runs on each rank.
    const auto inside = [](const std::filesystem::path& path) {
      std::map<std::pair<int, std::string>, std::vector<std::string>> out;
      for (auto [rank, spans] : trace_events(path)) {
        // In time order, a span before the spans it holds.
        std::sort(spans.begin(), spans.end(), [](const TraceEvent& a, const TraceEvent& b) {
          return std::tie(a.ts, a.depth) < std::tie(b.ts, b.depth);
        });
        std::set<std::string> seen;
        std::string module;
        for (const TraceEvent& e : spans) {
          if (e.depth == 1) module = e.cat == "compute" && seen.insert(e.name).second ? e.name : "";
          if (e.depth == 2 && e.cat == "communication" && !module.empty()) out[{rank, module}].push_back(e.name);
        }
      }
      return out;
    };
    EXPECT_EQ(inside(dir / (name + "-predicted.json")), inside(dir / (name + "-measured.json")));
  }
}

}  // namespace
}  // namespace loom
