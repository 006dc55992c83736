// The CUDA kernels against the CPU kernels on the same inputs: each result
// within fp32 rounding of the CPU's (or bit-identical where the two sum in the
// same order: embeddings, dropout masks), and each CUDA kernel bit-identical
// to itself across two runs. Skips where no CUDA device is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cuda/cuda_kernels.h"
#include "kernels/cuda/philox.cuh"
#include "kernels/kernel_test_util.h"
#include "loom/kernels.h"
#include "test_util.h"

namespace loom::cuda {
namespace {

using cpu::kernel_testing::concat;
using cpu::kernel_testing::random_vector;
using cpu::kernel_testing::to_double;

inline std::vector<float> zeros(int64_t n) { return std::vector<float>(static_cast<size_t>(n)); }

#define CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr

// A device copy of a host vector, freed with the object.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(const std::vector<T>& host) : n_(host.size()) {
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr_), std::max<size_t>(n_, 1) * sizeof(T)), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice), cudaSuccess);
  }
  ~DeviceVector() { cudaFree(ptr_); }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;

  T* get() { return ptr_; }
  // Waits for all work on the device first.
  std::vector<T> host() const {
    std::vector<T> out(n_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(out.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return out;
  }

 private:
  size_t n_;
  T* ptr_ = nullptr;
};

class CudaKernels : public ::testing::Test {
 protected:
  void SetUp() override {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) GTEST_SKIP() << "no CUDA device";
    CUDA_OK(cudaStreamCreate(&stream_));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
  }

  // Runs the CUDA computation twice on fresh copies of its inputs and expects
  // the same bytes; returns the first run's outputs.
  static std::vector<float> run_twice(const std::string& what, const std::function<std::vector<float>()>& run) {
    const std::vector<float> first = run(), second = run();
    EXPECT_EQ(first.size(), second.size()) << what;
    if (first.size() == second.size() && !first.empty()) {
      EXPECT_EQ(std::memcmp(first.data(), second.data(), first.size() * sizeof(float)), 0)
          << what << ": two runs differ";
    }
    return first;
  }

  // |cuda - cpu| <= tol (|cpu| + the largest |cpu|): relative to the element
  // and to the output's scale, so elements that cancel to near zero are held
  // to the precision of the terms they came from.
  static void expect_close(const std::string& what, const std::vector<float>& cuda, const std::vector<float>& cpu,
                           double tol) {
    double scale = 0.0;
    for (float x : cpu) scale = std::max(scale, static_cast<double>(std::fabs(x)));
    ASSERT_GT(scale, 0.0) << what << ": the CPU result is all zeros, the comparison proves nothing";
    cpu::kernel_testing::expect_close(what, cuda, to_double(cpu), tol, tol * scale);
  }

  static void expect_identical(const std::string& what, const std::vector<float>& cuda,
                               const std::vector<float>& cpu) {
    ASSERT_EQ(cuda.size(), cpu.size()) << what;
    for (size_t i = 0; i < cpu.size(); ++i)
      if (std::memcmp(&cuda[i], &cpu[i], sizeof(float)) != 0) {
        ADD_FAILURE() << what << "[" << i << "]: " << cuda[i] << " vs CPU " << cpu[i];
        return;
      }
  }

  cudaStream_t stream_ = nullptr;
};

constexpr double kElementwiseTol = 1e-5;
constexpr double kGemmTol = 1e-4;

TEST_F(CudaKernels, GemmMatchesCpuForEveryTransposeStrideAndAlignment) {
  const int64_t M = 37, N = 53, K = 29, pad = 3;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t offset : {0, 1}) {  // 1: operands 4 bytes past an aligned address
        const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
        const auto A = random_vector((ta ? K : M) * lda, 1), B = random_vector((tb ? N : K) * ldb, 2);
        const auto C0 = random_vector(M * ldc, 3);
        auto want = C0;
        cpu::gemm(ta, tb, M, N, K, 0.7f, A.data(), lda, B.data(), ldb, 0.5f, want.data(), ldc);
        const std::string what =
            std::string("gemm ") + (ta ? "T" : "N") + (tb ? "T" : "N") + " offset " + std::to_string(offset);
        const auto shifted = [&](const std::vector<float>& v) {
          std::vector<float> s(static_cast<size_t>(offset), 0.0f);
          s.insert(s.end(), v.begin(), v.end());
          return s;
        };
        const auto got = run_twice(what, [&] {
          DeviceVector<float> a(shifted(A)), b(shifted(B)), c(shifted(C0));
          gemm(ta, tb, M, N, K, 0.7f, a.get() + offset, lda, b.get() + offset, ldb, 0.5f, c.get() + offset, ldc,
               stream_);
          const auto hc = c.host();
          return std::vector<float>(hc.begin() + offset, hc.end());
        });
        expect_close(what, got, want, kGemmTol);
      }
}

TEST_F(CudaKernels, LinearForwardAndBackwardMatchCpu) {
  const int64_t N = 64, C = 48, OC = 80;
  const auto inp = random_vector(N * C, 1), weight = random_vector(OC * C, 2), bias = random_vector(OC, 3);
  const auto dout = random_vector(N * OC, 4);
  // Gradients start non-zero: backward must add to them.
  const auto dinp0 = random_vector(N * C, 5), dw0 = random_vector(OC * C, 6), db0 = random_vector(OC, 7);
  std::vector<float> out(N * OC), dinp = dinp0, dw = dw0, db = db0;
  cpu::linear_forward(out.data(), inp.data(), weight.data(), bias.data(), N, C, OC);
  cpu::linear_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), N, C, OC);
  const auto got = run_twice("linear", [&] {
    DeviceVector<float> i(inp), w(weight), b(bias), g(dout), o(zeros(N * OC)), di(dinp0), dw_(dw0),
        db_(db0);
    linear_forward(o.get(), i.get(), w.get(), b.get(), N, C, OC, stream_);
    linear_backward(di.get(), dw_.get(), db_.get(), g.get(), i.get(), w.get(), N, C, OC, stream_);
    const auto ho = o.host(), hdi = di.host(), hdw = dw_.host(), hdb = db_.host();
    return concat({&ho, &hdi, &hdw, &hdb});
  });
  const auto want = concat({&out, &dinp, &dw, &db});
  expect_close("linear out", {got.begin(), got.begin() + N * OC}, out, kGemmTol);
  expect_close("linear all", got, want, kGemmTol);
  // A bias one float past a 16-byte boundary takes the path without
  // cuBLASLt's bias epilogue (the output starts as the bias).
  std::vector<float> shifted(OC + 1);
  std::copy(bias.begin(), bias.end(), shifted.begin() + 1);
  const auto got_shifted = run_twice("linear, bias unaligned", [&] {
    DeviceVector<float> i(inp), w(weight), b(shifted), o(zeros(N * OC));
    linear_forward(o.get(), i.get(), w.get(), b.get() + 1, N, C, OC, stream_);
    return o.host();
  });
  expect_close("linear out, bias unaligned", got_shifted, out, kGemmTol);
}

TEST_F(CudaKernels, AddBiasMatchesCpu) {
  const int64_t N = 19, OC = 300;
  const auto out0 = random_vector(N * OC, 1), bias = random_vector(OC, 2);
  auto want = out0;
  cpu::add_bias(want.data(), bias.data(), N, OC);
  const auto got = run_twice("add_bias", [&] {
    DeviceVector<float> o(out0), b(bias);
    add_bias(o.get(), b.get(), N, OC, stream_);
    return o.host();
  });
  expect_close("add_bias", got, want, kElementwiseTol);
}

TEST_F(CudaKernels, LayerNormForwardAndBackwardMatchCpu) {
  const int64_t N = 45, C = 100;  // C not a multiple of the block or the warp
  const auto inp = random_vector(N * C, 1, -2.0f, 3.0f), weight = random_vector(C, 2), bias = random_vector(C, 3);
  const auto dout = random_vector(N * C, 4);
  const auto dinp0 = random_vector(N * C, 5), dw0 = random_vector(C, 6), db0 = random_vector(C, 7);
  std::vector<float> out(N * C), mean(N), rstd(N), dinp = dinp0, dw = dw0, db = db0;
  cpu::layernorm_forward(out.data(), mean.data(), rstd.data(), inp.data(), weight.data(), bias.data(), N, C);
  cpu::layernorm_backward(dinp.data(), dw.data(), db.data(), dout.data(), inp.data(), weight.data(), mean.data(),
                          rstd.data(), N, C);
  const auto got = run_twice("layernorm", [&] {
    DeviceVector<float> i(inp), w(weight), b(bias), g(dout), o(zeros(N * C)), m(zeros(N)),
        r(zeros(N)), di(dinp0), dw_(dw0), db_(db0);
    layernorm_forward(o.get(), m.get(), r.get(), i.get(), w.get(), b.get(), N, C, stream_);
    layernorm_backward(di.get(), dw_.get(), db_.get(), g.get(), i.get(), w.get(), m.get(), r.get(), N, C, stream_);
    const auto ho = o.host(), hm = m.host(), hr = r.host(), hdi = di.host(), hdw = dw_.host(), hdb = db_.host();
    return concat({&ho, &hm, &hr, &hdi, &hdw, &hdb});
  });
  const std::vector<std::pair<const char*, const std::vector<float>*>> parts = {
      {"out", &out}, {"mean", &mean}, {"rstd", &rstd}, {"dinp", &dinp}, {"dweight", &dw}, {"dbias", &db}};
  size_t at = 0;
  for (const auto& [name, want] : parts) {
    expect_close(std::string("layernorm ") + name, {got.begin() + at, got.begin() + at + want->size()}, *want,
                 kElementwiseTol);
    at += want->size();
  }
}

// Aligned buffers take four elements a word (the last n % 4 one by one),
// buffers one float past a 16-byte boundary one element at a time.
TEST_F(CudaKernels, GeluForwardAndBackwardMatchCpu) {
  const int64_t n = 10007;
  const auto inp = random_vector(n, 1, -6.0f, 6.0f), dout = random_vector(n, 2), dinp0 = random_vector(n, 3);
  std::vector<float> out(n), dinp = dinp0;
  cpu::gelu_forward(out.data(), inp.data(), n);
  cpu::gelu_backward(dinp.data(), inp.data(), dout.data(), n);
  for (int64_t skip : {0, 1}) {
    const std::string what = skip == 0 ? "gelu" : "gelu unaligned";
    const auto got = run_twice(what, [&] {
      DeviceVector<float> i(inp), g(dout), o(zeros(n)), di(dinp0);
      gelu_forward(o.get() + skip, i.get() + skip, n - skip, stream_);
      gelu_backward(di.get() + skip, i.get() + skip, g.get() + skip, n - skip, stream_);
      const auto ho = o.host(), hdi = di.host();
      return concat({&ho, &hdi});
    });
    std::vector<float> want_out = out, want_dinp = dinp;
    want_out[0] = skip == 0 ? out[0] : 0.0f;  // skipped: left as it was
    want_dinp[0] = skip == 0 ? dinp[0] : dinp0[0];
    expect_close(what, got, concat({&want_out, &want_dinp}), kElementwiseTol);
  }
}

TEST_F(CudaKernels, AddAccumulateScaleMatchCpu) {
  const int64_t n = 70001;
  const auto a = random_vector(n, 1), b = random_vector(n, 2);
  std::vector<float> sum(n), acc = a, scaled = b;
  cpu::add(sum.data(), a.data(), b.data(), n);
  cpu::accumulate(acc.data(), b.data(), n);
  cpu::scale(scaled.data(), n, -0.37f);
  const auto got = run_twice("elementwise", [&] {
    DeviceVector<float> da(a), db(b), out(zeros(n)), y(a), x(b);
    add(out.get(), da.get(), db.get(), n, stream_);
    accumulate(y.get(), db.get(), n, stream_);
    scale(x.get(), n, -0.37f, stream_);
    const auto ho = out.host(), hy = y.host(), hx = x.host();
    return concat({&ho, &hy, &hx});
  });
  // Single roundings of the same operations: the CPU's bits exactly.
  expect_identical("add, accumulate, scale", got, concat({&sum, &acc, &scaled}));
}

TEST_F(CudaKernels, SumSquaresMatchesCpuAndRepeats) {
  const int64_t n = 300007;
  const auto x = random_vector(n, 1, -3.0f, 3.0f);
  const double want = cpu::sum_squares(x.data(), n);
  DeviceVector<float> dx(x);
  const double first = sum_squares(dx.get(), n, stream_), second = sum_squares(dx.get(), n, stream_);
  EXPECT_EQ(std::memcmp(&first, &second, sizeof(double)), 0) << first << " then " << second;
  EXPECT_NEAR(first, want, 1e-11 * want);
}

// Runs without a device: the draw the dropout kernels make, on the host.
TEST(CudaPhilox, UniformIsTheCpusBitForBit) {
  int64_t checked = 0;
  for (uint64_t key : {uint64_t(0), uint64_t(0x1234abcd5678ef01ull), ~uint64_t(0)})
    for (uint64_t base : {uint64_t(0), (uint64_t(1) << 32) - 500, ~uint64_t(0) - 999})
      for (uint64_t j = 0; j < 1000; ++j, ++checked) {
        const uint64_t i = base + j;
        const float want = loom::philox_uniform(key, i), got = philox_uniform(key, i);
        ASSERT_EQ(std::memcmp(&want, &got, sizeof(float)), 0) << "key " << key << " index " << i;
      }
  EXPECT_EQ(checked, 9000);
}

// A contiguous range and a strided [rows, cols] block (rows 137 apart).
TEST_F(CudaKernels, DropoutMasksAreTheCpusBitForBit) {
  const uint64_t key = 0x1234abcd5678ef01ull, first = (uint64_t(1) << 33) + 17;  // a counter above 32 bits
  const float p = 0.3f;
  for (const auto [rows, cols, stride] : {std::array<int64_t, 3>{1, 50001, 50001}, {500, 100, 137}}) {
    SCOPED_TRACE(str(rows, " x ", cols, " stride ", stride));
    const int64_t n = rows * cols;
    const auto inp = random_vector(n, 1, 0.5f, 1.5f), dout = random_vector(n, 2, 0.5f, 1.5f);
    const auto dinp0 = random_vector(n, 3);
    std::vector<float> out(n), dinp = dinp0;
    cpu::dropout_forward(out.data(), inp.data(), rows, cols, stride, p, key, first);
    cpu::dropout_backward(dinp.data(), dout.data(), rows, cols, stride, p, key, first);
    const auto got = run_twice("dropout", [&] {
      DeviceVector<float> i(inp), g(dout), o(zeros(n)), di(dinp0);
      dropout_forward(o.get(), i.get(), rows, cols, stride, p, key, first, stream_);
      dropout_backward(di.get(), g.get(), rows, cols, stride, p, key, first, stream_);
      const auto ho = o.host(), hdi = di.host();
      return concat({&ho, &hdi});
    });
    const std::vector<float> got_out(got.begin(), got.begin() + n), got_dinp(got.begin() + n, got.end());
    // Inputs are never zero, so zeros in out are exactly the dropped elements.
    expect_identical("dropout forward", got_out, out);
    int64_t dropped = 0, mismatched = 0;
    for (int64_t i = 0; i < n; ++i) {
      dropped += out[i] == 0.0f;
      mismatched += (out[i] == 0.0f) != (got_dinp[i] == dinp0[i]);
    }
    EXPECT_EQ(mismatched, 0) << "backward drops other elements than forward";
    EXPECT_NEAR(static_cast<double>(dropped) / n, p, 0.01);
    expect_close("dropout backward", got_dinp, dinp, kElementwiseTol);
  }
}

TEST_F(CudaKernels, EmbeddingForwardAndBackwardAreTheCpusBitForBit) {
  const int64_t B = 3, T = 40, C = 200, V = 50, maxT = 64, pos0 = 7;
  const auto tokens = loom::testing::random_tokens(B * T, V, 1);  // repeats: V < B*T
  const auto wte = random_vector(V * C, 2), wpe = random_vector(maxT * C, 3), dout = random_vector(B * T * C, 4);
  const auto dwte0 = random_vector(V * C, 5), dwpe0 = random_vector(maxT * C, 6);
  std::vector<float> out(B * T * C), dwte = dwte0, dwpe = dwpe0;
  cpu::embedding_forward(out.data(), tokens.data(), wte.data(), wpe.data(), B, T, C, pos0);
  cpu::embedding_backward(dwte.data(), dwpe.data(), dout.data(), tokens.data(), B, T, C, pos0);
  const auto got = run_twice("embedding", [&] {
    DeviceVector<int32_t> tok(tokens);
    DeviceVector<float> w(wte), p(wpe), g(dout), o(zeros(B * T * C)), dw(dwte0), dp(dwpe0);
    embedding_forward(o.get(), tok.get(), w.get(), p.get(), B, T, C, pos0, stream_);
    embedding_backward(dw.get(), dp.get(), g.get(), tok.get(), B, T, C, pos0, stream_);
    const auto ho = o.host(), hdw = dw.host(), hdp = dp.host();
    return concat({&ho, &hdw, &hdp});
  });
  // Each destination element adds its rows in row order, as on the CPU.
  expect_identical("embedding", got, concat({&out, &dwte, &dwpe}));
}

TEST_F(CudaKernels, CrossEntropyForwardAndBackwardMatchCpu) {
  const int64_t N = 21, V = 1001;
  const auto logits = random_vector(N * V, 1, -8.0f, 8.0f), dloss = random_vector(N, 2);
  auto targets = loom::testing::random_tokens(N, V, 3);
  targets[4] = -1;  // ignored rows
  targets[11] = -1;
  std::vector<float> losses(N), lse(N), dlogits(N * V);
  cpu::cross_entropy_forward(losses.data(), lse.data(), logits.data(), targets.data(), N, V);
  cpu::cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(), dloss.data(), N, V);
  const auto got = run_twice("cross_entropy", [&] {
    DeviceVector<int32_t> t(targets);
    DeviceVector<float> x(logits), dl(dloss), l(zeros(N)), s(zeros(N)),
        dx(std::vector<float>(N * V, 5.0f));
    cross_entropy_forward(l.get(), s.get(), x.get(), t.get(), N, V, stream_);
    cross_entropy_backward(dx.get(), x.get(), s.get(), t.get(), dl.get(), N, V, stream_);
    // In place, as the trainer runs it: dlogits overwrites the logits.
    cross_entropy_backward(x.get(), x.get(), s.get(), t.get(), dl.get(), N, V, stream_);
    const auto hl = l.host(), hs = s.host(), hdx = dx.host(), hx = x.host();
    return concat({&hl, &hs, &hdx, &hx});
  });
  expect_close("cross_entropy losses", {got.begin(), got.begin() + N}, losses, kElementwiseTol);
  expect_close("cross_entropy lse", {got.begin() + N, got.begin() + 2 * N}, lse, kElementwiseTol);
  const std::vector<float> got_d(got.begin() + 2 * N, got.begin() + 2 * N + N * V);
  const std::vector<float> got_inplace(got.begin() + 2 * N + N * V, got.end());
  expect_close("cross_entropy dlogits", got_d, dlogits, kElementwiseTol);
  expect_identical("cross_entropy dlogits in place", got_inplace, got_d);
}

TEST_F(CudaKernels, AdamWMatchesCpu) {
  const int64_t n = 20011;
  const auto param0 = random_vector(n, 1), grad = random_vector(n, 2), m0 = random_vector(n, 3, -0.1f, 0.1f);
  const auto v0 = random_vector(n, 4, 0.0f, 0.01f);
  auto s = AdamWStep::at(7, 3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f);
  s.grad_scale = 0.5f;
  std::vector<float> param = param0, m = m0, v = v0;
  cpu::adamw_update(param.data(), grad.data(), m.data(), v.data(), n, s);
  const auto got = run_twice("adamw", [&] {
    DeviceVector<float> p(param0), g(grad), dm(m0), dv(v0);
    adamw_update(p.get(), g.get(), dm.get(), dv.get(), n, s, stream_);
    const auto hp = p.host(), hm = dm.host(), hv = dv.host();
    return concat({&hp, &hm, &hv});
  });
  expect_close("adamw", got, concat({&param, &m, &v}), kElementwiseTol);
}

TEST_F(CudaKernels, AttentionForwardAndBackwardMatchCpu) {
  struct Shape {
    int64_t B, T, C, NH;
  };
  // Head sizes 20 (part of a warp) and 80 (two and a half warps' worth); 64
  // and 128 over several 64-row tiles of the tiled forward, the last one
  // partial; 160 beyond its largest head.
  for (const Shape& shape : {Shape{2, 37, 60, 3}, Shape{1, 29, 160, 2}, Shape{1, 150, 128, 2}, Shape{2, 70, 256, 2},
                             Shape{1, 20, 320, 2}}) {
    const auto [B, T, C, NH] = shape;
    const std::string what = "attention hs=" + std::to_string(C / NH);
    const auto qkv = random_vector(B * T * 3 * C, 1, -2.0f, 2.0f), dout = random_vector(B * T * C, 2);
    const auto dqkv0 = random_vector(B * T * 3 * C, 3);
    std::vector<float> out(B * T * C), lse(B * NH * T), dqkv = dqkv0;
    cpu::attention_forward(out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
    cpu::attention_backward(dqkv.data(), dout.data(), out.data(), lse.data(), qkv.data(), B, T, C, NH, NH);
    const auto got = run_twice(what, [&] {
      DeviceVector<float> x(qkv), g(dout), o(zeros(B * T * C)), l(zeros(B * NH * T)), dx(dqkv0);
      attention_forward(o.get(), l.get(), x.get(), B, T, C, NH, stream_);
      attention_backward(dx.get(), g.get(), o.get(), l.get(), x.get(), B, T, C, NH, stream_);
      const auto ho = o.host(), hl = l.host(), hdx = dx.host();
      return concat({&ho, &hl, &hdx});
    });
    const size_t no = out.size(), nl = lse.size();
    expect_close(what + " out", {got.begin(), got.begin() + no}, out, kGemmTol);
    expect_close(what + " lse", {got.begin() + no, got.begin() + no + nl}, lse, kGemmTol);
    expect_close(what + " dqkv", {got.begin() + no + nl, got.end()}, dqkv, kGemmTol);
  }
}

TEST_F(CudaKernels, AttentionDecodeMatchesCpu) {
  // Three sequences: one new row after a cache, a prefill, several rows
  // after a short cache; grouped-query heads of sizes 20 and 80.
  const std::vector<int32_t> lens{33, 0, 4}, offsets{0, 1, 41, 46};
  const int64_t S = 3, N = 46, NH = 4, NKV = 2, max_len = 48;
  for (int64_t C : {int64_t{80}, int64_t{320}}) {
    const int64_t hs = C / NH, row = C + 2 * NKV * hs, slot = NKV * max_len * hs;
    const std::string what = "attention_decode hs=" + std::to_string(hs);
    const auto qkv = random_vector(N * row, 1, -2.0f, 2.0f);
    // The earlier positions' keys and values (the rest of each cache too).
    const auto k0 = random_vector(S * slot, 2, -2.0f, 2.0f), v0 = random_vector(S * slot, 3);
    std::vector<float> out(N * C), lse(N * NH), k = k0, v = v0;
    std::vector<float*> kp, vp;
    for (int64_t i = 0; i < S; ++i) {
      kp.push_back(k.data() + i * slot);
      vp.push_back(v.data() + i * slot);
    }
    cpu::attention_decode(out.data(), lse.data(), kp.data(), vp.data(), qkv.data(), lens.data(), offsets.data(), S, N,
                          C, NH, NKV, max_len);
    const auto got = run_twice(what, [&] {
      DeviceVector<float> x(qkv), o(zeros(N * C)), l(zeros(N * NH)), dk(k0), dv(v0);
      std::vector<float*> hk, hv;
      for (int64_t i = 0; i < S; ++i) {
        hk.push_back(dk.get() + i * slot);
        hv.push_back(dv.get() + i * slot);
      }
      DeviceVector<float*> pk(hk), pv(hv);
      DeviceVector<int32_t> dl(lens), doff(offsets);
      attention_decode(o.get(), l.get(), pk.get(), pv.get(), x.get(), dl.get(), doff.get(), S, N, C, NH, NKV, max_len,
                       stream_);
      const auto ho = o.host(), hl = l.host(), hkc = dk.host(), hvc = dv.host();
      return concat({&ho, &hl, &hkc, &hvc});
    });
    size_t at = 0;
    for (const auto& [name, want] : {std::pair<std::string, const std::vector<float>*>{" out", &out},
                                     {" lse", &lse}, {" k cache", &k}, {" v cache", &v}}) {
      expect_close(what + name, {got.begin() + at, got.begin() + at + want->size()}, *want, kGemmTol);
      at += want->size();
    }
  }
}

}  // namespace
}  // namespace loom::cuda
