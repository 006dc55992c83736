// A LoRA fine-tuning step of a LLaMA-shaped model (about 100M parameters)
// against the same step in PyTorch with PEFT on this CPU, in the same run, and
// against a full fine-tuning step of the same model in loom.
//
//   lora_step_bench [B T steps] [n_layer hidden heads kv_heads intermediate vocab] [r alpha targets]
//   e.g. lora_step_bench                  (4 x 256 tokens; 12 x 768, 12 heads, 4 kv heads, 2048, 16384: 101M)
//        lora_step_bench 2 512 3 8 1024 16 8 2816 32000 8 16 q,v
//
// The PyTorch side is bench/lora_step_torch.py (transformers' LlamaForCausalLM
// with PEFT's LoRA on the same projections, AdamW over the adapters and
// gradient-norm clipping, as loom's Trainer steps), run with $LOOM_BENCH_PYTHON
// (default python3), which needs torch, transformers and peft, on as many
// threads as loom uses. Each figure is the best of `steps` steps after a
// warm-up step. Prints tokens/s of each, loom's LoRA tokens/s as a ratio to
// PyTorch's (target >= 1.5), and loom's LoRA step time as a fraction of its
// full fine-tuning step, with the model-state bytes of each read from the
// device allocator; then each side's model GFLOP/s against its own GEMM rate
// (loom's sgemm baseline, torch.mm) and the ratio a step at loom's sgemm rate
// would reach.
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;

namespace {

struct Timing {
  double seconds = 0.0;        // best step
  size_t model_state = 0;      // device bytes in use between steps
};

Timing time_steps(const GPTConfig& cfg, int64_t B, int64_t T, int steps) {
  Allocator& device = MemoryContext::current().tier(Tier::device);
  const size_t before = device.used();
  TrainOptions opts;
  opts.schedule.max_lr = 1e-4f;
  opts.schedule.total_steps = steps + 1;
  Trainer trainer(cfg, opts);
  std::vector<int32_t> data(static_cast<size_t>(B * T + 1));
  for (size_t i = 0; i < data.size(); ++i)
    data[i] = static_cast<int32_t>(Philox::block(7, 0, i)[0] % static_cast<uint32_t>(cfg.vocab_size));
  const MicroBatch mb{data.data(), data.data() + 1, {B, T}, 0};
  trainer.step({&mb, 1});  // warm-up: first-touch pages, BLAS buffers, the caching allocator
  Timing t;
  t.model_state = device.used() - before;
  t.seconds = 1e30;
  for (int s = 0; s < steps; ++s) {
    const double t0 = bench::now_seconds();
    trainer.step({&mb, 1});
    t.seconds = std::min(t.seconds, bench::now_seconds() - t0);
  }
  return t;
}

struct TorchTiming {
  double seconds = 0.0;      // best step
  double gemm_gflops = 0.0;  // torch.mm, 2048^3
};

// Runs the PyTorch + PEFT step.
TorchTiming pytorch_step(const std::vector<std::string>& args) {
  const bench::PythonRun run = bench::run_python(LOOM_BENCH_SOURCE_DIR "/bench/lora_step_torch.py", args);
  if (run.status != 0)
    throw Error("bench: the PyTorch side failed (" + run.command + "):\n" + run.output +
                "\nIt needs torch, transformers and peft (pip install torch transformers peft); set "
                "LOOM_BENCH_PYTHON to a python that has them.");
  return {bench::json_number(run.output, "seconds_per_step"), bench::json_number(run.output, "gemm_gflops")};
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const auto arg = [&](int i, const char* fallback) { return std::string(argc > i ? argv[i] : fallback); };
    const int64_t B = std::stoll(arg(1, "4")), T = std::stoll(arg(2, "256"));
    const int steps = std::stoi(arg(3, "3"));
    GPTConfig cfg = GPTConfig::preset("llama-tiny");
    cfg.n_layer = std::stoll(arg(4, "12"));
    cfg.n_embd = std::stoll(arg(5, "768"));
    cfg.n_head = std::stoll(arg(6, "12"));
    cfg.n_kv_head = std::stoll(arg(7, "4"));
    cfg.intermediate_size = std::stoll(arg(8, "2048"));
    cfg.vocab_size = std::stoll(arg(9, "16384"));
    cfg.block_size = T;
    cfg.tied_embeddings = false;
    GPTConfig lora = cfg;
    lora.lora.r = std::stoll(arg(10, "16"));
    lora.lora.alpha = std::stof(arg(11, "32"));
    const std::string targets = arg(12, "q,k,v,o,gate,up,down");
    for (size_t at = 0; at <= targets.size();) {
      const size_t comma = std::min(targets.find(',', at), targets.size());
      lora.lora.targets.push_back(targets.substr(at, comma - at));
      at = comma + 1;
    }
    lora.validate();

    const int threads = cpu::num_threads();
    const double sgemm = cpu::measure_sgemm_gflops();
    std::printf("LLaMA-shaped: %lld layers, hidden %lld, %lld heads (%lld kv), intermediate %lld, vocab %lld: "
                "%.1fM parameters; B=%lld T=%lld; %d threads\n",
                static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
                static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.kv_heads()),
                static_cast<long long>(cfg.intermediate()), static_cast<long long>(cfg.vocab_size),
                static_cast<double>(cfg.num_params()) / 1e6, static_cast<long long>(B), static_cast<long long>(T),
                threads);
    std::printf("LoRA r=%lld alpha=%g on %s: %.2fM adapter parameters\n", static_cast<long long>(lora.lora.r),
                static_cast<double>(lora.lora.alpha), targets.c_str(),
                static_cast<double>(lora.num_params() - cfg.num_params()) / 1e6);
    const double tokens = static_cast<double>(B * T);

    const Timing loom_lora = time_steps(lora, B, T, steps);
    std::printf("loom LoRA step:          %8.1f ms  %8.0f tokens/s  model state %s\n", loom_lora.seconds * 1e3,
                tokens / loom_lora.seconds, format_bytes(static_cast<double>(loom_lora.model_state)).c_str());
    const Timing loom_full = time_steps(cfg, B, T, steps);
    std::printf("loom full fine-tuning:   %8.1f ms  %8.0f tokens/s  model state %s\n", loom_full.seconds * 1e3,
                tokens / loom_full.seconds, format_bytes(static_cast<double>(loom_full.model_state)).c_str());
    const TorchTiming torch = pytorch_step({arg(4, "12"), arg(5, "768"), arg(6, "12"), arg(7, "4"), arg(8, "2048"),
                                          arg(9, "16384"), std::to_string(B), std::to_string(T),
                                          std::to_string(steps), std::to_string(lora.lora.r),
                                          arg(11, "32"), std::to_string(threads), targets});
    std::printf("PyTorch + PEFT LoRA step: %7.1f ms  %8.0f tokens/s\n", torch.seconds * 1e3, tokens / torch.seconds);
    std::printf("loom LoRA tokens/s / PyTorch + PEFT: %.2f (target >= 1.5)\n", torch.seconds / loom_lora.seconds);
    std::printf("loom LoRA step time / full fine-tuning step time: %.2f\n", loom_lora.seconds / loom_full.seconds);
    // The step's model FLOPs (frozen weights: no weight gradient) at each
    // side's rate, against the GEMM rates: a step that is all GEMM cannot
    // beat PyTorch by more than torch's step time over the FLOPs at loom's
    // sgemm rate.
    const double flops = training_flops_per_step(lora, B, T);
    std::printf("model GFLOP/s: loom %.1f = %.2f of its sgemm (%.1f); PyTorch %.1f = %.2f of its GEMM (%.1f)\n",
                flops / loom_lora.seconds / 1e9, flops / loom_lora.seconds / 1e9 / sgemm, sgemm,
                flops / torch.seconds / 1e9, flops / torch.seconds / 1e9 / torch.gemm_gflops, torch.gemm_gflops);
    std::printf("ceiling of the ratio with every FLOP at loom's sgemm rate: %.2f\n",
                torch.seconds / (flops / (sgemm * 1e9)));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lora_step_bench: %s\n", e.what());
    return 1;
  }
}
