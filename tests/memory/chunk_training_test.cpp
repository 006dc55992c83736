// Chunk placement through the Trainer: every policy, offload fraction and
// tier trains the same model as everything on the device, and budgets that
// cannot hold a model fail before training.
#include <gtest/gtest.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>

#include "loom/memory.h"
#include "loom/planner.h"
#include "loom/train.h"
#include "test_util.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::DataParallelRun;
using testing::RunResult;

int64_t files_in(const fs::path& dir) {
  return std::distance(fs::directory_iterator(dir), fs::directory_iterator());
}

struct Placement {
  std::string name;
  MemoryPolicy policy = MemoryPolicy::fixed;
  double param_frac = 0.0, optim_frac = 0.0;
  bool nvme = false;
  int dp = 1;
  // auto: budgets that leave the device room for part of the parameters,
  // and (with NVMe) the host room for about half of the optimizer state.
  bool tight = false;
};

std::ostream& operator<<(std::ostream& os, const Placement& p) { return os << p.name; }

DataParallelRun memory_run(const Placement& p, const fs::path& nvme_dir) {
  // dp 1 runs without a communicator (dp = 0 in the helper's terms).
  DataParallelRun r = testing::layout(p.dp == 1 ? 0 : p.dp, p.dp == 1 ? 0 : 3);
  r.n_layer = 4;  // enough chunks (11) for fractions and a cache to mean something
  r.memory.policy = p.policy;
  r.memory.offload_param_frac = p.param_frac;
  r.memory.offload_optim_frac = p.optim_frac;
  if (p.nvme) r.memory.nvme_dir = nvme_dir;
  return r;
}

// The all-on-device runs every placement is held against: the reference (one
// rank) and ZeRO-3 (two), and the chunk stores with nothing offloaded.
const RunResult& on_device(int dp) {
  const auto run = [](int ranks, int stage) {
    DataParallelRun r = testing::layout(ranks, stage);
    r.n_layer = 4;
    return testing::run_layout(r);
  };
  static const RunResult one = run(0, 0);
  static const RunResult two = run(2, 3);
  return dp == 1 ? one : two;
}
const RunResult& chunks_on_device(int dp) {
  static const RunResult one = testing::run_layout(memory_run({"", MemoryPolicy::fixed, 0, 0, false, 1}, {}));
  static const RunResult two = testing::run_layout(memory_run({"", MemoryPolicy::fixed, 0, 0, false, 2}, {}));
  return dp == 1 ? one : two;
}

class ChunkPlacementEquivalence : public ::testing::TestWithParam<Placement> {};

TEST_P(ChunkPlacementEquivalence, TrainsLikeEverythingOnTheDevice) {
  const Placement p = GetParam();
  testing::TempDir nvme;
  DataParallelRun r = memory_run(p, nvme.path());
  if (p.tight) {
    // Budgets from this model's own figures: the warm-up's traced peak and
    // working set, plus half the parameters on the device; the parameters,
    // half the optimizer state and the host working set on the host.
    const int ranks = p.dp;
    const RunResult probe = testing::run_layout(memory_run({"", MemoryPolicy::automatic, 0, 0, p.nvme, p.dp}, nvme.path()));
    ASSERT_GE(probe.memory.traced_non_model, 0);
    GPT model(probe.model);
    MemoryOptions opts = r.memory;
    const TierBytes unlimited{{INT64_MAX, INT64_MAX, INT64_MAX}};
    const MemoryPlan plan = plan_memory(model.layout(), opts, DType::f32, ranks, 0, unlimited);
    const ChunkLayout chunks(model.layout(), plan.search.chunk_numel, ranks);
    const int64_t params = chunks.num_chunks() * chunks.shard_numel() * 4;
    r.device_budget = static_cast<size_t>(probe.memory.traced_non_model + plan.needs.device_working + params / 2);
    if (p.nvme) {
      // The host holds the parameters and about half the optimizer state
      // besides the working set of NVMe reads and writes.
      ChunkPlacement with_nvme = plan.placement;
      std::fill(with_nvme.optim.begin(), with_nvme.optim.end(), Tier::nvme);
      const MemoryNeeds needs = memory_needs(chunks, with_nvme, DType::f32, opts);
      r.host_budget = static_cast<size_t>(params + needs.host_working + 3 * params / 2);
    }
  }
  const RunResult a = testing::run_layout(r);
  // Against everything on the device without chunks: within 1e-6.
  const RunResult& ref = on_device(p.dp);
  const double loss_diff = testing::max_loss_rel_diff(a, ref), param_diff = testing::param_rel_diff(a, ref);
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-6));
  std::cout << p.name << ": max loss rel diff " << loss_diff << ", params rel L2 " << param_diff
            << " against everything on the device without chunks\n";
  // Against the chunk stores with nothing offloaded: the same arithmetic on
  // other tiers, so the same bits.
  const RunResult& same = chunks_on_device(p.dp);
  for (size_t s = 0; s < a.stats.size(); ++s) EXPECT_EQ(a.stats[s].loss, same.stats[s].loss) << "step " << s;
  EXPECT_TRUE(testing::bit_equal(a.params, same.params));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg, same.exp_avg));
  EXPECT_TRUE(testing::bit_equal(a.exp_avg_sq, same.exp_avg_sq));

  // The placement is the one asked for, and data moved accordingly.
  const auto count = [](const std::vector<Tier>& v, Tier t) { return std::count(v.begin(), v.end(), t); };
  const int64_t n = static_cast<int64_t>(a.placement.param.size());
  const Tier off = p.nvme ? Tier::nvme : Tier::host;
  if (p.policy == MemoryPolicy::fixed) {
    EXPECT_EQ(count(a.placement.param, off), std::lround(p.param_frac * static_cast<double>(n)));
    EXPECT_EQ(count(a.placement.optim, off), std::lround(p.optim_frac * static_cast<double>(n)));
    if (p.param_frac > 0) {
      EXPECT_GT(a.memory.traffic.at(p.nvme ? Tier::host : off, Tier::device), 0);
    }
    if (p.nvme && (p.param_frac > 0 || p.optim_frac > 0)) {
      EXPECT_GT(a.memory.nvme.bytes_read, 0);
      EXPECT_GT(a.memory.nvme.bytes_written, 0);
    }
  } else if (p.tight) {
    // Part of the parameters cached on the device, the rest moving in.
    EXPECT_GT(count(a.placement.param, Tier::device), 0);
    EXPECT_GT(count(a.placement.param, Tier::host), 0);
    EXPECT_GT(a.memory.traffic.at(Tier::host, Tier::device), 0);
    if (p.nvme) {
      EXPECT_GT(count(a.placement.optim, Tier::nvme), 0) << describe(a.memory);
      EXPECT_GT(count(a.placement.optim, Tier::host), 0);
    }
  } else {
    // The tracer saw every module of the warm-up, the largest of them is the
    // step's peak.
    ASSERT_EQ(a.memory.traced_modules.size(), static_cast<size_t>(GPT(a.model).layout().num_groups()));
    int64_t largest = 0;
    for (const auto& [module, bytes] : a.memory.traced_modules) largest = std::max(largest, bytes);
    EXPECT_EQ(largest, a.memory.traced_non_model);
    EXPECT_GT(largest, 0);
    // Unlimited budgets: everything ends on the device.
    EXPECT_EQ(count(a.placement.param, Tier::device), n);
    EXPECT_EQ(count(a.placement.optim, Tier::device), n);
  }
  EXPECT_EQ(files_in(nvme.path()), 0) << "NVMe scratch files are unlinked at creation";
}

std::vector<Placement> placements() {
  std::vector<Placement> all;
  for (int dp : {1, 2}) {
    for (bool nvme : {false, true}) {
      const std::string suffix = str(nvme ? "_nvme" : "_host", "_dp", dp);
      for (auto [pf, of] : {std::pair{0.0, 0.0}, {0.5, 0.5}, {1.0, 1.0}, {1.0, 0.0}, {0.0, 1.0}}) {
        if (nvme && pf == 0.0 && of == 0.0) continue;
        all.push_back({str("static_p", int(pf * 100), "_o", int(of * 100), suffix), MemoryPolicy::fixed, pf, of,
                       nvme, dp});
      }
      all.push_back({"auto_unlimited" + suffix, MemoryPolicy::automatic, 0, 0, nvme, dp});
      all.push_back({"auto_tight" + suffix, MemoryPolicy::automatic, 0, 0, nvme, dp, true});
    }
  }
  return all;
}

INSTANTIATE_TEST_SUITE_P(Policies, ChunkPlacementEquivalence, ::testing::ValuesIn(placements()),
                         [](const auto& info) { return info.param.name; });

// The comparison can fail: with the chunks' reduce-scatters (every
// floating-point sum of the group) doubled, the gradients are twice ZeRO-3's.
TEST(ChunkTraining, ADoubledGradientReductionFailsTheComparison) {
  DataParallelRun r = memory_run({"", MemoryPolicy::fixed, 0.5, 0.5, false, 2}, {});
  r.doubled_sums = MeshAxis::dp;
  const ::testing::AssertionResult match = testing::matches_reference(testing::run_layout(r), on_device(2), 1e-6);
  EXPECT_FALSE(match);
  EXPECT_CONTAINS(std::string(match.message()), "step-0 gradient of");
}

TEST(ChunkTraining, MixedPrecisionAndAccumulationMatchZeroStage3) {
  // Gradient accumulation (gradient shards of their own) and bf16/fp16
  // working parameters (loss scaling; gradients reusing the parameters'
  // memory with one micro-batch) against ZeRO-3 on two ranks, offloaded to
  // host and NVMe: fp32 within 1e-6, bf16/fp16 within the 1e-2 of mixed
  // precision (rounding to 8 or 11 bits amplifies the last bit of a
  // differently summed gradient norm).
  testing::TempDir nvme;
  for (DType precision : {DType::f32, DType::bf16, DType::f16}) {
    for (int accumulation : {1, 2}) {
      DataParallelRun zero = testing::layout(2, 3, precision, accumulation);
      DataParallelRun r = zero;
      r.memory.policy = MemoryPolicy::fixed;
      r.memory.offload_param_frac = 0.5;
      r.memory.offload_optim_frac = 1.0;
      r.memory.nvme_dir = nvme.path();
      const RunResult a = testing::run_layout(r), ref = testing::run_layout(zero);
      const double tolerance = precision == DType::f32 ? 1e-6 : 1e-2;
      EXPECT_TRUE(testing::matches_reference(a, ref, tolerance)) << dtype_name(precision) << " x" << accumulation;
      for (const StepStats& s : a.stats) EXPECT_FALSE(s.skipped);
      const RunResult b = testing::run_layout(r);
      EXPECT_TRUE(testing::bit_equal(a.params, b.params)) << dtype_name(precision) << " x" << accumulation;
    }
  }
}

// A model with enough layers that its state dwarfs one layer's working set:
// 16 layers of width 128 (3.2M parameters, 63 MiB of fp32 model state).
GPTConfig deep_gpt() {
  GPTConfig c = testing::small_gpt(0.0f, 16, 4);
  c.n_embd = 128;
  return c;
}

std::vector<float> train_deep(const MemoryOptions& memory, size_t device_budget, size_t host_budget, int steps,
                              MemoryReport* report = nullptr, const fs::path& checkpoint_root = {}) {
  MemoryContext context;
  MemoryContext::Install install(context);
  context.tier(Tier::device).set_budget(device_budget);
  context.tier(Tier::host).set_budget(host_budget);
  // Four micro-batches of two sequences: little activation memory, and
  // gradient shards of their own (accumulation).
  constexpr int kAccumulation = 4;
  TrainOptions o;
  o.schedule = {1e-3f, 1e-4f, 1, steps};
  o.checkpoint_activations = true;
  o.memory = memory;
  o.memory.micro_batches = kAccumulation;
  Trainer t(deep_gpt(), o);
  std::vector<float> losses;
  for (int s = 0; s < steps; ++s) {
    const std::vector<int32_t> data = testing::step_tokens(s, deep_gpt().vocab_size);
    losses.push_back(t.step(testing::rank_micro_batches(data, 1, 0, kAccumulation)).loss);
  }
  if (report) *report = t.memory_report();
  // Under the same budgets: the state streams to the files a chunk at a time.
  if (!checkpoint_root.empty()) save_checkpoint(checkpoint_root, t, {}, 0);
  return losses;
}

// Parameters, master weights, moments and the accumulated gradient.
int64_t deep_state_bytes() { return 20 * deep_gpt().num_params(); }

TEST(ChunkTraining, ModelStateTenTimesTheDeviceBudgetTrains) {
  const size_t budget = static_cast<size_t>(deep_state_bytes() / 10);
  const std::vector<float> ref = train_deep({}, kUnlimited, kUnlimited, 3);
  for (MemoryPolicy policy : {MemoryPolicy::fixed, MemoryPolicy::automatic}) {
    MemoryOptions m;
    m.policy = policy;
    if (policy == MemoryPolicy::fixed) m.offload_param_frac = m.offload_optim_frac = 1.0;
    MemoryReport report;
    const std::vector<float> losses = train_deep(m, budget, kUnlimited, 3, &report);
    for (size_t s = 0; s < ref.size(); ++s)
      EXPECT_NEAR(losses[s], ref[s], 1e-6 * std::fabs(ref[s])) << memory_policy_name(policy) << " step " << s;
    EXPECT_LE(report.peak[Tier::device], static_cast<int64_t>(budget));
    const int64_t state = report.model_state[Tier::device] + report.model_state[Tier::host];
    EXPECT_GE(state, 10 * static_cast<int64_t>(budget)) << describe(report);
  }
}

TEST(ChunkTraining, StateBeyondDeviceAndHostTrainsOnlyWithNvme) {
  const int64_t state = deep_state_bytes();
  const size_t device = static_cast<size_t>(state / 10), host = static_cast<size_t>(state * 35 / 100);
  MemoryOptions m;
  m.policy = MemoryPolicy::fixed;
  m.offload_param_frac = m.offload_optim_frac = 1.0;
  const std::string msg = testing::error_of([&] { train_deep(m, device, host, 1); });
  EXPECT_CONTAINS(msg, "cannot fit this model");
  EXPECT_CONTAINS(msg, "memory.host_budget");
  EXPECT_CONTAINS(msg, "more than the device and host budgets hold together");
  EXPECT_CONTAINS(msg, "memory.nvme_dir");

  testing::TempDir nvme, checkpoints;
  m.nvme_dir = nvme.path();
  MemoryReport report;
  const std::vector<float> ref = train_deep({}, kUnlimited, kUnlimited, 2);
  const std::vector<float> losses = train_deep(m, device, host, 2, &report, checkpoints.path());
  for (size_t s = 0; s < ref.size(); ++s) EXPECT_NEAR(losses[s], ref[s], 1e-6 * std::fabs(ref[s])) << "step " << s;
  EXPECT_GT(report.model_state[Tier::nvme], static_cast<int64_t>(device + host) / 2);
  EXPECT_LE(report.peak[Tier::host], static_cast<int64_t>(host));
  EXPECT_GT(report.nvme.bytes_written, 0);
  EXPECT_EQ(files_in(nvme.path()), 0);
  // The checkpoint, written under a host budget that could not hold the
  // gathered state, resumes a Trainer with everything on the device.
  EXPECT_LT(host, static_cast<size_t>(12 * deep_gpt().num_params()));
  TrainOptions o;
  o.memory.micro_batches = 4;
  Trainer resumed(deep_gpt(), o);
  load_checkpoint(resolve_checkpoint(checkpoints.path()), resumed);
  EXPECT_EQ(resumed.optimizer_steps(), 2);
  EXPECT_EQ(resumed.steps_done(), 2);
}

TEST(ChunkTraining, OutOfBudgetIsAnErrorBeforeAnythingIsAllocated) {
  MemoryContext context;
  MemoryContext::Install install(context);
  context.tier(Tier::device).set_budget(64 << 10);
  context.tier(Tier::host).set_budget(kUnlimited);
  TrainOptions o;
  o.memory.policy = MemoryPolicy::fixed;  // everything on the device
  const std::string msg = testing::error_of([&] { Trainer t(deep_gpt(), o); });
  EXPECT_CONTAINS(msg, "memory.policy = \"static\" cannot fit this model: the device needs");
  EXPECT_CONTAINS(msg, "model state 50.");
  EXPECT_CONTAINS(msg, "but its budget is 64.00 KiB (memory.device_budget)");
  EXPECT_CONTAINS(msg, "memory.offload_param_frac");
  EXPECT_EQ(context.tier(Tier::device).peak(), 0u);
  EXPECT_EQ(context.tier(Tier::host).peak(), 0u);

  o.memory.policy = MemoryPolicy::automatic;  // even the warm-up's working set does not fit
  EXPECT_CONTAINS(testing::error_of([&] { Trainer t(deep_gpt(), o); }), "the device needs");
}

TEST(ChunkTraining, KilledMidStepLeavesNothingTheNextRunTrusts) {
  // The killed run is this test's body again in a child process (gtest's
  // threadsafe death tests re-execute the binary); the directory travels in
  // the environment so that the child uses the parent's.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const char* given = std::getenv("LOOM_TEST_NVME_DIR");
  std::unique_ptr<testing::TempDir> own;
  if (!given) {
    own = std::make_unique<testing::TempDir>();
    ::setenv("LOOM_TEST_NVME_DIR", own->path().c_str(), 1);
  }
  const fs::path dir = given ? fs::path(given) : own->path();
  DataParallelRun r = memory_run({"", MemoryPolicy::fixed, 1.0, 1.0, true, 1}, dir);
  r.steps = 4;
  EXPECT_EXIT(
      {
        r.on_gradients = [](int step, GradStore&) {
          if (step == 2) std::raise(SIGKILL);
        };
        testing::run_layout(r);
      },
      ::testing::KilledBySignal(SIGKILL), "");
  ::unsetenv("LOOM_TEST_NVME_DIR");
  // Nothing of the killed run is left to trust: the scratch files are gone,
  // and a new run in the same directory trains as a fresh one.
  EXPECT_EQ(files_in(dir), 0);
  const RunResult again = testing::run_layout(r);
  const RunResult& ref = chunks_on_device(1);
  for (size_t s = 0; s < again.stats.size(); ++s) EXPECT_EQ(again.stats[s].loss, ref.stats[s].loss) << "step " << s;
}

TEST(ChunkTraining, CheckpointOfAChunkPlacedRunLoadsIntoAnyLayout) {
  testing::TempDir root, nvme;
  const GPTConfig cfg = testing::small_gpt(0.0f);
  TrainOptions o = testing::small_options(testing::layout(0, 0));
  o.memory.policy = MemoryPolicy::fixed;
  o.memory.offload_param_frac = 0.5;
  o.memory.offload_optim_frac = 1.0;
  o.memory.nvme_dir = nvme.path();
  Trainer placed(cfg, o);
  TrainOptions plain = testing::small_options(testing::layout(0, 0));
  Trainer reference(cfg, plain);
  for (int s = 0; s < 3; ++s) {
    const std::vector<int32_t> data = testing::step_tokens(s, cfg.vocab_size);
    placed.step(testing::rank_micro_batches(data, 1, 0, 1));
    reference.step(testing::rank_micro_batches(data, 1, 0, 1));
  }
  const fs::path dir = save_checkpoint(root.path(), placed, {}, 0);
  Trainer resumed(cfg, plain);
  load_checkpoint(dir, resumed);
  EXPECT_EQ(resumed.optimizer_steps(), 3);
  const Trainer::State a = resumed.gather_state(), b = reference.gather_state();
  EXPECT_LE(testing::max_rel_diff(a.params.data<float>(), b.params.data<float>(), a.params.numel(), 1e-3), 1e-6);
  // And back into a placed Trainer.
  Trainer placed_again(cfg, o);
  load_checkpoint(dir, placed_again);
  const Trainer::State c = placed_again.gather_state();
  EXPECT_TRUE(testing::bit_equal(c.params, a.params));
  EXPECT_TRUE(testing::bit_equal(c.exp_avg_sq, a.exp_avg_sq));
}

}  // namespace
}  // namespace loom
