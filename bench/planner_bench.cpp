// The planner's predictions against measured runs on this machine.
//
//   planner_bench [steps] [calibration.json]
//
// Calibrates the machine first (loom calibrate's measurements, in the same
// run, unless a calibration file is given), then for each layout of a small
// GPT on local ranks: the predicted step time (predict_step_time) and its
// split, the measured step time (the slowest rank's, median over `steps`
// timed steps after a warm-up step), and predicted / measured. The summary
// is the median and the worst absolute error over the layouts (the issue's
// targets: median <= 10%, none worse than 20%).
//
// Every layout goes through plan_training (its config is the layout's
// settings over configs/tiny-test.toml-like keys), so only valid layouts run,
// and trains the same global batch.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/config.h"
#include "loom/parallel.h"
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
};

std::vector<Case> cases() {
  using S = PipelineSchedule;
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
  };
}

TrainPlan plan_of(const Case& c) {
  Config cfg(loom_schema());
  for (const std::string& s : kModel) cfg.set_override(s);
  for (const std::string& s : layout_settings(c.layout)) cfg.set_override(s);
  cfg.set_override(str("precision=", c.precision == DType::f32 ? "fp32" : "bf16"));
  return plan_training(cfg);
}

// The slowest rank's step time, median over the timed steps.
double measure(const TrainPlan& plan, const std::vector<int32_t>& data, int steps) {
  std::vector<std::vector<double>> times(static_cast<size_t>(plan.nproc));
  run_local(plan.nproc, [&](Communicator& world) {
    const std::unique_ptr<DeviceMesh> mesh = plan_mesh(plan, world);
    Trainer trainer = mesh ? Trainer(plan.model, plan.options, *mesh) : Trainer(plan.model, plan.options, &world);
    const int replica = mesh ? mesh->coord(MeshAxis::dp) : world.rank();
    std::vector<MicroBatch> mbs;
    for (int64_t m = 0; m < plan.accumulation; ++m) {
      const int64_t first = (m * plan.dp + replica) * plan.micro_batch;
      mbs.push_back({data.data() + first * plan.seq_len, data.data() + first * plan.seq_len + 1,
                     {plan.micro_batch, plan.seq_len}, first});
    }
    trainer.step(mbs);  // warm-up: first touches, BLAS buffers
    for (int i = 0; i < steps; ++i) {
      world.barrier();
      const double t0 = bench::now_seconds();
      trainer.step(mbs);
      times[static_cast<size_t>(world.rank())].push_back(bench::now_seconds() - t0);
    }
  });
  std::vector<double> slowest;
  for (int i = 0; i < steps; ++i) {
    double s = 0;
    for (const auto& rank : times) s = std::max(s, rank[static_cast<size_t>(i)]);
    slowest.push_back(s);
  }
  return median(slowest);
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 5;
  MachineRates rates;
  if (argc > 2) {
    rates = load_machine_rates(argv[2]);
  } else {
    std::printf("calibrating this machine\n");
    CalibrationOptions o;
    o.progress = [](const std::string& line) { std::printf("  %s\n", line.c_str()); };
    rates = calibrate_machine(o);
  }
  std::printf("rates: %s\n\n", rates.description.c_str());

  std::vector<int32_t> data(static_cast<size_t>(16 * 128 + 1));
  std::mt19937 rng(1);
  for (int32_t& t : data) t = static_cast<int32_t>(rng() % 4096);

  std::printf("%-22s %10s %10s %7s | predicted: %8s %8s %8s %8s\n", "layout", "predicted", "measured", "ratio",
              "compute", "comm", "bubble", "optim");
  std::vector<double> errors;
  for (const Case& c : cases()) {
    const TrainPlan plan = plan_of(c);
    const LayoutProblem problem{.model = plan.model, .global_batch = plan.global_batch, .seq_len = plan.seq_len};
    const StepTimePrediction p =
        predict_step_time(problem, c.layout, c.precision, rates, plan.options.zero.bucket_bytes);
    const double measured = measure(plan, data, steps);
    const double ratio = p.step_s / measured;
    errors.push_back(std::abs(ratio - 1.0));
    std::printf("%-22s %8.1fms %8.1fms %7.3f | %8.1fms %6.1fms %6.1fms %6.1fms\n", c.name.c_str(), p.step_s * 1e3,
                measured * 1e3, ratio, p.compute_s * 1e3, p.communication_s * 1e3, p.bubble_s * 1e3,
                p.optimizer_s * 1e3);
    std::fflush(stdout);
  }
  std::printf("\nstep time: median |predicted/measured - 1| = %.3f (target <= 0.10), worst = %.3f (target <= 0.20) "
              "over %zu layouts\n",
              median(errors), *std::max_element(errors.begin(), errors.end()), errors.size());
  return 0;
}
