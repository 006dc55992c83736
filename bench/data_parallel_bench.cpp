// Data-parallel training under each ZeRO stage and precision, on the local
// backend (ranks as threads).
//
//   data_parallel_bench [ranks] [B] [T] [steps] [n_layer n_embd n_head vocab]
//   e.g. data_parallel_bench 2 4 128 3 4 384 6 4096
//
// Per configuration: step time, tokens/s of the global batch, model-state
// bytes per rank (allocator counters) as a ratio to the ZeRO formula, the time
// the same collectives take with nothing to overlap (measured in the same run,
// right after), and the exposed communication: the time a rank spent blocked
// on communication during a step (comm.h blocked_seconds). Blocked time also
// contains waiting for a slower peer to arrive; the rank that arrives last at
// the step's synchronization points waits for data only, so the bench reports
// both the mean over ranks and, per step, the least-blocked rank (median over
// steps), which is the exposed communication without the ranks' skew.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/comm.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;

namespace {

struct Setting {
  int stage;
  DType precision;
};

struct Figures {
  double step_s = 0, alone_s = 0, state_bytes = 0;
  std::vector<double> blocked_s;  // per step
};

// The collectives one step issues, run back to back with no compute:
// stage 0 all-reduces every bucket; stages 1-2 reduce-scatter and all-gather
// every bucket; stage 3 gathers every group twice and reduce-scatters it once.
double time_collectives_alone(Communicator& dp, const ZeroPartition& part, int stage, DType dt) {
  Tensor buf = Tensor::zeros({part.padded_numel()}, dt);
  const auto at = [&](int64_t i) { return static_cast<char*>(buf.raw()) + static_cast<size_t>(i) * dtype_size(dt); };
  dp.barrier();
  const double t0 = bench::now_seconds();
  for (const ZeroBucket& b : part.buckets()) {
    void* bucket = at(b.padded_begin);
    void* own = at(b.padded_begin + part.rank() * b.shard);
    if (stage == 0) {
      dp.all_reduce(bucket, b.numel(), dt);
      continue;
    }
    dp.reduce_scatter(bucket, own, b.shard, dt);
    dp.all_gather(own, bucket, b.shard, dt);
    if (stage == 3) dp.all_gather(own, bucket, b.shard, dt);
  }
  dp.barrier();
  return bench::now_seconds() - t0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const int ranks = argc > 1 ? std::atoi(argv[1]) : 2;
    const int64_t B = argc > 2 ? std::atoll(argv[2]) : 4;
    const int64_t T = argc > 3 ? std::atoll(argv[3]) : 128;
    const int steps = argc > 4 ? std::atoi(argv[4]) : 3;
    GPTConfig cfg;
    cfg.n_layer = argc > 5 ? std::atoll(argv[5]) : 4;
    cfg.n_embd = argc > 6 ? std::atoll(argv[6]) : 384;
    cfg.n_head = argc > 7 ? std::atoll(argv[7]) : 6;
    cfg.vocab_size = argc > 8 ? std::atoll(argv[8]) : 4096;
    cfg.block_size = T;
    cfg.validate();
    const double psi = static_cast<double>(cfg.num_params());
    std::printf("ranks %d (local backend), model: layers %lld width %lld heads %lld vocab %lld, %.2fM params; "
                "per rank B=%lld T=%lld; %d timed steps\n",
                ranks, static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
                static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.vocab_size), psi / 1e6,
                static_cast<long long>(B), static_cast<long long>(T), steps);
    std::printf("%-12s %9s %9s %12s %8s %9s %11s %10s %9s %10s\n", "config", "ms/step", "tokens/s", "state/rank",
                "/formula", "comm ms", "blocked ms", "exposed ms", "exp/step", "exp/comm");

    const Setting settings[] = {{0, DType::f32}, {1, DType::f32},  {2, DType::f32},
                                {3, DType::f32}, {1, DType::bf16}, {3, DType::bf16}};
    for (const Setting& s : settings) {
      std::vector<Figures> per_rank(static_cast<size_t>(ranks));
      run_local(ranks, [&](Communicator& world) {
        Allocator& device = MemoryContext::current().tier(Tier::device);
        const size_t base = device.used();
        TrainOptions opts;
        opts.schedule.max_lr = 1e-4f;
        opts.schedule.total_steps = steps + 1;
        opts.zero.stage = s.stage;
        opts.zero.precision = s.precision;
        Trainer trainer(cfg, opts, &world);
        std::vector<int32_t> tokens(static_cast<size_t>(B * T + 1));
        for (size_t i = 0; i < tokens.size(); ++i)
          tokens[i] = static_cast<int32_t>(Philox::block(7, static_cast<uint64_t>(world.rank()), i)[0] %
                                           static_cast<uint32_t>(cfg.vocab_size));
        MicroBatch mb{tokens.data(), tokens.data() + 1, {B, T}, world.rank() * B};
        trainer.step({&mb, 1});  // warm-up: first touches, stage-3 order
        // No barrier between the timed steps: stages 1-2 overlap their
        // parameter all-gathers with the next forward, and a barrier would
        // absorb them outside the measurement.
        world.barrier();
        Figures f;
        for (int i = 0; i < steps; ++i) {
          const double t0 = bench::now_seconds(), b0 = blocked_seconds();
          trainer.step({&mb, 1});
          f.step_s += bench::now_seconds() - t0;
          f.blocked_s.push_back(blocked_seconds() - b0);
        }
        f.step_s /= steps;
        f.state_bytes = static_cast<double>(device.used() - base);
        f.alone_s = time_collectives_alone(world, *trainer.partition(), s.stage, s.precision);
        per_rank[static_cast<size_t>(world.rank())] = f;
      });
      Figures m;
      double blocked_mean = 0;
      std::vector<double> least_blocked;
      for (int i = 0; i < steps; ++i) {
        double least = 1e30;
        for (const Figures& f : per_rank) {
          blocked_mean += f.blocked_s[static_cast<size_t>(i)] / (ranks * steps);
          least = std::min(least, f.blocked_s[static_cast<size_t>(i)]);
        }
        least_blocked.push_back(least);
      }
      std::sort(least_blocked.begin(), least_blocked.end());
      const double exposed = least_blocked[least_blocked.size() / 2];
      for (const Figures& f : per_rank) {
        m.step_s += f.step_s / ranks;
        m.alone_s += f.alone_s / ranks;
        m.state_bytes += f.state_bytes / ranks;
      }
      const std::string name = str("stage ", s.stage, " ", dtype_name(s.precision));
      std::printf("%-12s %9.1f %9.0f %12s %8.3f %9.1f %11.1f %10.1f %9.3f %10.3f\n", name.c_str(), m.step_s * 1e3,
                  static_cast<double>(ranks * B * T) / m.step_s, format_bytes(m.state_bytes).c_str(),
                  m.state_bytes / zero_model_state_bytes(s.stage, s.precision, psi, ranks), m.alone_s * 1e3, blocked_mean * 1e3,
                  exposed * 1e3, exposed / m.step_s, exposed / m.alone_s);
    }
    std::printf("target: exp/comm < 0.5 for stages 0 and 1 with 2 ranks\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
