// Batch-1 decode with weight-only int8 and int4 weights against fp32, on a
// model whose weights are larger than the CPU caches: tokens/s as ratios to
// fp32, and each as a fraction of the memory-bandwidth bound (the bytes of
// weights one token reads / the copy bandwidth measured in this run).
//
// Also one linear layer through each kernel, as a ratio to fp32's BLAS: one
// row (decode, 64 MB of fp32 weights: memory-bound) and 32 rows (a prefill
// chunk, 4096 x 1024 weights: compute-bound).
//
//   compression_bench [--layers 6] [--width 1024] [--tokens 12]
//
// On a machine whose cores are shared, OMP_NUM_THREADS=1 gives steadier
// figures (a parallel region waits for its slowest thread).
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "bench_common.h"
#include "loom/inference.h"
#include "loom/quant.h"

using namespace loom;

namespace {

// Bytes moved per second by memcpy of a buffer far larger than the caches
// (read + write), in parallel chunks; best of 5.
double copy_bandwidth(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = bench::now_seconds();
    const int64_t chunks = 64;
    const size_t chunk = bytes / chunks;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) std::memcpy(b.data() + c * chunk, a.data() + c * chunk, chunk);
    best = std::min(best, bench::now_seconds() - t0);
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

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

// The weight bytes one decoded token reads: every parameter (the position
// table, of which a token reads one row, counted whole: block_size rows, a
// small share here).
double bytes_per_token(const GPT& model, const ParamStore& params) {
  double bytes = 0.0;
  const ParamLayout& layout = model.layout();
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const QuantizedWeight* q = params.quantized(static_cast<int>(i));
    bytes += q != nullptr ? static_cast<double>(q->nbytes()) : 4.0 * static_cast<double>(layout.params()[i].numel());
  }
  return bytes;
}

// GFLOP/s of one linear layer's forward over `n` rows: fp32 (BLAS) and the
// quantized kernels; best of 5.
void linear_rates(int64_t n, int64_t in, int64_t out) {
  std::vector<float> w(static_cast<size_t>(in * out)), x(static_cast<size_t>(n * in)), y(static_cast<size_t>(n * out));
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>((i * 7919) % 255) / 255.0f - 0.5f;
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 104729) % 251) / 251.0f - 0.5f;
  const QuantizedWeight q8 = quantize_int8(w.data(), out, in), q4 = quantize_int4(w.data(), out, in, 128);
  auto rate = [&](const std::function<void()>& run) {
    run();
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
      const double t0 = bench::now_seconds();
      run();
      best = std::min(best, bench::now_seconds() - t0);
    }
    return 2.0 * static_cast<double>(n * in * out) / best / 1e9;
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

  const double bandwidth = copy_bandwidth(size_t{512} << 20);
  std::printf("model: %lld layers, width %lld, vocab %lld; %d threads; copy bandwidth %.2f GB/s (read + write)\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
              static_cast<long long>(cfg.vocab_size), cpu::num_threads(), bandwidth / 1e9);
  std::printf("%-6s %14s %12s %10s %14s\n", "", "MB/token", "tokens/s", "vs fp32", "of bw bound");
  double base = 0.0;
  for (const auto& [name, params] :
       {std::pair<const char*, ParamStore*>{"fp32", &fp32}, {"int8", int8.get()}, {"int4", int4.get()}}) {
    const double rate = decode_rate(model, *params, tokens), bytes = bytes_per_token(model, *params);
    if (base == 0.0) base = rate;
    std::printf("%-6s %14.1f %12.2f %9.2fx %13.1f%%\n", name, bytes / 1e6, rate, rate / base,
                100.0 * rate / (bandwidth / bytes));
  }
  linear_rates(1, 4096, 4096);
  linear_rates(32, width, 4 * width);
  return 0;
}
