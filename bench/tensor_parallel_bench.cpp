// 1D, 2D, 2.5D and 3D tensor parallelism at the same tp, on the local
// backend (every rank a thread):
//
//   tensor_parallel_bench [tp list] [batch] [T] [steps] [n_layer n_embd n_head vocab] [budget_mib]
//   e.g. tensor_parallel_bench 4,8,16 16 128 3 4 256 16 2048   (the defaults: 2048 tokens, 8 per column)
//        tensor_parallel_bench 4,8,16 8 128 3 4 512 16 4096    (wider, 2 tokens per column: weights dominate)
//
// For each tp every mode whose grid the tp forms runs the same model on the
// same batch of `batch` sequences of T tokens (one micro-batch, fp32, no
// data or pipeline parallelism). Per mode, each as a ratio to 1D at the same
// tp, measured in the same run:
//   step time     the slowest rank's, median over the timed steps, and
//                 tokens/s;
//   peak memory   the costliest rank's device high-water mark over the
//                 timed steps, and its activations: the peak above what the
//                 rank holds between steps (parameters, gradients, AdamW);
//   bytes sent    per rank per step, the most any rank sent over all its
//                 communicators (CommStats' ring model);
//   largest batch the most sequences (a multiple of the mode's token groups)
//                 whose step fits a per-rank device budget, found by running
//                 steps under that budget: fitted from the peaks at `batch`
//                 and 2 `batch`, then confirmed by a step that fits and one a
//                 token group larger that runs out of memory. The budget is
//                 budget_mib when given, else 1D's measured peak at `batch`
//                 at the same tp (the budget 1D just fits).
// Modes whose grid the tp does not form are listed as skipped and left out
// of the table.
// The targets at tp 8: activations <= 0.6 x 1D, bytes sent <= 1D,
// largest batch >= 1.5 x 1D. The last step's loss, relative to 1D's, says
// the modes trained the same model.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/parallel.h"
#include "loom/train.h"

using namespace loom;
using bench::median;

namespace {

struct Settings {
  GPTConfig model;
  std::vector<int> tps{4, 8, 16};
  int64_t batch = 16, T = 128;
  int steps = 3;
  double budget = 0;  // bytes; 0: 1D's peak at each tp
};

struct Mode {
  TensorParallelMode mode = TensorParallelMode::one_d;
  int depth = 1;  // 2.5D's layers
  TensorGridShape grid(int tp) const { return tensor_grid_shape(mode, tp, depth); }
  std::string name() const {
    return mode == TensorParallelMode::two_and_half_d ? str("2.5d (depth ", depth, ")")
                                                      : tensor_parallel_mode_name(mode);
  }
  // How many ways the batch's sequences are split.
  int64_t token_groups(int tp) const {
    const TensorGridShape g = grid(tp);
    return g.ranks() > 1 ? int64_t{g.q} * g.depth : 1;
  }
  // Why this mode cannot run at `tp`, or empty.
  std::string unfit(const Settings& s, int tp) const {
    if (mode == TensorParallelMode::one_d)
      return s.model.n_head % tp == 0 ? std::string() : str("tp ", tp, " does not divide n_head ", s.model.n_head);
    const TensorGridShape g = grid(tp);
    if (g.q == 0) return str("tp ", tp, " forms no ", tensor_parallel_mode_name(mode), " grid");
    const int64_t q = g.q, out_parts = g.cube ? q * q : q;
    if (s.model.n_head % q != 0 || s.model.n_embd % out_parts != 0 || s.model.intermediate() % out_parts != 0)
      return str("the grid's side ", q, " does not split the model");
    if (s.batch % token_groups(tp) != 0)
      return str("batch ", s.batch, " does not split over ", token_groups(tp), " token groups");
    return {};
  }
};

std::vector<Mode> modes() {
  using M = TensorParallelMode;
  return {{M::one_d}, {M::two_d}, {M::two_and_half_d, 2}, {M::two_and_half_d, 4}, {M::three_d}};
}

struct Figures {
  double step_s = 0, peak = 0, activations = 0, sent = 0;
  float loss = 0;
};

std::vector<int32_t> tokens_of(const Settings& s, int64_t batch) {
  std::vector<int32_t> d(static_cast<size_t>(batch * s.T + 1));
  for (size_t i = 0; i < d.size(); ++i)
    d[i] = static_cast<int32_t>(Philox::block(7, 0, i)[0] % static_cast<uint32_t>(s.model.vocab_size));
  return d;
}

TrainOptions options(const Settings& s) {
  TrainOptions o;
  o.schedule.max_lr = 1e-4f;
  o.schedule.total_steps = s.steps + 1;
  return o;
}

// Every communicator a rank of `mesh` sends over: the world, the mesh's
// axes and the grid's groups.
double bytes_sent(DeviceMesh& mesh) {
  std::set<Communicator*> groups{&mesh.world()};
  for (MeshAxis axis : kMeshAxes) groups.insert(&mesh.group(axis));
  if (const TensorGrid* g = mesh.tensor_grid())
    for (Communicator* c : {g->hidden_group, g->weight_group, g->depth_group, g->token_group, g->inner_token_group,
                            g->table_group})
      groups.insert(c);
  double bytes = 0;
  for (Communicator* c : groups) bytes += c->stats().sent().bytes;
  return bytes;
}

// Runs a warm-up step and `steps` timed steps of `batch` sequences under a
// per-rank device budget (0: none). Throws what a rank threw (out of memory
// under a budget).
Figures run_mode(const Settings& s, const Mode& m, int tp, int64_t batch, int steps, double budget) {
  const std::vector<int32_t> data = tokens_of(s, batch);
  struct Rank {
    std::vector<double> step_s;
    double peak = 0, activations = 0, sent = 0;
    float loss = 0;
  };
  std::vector<Rank> ranks(static_cast<size_t>(tp));
  run_local(tp, [&](Communicator& world) {
    Allocator& device = MemoryContext::current().tier(Tier::device);
    if (budget > 0) device.set_budget(static_cast<size_t>(budget));
    MeshShape shape;
    shape[MeshAxis::tp] = tp;
    DeviceMesh mesh(world, shape, m.grid(tp));
    Trainer trainer(s.model, options(s), mesh);
    const MicroBatch mb{data.data(), data.data() + 1, {batch, s.T}, 0};
    trainer.step({&mb, 1});  // warm-up: the optimizer state, first touches
    Rank& r = ranks[static_cast<size_t>(world.rank())];
    const double resident = static_cast<double>(device.used());
    device.reset_peak();
    const double sent0 = bytes_sent(mesh);
    for (int i = 0; i < steps; ++i) {
      world.barrier();
      const double t0 = bench::now_seconds();
      r.loss = trainer.step({&mb, 1}).loss;
      world.barrier();
      r.step_s.push_back(bench::now_seconds() - t0);
    }
    r.peak = static_cast<double>(device.peak());
    r.activations = r.peak - resident;
    r.sent = (bytes_sent(mesh) - sent0) / std::max(steps, 1);
  });
  Figures f;
  f.step_s = steps > 0 ? median(ranks[0].step_s) : 0.0;  // every step ends in a barrier
  for (const Rank& r : ranks) {
    f.peak = std::max(f.peak, r.peak);
    f.activations = std::max(f.activations, r.activations);
    f.sent = std::max(f.sent, r.sent);
  }
  f.loss = ranks[0].loss;
  return f;
}

// Whether a step of `batch` sequences fits `budget` on every rank.
bool fits(const Settings& s, const Mode& m, int tp, int64_t batch, double budget) {
  try {
    run_mode(s, m, tp, batch, 0, budget);
    return true;
  } catch (const Error& e) {
    if (std::string(e.what()).find("out of device memory") == std::string::npos) throw;
    return false;
  }
}

// The most sequences, a multiple of the mode's token groups, whose step fits
// `budget`: a guess from two peaks, then steps under the budget until one
// fits and one a token group larger does not.
int64_t largest_batch(const Settings& s, const Mode& m, int tp, const Figures& at_batch, double budget) {
  const int64_t g = m.token_groups(tp);
  const Figures twice = run_mode(s, m, tp, 2 * s.batch, 0, 0);
  const double per_sequence = (twice.peak - at_batch.peak) / static_cast<double>(s.batch);
  int64_t b = per_sequence > 0 ? static_cast<int64_t>((budget - at_batch.peak) / per_sequence) + s.batch : s.batch;
  b = std::max<int64_t>(g, b / g * g);
  while (!fits(s, m, tp, b, budget)) {
    if (b == g) return 0;
    b -= g;
  }
  while (fits(s, m, tp, b + g, budget)) b += g;
  return b;
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> v;
  std::stringstream in(text);
  for (std::string item; std::getline(in, item, ',');) v.push_back(std::atoi(item.c_str()));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Settings s;
    if (argc > 1) s.tps = parse_list(argv[1]);
    if (argc > 2) s.batch = std::atoll(argv[2]);
    if (argc > 3) s.T = std::atoll(argv[3]);
    if (argc > 4) s.steps = std::atoi(argv[4]);
    s.model.n_layer = argc > 5 ? std::atoll(argv[5]) : 4;
    s.model.n_embd = argc > 6 ? std::atoll(argv[6]) : 256;
    s.model.n_head = argc > 7 ? std::atoll(argv[7]) : 16;
    s.model.vocab_size = argc > 8 ? std::atoll(argv[8]) : 2048;
    if (argc > 9) s.budget = std::atof(argv[9]) * 1024 * 1024;
    s.model.block_size = s.T;
    s.model.validate();
    if (s.steps < 1) throw Error(str("steps = ", s.steps, ": time at least one step"));
    if (s.tps.empty() || *std::min_element(s.tps.begin(), s.tps.end()) < 2)
      throw Error("the tp list must name sizes of 2 or more, e.g. 4,8,16");
    std::printf("model: layers %lld width %lld heads %lld vocab %lld, %.2fM params; batch %lld x T=%lld, one "
                "micro-batch, fp32; %d timed steps; local backend\n",
                static_cast<long long>(s.model.n_layer), static_cast<long long>(s.model.n_embd),
                static_cast<long long>(s.model.n_head), static_cast<long long>(s.model.vocab_size),
                static_cast<double>(s.model.num_params()) / 1e6, static_cast<long long>(s.batch),
                static_cast<long long>(s.T), s.steps);
    const double tokens = static_cast<double>(s.batch * s.T);

    struct Row {
      int tp = 0;
      Mode mode;
      std::string skipped;
      Figures f;
      int64_t largest = 0;
      double budget = 0;
    };
    std::vector<Row> rows;
    for (int tp : s.tps)
      for (const Mode& m : modes()) {
        Row row{tp, m, m.unfit(s, tp), {}, 0, 0};
        if (row.skipped.empty()) row.f = run_mode(s, m, tp, s.batch, s.steps, 0);
        std::printf("tp %-3d %-16s %s\n", tp, m.name().c_str(),
                    row.skipped.empty() ? str(row.f.step_s * 1e3, " ms/step, peak ", format_bytes(row.f.peak)).c_str()
                                        : str("skipped: ", row.skipped).c_str());
        std::fflush(stdout);
        rows.push_back(row);
      }
    // The 1D row of each tp.
    const auto one_d = [&](int tp) -> const Row& {
      for (const Row& b : rows)
        if (b.tp == tp && b.mode.mode == TensorParallelMode::one_d) return b;
      throw Error(str("no 1D layout at tp ", tp));
    };
    for (Row& r : rows) {
      if (!r.skipped.empty()) continue;
      r.budget = s.budget > 0 ? s.budget : one_d(r.tp).f.peak;
      if (r.budget <= 0) continue;  // 1D did not run at this tp
      r.largest = largest_batch(s, r.mode, r.tp, r.f, r.budget);
      std::printf("tp %-3d %-16s largest batch %lld under %s per rank\n", r.tp, r.mode.name().c_str(),
                  static_cast<long long>(r.largest), format_bytes(r.budget).c_str());
      std::fflush(stdout);
    }

    std::printf("\n| tp | mode | ms/step | tokens/s | x 1D | peak/rank | x 1D | activations/rank | x 1D | "
                "sent/rank/step | x 1D | largest batch | x 1D | loss vs 1D |\n");
    std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : rows) {
      if (!r.skipped.empty()) continue;
      const Row* base = &one_d(r.tp);
      const Figures& o = base->f;
      const double loss_diff = std::fabs(static_cast<double>(r.f.loss) - o.loss) / o.loss;
      std::printf("| %d | %s | %.0f | %.0f | %.2f | %s | %.2f | %s | %.2f | %s | %.2f | %lld | %.2f | %.1e |\n",
                  r.tp, r.mode.name().c_str(), r.f.step_s * 1e3, tokens / r.f.step_s, o.step_s / r.f.step_s,
                  format_bytes(r.f.peak).c_str(), r.f.peak / o.peak, format_bytes(r.f.activations).c_str(),
                  r.f.activations / o.activations, format_bytes(r.f.sent).c_str(), r.f.sent / o.sent,
                  static_cast<long long>(r.largest),
                  base->largest > 0 ? static_cast<double>(r.largest) / static_cast<double>(base->largest) : 0.0,
                  loss_diff);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
