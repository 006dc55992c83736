// What the CUDA kernels share: error checks, launch shapes and the
// fixed-order block reductions that keep every result bit-identical run to run.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "loom/core.h"

// A CUDA call that fails here is a broken invariant (bad pointer, launch
// shape, lost device), not user input.
#define LOOM_CUDA_CHECK(expr)                                                          \
  do {                                                                                 \
    const cudaError_t loom_cuda_err_ = (expr);                                         \
    LOOM_CHECK(loom_cuda_err_ == cudaSuccess, #expr, ": ", cudaGetErrorString(loom_cuda_err_)); \
  } while (0)

namespace loom::cuda {

inline constexpr int kThreads = 256;

// Blocks for a grid-stride loop over n elements: enough to fill the GPU,
// never more than the loop needs.
inline unsigned grid_for(int64_t n) {
  constexpr int64_t kMaxBlocks = 1 << 16;
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

inline void check_launch() { LOOM_CUDA_CHECK(cudaGetLastError()); }

// A grid-stride loop: for (int64_t e = grid_start(); e < n; e += grid_step()).
__device__ inline int64_t grid_start() { return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; }
__device__ inline int64_t grid_step() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

struct Sum {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
struct Max {
  __device__ float operator()(float a, float b) const { return fmaxf(a, b); }
};

// Reduces v over the block (blockDim.x a multiple of 32, at most 1024) and
// returns the result to every thread. The butterfly inside each warp and the
// pass over the warps' results have a fixed shape, so the result depends on
// the block size alone. scratch holds 32 values; consecutive calls may share it.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op, T identity, T* scratch) {
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();  // an earlier call may still be reading scratch
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x / 32) ? scratch[lane] : identity;
  for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// dst[c] += sum over rows i of f(i, c), for an [N, C] problem, rows summed in
// a fixed order: a 32x32 block owns 32 columns, its thread (x, y) sums rows
// y, y + 32, ... of column x, and the 32 partials are added in order of y.
template <typename F>
__global__ void column_sums_kernel(float* dst, int64_t N, int64_t C, F f) {
  __shared__ float partial[32][33];
  const int64_t c = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  float s = 0.0f;
  if (c < C)
    for (int64_t i = threadIdx.y; i < N; i += 32) s += f(i, c);
  partial[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y == 0 && c < C) {
    float total = 0.0f;
    for (int y = 0; y < 32; ++y) total += partial[y][threadIdx.x];
    dst[c] += total;
  }
}

template <typename F>
void column_sums(float* dst, int64_t N, int64_t C, F f, cudaStream_t stream) {
  if (C == 0) return;
  column_sums_kernel<<<static_cast<unsigned>((C + 31) / 32), dim3(32, 32), 0, stream>>>(dst, N, C, f);
  check_launch();
}

}  // namespace loom::cuda
