#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

namespace {

__global__ void embedding_forward_kernel(float* out, const int32_t* tokens, const float* wte, const float* wpe,
                                         int64_t T, int64_t C, int64_t pos0, int64_t n) {
  for (int64_t e = grid_start(); e < n; e += grid_step()) {
    const int64_t i = e / C, c = e % C;
    out[e] = wte[static_cast<int64_t>(tokens[i]) * C + c] + wpe[(pos0 + i % T) * C + c];
  }
}

// dst[row(i)] += src[i] for each of the N rows of src, without atomics: the
// destination rows are dealt to kShards shards by row % kShards, and thread
// (column c, shard s) walks all source rows in order, adding those of its
// shard. Each destination element has one owner that adds its rows in row
// order, as the CPU kernel does, so the sums are the CPU's bit for bit.
constexpr int kShards = 64;
constexpr int kColumnsPerBlock = 128;

template <typename Row>
__global__ void scatter_add_rows_kernel(float* dst, const float* src, int64_t N, int64_t C, Row row) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t shard = blockIdx.y;
  if (c >= C) return;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t r = row(i);
    if (r % kShards == shard) dst[r * C + c] += src[i * C + c];
  }
}

template <typename Row>
void scatter_add_rows(float* dst, const float* src, int64_t N, int64_t C, Row row, cudaStream_t stream) {
  if (C == 0) return;
  const dim3 grid(static_cast<unsigned>((C + kColumnsPerBlock - 1) / kColumnsPerBlock), kShards);
  scatter_add_rows_kernel<<<grid, kColumnsPerBlock, 0, stream>>>(dst, src, N, C, row);
  check_launch();
}

}  // namespace

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0, cudaStream_t stream) {
  const int64_t n = B * T * C;
  embedding_forward_kernel<<<grid_for(n), kThreads, 0, stream>>>(out, tokens, wte, wpe, T, C, pos0, n);
  check_launch();
}

void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0, cudaStream_t stream) {
  const int64_t N = B * T;
  if (dwte != nullptr)
    scatter_add_rows(
        dwte, dout, N, C, [=] __device__(int64_t i) { return static_cast<int64_t>(tokens[i]); }, stream);
  if (dwpe != nullptr)
    scatter_add_rows(dwpe, dout, N, C, [=] __device__(int64_t i) { return pos0 + i % T; }, stream);
}

}  // namespace loom::cuda
