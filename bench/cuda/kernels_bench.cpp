// The CUDA kernels (src/kernels/cuda) against PyTorch's on the same GPU and
// shapes: a GPT-2 124M training step's kernels at B x T tokens, fp32 (TF32
// off, as loom's exactness path runs), each timed with CUDA events, median
// of `reps` launches after warm-ups.
//
//   cuda_kernels_bench [reps] [B] [T] [torch script]
//
// The PyTorch side is bench/cuda/kernels_torch.py, run by $LOOM_BENCH_PYTHON
// (default python3), which needs torch with CUDA. Prints per kernel loom's
// and PyTorch's milliseconds and PyTorch's over loom's (above 1: loom is
// faster), and the linear layers' FLOP rate against the fp32 GEMM rate
// torch.mm reaches on the same GPU.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "bench_common.h"
#include "kernels/cuda/cuda_kernels.h"

using namespace loom;

namespace {

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw Error(str("cuda_kernels_bench: ", what, ": ", cudaGetErrorString(e)));
}

// A device buffer of `n` elements, filled from a uniform draw on the host.
template <typename T>
class Buffer {
 public:
  Buffer(int64_t n, T lo, T hi, uint32_t seed) : n_(n) {
    check(cudaMalloc(reinterpret_cast<void**>(&ptr_), static_cast<size_t>(n) * sizeof(T)), "cudaMalloc");
    std::vector<T> host(static_cast<size_t>(n));
    std::mt19937 rng(seed);
    if constexpr (std::is_integral_v<T>) {
      std::uniform_int_distribution<T> d(lo, hi);
      for (T& x : host) x = d(rng);
    } else {
      std::uniform_real_distribution<T> d(lo, hi);
      for (T& x : host) x = d(rng);
    }
    check(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  ~Buffer() { cudaFree(ptr_); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* get() const { return ptr_; }

 private:
  int64_t n_;
  T* ptr_ = nullptr;
};

// Median milliseconds of `reps` runs of `work` on `stream`, after 3.
double time_ms(cudaStream_t stream, int reps, const std::function<void()>& work) {
  cudaEvent_t begin, end;
  check(cudaEventCreate(&begin), "cudaEventCreate");
  check(cudaEventCreate(&end), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) work();
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    check(cudaEventRecord(begin, stream), "cudaEventRecord");
    work();
    check(cudaEventRecord(end, stream), "cudaEventRecord");
    check(cudaEventSynchronize(end), "cudaEventSynchronize");
    float t = 0.0f;
    check(cudaEventElapsedTime(&t, begin, end), "cudaEventElapsedTime");
    ms.push_back(t);
  }
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  return bench::median(ms);
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  const int64_t B = argc > 2 ? std::atoll(argv[2]) : 4, T = argc > 3 ? std::atoll(argv[3]) : 1024;
  const std::string script = argc > 4 ? argv[4] : LOOM_BENCH_SOURCE_DIR "/bench/cuda/kernels_torch.py";
  if (reps < 1 || B < 1 || T < 1) {
    std::fprintf(stderr, "usage: cuda_kernels_bench [reps >= 1] [B] [T] [kernels_torch.py]\n");
    return 2;
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "cuda_kernels_bench: no CUDA device\n");
    return 1;
  }
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  const int64_t C = 768, NH = 12, V = 50257, N = B * T, params = 124439808;
  std::printf("%s, GPT-2 124M kernels at B=%lld T=%lld (N=%lld), fp32, median of %d\n", prop.name,
              static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(N), reps);

  cudaStream_t s;
  check(cudaStreamCreate(&s), "cudaStreamCreate");
  struct Row {
    std::string name;
    double loom_ms;
  };
  std::vector<Row> rows;
  {
    // The MLP's first layer, C -> 4C, forward and backward.
    Buffer<float> x(N * C, -1, 1, 1), w(4 * C * C, -0.05f, 0.05f, 2), b(4 * C, -0.1f, 0.1f, 3),
        y(N * 4 * C, 0, 0, 4), dy(N * 4 * C, -1, 1, 5), dx(N * C, 0, 0, 6), dw(4 * C * C, 0, 0, 7), db(4 * C, 0, 0, 8);
    rows.push_back({"linear_forward", time_ms(s, reps, [&] {
                      cuda::linear_forward(y.get(), x.get(), w.get(), b.get(), N, C, 4 * C, s);
                    })});
    rows.push_back({"linear_backward", time_ms(s, reps, [&] {
                      cuda::linear_backward(dx.get(), dw.get(), db.get(), dy.get(), x.get(), w.get(), N, C, 4 * C, s);
                    })});
  }
  {
    Buffer<float> x(N * C, -1, 1, 1), w(C, 0.5f, 1.5f, 2), b(C, -0.1f, 0.1f, 3), y(N * C, 0, 0, 4),
        mean(N, 0, 0, 5), rstd(N, 0, 0, 6), dy(N * C, -1, 1, 7), dx(N * C, 0, 0, 8), dw(C, 0, 0, 9), db(C, 0, 0, 10);
    rows.push_back({"layernorm_forward", time_ms(s, reps, [&] {
                      cuda::layernorm_forward(y.get(), mean.get(), rstd.get(), x.get(), w.get(), b.get(), N, C, s);
                    })});
    rows.push_back({"layernorm_backward", time_ms(s, reps, [&] {
                      cuda::layernorm_backward(dx.get(), dw.get(), db.get(), dy.get(), x.get(), w.get(), mean.get(),
                                               rstd.get(), N, C, s);
                    })});
  }
  {
    const int64_t n = N * 4 * C;
    Buffer<float> x(n, -3, 3, 1), y(n, 0, 0, 2), dy(n, -1, 1, 3), dx(n, 0, 0, 4);
    rows.push_back({"gelu_forward", time_ms(s, reps, [&] { cuda::gelu_forward(y.get(), x.get(), n, s); })});
    rows.push_back(
        {"gelu_backward", time_ms(s, reps, [&] { cuda::gelu_backward(dx.get(), x.get(), dy.get(), n, s); })});
  }
  {
    Buffer<float> qkv(N * 3 * C, -1, 1, 1), out(N * C, 0, 0, 2), lse(B * NH * T, 0, 0, 3), dout(N * C, -1, 1, 4),
        dqkv(N * 3 * C, 0, 0, 5);
    rows.push_back({"attention_forward", time_ms(s, reps, [&] {
                      cuda::attention_forward(out.get(), lse.get(), qkv.get(), B, T, C, NH, s);
                    })});
    rows.push_back({"attention_backward", time_ms(s, reps, [&] {
                      cuda::attention_backward(dqkv.get(), dout.get(), out.get(), lse.get(), qkv.get(), B, T, C, NH,
                                               s);
                    })});
  }
  {
    Buffer<float> logits(N * V, -4, 4, 1), losses(N, 0, 0, 2), lse(N, 0, 0, 3), dloss(N, 1.0f / N, 1.0f / N, 4),
        dlogits(N * V, 0, 0, 5);
    Buffer<int32_t> targets(N, 0, static_cast<int32_t>(V - 1), 6);
    rows.push_back({"cross_entropy_forward", time_ms(s, reps, [&] {
                      cuda::cross_entropy_forward(losses.get(), lse.get(), logits.get(), targets.get(), N, V, s);
                    })});
    rows.push_back({"cross_entropy_backward", time_ms(s, reps, [&] {
                      cuda::cross_entropy_backward(dlogits.get(), logits.get(), lse.get(), targets.get(), dloss.get(),
                                                   N, V, s);
                    })});
  }
  {
    Buffer<float> p(params, -0.1f, 0.1f, 1), g(params, -0.01f, 0.01f, 2), m(params, 0, 0, 3), v(params, 0, 0, 4);
    const cpu::AdamWStep step = cpu::AdamWStep::at(10, 6e-4f, 0.9f, 0.95f, 1e-8f, 0.1f);
    rows.push_back({"adamw_124M", time_ms(s, reps, [&] {
                      cuda::adamw_update(p.get(), g.get(), m.get(), v.get(), params, step, s);
                    })});
  }
  check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  cudaStreamDestroy(s);

  const bench::PythonRun torch =
      bench::run_python(script, {str(reps), str(B), str(T), str(C), str(NH), str(V), str(params)});
  if (torch.status != 0) {
    std::fprintf(stderr, "the PyTorch side failed (%s):\n%s\n", torch.command.c_str(), torch.output.c_str());
    return 1;
  }
  std::printf("%-24s %10s %10s %14s\n", "kernel", "loom ms", "torch ms", "torch / loom");
  for (const Row& r : rows) {
    const double t = bench::json_number(torch.output, r.name);
    std::printf("%-24s %10.3f %10.3f %14.2f\n", r.name.c_str(), r.loom_ms, t, t / r.loom_ms);
  }
  // The linear layer's forward and backward FLOPs (2 and 4 per weight and
  // row) at the rate torch.mm reaches in fp32 on this GPU.
  const double flops = 6.0 * static_cast<double>(N) * 4.0 * C * C;
  double linear_ms = 0.0;
  for (const Row& r : rows)
    if (r.name.rfind("linear_", 0) == 0) linear_ms += r.loom_ms;
  const double mm = bench::json_number(torch.output, "mm_tflops");
  std::printf("loom linear forward + backward: %.1f TFLOP/s fp32 = %.2f of torch.mm's %.1f TFLOP/s (8192^3, TF32 off)\n",
              flops / (linear_ms * 1e-3) / 1e12, flops / (linear_ms * 1e-3) / 1e12 / mm, mm);
  return 0;
}
