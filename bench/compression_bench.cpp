// Batch-1 decode with weight-only int8 and int4 weights against fp32, on a
// model whose weights are larger than the CPU caches: tokens/s as ratios to
// fp32, and each as a fraction of the memory-bandwidth bound (the bytes of
// weights one token reads / the copy bandwidth measured in this run).
//
// Also one linear layer through each kernel, as a ratio to fp32's BLAS: one
// row (decode, 64 MB of fp32 weights: memory-bound) and 32 rows (a prefill
// chunk, 4096 x 1024 weights: compute-bound).
//
// W8A8 (SmoothQuant, calibrated on a few random batches) decodes beside them,
// and its linear layer (activation quantization, int8 GEMM, epilogue) runs
// through each int8 GEMM, oneDNN's and loom's own, as ratios to fp32's BLAS
// for 1, 32 and 512 rows; the crossover line times both GEMMs by row count,
// where Int8Gemm::fastest switches (kernels.h).
//
//   compression_bench [--layers 6] [--width 1024] [--tokens 12]
//
// On a machine whose cores are shared, OMP_NUM_THREADS=1 gives steadier
// figures (a parallel region waits for its slowest thread).
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/inference.h"
#include "loom/nn.h"
#include "loom/quant.h"

using namespace loom;

namespace {

// Greedy decode of `tokens` tokens after a one-token prompt; tokens/s.
double decode_rate(const GPT& model, ParamStore& params, int64_t tokens) {
  GenerationRequest r;
  r.prompt = {1};
  r.max_tokens = tokens;
  r.sample.temperature = 0.0f;
  Generator(model, params, 1).run({r});  // warm-up
  std::vector<double> times;
  for (int rep = 0; rep < 3; ++rep) {
    const double t0 = bench::now_seconds();
    Generator(model, params, 1).run({r});
    times.push_back(bench::now_seconds() - t0);
  }
  return static_cast<double>(tokens) / bench::median(times);
}

// Best-of-5 seconds of run() after a warm-up.
double best_seconds(const std::function<void()>& run) {
  run();
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = bench::now_seconds();
    run();
    best = std::min(best, bench::now_seconds() - t0);
  }
  return best;
}

// GFLOP/s of one linear layer's forward over `n` rows: fp32 (BLAS) and the
// quantized kernels; best of 5.
void linear_rates(int64_t n, int64_t in, int64_t out) {
  std::vector<float> w(static_cast<size_t>(in * out)), x(static_cast<size_t>(n * in)), y(static_cast<size_t>(n * out));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 7919) % 255) / 255.0f - 0.5f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 104729) % 251) / 251.0f - 0.5f;
  const QuantizedWeight q8 = quantize_int8(w.data(), out, in), q4 = quantize_int4(w.data(), out, in, 128);
  auto rate = [&](const std::function<void()>& run) {
    return 2.0 * static_cast<double>(n * in * out) / best_seconds(run) / 1e9;
  };
  const double fp32 = rate([&] { cpu::linear_forward(y.data(), x.data(), w.data(), nullptr, n, in, out); });
  const double int8 = rate([&] {
    cpu::linear_forward_int8(y.data(), out, x.data(), q8.values.data<int8_t>(), q8.scales.data<float>(), nullptr, n,
                             in, out);
  });
  const double int4 = rate([&] {
    cpu::linear_forward_int4(y.data(), out, x.data(), q4.values.data<uint8_t>(), q4.scales.data<float>(),
                             q4.zeros.data<uint8_t>(), nullptr, n, in, out, 128);
  });
  std::printf("linear %lld x %lld -> %lld: fp32 %.1f GFLOP/s, int8 %.2fx, int4 %.2fx of it\n",
              static_cast<long long>(n), static_cast<long long>(in), static_cast<long long>(out), fp32, int8 / fp32,
              int4 / fp32);
}

// A W8A8 model of `fp32`, smoothed by the inputs of two forwards over random
// tokens (what `loom quantize --data` runs over its shard).
std::unique_ptr<QuantizedParamStore> w8a8_params(const GPT& model, ParamStore& fp32) {
  SmoothQuantCalibration calibration;
  const int64_t T = model.config().block_size;
  std::vector<int32_t> tokens(static_cast<size_t>(2 * T + 1));
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % model.config().vocab_size);
  ForwardOptions fo;
  fo.training = false;
  for (int b = 0; b < 2; ++b) {
    MicroBatchState s;
    const_cast<GPT&>(model).forward(fp32, s, tokens.data(), tokens.data() + 1, {2, T}, fo);
  }
  return quantize_params(model.layout(), fp32, {.method = QuantMethod::w8a8}, &calibration);
}

// One W8A8 linear layer over `n` rows through each int8 GEMM, as ratios to
// fp32's BLAS on the same shape.
void w8a8_linear_rates(int64_t n, int64_t in, int64_t out) {
  std::vector<float> w(static_cast<size_t>(in * out)), x(static_cast<size_t>(n * in)), y(static_cast<size_t>(n * out));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 7919) % 255) / 255.0f - 0.5f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 104729) % 251) / 251.0f - 0.5f;
  const std::vector<float> xmax(static_cast<size_t>(in), 0.5f);
  const QuantizedWeight q = quantize_w8a8(w.data(), out, in, xmax, 0.5);
  const double flop = 2.0 * static_cast<double>(n * in * out);
  const double fp32 = flop / best_seconds([&] { cpu::linear_forward(y.data(), x.data(), w.data(), nullptr, n, in, out); });
  auto w8a8 = [&](cpu::Int8Gemm gemm) {
    return flop / best_seconds([&] {
      cpu::linear_forward_w8a8(y.data(), out, x.data(), q.smooth.data<float>(), q.values.data<int8_t>(),
                               q.scales.data<float>(), nullptr, n, in, out, gemm);
    });
  };
  const double own = w8a8(cpu::Int8Gemm::own);
  std::printf("w8a8 GEMM %lld x %lld -> %lld: fp32 %.1f GFLOP/s; own %.2fx", static_cast<long long>(n),
              static_cast<long long>(in), static_cast<long long>(out), fp32 / 1e9, own / fp32);
  if (cpu::onednn_int8_gemm_available()) std::printf(", oneDNN %.2fx", w8a8(cpu::Int8Gemm::onednn) / fp32);
  std::printf(", fastest %.2fx of it\n", w8a8(cpu::Int8Gemm::fastest) / fp32);
}

// Own kernel time / oneDNN time by row count, for one layer shape: where
// oneDNN starts to win.
void w8a8_crossover(int64_t in, int64_t out) {
  if (!cpu::onednn_int8_gemm_available()) return;
  std::printf("w8a8 own / oneDNN time, %lld -> %lld, by rows:", static_cast<long long>(in),
              static_cast<long long>(out));
  const std::vector<int8_t> w(static_cast<size_t>(in * out), 3);
  const std::vector<float> scale(static_cast<size_t>(out), 0.01f);
  for (int64_t n : {1, 2, 4, 8, 16, 32, 64}) {
    const std::vector<float> x(static_cast<size_t>(n * in), 0.25f);
    std::vector<float> y(static_cast<size_t>(n * out));
    auto time = [&](cpu::Int8Gemm gemm) {
      return best_seconds([&] {
        cpu::linear_forward_w8a8(y.data(), out, x.data(), nullptr, w.data(), scale.data(), nullptr, n, in, out, gemm);
      });
    };
    std::printf(" %lld: %.2f", static_cast<long long>(n), time(cpu::Int8Gemm::own) / time(cpu::Int8Gemm::onednn));
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  int64_t layers = 6, width = 1024, tokens = 12;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const int64_t v = std::stoll(argv[i + 1]);
    if (flag == "--layers") layers = v;
    else if (flag == "--width") width = v;
    else if (flag == "--tokens") tokens = v;
  }
  GPTConfig cfg = GPTConfig::preset("tiny");
  cfg.n_layer = layers;
  cfg.n_embd = width;
  cfg.n_head = width / 64;
  cfg.vocab_size = 8192;
  cfg.block_size = 64;
  cfg.validate();
  const GPT model(cfg);
  ParamStore fp32(model.layout(), 1);
  const auto int8 = quantize_params(model.layout(), fp32, {QuantMethod::int8, 0});
  const auto int4 = quantize_params(model.layout(), fp32, {QuantMethod::int4, 128});
  const auto w8a8 = w8a8_params(model, fp32);

  const double bandwidth = bench::copy_bandwidth(size_t{512} << 20);
  std::printf("model: %lld layers, width %lld, vocab %lld; %d threads; copy bandwidth %.2f GB/s (read + write)\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
              static_cast<long long>(cfg.vocab_size), cpu::num_threads(), bandwidth / 1e9);
  std::printf("%-6s %14s %12s %10s %14s\n", "", "MB/token", "tokens/s", "vs fp32", "of bw bound");
  double base = 0.0;
  for (const auto& [name, params] :
       {std::pair<const char*, ParamStore*>{"fp32", &fp32}, {"int8", int8.get()}, {"int4", int4.get()},
        {"w8a8", w8a8.get()}}) {
    const double rate = decode_rate(model, *params, tokens), bytes = bench::weight_bytes_per_token(model, *params);
    if (base == 0.0) base = rate;
    std::printf("%-6s %14.1f %12.2f %9.2fx %13.1f%%\n", name, bytes / 1e6, rate, rate / base,
                100.0 * rate / (bandwidth / bytes));
  }
  linear_rates(1, 4096, 4096);
  linear_rates(32, width, 4 * width);
  for (int64_t n : {1, 32, 512}) w8a8_linear_rates(n, n == 1 ? 4096 : width, n == 1 ? 4096 : 4 * width);
  w8a8_crossover(width, 4 * width);
  return 0;
}
