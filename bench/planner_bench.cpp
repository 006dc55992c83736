// The planner's predictions against measured runs on this machine.
//
//   planner_bench [steps] [calibration.json|-] [name]
//
// Calibrates the machine first (loom calibrate's measurements, in the same
// run, with the NVMe rates of ./loom-nvme-bench-<pid>, unless a calibration
// file is given; "-" calibrates), then for each layout of a small GPT on
// local ranks (those whose name contains `name`, when given): the predicted
// step time (predict_step_time) and its split, the measured step time (the
// slowest rank's, median over `steps` timed steps after a warm-up step), and
// predicted / measured. The summary is the median and the worst absolute
// error over the layouts (the targets: median <= 10%, none worse
// than 20%), then, over every layout, the what-if table below.
//
// Every layout goes through plan_training (its config is the layout's
// settings over configs/tiny-test.toml-like keys), so only valid layouts run,
// and trains the same global batch. The offloaded layouts (memory.policy)
// place their chunks on the host, or on NVMe in ./loom-nvme-bench-<pid>
// (removed at the end; left out when a given calibration has no NVMe
// rates).
//
//   planner_bench --published
//
// prints only the what-if table, which a run over every layout ends with: each
// published large run (published_runs(): Megatron-LM on Selene's A100s)
// priced with its hardware file, predicted / reported seconds per iteration,
// and each rank's predicted device peak against the GPU's memory.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench_common.h"
#include "planned_step.h"
#include "loom/config.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;
using bench::median;

namespace {

const std::vector<std::string> kModel = {
    "model.preset=custom", "model.n_layer=4",  "model.n_head=8",      "model.n_embd=256", "model.vocab_size=4096",
    "model.block_size=128", "data.vocab_size=4096", "train.seq_len=128", "train.batch_size=16", "model.dropout=0"};

struct Case {
  std::string name;
  Layout layout;
  DType precision = DType::f32;
  std::vector<std::string> memory = {};  // memory.* settings besides the policy
  bool nvme = false;                     // memory.nvme_dir: the bench's directory
};

std::vector<Case> cases() {
  using S = PipelineSchedule;
  const MemoryPolicy fixed = MemoryPolicy::fixed;
  const std::vector<std::string> half = {"memory.offload_param_frac=0.5", "memory.offload_optim_frac=0.5"};
  return {
      {"single", {.micro_batch = 2}},
      {"single recompute", {.micro_batch = 2, .recompute = true}},
      {"dp2 zero0", {.dp = 2, .micro_batch = 2}},
      {"dp2 zero1", {.dp = 2, .micro_batch = 2, .zero_stage = 1}},
      {"dp2 zero3", {.dp = 2, .micro_batch = 2, .zero_stage = 3}},
      {"dp2 zero1 bf16", {.dp = 2, .micro_batch = 2, .zero_stage = 1}, DType::bf16},
      {"dp4 zero1", {.dp = 4, .micro_batch = 2, .zero_stage = 1}},
      {"tp2", {.tp = 2, .micro_batch = 2}},
      {"tp2 sp", {.tp = 2, .sequence_parallel = true, .micro_batch = 2}},
      {"tp4", {.tp = 4, .micro_batch = 2}},
      {"pp2 gpipe", {.pp = 2, .schedule = S::gpipe, .micro_batch = 1}},
      {"pp2 1f1b", {.pp = 2, .micro_batch = 1}},
      {"pp2 interleaved v2", {.pp = 2, .schedule = S::interleaved_1f1b, .virtual_stages = 2, .micro_batch = 1}},
      {"dp2 x tp2", {.dp = 2, .tp = 2, .micro_batch = 2}},
      {"dp2 x pp2", {.dp = 2, .pp = 2, .micro_batch = 1}},
      {"tp2 x pp2", {.tp = 2, .pp = 2, .micro_batch = 1}},
      // The grids: micro-batches of whole sequences per token group.
      {"2d tp4", {.tp = 4, .tp_mode = TensorParallelMode::two_d, .micro_batch = 2}},
      {"2.5d tp8", {.tp = 8, .tp_mode = TensorParallelMode::two_and_half_d, .tp_depth = 2, .micro_batch = 4}},
      {"3d tp8", {.tp = 8, .tp_mode = TensorParallelMode::three_d, .micro_batch = 4}},
      // Offloaded state: half the chunks' parameters and optimizer state
      // off the device, moved every micro-batch (eight) or once (one).
      {"offload host", {.micro_batch = 2, .memory_policy = fixed}, DType::f32, half},
      {"offload host bf16", {.micro_batch = 2, .memory_policy = fixed}, DType::bf16, half},
      {"offload host mb16", {.micro_batch = 16, .memory_policy = fixed}, DType::f32, half},
      {"offload nvme", {.micro_batch = 2, .memory_policy = fixed}, DType::f32, half, true},
      {"offload nvme mb16", {.micro_batch = 16, .memory_policy = fixed}, DType::f32, half, true},
      {"dp2 offload host", {.dp = 2, .micro_batch = 2, .zero_stage = 3, .memory_policy = fixed}, DType::f32, half},
      {"offload auto", {.micro_batch = 2, .memory_policy = MemoryPolicy::automatic}},
  };
}

TrainPlan plan_of(const Case& c, const std::filesystem::path& nvme_dir) {
  Config cfg(loom_schema());
  for (const std::string& s : kModel) cfg.set_override(s);
  for (const std::string& s : layout_settings(c.layout)) cfg.set_override(s);
  for (const std::string& s : c.memory) cfg.set_override(s);
  if (c.nvme) cfg.set_override(str("memory.nvme_dir=", nvme_dir.string()));
  cfg.set_override(str("precision=", c.precision == DType::f32 ? "fp32" : "bf16"));
  return plan_training(cfg);
}

// The what-if table: every published run priced on its machine's hardware
// file, the step time against the reported one, and whether its largest
// predicted device peak fits the GPU.
void print_published_runs() {
  std::printf("what-if: published runs, predicted from hardware/ files (docs/planning.md)\n");
  std::printf("%-58s %6s %11s %10s %10s %7s %6s %9s\n", "run", "GPUs", "dp/tp/pp", "reported", "predicted", "ratio",
              "MFU", "peak GiB");
  std::vector<double> ratios;
  for (const PublishedRun& r : published_runs()) {
    const MachineRates rates = load_machine_rates(str(LOOM_BENCH_SOURCE_DIR, "/hardware/", r.hardware));
    StepMemoryOptions memory;
    memory.precision = r.precision;
    const StepTimePrediction p = predict_step_time(r.problem, r.layout, memory, rates);
    double peak = 0.0;
    for (const RankMemory& m : predict_step_memory(r.problem, r.layout, memory))
      peak = std::max(peak, m.peak(Tier::device));
    const double ratio = p.step_s / r.reported_step_s;
    ratios.push_back(ratio);
    std::printf("%-58s %6lld %11s %9.2fs %9.2fs %7.3f %5.1f%% %6.1f%s\n", r.name.c_str(),
                static_cast<long long>(r.layout.dp * r.layout.tp * r.layout.pp),
                str(r.layout.dp, "/", r.layout.tp, "/", r.layout.pp).c_str(), r.reported_step_s, p.step_s, ratio,
                100.0 * p.mfu, peak / double(1 << 30), peak > rates.device_memory_bytes ? " over" : "");
  }
  std::vector<double> errors;
  for (double r : ratios) errors.push_back(std::abs(r - 1.0));
  std::printf("what-if: median |predicted/reported - 1| = %.3f, worst = %.3f over %zu runs\n", median(errors),
              *std::max_element(errors.begin(), errors.end()), errors.size());
}

int run(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--published") {
    print_published_runs();
    return 0;
  }
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  if (steps < 1) {
    std::fprintf(stderr,
                 "usage: planner_bench [steps >= 1] [calibration.json|-] [name] | planner_bench --published\n");
    return 2;
  }
  const bench::NvmeDir nvme("-");
  MachineRates rates;
  const std::string only = argc > 3 ? argv[3] : "";
  if (argc > 2 && std::string(argv[2]) != "-") {
    rates = load_machine_rates(argv[2]);
  } else {
    std::printf("calibrating this machine\n");
    CalibrationOptions o;
    o.progress = [](const std::string& line) { std::printf("  %s\n", line.c_str()); };
    o.nvme_dir = nvme.path();
    rates = calibrate_machine(o);
  }
  std::printf("rates: %s\n\n", rates.description.c_str());

  const std::vector<int32_t> data = bench::random_tokens(16, 128, 4096);

  std::printf("%-22s %10s %10s %7s | predicted: %8s %8s %8s %8s %8s\n", "layout", "predicted", "measured", "ratio",
              "compute", "comm", "bubble", "optim", "transfer");
  std::vector<double> errors;
  for (const Case& c : cases()) {
    if (c.name.find(only) == std::string::npos) continue;
    if (c.nvme && rates.nvme_read_bytes_per_s <= 0.0) {
      std::printf("%-22s left out: the calibration has no NVMe rates\n", c.name.c_str());
      continue;
    }
    const TrainPlan plan = plan_of(c, nvme.path());
    const LayoutProblem problem{.model = plan.model, .global_batch = plan.global_batch, .seq_len = plan.seq_len};
    const StepMemoryOptions options{.precision = plan.options.zero.precision,
                                    .bucket_bytes = plan.options.zero.bucket_bytes,
                                    .memory = plan.options.memory};
    const StepTimePrediction p = predict_step_time(problem, c.layout, options, rates);
    const double measured = bench::measure_planned_step(plan, data, steps);
    const double ratio = p.step_s / measured;
    errors.push_back(std::abs(ratio - 1.0));
    std::printf("%-22s %8.1fms %8.1fms %7.3f | %8.1fms %6.1fms %6.1fms %6.1fms %6.1fms\n", c.name.c_str(),
                p.step_s * 1e3, measured * 1e3, ratio, p.compute_s * 1e3, p.communication_s * 1e3,
                p.bubble_s * 1e3, p.optimizer_s * 1e3, p.transfer_s * 1e3);
    if (const std::string moved = describe(p.traffic.bytes()); !moved.empty())
      std::printf("%-22s moves per step and rank: %s\n", "", moved.c_str());
    std::fflush(stdout);
  }
  if (errors.empty()) {
    std::fprintf(stderr, "planner_bench: no layout ran: none whose name contains \"%s\" that these rates price\n",
                 only.c_str());
    return 2;
  }
  std::printf("\nstep time: median |predicted/measured - 1| = %.3f (target <= 0.10), worst = %.3f (target <= 0.20) "
              "over %zu layouts\n",
              median(errors), *std::max_element(errors.begin(), errors.end()), errors.size());
  // A rerun of some layouts is about them alone.
  if (only.empty()) {
    std::printf("\n");
    print_published_runs();
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // Errors end the run here, so that the bench's NVMe directory is removed
  // on the way out.
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "planner_bench: %s\n", e.what());
    return 1;
  }
}
