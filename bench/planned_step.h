// Shared by the planner's benchmarks: one training step of a TrainPlan on
// local ranks, timed as the slowest rank's, on a deterministic batch.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/parallel.h"
#include "loom/train.h"

namespace loom::bench {

// Tokens for `sequences` sequences of `seq_len` (and the next token of the
// last), uniform over `vocab`.
inline std::vector<int32_t> random_tokens(int64_t sequences, int64_t seq_len, int64_t vocab) {
  std::vector<int32_t> data(static_cast<size_t>(sequences * seq_len + 1));
  std::mt19937 rng(1);
  for (int32_t& t : data) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  return data;
}

// The slowest rank's step time, median over `steps` timed steps after a
// warm-up step (first touches, BLAS buffers). Throws what a rank throws (an
// out-of-memory Error under a device budget, say).
inline double measure_planned_step(const TrainPlan& plan, const std::vector<int32_t>& data, int steps) {
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
    trainer.step(mbs);
    for (int i = 0; i < steps; ++i) {
      world.barrier();
      const double t0 = now_seconds();
      trainer.step(mbs);
      times[static_cast<size_t>(world.rank())].push_back(now_seconds() - t0);
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

}  // namespace loom::bench
