// Hybrid parallel training (dp x tp x pp meshes, sequence parallelism, ZeRO-1,
// the pipeline schedules) on the local backend: 8 ranks as threads, and two
// 2-rank pipelines, one rank per core of a 2-core machine, whose bubble is
// comparable with the textbook's (with more ranks than cores a rank waiting
// for its neighbour also waits for the neighbour's share of the cores).
//
//   model_parallel_bench [global_batch] [micro_batch] [T] [steps] [n_layer n_embd n_head vocab]
//   e.g. model_parallel_bench 16 1 128 3 8 256 8 4096   (the defaults)
//        model_parallel_bench 32 1 128 3                 (more micro-batches: smaller bubbles)
//
// Every layout trains the same model on the same global batch of
// global_batch sequences of T tokens, cut into micro-batches of micro_batch
// sequences: a data-parallel replica runs global_batch / (dp * micro_batch) of
// them per step through its pipeline. The baseline is the single-rank
// reference (a Trainer without a communicator, the whole machine's threads)
// on the same micro-batches as gradient accumulation, timed next to every
// layout in the same run (x ref is to the median of all its steps); the
// layouts split the same cores among their ranks, so a ratio of 1 means the
// parallelism costs nothing.
//
// Per layout: the step time (the slowest rank's, median over the timed
// steps), tokens/s of the global batch and its ratio to the reference; the
// peak device memory of the costliest rank during the timed steps (allocator
// high-water mark); the exposed communication, the time a rank spent blocked
// in communication outside the pipeline's waits for its neighbours, as a
// fraction of its step (mean over ranks, median over steps); the bubble,
// the pipeline's waits for a neighbour as a fraction of the pipeline's part
// of the step (PipelineTiming, mean over ranks, median over steps), next to
// the textbook (p-1)/(m+p-1) (divided by v when interleaved) and that
// bubble with the stages' imbalance added, 1 - (1 - textbook) * mean/max of
// the pipeline ranks' loads (pipeline_layer_costs of the layers they hold: in
// steady state every stage runs at the slowest one's pace); and the last
// step's loss relative to the reference's, which says the layout trained the
// same model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/parallel.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;
using bench::median;

namespace {

struct Settings {
  GPTConfig model;
  int64_t global_batch = 16, micro_batch = 1, T = 128;
  int steps = 3;
};

struct MeshLayout {
  int dp = 1, tp = 1, pp = 1;
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;
  int virtual_stages = 1;
  bool sequence_parallel = false;
  int zero_stage = 0;

  int ranks() const { return dp * tp * pp; }
  std::string name() const {
    std::string n;
    const auto axis = [&](const char* a, int size) {
      if (size > 1) n += str(n.empty() ? "" : " x ", a, size);
    };
    axis("dp", dp);
    axis("tp", tp);
    axis("pp", pp);
    if (pp > 1) n += str(" ", pipeline_schedule_name(schedule));
    if (virtual_stages > 1) n += str(" v", virtual_stages);
    if (sequence_parallel) n += " sp";
    if (zero_stage > 0) n += str(" zero", zero_stage);
    return n;
  }
  // Micro-batches each replica runs per step.
  int64_t micro_batches(const Settings& s) const { return s.global_batch / (dp * s.micro_batch); }
  // Why the layout cannot run these settings, or empty.
  std::string unfit(const Settings& s) const {
    if (s.global_batch % (dp * s.micro_batch) != 0)
      return str("global batch ", s.global_batch, " is not a multiple of dp * micro_batch = ", dp * s.micro_batch);
    if (s.model.n_head % tp != 0) return str("tp ", tp, " does not divide n_head ", s.model.n_head);
    if (sequence_parallel && s.micro_batch * s.T % tp != 0)
      return str("micro_batch * T = ", s.micro_batch * s.T, " does not split over tp ", tp);
    if (s.model.n_layer % (pp * virtual_stages) != 0 && virtual_stages > 1)
      return str("n_layer ", s.model.n_layer, " does not split evenly into ", pp * virtual_stages, " virtual stages");
    if (s.model.n_layer < pp * virtual_stages)
      return str("n_layer ", s.model.n_layer, " < ", pp * virtual_stages, " virtual stages");
    if (pp > 1 && micro_batches(s) < pp) return str(micro_batches(s), " micro-batches never fill ", pp, " stages");
    if (virtual_stages > 1 && micro_batches(s) % pp != 0)
      return str(micro_batches(s), " micro-batches are not a multiple of pp ", pp, " (interleaved)");
    return {};
  }
  double textbook_bubble(const Settings& s) const {
    const double p = pp, m = static_cast<double>(micro_batches(s));
    return (p - 1) / (m + p - 1) / virtual_stages;
  }
};

struct Figures {
  double step_s = 0, peak_bytes = 0, exposed = 0, bubble = 0;
  double load_balance = 1;  // mean / max of the pipeline ranks' loads
  float loss = 0;
};

TrainOptions options(const Settings& s, const MeshLayout& l) {
  TrainOptions o;
  o.schedule.max_lr = 1e-4f;
  o.schedule.total_steps = s.steps + 1;
  o.zero.stage = l.zero_stage;
  o.model_parallel.schedule = l.schedule;
  o.model_parallel.virtual_stages = l.virtual_stages;
  o.model_parallel.sequence_parallel = l.sequence_parallel;
  return o;
}

// Replica `replica` of `dp` runs micro-batch m = sequences
// [(m * dp + replica) * micro_batch, ... + micro_batch) of the global batch.
std::vector<MicroBatch> replica_micro_batches(const std::vector<int32_t>& data, const Settings& s, int dp, int replica) {
  std::vector<MicroBatch> mbs;
  for (int64_t m = 0; m < s.global_batch / (dp * s.micro_batch); ++m) {
    const int64_t first = (m * dp + replica) * s.micro_batch;
    mbs.push_back({data.data() + first * s.T, data.data() + first * s.T + 1, {s.micro_batch, s.T}, first});
  }
  return mbs;
}

// The single-rank reference. The machine is shared and its load comes in
// bursts, which slow the reference's two OpenMP threads far more than the
// ranks' single threads (every parallel region waits for a descheduled
// thread), so the reference is timed again next to every layout and the
// ratios are to the median of all its steps; the figures of its first timing
// (the loss after as many steps as a layout runs, the peak memory) stay.
class Reference {
 public:
  Reference(const Settings& s, const std::vector<int32_t>& data)
      : steps_(s.steps), trainer_(s.model, options(s, MeshLayout{})), mbs_(replica_micro_batches(data, s, 1, 0)) {
    trainer_.step(mbs_);  // warm-up: first touches, BLAS buffers
    Allocator& device = MemoryContext::current().tier(Tier::device);
    device.reset_peak();
    first_.step_s = time_steps();
    first_.peak_bytes = static_cast<double>(device.peak());
    first_.loss = last_loss_;
  }
  const Figures& first() const { return first_; }
  // Median step time over `steps` more steps.
  double time_steps() {
    std::vector<double> times;
    for (int i = 0; i < steps_; ++i) {
      const double t0 = bench::now_seconds();
      last_loss_ = trainer_.step(mbs_).loss;
      times.push_back(bench::now_seconds() - t0);
    }
    all_.insert(all_.end(), times.begin(), times.end());
    return median(times);
  }
  // Every timed step so far.
  const std::vector<double>& step_times() const { return all_; }

 private:
  int steps_;
  Trainer trainer_;
  std::vector<MicroBatch> mbs_;
  float last_loss_ = 0;
  Figures first_;
  std::vector<double> all_;
};

struct RankSteps {
  std::vector<double> step_s, exposed, bubble;
  double load = 0;  // FLOPs of the layers this rank holds
  size_t peak_bytes = 0;
  float loss = 0;
};

Figures run_layout(const Settings& s, const MeshLayout& l, const std::vector<int32_t>& data) {
  std::vector<RankSteps> ranks(static_cast<size_t>(l.ranks()));
  run_local(l.ranks(), [&](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::dp] = l.dp;
    shape[MeshAxis::tp] = l.tp;
    shape[MeshAxis::pp] = l.pp;
    DeviceMesh mesh(world, shape);
    Trainer trainer(s.model, options(s, l), mesh);
    const std::vector<MicroBatch> mbs = replica_micro_batches(data, s, l.dp, mesh.coord(MeshAxis::dp));
    trainer.step(mbs);
    Allocator& device = MemoryContext::current().tier(Tier::device);
    device.reset_peak();
    world.barrier();
    RankSteps& r = ranks[static_cast<size_t>(world.rank())];
    const std::vector<double> costs = pipeline_layer_costs(s.model, s.T);
    for (const LayerRange& chunk : trainer.model().parallel().chunks)
      for (int layer = chunk.begin; layer < chunk.end; ++layer) r.load += costs[static_cast<size_t>(layer)];
    for (int i = 0; i < s.steps; ++i) {
      const double t0 = bench::now_seconds(), b0 = blocked_seconds();
      r.loss = trainer.step(mbs).loss;
      const double dt = bench::now_seconds() - t0;
      // blocked_seconds also counts the pipeline's receives, which are the
      // bubble, not communication.
      const PipelineTiming& pt = trainer.pipeline_timing();
      r.step_s.push_back(dt);
      r.exposed.push_back((blocked_seconds() - b0 - pt.idle_seconds) / dt);
      r.bubble.push_back(pt.bubble_fraction());
    }
    r.peak_bytes = device.peak();
  });
  std::vector<double> step_s, exposed, bubble;
  Figures f;
  for (int i = 0; i < s.steps; ++i) {
    double slowest = 0, exposed_sum = 0, bubble_sum = 0;
    for (const RankSteps& r : ranks) {
      slowest = std::max(slowest, r.step_s[static_cast<size_t>(i)]);
      exposed_sum += r.exposed[static_cast<size_t>(i)];
      bubble_sum += r.bubble[static_cast<size_t>(i)];
    }
    step_s.push_back(slowest);
    exposed.push_back(exposed_sum / l.ranks());
    bubble.push_back(bubble_sum / l.ranks());
  }
  double load_sum = 0, load_max = 0;
  for (const RankSteps& r : ranks) {
    f.peak_bytes = std::max(f.peak_bytes, static_cast<double>(r.peak_bytes));
    load_sum += r.load;
    load_max = std::max(load_max, r.load);
  }
  // A rank without chunks holds the whole model, and so does every other.
  if (load_max > 0) f.load_balance = load_sum / l.ranks() / load_max;
  f.step_s = median(step_s);
  f.exposed = median(exposed);
  f.bubble = median(bubble);
  f.loss = ranks[0].loss;
  return f;
}

std::vector<MeshLayout> layouts() {
  using S = PipelineSchedule;
  return {
      {.dp = 8},
      {.tp = 8},
      {.pp = 8},
      {.dp = 4, .tp = 2},
      {.dp = 4, .pp = 2},
      {.dp = 2, .pp = 4, .schedule = S::gpipe},
      {.dp = 2, .pp = 4},
      {.dp = 2, .pp = 4, .schedule = S::interleaved_1f1b, .virtual_stages = 2},
      {.pp = 2},
      {.pp = 2, .schedule = S::interleaved_1f1b, .virtual_stages = 2},
      {.tp = 2, .pp = 4},
      {.tp = 4, .pp = 2},
      {.dp = 2, .tp = 2, .pp = 2},
      {.dp = 2, .tp = 2, .pp = 2, .sequence_parallel = true},
      {.dp = 2, .tp = 2, .pp = 2, .zero_stage = 1},
  };
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Settings s;
    if (argc > 1) s.global_batch = std::atoll(argv[1]);
    if (argc > 2) s.micro_batch = std::atoll(argv[2]);
    if (argc > 3) s.T = std::atoll(argv[3]);
    if (argc > 4) s.steps = std::atoi(argv[4]);
    s.model.n_layer = argc > 5 ? std::atoll(argv[5]) : 8;
    s.model.n_embd = argc > 6 ? std::atoll(argv[6]) : 256;
    s.model.n_head = argc > 7 ? std::atoll(argv[7]) : 8;
    s.model.vocab_size = argc > 8 ? std::atoll(argv[8]) : 4096;
    s.model.block_size = s.T;
    s.model.validate();
    if (s.steps < 1) throw Error(str("steps = ", s.steps, ": time at least one step"));
    if (s.micro_batch < 1 || s.global_batch % s.micro_batch != 0)
      throw Error(str("global batch ", s.global_batch, " must be a positive multiple of micro_batch ", s.micro_batch));

    const std::vector<int32_t> data = [&] {
      std::vector<int32_t> d(static_cast<size_t>(s.global_batch * s.T + 1));
      for (size_t i = 0; i < d.size(); ++i)
        d[i] = static_cast<int32_t>(Philox::block(7, 0, i)[0] % static_cast<uint32_t>(s.model.vocab_size));
      return d;
    }();
    const double tokens = static_cast<double>(s.global_batch * s.T);
    std::printf("model: layers %lld width %lld heads %lld vocab %lld, %.2fM params; global batch %lld x T=%lld "
                "in micro-batches of %lld; %d timed steps; local backend, %d threads in all\n",
                static_cast<long long>(s.model.n_layer), static_cast<long long>(s.model.n_embd),
                static_cast<long long>(s.model.n_head), static_cast<long long>(s.model.vocab_size),
                static_cast<double>(s.model.num_params()) / 1e6, static_cast<long long>(s.global_batch),
                static_cast<long long>(s.T), static_cast<long long>(s.micro_batch), s.steps, cpu::num_threads());

    Reference reference(s, data);
    const Figures& ref = reference.first();
    std::printf("reference (1 rank, %lld micro-batches): %.1f ms/step, %.0f tokens/s, peak %s\n",
                static_cast<long long>(s.global_batch / s.micro_batch), ref.step_s * 1e3, tokens / ref.step_s,
                format_bytes(ref.peak_bytes).c_str());
    std::fflush(stdout);

    struct Row {
      std::string name, m, skipped;
      Figures f;
      double reference_s = 0, textbook = 0;
    };
    std::vector<Row> rows;
    for (const MeshLayout& l : layouts()) {
      Row row{l.name(), str(l.micro_batches(s)), l.unfit(s), {}, 0, l.textbook_bubble(s)};
      if (row.skipped.empty()) {
        row.reference_s = reference.time_steps();
        row.f = run_layout(s, l, data);
      }
      const std::string status = row.skipped.empty() ? str(row.f.step_s * 1e3, " ms/step (reference ",
                                                           row.reference_s * 1e3, " ms/step)")
                                                     : str("skipped: ", row.skipped);
      std::printf("%-30s %s\n", row.name.c_str(), status.c_str());
      std::fflush(stdout);
      rows.push_back(row);
    }
    const std::vector<double>& reference_times = reference.step_times();
    const double reference_s = median(reference_times);
    const auto [fastest, slowest] = std::minmax_element(reference_times.begin(), reference_times.end());
    std::printf("\nreference over the run: %zu steps, median %.0f ms, %.0f to %.0f ms; x ref is to the median, "
                "ref here the reference's median right before the layout\n\n",
                reference_times.size(), reference_s * 1e3, *fastest * 1e3, *slowest * 1e3);

    std::printf("| layout | m | ms/step | tokens/s | x ref | ref here ms | peak mem/rank | exposed comm | bubble | "
                "textbook | + imbalance | loss vs ref |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    std::printf("| reference (1 rank) | %lld | %.0f | %.0f | 1.00 | - | %s | - | - | - | - | - |\n",
                static_cast<long long>(s.global_batch / s.micro_batch), reference_s * 1e3, tokens / reference_s,
                format_bytes(ref.peak_bytes).c_str());
    for (const Row& r : rows) {
      if (!r.skipped.empty()) {
        std::printf("| %s | %s | skipped: %s | | | | | | | | | |\n", r.name.c_str(), r.m.c_str(), r.skipped.c_str());
        continue;
      }
      const double loss_diff = std::fabs(static_cast<double>(r.f.loss) - ref.loss) / ref.loss;
      std::printf("| %s | %s | %.0f | %.0f | %.2f | %.0f | %s | %.3f | %.3f | %.3f | %.3f | %.1e |\n", r.name.c_str(),
                  r.m.c_str(), r.f.step_s * 1e3, tokens / r.f.step_s, reference_s / r.f.step_s, r.reference_s * 1e3,
                  format_bytes(r.f.peak_bytes).c_str(), r.f.exposed, r.f.bubble, r.textbook,
                  1 - (1 - r.textbook) * r.f.load_balance, loss_diff);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
