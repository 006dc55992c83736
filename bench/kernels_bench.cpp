// Kernel micro-benchmark at GPT-2 124M shapes (B=4, T=256, C=768, NH=12,
// V=50257). The baseline is this machine's cblas_sgemm on a 2048^3 product,
// measured first in the same run; GEMM-based kernels print their GFLOP/s as a
// ratio to it, the others GB/s or GFLOP/s. The last table adds the kernels up
// into one training step (forward, backward, AdamW) and reports the step's
// model FLOP rate against the baseline, the figure the trainer is held to.
//
// Usage: kernels_bench [threads]   (default: all OpenMP threads)
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench_common.h"
#include "loom/nn.h"
#include "loom/planner.h"

namespace {

using namespace loom::cpu;

std::vector<float> random_vector(int64_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::vector<float> v(static_cast<size_t>(n));
  const uint64_t key = loom::stream_key(seed, "kernels-bench");
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = lo + (hi - lo) * loom::philox_uniform(key, i);
  return v;
}

// Best wall time of at least 3 runs and at least 0.5 s in all, after one
// warm-up run. The minimum is the figure least disturbed by other load.
double best_seconds(const std::function<void()>& fn) {
  fn();
  double best = 1e30, total = 0.0;
  for (int rep = 0; rep < 3 || total < 0.5; ++rep) {
    const double t0 = loom::bench::now_seconds();
    fn();
    const double s = loom::bench::now_seconds() - t0;
    best = std::min(best, s);
    total += s;
  }
  return best;
}

struct Row {
  std::string name;
  double seconds;
  double flops;  // 0 for memory-bound kernels
  double bytes;  // 0 for GEMM-based kernels
};

double sgemm_baseline_gflops = 0.0;

void print_row(const Row& r) {
  std::printf("  %-34s %9.3f ms", r.name.c_str(), r.seconds * 1e3);
  if (r.flops > 0) {
    const double gflops = r.flops / r.seconds * 1e-9;
    std::printf("  %8.1f GFLOP/s  %5.2fx sgemm", gflops, gflops / sgemm_baseline_gflops);
  }
  if (r.bytes > 0) std::printf("  %8.1f GB/s", r.bytes / r.seconds * 1e-9);
  std::printf("\n");
}

Row measure(const std::string& name, double flops, double bytes, const std::function<void()>& fn) {
  Row r{name, best_seconds(fn), flops, bytes};
  print_row(r);
  return r;
}

// Flops of the GEMMs attention runs: per (b, h) and 64-row query tile, two
// (forward) or five (backward) products of rows x keys x hs.
double attention_flops(int64_t B, int64_t T, int64_t C, int64_t NH, int gemms) {
  const int64_t hs = C / NH;
  double f = 0.0;
  for (int64_t t0 = 0; t0 < T; t0 += 64) {
    const int64_t rows = std::min<int64_t>(64, T - t0);
    f += 2.0 * static_cast<double>(rows) * static_cast<double>(t0 + rows) * static_cast<double>(hs) * gemms;
  }
  return f * static_cast<double>(B * NH);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) set_num_threads(std::atoi(argv[1]));
  const int threads = num_threads();
  std::printf("kernels_bench: %d threads\n\n", threads);

  sgemm_baseline_gflops = measure_sgemm_gflops(2048, 5);
  std::printf("baseline cblas_sgemm 2048^3: %.1f GFLOP/s\n\nGEMM\n", sgemm_baseline_gflops);
  {
    const int64_t n = 2048;
    const auto A = random_vector(n * n, 1), B = random_vector(n * n, 2);
    std::vector<float> C(static_cast<size_t>(n * n));
    measure("loom gemm 2048^3 (fixed tiles)", 2.0 * n * n * n, 0,
            [&] { gemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n); });
  }

  const loom::GPTConfig gpt2 = loom::GPTConfig::preset("gpt2");
  const int64_t B = 4, T = 256, C = gpt2.n_embd, NH = gpt2.n_head, V = gpt2.vocab_size, L = gpt2.n_layer, N = B * T;
  const double fN = static_cast<double>(N), fC = static_cast<double>(C), fV = static_cast<double>(V);
  std::printf("\nGPT-2 124M shapes: B=%lld T=%lld C=%lld NH=%lld V=%lld\n", static_cast<long long>(B),
              static_cast<long long>(T), static_cast<long long>(C), static_cast<long long>(NH),
              static_cast<long long>(V));

  // Linear layers of a block and the (tied, bias-free) LM head.
  struct LinearShape {
    const char* name;
    int64_t in, out;
    bool bias;
  };
  const LinearShape linears[] = {{"qkv", C, 3 * C, true},
                                 {"attn proj", C, C, true},
                                 {"fc", C, 4 * C, true},
                                 {"fc proj", 4 * C, C, true},
                                 {"lm head", C, V, false}};
  std::vector<Row> fwd_rows, bwd_rows;
  std::printf("\nLinear (forward: 2 N in out flops; backward: dinp and dweight, 4 N in out)\n");
  double linear_fwd_block = 0, linear_bwd_block = 0, lm_fwd = 0, lm_bwd = 0;
  for (const auto& l : linears) {
    const auto inp = random_vector(N * l.in, 3), w = random_vector(l.out * l.in, 4, -0.05f, 0.05f);
    const auto bias = random_vector(l.out, 5);
    std::vector<float> out(static_cast<size_t>(N * l.out)), dinp(static_cast<size_t>(N * l.in));
    std::vector<float> dw(static_cast<size_t>(l.out * l.in)), db(static_cast<size_t>(l.out));
    const double flops = 2.0 * fN * static_cast<double>(l.in) * static_cast<double>(l.out);
    const Row f = measure(std::string(l.name) + " forward", flops, 0, [&] {
      linear_forward(out.data(), inp.data(), w.data(), l.bias ? bias.data() : nullptr, N, l.in, l.out);
    });
    const Row b = measure(std::string(l.name) + " backward", 2 * flops, 0, [&] {
      linear_backward(dinp.data(), dw.data(), l.bias ? db.data() : nullptr, out.data(), inp.data(), w.data(), N, l.in,
                      l.out);
    });
    if (std::string(l.name) == "lm head") {
      lm_fwd = f.seconds;
      lm_bwd = b.seconds;
    } else {
      linear_fwd_block += f.seconds;
      linear_bwd_block += b.seconds;
    }
  }

  // A narrow model over many tokens: the weight gradients are small products
  // with a long K, which only split-K spreads over every thread.
  {
    const int64_t Cs = 256, Ns = 2048;
    std::printf("\nLinear backward, narrow (C=%lld, N=%lld tokens)\n", static_cast<long long>(Cs),
                static_cast<long long>(Ns));
    for (const auto& [in, outf] : {std::pair<int64_t, int64_t>{Cs, 3 * Cs}, {Cs, Cs}, {4 * Cs, Cs}}) {
      const auto inp = random_vector(Ns * in, 3), w = random_vector(outf * in, 4, -0.05f, 0.05f);
      const auto dout = random_vector(Ns * outf, 5);
      std::vector<float> dinp(static_cast<size_t>(Ns * in)), dw(static_cast<size_t>(outf * in));
      const double flops = 4.0 * static_cast<double>(Ns) * static_cast<double>(in) * static_cast<double>(outf);
      measure(std::to_string(in) + " -> " + std::to_string(outf) + " backward", flops, 0, [&] {
        linear_backward(dinp.data(), dw.data(), nullptr, dout.data(), inp.data(), w.data(), Ns, in, outf);
      });
    }
  }

  std::printf("\nAttention (flops of the tile GEMMs actually run)\n");
  double attn_fwd, attn_bwd;
  {
    const auto qkv = random_vector(N * 3 * C, 6, -2.0f, 2.0f), dout = random_vector(N * C, 7);
    std::vector<float> out(static_cast<size_t>(N * C)), lse(static_cast<size_t>(B * NH * T));
    std::vector<float> dqkv(qkv.size());
    attn_fwd = measure("attention forward", attention_flops(B, T, C, NH, 2), 0, [&] {
                 attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
               }).seconds;
    attn_bwd = measure("attention backward", attention_flops(B, T, C, NH, 5), 0, [&] {
                 attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
               }).seconds;
  }

  {
    // Fewer heads than threads: the backward shares each head's keys out.
    const int64_t Bf = 1, Tf = 1024, Cf = 256, NHf = 4;
    const auto qkv = random_vector(Bf * Tf * 3 * Cf, 6, -2.0f, 2.0f), dout = random_vector(Bf * Tf * Cf, 7);
    std::vector<float> out(static_cast<size_t>(Bf * Tf * Cf)), lse(static_cast<size_t>(Bf * NHf * Tf));
    std::vector<float> dqkv(qkv.size());
    attention_forward(out.data(), lse.data(), qkv.data(), Bf, Tf, Cf, NHf, NHf);
    measure("attention backward B=1 T=1024 NH=4", attention_flops(Bf, Tf, Cf, NHf, 5), 0, [&] {
      attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), Bf, Tf, Cf, NHf, NHf);
    });
  }

  {
    // Grouped-query attention, a kv head per 4 query heads: the same products
    // as the multi-head rows above, a quarter of the kv heads to spread out.
    const int64_t NKV = NH / 4, row = C + 2 * NKV * (C / NH);
    const auto qkv = random_vector(N * row, 6, -2.0f, 2.0f), dout = random_vector(N * C, 7);
    std::vector<float> out(static_cast<size_t>(N * C)), lse(static_cast<size_t>(B * NH * T));
    std::vector<float> dqkv(qkv.size());
    measure("attention forward NKV=NH/4", attention_flops(B, T, C, NH, 2), 0, [&] {
      attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV);
    });
    measure("attention backward NKV=NH/4", attention_flops(B, T, C, NH, 5), 0, [&] {
      attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NKV);
    });
  }

  std::printf("\nMemory-bound kernels (bytes each call must read and write)\n");
  double ln_fwd, ln_bwd, gelu_fwd, gelu_bwd, add_s, acc_s, emb_fwd, emb_bwd, ce_fwd, ce_bwd, adamw_per_param;
  {
    const auto inp = random_vector(N * C, 8), w = random_vector(C, 9), b = random_vector(C, 10);
    const auto dout = random_vector(N * C, 11);
    std::vector<float> out(static_cast<size_t>(N * C)), mean(N), rstd(N), dinp(static_cast<size_t>(N * C)), dw(C),
        db(C);
    const double nc4 = fN * fC * 4;
    ln_fwd = measure("layernorm forward", 0, 2 * nc4, [&] {
               layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), w.data(), b.data(), N, C);
             }).seconds;
    ln_bwd = measure("layernorm backward", 0, 4 * nc4, [&] {
               layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), w.data(), mean.data(),
                                  rstd.data(), N, C);
             }).seconds;
    add_s = measure("add (residual)", 0, 3 * nc4, [&] { add(out.data(), inp.data(), dout.data(), N * C); }).seconds;
    acc_s = measure("accumulate", 0, 3 * nc4, [&] { accumulate(dinp.data(), dout.data(), N * C); }).seconds;
  }
  {
    const int64_t n = N * 4 * C;
    const auto x = random_vector(n, 12, -4.0f, 4.0f), dout = random_vector(n, 13);
    std::vector<float> out(static_cast<size_t>(n)), dinp(static_cast<size_t>(n));
    gelu_fwd = measure("gelu forward", 0, 8.0 * n, [&] { gelu_forward(out.data(), x.data(), n); }).seconds;
    gelu_bwd =
        measure("gelu backward", 0, 16.0 * n, [&] { gelu_backward(dinp.data(), x.data(), dout.data(), n); }).seconds;
    measure("dropout forward p=0.1", 0, 8.0 * n, [&] { dropout_forward(out.data(), x.data(), 1, n, n, 0.1f, 7, 0); });
    measure("dropout backward p=0.1", 0, 12.0 * n, [&] { dropout_backward(dinp.data(), x.data(), 1, n, n, 0.1f, 7, 0); });
    measure("sum_squares", 0, 4.0 * n, [&] { static_cast<void>(sum_squares(x.data(), n)); });
  }
  {
    std::vector<int32_t> tokens(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) tokens[i] = static_cast<int32_t>((i * 7919) % V);
    const auto wte = random_vector(V * C, 14), wpe = random_vector(1024 * C, 15), dout = random_vector(N * C, 16);
    std::vector<float> out(static_cast<size_t>(N * C)), dwte(wte.size()), dwpe(wpe.size());
    const double nc4 = fN * fC * 4;
    emb_fwd = measure("embedding forward", 0, 3 * nc4, [&] {
                embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, 0);
              }).seconds;
    emb_bwd = measure("embedding backward", 0, 5 * nc4, [&] {
                embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, 0);
              }).seconds;
  }
  {
    // Logits are regenerated before each in-place backward, outside the timing.
    auto logits = random_vector(N * V, 17, -5.0f, 5.0f);
    const auto saved = logits;
    std::vector<int32_t> targets(static_cast<size_t>(N));
    for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 104729) % V);
    std::vector<float> losses(N), lse(N), dloss(N, 1.0f / static_cast<float>(N));
    const double nv4 = fN * fV * 4;
    ce_fwd = measure("cross-entropy forward (V=50257)", 0, nv4, [&] {
               cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
             }).seconds;
    std::vector<float> dlogits(logits.size());
    ce_bwd = measure("cross-entropy backward", 0, 2 * nv4, [&] {
               cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
             }).seconds;
  }
  {
    const int64_t n = 16 << 20;
    auto p = random_vector(n, 18), m = random_vector(n, 19), v = random_vector(n, 20, 0.0f, 1e-4f);
    const auto g = random_vector(n, 21);
    const AdamWStep s = AdamWStep::at(10, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f);
    adamw_per_param = measure("adamw (16M params)", 0, 28.0 * static_cast<double>(n),
                              [&] { adamw_update(p.data(), g.data(), m.data(), v.data(), n, s); })
                          .seconds /
                      static_cast<double>(n);
  }

  // One GPT-2 124M training step from the kernels above (no dropout): per
  // layer two layernorms, four linears, attention, gelu and two residual adds
  // forward; their backward plus two residual-gradient accumulations; then
  // the final layernorm, the LM head, cross-entropy, the embeddings and AdamW.
  const double params = static_cast<double>(gpt2.num_params());
  const double per_layer_fwd = 2 * ln_fwd + linear_fwd_block + attn_fwd + gelu_fwd + 2 * add_s;
  const double per_layer_bwd = 2 * ln_bwd + linear_bwd_block + attn_bwd + gelu_bwd + 2 * acc_s;
  const double gemm_time = L * (linear_fwd_block + linear_bwd_block) + lm_fwd + lm_bwd;
  const double attention_time = L * (attn_fwd + attn_bwd);
  const double other_time = L * (2 * ln_fwd + gelu_fwd + 2 * add_s + 2 * ln_bwd + gelu_bwd + 2 * acc_s) + ln_fwd +
                            ln_bwd + ce_fwd + ce_bwd + emb_fwd + emb_bwd;
  const double adamw_time = adamw_per_param * params;
  const double step = L * (per_layer_fwd + per_layer_bwd) + lm_fwd + lm_bwd + ln_fwd + ln_bwd + ce_fwd + ce_bwd +
                      emb_fwd + emb_bwd + adamw_time;
  const double step_flops = loom::training_flops_per_step(gpt2, B, T);
  std::printf("\nEstimated GPT-2 124M step (B=4, T=256), sum of the kernels above\n");
  std::printf("  %-34s %9.1f ms  %5.1f%%\n", "linear layers and LM head (GEMM)", gemm_time * 1e3,
              100 * gemm_time / step);
  std::printf("  %-34s %9.1f ms  %5.1f%%\n", "attention forward + backward", attention_time * 1e3,
              100 * attention_time / step);
  std::printf("  %-34s %9.1f ms  %5.1f%%\n", "layernorm, gelu, residual, CE, emb", other_time * 1e3,
              100 * other_time / step);
  std::printf("  %-34s %9.1f ms  %5.1f%%\n", "adamw over 124M params", adamw_time * 1e3, 100 * adamw_time / step);
  const double step_gflops = step_flops / step * 1e-9;
  std::printf("  step %.1f ms, %.1f model GFLOP/s = %.2fx sgemm\n", step * 1e3, step_gflops,
              step_gflops / sgemm_baseline_gflops);
  return 0;
}
