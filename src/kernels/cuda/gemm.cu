#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

#define LOOM_CUBLAS_CHECK(expr)                                                         \
  do {                                                                                  \
    const cublasStatus_t loom_cublas_status_ = (expr);                                  \
    LOOM_CHECK(loom_cublas_status_ == CUBLAS_STATUS_SUCCESS, #expr, ": cuBLAS status ", \
               static_cast<int>(loom_cublas_status_));                                  \
  } while (0)

// cuBLAS recommends 32 MiB on Hopper; smaller GPUs use less of it.
constexpr size_t kWorkspaceBytes = size_t(32) << 20;

// The calling thread's cuBLASLt handles (one per device) and workspaces (one
// per device and stream: work queued on two streams may run at once, so they
// must not share one). Freed when the thread ends; errors are ignored there,
// since the CUDA runtime may already be shutting down.
class LtContext {
 public:
  ~LtContext() {
    for (auto& [key, ws] : workspaces_) cudaFree(ws);
    for (auto& [device, handle] : handles_) cublasLtDestroy(handle);
  }

  cublasLtHandle_t handle(int device) {
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cublasLtHandle_t h = nullptr;
    LOOM_CUBLAS_CHECK(cublasLtCreate(&h));
    handles_.emplace(device, h);
    return h;
  }

  void* workspace(int device, cudaStream_t stream) {
    const auto key = std::make_pair(device, stream);
    auto it = workspaces_.find(key);
    if (it != workspaces_.end()) return it->second;
    void* ws = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&ws, kWorkspaceBytes));
    workspaces_.emplace(key, ws);
    return ws;
  }

 private:
  std::map<int, cublasLtHandle_t> handles_;
  std::map<std::pair<int, cudaStream_t>, void*> workspaces_;
};

LtContext& lt_context() {
  thread_local LtContext ctx;
  return ctx;
}

// Owns a cuBLASLt descriptor for the length of one call.
template <typename T, cublasStatus_t (*Destroy)(T)>
struct Desc {
  T d = nullptr;
  ~Desc() {
    if (d != nullptr) Destroy(d);
  }
};

// The largest power of two up to 256 that divides p's address: cuBLASLt
// assumes 256-byte aligned operands unless told, and callers pass pointers
// into the middle of buffers (a head's columns, a micro-batch's rows).
uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  uint32_t a = 256;
  while (a > 1 && address % a != 0) a /= 2;
  return a;
}

// C = beta * C over an [M, N] block with leading dimension ldc: a product
// with K = 0, which cuBLASLt does not take.
__global__ void scale_matrix_kernel(float* C, int64_t M, int64_t N, int64_t ldc, float beta) {
  for (int64_t e = grid_start(); e < M * N; e += grid_step()) {
    float& c = C[(e / N) * ldc + e % N];
    c = beta == 0.0f ? 0.0f : beta * c;
  }
}

__global__ void broadcast_rows_kernel(float* out, const float* row, int64_t n, int64_t width) {
  for (int64_t e = grid_start(); e < n; e += grid_step())
    out[e] = row[e % width];
}

__global__ void add_bias_kernel(float* out, const float* bias, int64_t n, int64_t OC) {
  for (int64_t e = grid_start(); e < n; e += grid_step())
    out[e] += bias[e % OC];
}

// C = alpha op(A) op(B) + beta C, plus `bias` (one value per column of the
// row-major C, or null) added by cuBLASLt's epilogue as the product is
// written. False, with nothing run, where cuBLASLt has no algorithm for a
// bias epilogue on these operands; a product without one always has.
bool lt_matmul(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
               const float* B, int64_t ldb, float beta, float* C, int64_t ldc, const float* bias,
               cudaStream_t stream) {
  int device = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  LtContext& ctx = lt_context();
  cublasLtHandle_t handle = ctx.handle(device);
  void* workspace = ctx.workspace(device, stream);

  // cuBLASLt is column-major, and a row-major matrix is its transpose in
  // column-major: the row-major C = op(A) op(B) is computed as the
  // column-major C^T = op(B)^T op(A)^T, i.e. with the operands swapped.
  Desc<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> op;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&op.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_first = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t op_second = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
  LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
  if (bias != nullptr) {
    // The row-major C's columns are the column-major result's rows, which
    // the bias epilogue adds one value to each of.
    const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(op.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
  }

  using Layout = Desc<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy>;
  Layout first, second, out;
  const auto u = [](int64_t x) { return static_cast<uint64_t>(x); };
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&first.d, CUDA_R_32F, u(trans_b ? K : N), u(trans_b ? N : K), ldb));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&second.d, CUDA_R_32F, u(trans_a ? M : K), u(trans_a ? K : M), lda));
  LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&out.d, CUDA_R_32F, u(N), u(M), ldc));

  Desc<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> pref;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.d));
  const size_t ws_bytes = kWorkspaceBytes;
  LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                         sizeof(ws_bytes)));
  const std::pair<cublasLtMatmulPreferenceAttributes_t, const void*> operands[] = {
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, B},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, A},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, C},
      {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, C}};
  for (const auto& [attribute, pointer] : operands) {
    const uint32_t a = alignment(pointer);
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.d, attribute, &a, sizeof(a)));
  }
  cublasLtMatmulHeuristicResult_t heuristic{};
  int found = 0;
  const cublasStatus_t searched = cublasLtMatmulAlgoGetHeuristic(handle, op.d, first.d, second.d, out.d, out.d,
                                                                 pref.d, 1, &heuristic, &found);
  if (bias != nullptr && (searched != CUBLAS_STATUS_SUCCESS || found == 0)) return false;
  LOOM_CUBLAS_CHECK(searched);
  LOOM_CHECK(found > 0, "cuBLASLt has no fp32 algorithm for a ", M, "x", N, "x", K, " product");
  LOOM_CUBLAS_CHECK(cublasLtMatmul(handle, op.d, &alpha, B, first.d, A, second.d, &beta, C, out.d, C, out.d,
                                   &heuristic.algo, workspace, kWorkspaceBytes, stream));
  return true;
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, cudaStream_t stream) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    scale_matrix_kernel<<<grid_for(M * N), kThreads, 0, stream>>>(C, M, N, ldc, beta);
    check_launch();
    return;
  }
  lt_matmul(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, nullptr, stream);
}

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC, cudaStream_t stream) {
  // The bias joins the product in cuBLASLt's epilogue; where no algorithm
  // has one, out starts as the bias and the product adds onto it, as on the
  // CPU.
  if (bias != nullptr && alignment(bias) >= 16 && N > 0 && OC > 0 && C > 0 &&
      lt_matmul(false, true, N, OC, C, 1.0f, inp, C, weight, C, 0.0f, out, OC, bias, stream))
    return;
  if (bias != nullptr) {
    broadcast_rows_kernel<<<grid_for(N * OC), kThreads, 0, stream>>>(out, bias, N * OC, OC);
    check_launch();
  }
  gemm(false, true, N, OC, C, 1.0f, inp, C, weight, C, bias != nullptr ? 1.0f : 0.0f, out, OC, stream);
}

void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, cudaStream_t stream) {
  if (dinp != nullptr) gemm(false, false, N, C, OC, 1.0f, dout, OC, weight, C, 1.0f, dinp, C, stream);
  if (dweight != nullptr) gemm(true, false, OC, C, N, 1.0f, dout, OC, inp, C, 1.0f, dweight, C, stream);
  if (dbias != nullptr)
    column_sums(dbias, N, OC, [=] __device__(int64_t i, int64_t j) { return dout[i * OC + j]; }, stream);
}

void add_bias(float* out, const float* bias, int64_t N, int64_t OC, cudaStream_t stream) {
  if (N * OC == 0) return;
  add_bias_kernel<<<grid_for(N * OC), kThreads, 0, stream>>>(out, bias, N * OC, OC);
  check_launch();
}

}  // namespace loom::cuda
