// Training-step benchmark of the single-rank fp32 reference path.
//
//   train_step_bench [preset|custom] [B] [T] [steps] [n_layer n_embd n_head vocab] [checkpoint]
//   e.g. train_step_bench gpt2 4 256 3
//        train_step_bench custom 8 256 5 4 256 4 8192
//        train_step_bench custom 8 256 5 4 256 4 8192 checkpoint   (activation checkpointing)
//
// Prints ms/step, tokens/s, model GFLOP/s (Megatron's FLOP count) and its ratio
// to this machine's sgemm GFLOP/s measured at the start of the same run, the
// optimizer's share of the step, the measured peak device memory against the
// estimate computed from the shapes, and the caching allocator's steady state:
// device allocations that reached the system per step after the first (the
// target is 0) and the bytes it reserved against the bytes in use at the peak.
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;

int main(int argc, char** argv) {
  try {
    const std::string preset = argc > 1 ? argv[1] : "tiny";
    const int64_t B = argc > 2 ? std::atoll(argv[2]) : 4;
    const int64_t T = argc > 3 ? std::atoll(argv[3]) : 64;
    const int steps = argc > 4 ? std::atoi(argv[4]) : 5;
    GPTConfig cfg;
    if (preset == "custom") {
      if (argc < 9) throw Error("custom needs: B T steps n_layer n_embd n_head vocab");
      cfg.n_layer = std::atoll(argv[5]);
      cfg.n_embd = std::atoll(argv[6]);
      cfg.n_head = std::atoll(argv[7]);
      cfg.vocab_size = std::atoll(argv[8]);
      cfg.block_size = T;
    } else {
      cfg = GPTConfig::preset(preset);
    }
    cfg.validate();
    const int after_shape = preset == "custom" ? 9 : 5;
    const bool checkpoint = argc > after_shape && std::string(argv[after_shape]) == "checkpoint";

    const double sgemm = cpu::measure_sgemm_gflops();
    std::printf("threads: %d   sgemm baseline (2048^3): %.1f GFLOP/s\n", cpu::num_threads(), sgemm);
    std::printf("model: %s  layers %lld  width %lld  heads %lld  vocab %lld  params %.2fM   B=%lld T=%lld%s\n",
                preset.c_str(), static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
                static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.vocab_size),
                static_cast<double>(cfg.num_params()) / 1e6, static_cast<long long>(B), static_cast<long long>(T),
                checkpoint ? "  activation checkpointing" : "");

    Allocator& device = MemoryContext::current().tier(Tier::device);
    const size_t base = device.used();
    device.reset_peak();

    TrainOptions opts;
    opts.schedule.max_lr = 1e-4f;
    opts.schedule.total_steps = steps + 1;
    opts.checkpoint_activations = checkpoint;
    Trainer trainer(cfg, opts);
    std::vector<int32_t> tokens(static_cast<size_t>(B * T)), targets(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int32_t>(Philox::block(7, 0, i)[0] % static_cast<uint32_t>(cfg.vocab_size));
      targets[i] = static_cast<int32_t>(Philox::block(7, 1, i)[0] % static_cast<uint32_t>(cfg.vocab_size));
    }
    const MicroBatch mb{tokens.data(), targets.data(), {B, T}, 0};

    trainer.step({&mb, 1});  // warm-up: first-touch page faults, BLAS buffers, the cache
    const uint64_t first_allocations = device.system_allocations();
    const uint64_t first_frees = device.system_frees();
    double best_step = 1e30, best_optim = 1e30;
    for (int s = 0; s < steps; ++s) {
      double t0 = bench::now_seconds();
      trainer.step({&mb, 1});
      best_step = std::min(best_step, bench::now_seconds() - t0);
      // The optimizer alone, on the gradients just computed.
      t0 = bench::now_seconds();
      trainer.optimizer().step(1e-6f, 1.0f);
      ops::synchronize();
      best_optim = std::min(best_optim, bench::now_seconds() - t0);
    }

    const double flops = training_flops_per_step(cfg, B, T);
    const double gflops = flops / best_step / 1e9;
    std::printf("step: %.1f ms   tokens/s: %.0f   model GFLOP/s: %.1f   ratio to sgemm: %.3f\n", best_step * 1e3,
                static_cast<double>(B * T) / best_step, gflops, gflops / sgemm);
    std::printf("optimizer step: %.1f ms = %.1f%% of the training step\n", best_optim * 1e3,
                100.0 * best_optim / best_step);

    Layout layout;
    layout.micro_batch = B;
    layout.recompute = checkpoint;
    const RankMemory predicted =
        predict_step_memory(LayoutProblem{.model = cfg, .global_batch = B, .seq_len = T}, layout, {}).at(0);
    const TierPeak& est = predicted.tiers[static_cast<int>(Tier::device)];
    const double measured = static_cast<double>(device.peak() - base);
    std::printf("peak device memory: measured %s, predicted from shapes %s (measured/predicted = %.3f)\n",
                format_bytes(measured).c_str(), format_bytes(est.bytes).c_str(), measured / est.bytes);
    std::printf("  peak phase: %s; reserved: measured %s, predicted %s\n", est.phase.c_str(),
                format_bytes(static_cast<double>(device.peak_reserved())).c_str(), format_bytes(est.reserved).c_str());
    for (const MemoryTerm& t : est.terms) std::printf("  %-30s %s\n", t.name.c_str(), format_bytes(t.bytes).c_str());
    std::printf("device allocator: %.2f system allocations and %.2f frees per step after the first (%llu until "
                "then), reserved %s at the peak of %s in use (reserved/in use = %.3f)\n",
                static_cast<double>(device.system_allocations() - first_allocations) / steps,
                static_cast<double>(device.system_frees() - first_frees) / steps,
                static_cast<unsigned long long>(first_allocations),
                format_bytes(static_cast<double>(device.peak_reserved())).c_str(),
                format_bytes(static_cast<double>(device.peak())).c_str(),
                static_cast<double>(device.peak_reserved()) / static_cast<double>(device.peak()));
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
