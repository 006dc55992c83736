#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_kernels.h"

namespace loom::cuda {

// Causal attention. Like the CPU kernel it keeps only out and lse, and
// backward recomputes the scores; every result is deterministic without
// atomics. Heads of up to 128 dimensions run the tiled kernels below; larger
// ones (or tiles a device's shared memory cannot hold) run these
// straightforward ones: one warp per query row (forward, dq) or per key row
// (dk, dv), the head dimension spread over the lanes, every output element
// written by one lane and every dot product a warp butterfly of fixed shape.
namespace {

constexpr int kMaxPerLane = 8;  // head sizes up to 256
constexpr int kWarpsPerBlock = 8;

struct Shape {
  int64_t B, T, C, NH, hs;
  float scale;
  // Offsets of row t's q, k, v of head h of sequence b in qkv[B, T, 3C].
  __device__ int64_t q(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * 3 * C + h * hs; }
  __device__ int64_t k(int64_t b, int64_t h, int64_t t) const { return q(b, h, t) + C; }
  __device__ int64_t v(int64_t b, int64_t h, int64_t t) const { return q(b, h, t) + 2 * C; }
  __device__ int64_t o(int64_t b, int64_t h, int64_t t) const { return (b * T + t) * C + h * hs; }
};

// Loads row x's elements lane, lane + 32, ... (zeros past hs).
__device__ inline void load(float (&r)[kMaxPerLane], const float* x, int64_t hs) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u) r[u] = lane + 32 * u < hs ? x[lane + 32 * u] : 0.0f;
}

// The dot product of a register row with row y, the same value in every lane.
__device__ inline float dot(const float (&r)[kMaxPerLane], const float* y, int64_t hs) {
  const int lane = threadIdx.x % 32;
  float s = 0.0f;
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < hs) s += r[u] * y[lane + 32 * u];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// Row (b, h, t) of this warp, or false past the last one.
__device__ inline bool warp_row(const Shape& s, int64_t& b, int64_t& h, int64_t& t) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (row >= s.B * s.NH * s.T) return false;
  t = row % s.T;
  h = row / s.T % s.NH;
  b = row / (s.T * s.NH);
  return true;
}

__global__ void attention_forward_kernel(float* out, float* lse, const float* qkv, Shape s) {
  int64_t b, h, t;
  if (!warp_row(s, b, h, t)) return;
  const int lane = threadIdx.x % 32;
  float q[kMaxPerLane], acc[kMaxPerLane] = {};
  load(q, qkv + s.q(b, h, t), s.hs);
  float m = -INFINITY, l = 0.0f;  // running max and sum of exp(score - m)
  for (int64_t j = 0; j <= t; ++j) {
    const float score = dot(q, qkv + s.k(b, h, j), s.hs) * s.scale;
    const float m_new = fmaxf(m, score);
    const float rescale = expf(m - m_new), p = expf(score - m_new);
    l = l * rescale + p;
    const float* v = qkv + s.v(b, h, j);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) acc[u] = acc[u] * rescale + p * v[lane + 32 * u];
    m = m_new;
  }
  float* o = out + s.o(b, h, t);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) o[lane + 32 * u] = acc[u] / l;
  if (lane == 0) lse[(b * s.NH + h) * s.T + t] = m + logf(l);
}

// dq for query row t, and D[t] = dout . out (the softmax backward's row term),
// which the dk/dv pass reads.
__global__ void attention_backward_dq_kernel(float* dqkv, float* D, const float* dout, const float* out,
                                             const float* lse, const float* qkv, Shape s) {
  int64_t b, h, t;
  if (!warp_row(s, b, h, t)) return;
  const int lane = threadIdx.x % 32;
  float q[kMaxPerLane], g[kMaxPerLane], dq[kMaxPerLane] = {};
  load(q, qkv + s.q(b, h, t), s.hs);
  load(g, dout + s.o(b, h, t), s.hs);
  const int64_t row = (b * s.NH + h) * s.T + t;
  const float d = dot(g, out + s.o(b, h, t), s.hs), l = lse[row];
  for (int64_t j = 0; j <= t; ++j) {
    const float* k = qkv + s.k(b, h, j);
    const float p = expf(dot(q, k, s.hs) * s.scale - l);
    const float ds = p * (dot(g, qkv + s.v(b, h, j), s.hs) - d);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) dq[u] += ds * k[lane + 32 * u];
  }
  float* dst = dqkv + s.q(b, h, t);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) dst[lane + 32 * u] += dq[u] * s.scale;
  if (lane == 0) D[row] = d;
}

// dk and dv for key row j, from every query row t >= j.
__global__ void attention_backward_dkdv_kernel(float* dqkv, const float* D, const float* dout, const float* lse,
                                               const float* qkv, Shape s) {
  int64_t b, h, j;
  if (!warp_row(s, b, h, j)) return;
  const int lane = threadIdx.x % 32;
  float k[kMaxPerLane], v[kMaxPerLane], dk[kMaxPerLane] = {}, dv[kMaxPerLane] = {};
  load(k, qkv + s.k(b, h, j), s.hs);
  load(v, qkv + s.v(b, h, j), s.hs);
  const int64_t rows = (b * s.NH + h) * s.T;
  for (int64_t t = j; t < s.T; ++t) {
    const float* q = qkv + s.q(b, h, t);
    const float* g = dout + s.o(b, h, t);
    const float p = expf(dot(k, q, s.hs) * s.scale - lse[rows + t]);
    const float ds = p * (dot(v, g, s.hs) - D[rows + t]);
#pragma unroll
    for (int u = 0; u < kMaxPerLane; ++u)
      if (lane + 32 * u < s.hs) {
        dv[u] += p * g[lane + 32 * u];
        dk[u] += ds * q[lane + 32 * u];
      }
  }
  float* dst_k = dqkv + s.k(b, h, j);
  float* dst_v = dqkv + s.v(b, h, j);
#pragma unroll
  for (int u = 0; u < kMaxPerLane; ++u)
    if (lane + 32 * u < s.hs) {
      dst_k[lane + 32 * u] += dk[u] * s.scale;
      dst_v[lane + 32 * u] += dv[u];
    }
}

// The forward pass tiled through shared memory, for head sizes up to 128:
// a block of 256 threads takes 64 query rows of one (sequence, head) and
// walks the key rows up to the diagonal 64 at a time. Four threads share a
// query row: each scores 16 keys of the tile against it, the four agree on
// the row's running max and sum by a fixed butterfly, and each then
// accumulates a quarter of the row's output dimensions over the tile's
// probabilities. Q (pre-scaled) and V are kept row-major, K transposed so a
// thread's keys are four float4 loads. A thread's keys and dimensions are
// every fourth group of four (its quad's), so the four threads of a row read
// neighbouring 16-byte words, and rows pad by one float: no shared-memory
// bank is read twice at once. Every sum runs in a fixed order: the same bits
// run to run.
constexpr int kTile = 64;           // query rows per block, keys per step
constexpr int kTiledThreads = 256;  // four per query row
constexpr int kKeysPerThread = kTile / 4;

// acc[4 c + i] += p * row[4 (4 c + quad) + i] for c < n / 4: a thread's
// share of a tile row in float4 words, every fourth word from its quad's
// (its 16 columns of a transposed tile's row, or its quarter of a
// row-major one).
template <int n>
__device__ inline void add_scaled_words(float (&acc)[n], float p, const float* row, int quad) {
  const float4* r4 = reinterpret_cast<const float4*>(row);
#pragma unroll
  for (int c = 0; c < n / 4; ++c) {
    const float4 v = r4[4 * c + quad];
    acc[4 * c] += p * v.x;
    acc[4 * c + 1] += p * v.y;
    acc[4 * c + 2] += p * v.z;
    acc[4 * c + 3] += p * v.w;
  }
}

template <int HD>
struct TiledLayout {
  static constexpr int q_stride = HD + 1, kt_stride = kTile + 4, v_stride = HD, p_stride = kTile + 1;
  static constexpr int q_at = 0, kt_at = q_at + kTile * q_stride, v_at = kt_at + HD * kt_stride,
                       p_at = v_at + kTile * v_stride, floats = p_at + kTile * p_stride;
  static constexpr size_t bytes = static_cast<size_t>(floats) * sizeof(float);
};

template <int HD>
__global__ void __launch_bounds__(kTiledThreads)
    attention_forward_tiled_kernel(float* out, float* lse, const float* qkv, Shape s) {
  using L = TiledLayout<HD>;
  extern __shared__ float smem[];
  float* Qs = smem + L::q_at;   // [kTile][q_stride]
  float* Kt = smem + L::kt_at;  // [HD][kt_stride]
  float* Vs = smem + L::v_at;   // [kTile][HD]
  float* Ps = smem + L::p_at;   // [kTile][p_stride]
  const int64_t bh = blockIdx.y, b = bh / s.NH, h = bh % s.NH;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x, r = tid / 4, quad = tid % 4;
  const int64_t hs = s.hs;

  for (int e = tid; e < kTile * HD; e += kTiledThreads) {
    const int row = e / HD, d = e % HD;
    const int64_t t = q0 + row;
    Qs[row * L::q_stride + d] = t < s.T && d < hs ? qkv[s.q(b, h, t) + d] * s.scale : 0.0f;
  }
  constexpr int kDims = HD / 4;  // output dimensions per thread: 4 (4 c + quad) + i for c < kDims / 4
  float acc[kDims] = {};
  float m = -INFINITY, l = 0.0f;
  const int64_t t = q0 + r;
  const int64_t last_key = q0 + kTile < s.T ? q0 + kTile : s.T;  // keys below it can be seen by some row
  for (int64_t k0 = 0; k0 < last_key; k0 += kTile) {
    __syncthreads();  // the previous tile's K, V and P are read
    for (int e = tid; e < kTile * HD; e += kTiledThreads) {
      const int j = e / HD, d = e % HD;
      const int64_t key = k0 + j;
      const bool in = key < s.T && d < hs;
      Kt[d * L::kt_stride + j] = in ? qkv[s.k(b, h, key) + d] : 0.0f;
      Vs[j * L::v_stride + d] = in ? qkv[s.v(b, h, key) + d] : 0.0f;
    }
    __syncthreads();
    // sc[4 u + i] scores key 4 (4 u + quad) + i of the tile.
    float sc[kKeysPerThread] = {};
    const float* q_row = Qs + r * L::q_stride;
    for (int d = 0; d < HD; ++d) add_scaled_words(sc, q_row[d], Kt + d * L::kt_stride, quad);
    // Causal: key k0 + j is seen by query t when it is at most t (and real).
    float tile_max = -INFINITY;
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int64_t key = k0 + 4 * (4 * (u / 4) + quad) + u % 4;
      if (key > t || key >= s.T) sc[u] = -INFINITY;
      tile_max = fmaxf(tile_max, sc[u]);
    }
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // Finite: every row sees key 0 in the first tile.
    const float m_new = fmaxf(m, tile_max);
    float tile_sum = 0.0f;
    float* p_row = Ps + r * L::p_stride;
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const float p = expf(sc[u] - m_new);
      p_row[4 * (4 * (u / 4) + quad) + u % 4] = p;
      tile_sum += p;
    }
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 1);
    tile_sum += __shfl_xor_sync(0xffffffffu, tile_sum, 2);
    const float rescale = expf(m - m_new);
    l = l * rescale + tile_sum;
    m = m_new;
    __syncwarp();  // the quad's probabilities are in Ps
#pragma unroll
    for (int k = 0; k < kDims; ++k) acc[k] *= rescale;
    const float* p_all = Ps + r * L::p_stride;
    for (int j = 0; j < kTile; ++j) add_scaled_words(acc, p_all[j], Vs + j * L::v_stride, quad);
  }
  if (t >= s.T) return;
  float* o = out + s.o(b, h, t);
#pragma unroll
  for (int k = 0; k < kDims; ++k) {
    const int d = 4 * (4 * (k / 4) + quad) + k % 4;
    if (d < hs) o[d] = acc[k] / l;
  }
  if (quad == 0) lse[(b * s.NH + h) * s.T + t] = m + logf(l);
}


// The backward pass tiled the same way, in two kernels so that each output
// row is summed by the threads that own it (no atomics): the first takes 64
// query rows and walks the key tiles up to the diagonal for dq (and writes
// D = dout . out per row, which the second reads); the second takes 64 key
// rows and walks the query tiles from the diagonal on for dk and dv. Each
// step first scores the tile and forms the probabilities P and their
// gradients dS = P (dout . v - D) from transposed copies (four float4 loads
// per thread and dimension, as the forward's), then reloads the tile
// row-major into the same shared memory to accumulate over it.
__device__ inline int tile_key(int u, int quad) { return 4 * (4 * (u / 4) + quad) + u % 4; }

template <int HD>
struct DqLayout {
  static constexpr int row_stride = HD + 1, t_stride = kTile + 4, p_stride = kTile + 1;
  static constexpr int q_at = 0, g_at = q_at + kTile * row_stride, kv_at = g_at + kTile * row_stride,
                       ds_at = kv_at + 2 * HD * t_stride, floats = ds_at + kTile * p_stride;
  static constexpr size_t bytes = static_cast<size_t>(floats) * sizeof(float);
};

template <int HD>
__global__ void __launch_bounds__(kTiledThreads)
    attention_backward_dq_tiled_kernel(float* dqkv, float* D, const float* dout, const float* out, const float* lse,
                                       const float* qkv, Shape s) {
  using L = DqLayout<HD>;
  extern __shared__ float smem[];
  float* Qs = smem + L::q_at;   // [kTile][row_stride], pre-scaled
  float* Gs = smem + L::g_at;   // dout, [kTile][row_stride]
  float* Kt = smem + L::kv_at;  // [HD][t_stride], then Ks [kTile][HD]
  float* Vt = Kt + HD * L::t_stride;
  float* dS = smem + L::ds_at;  // [kTile][p_stride]
  const int64_t bh = blockIdx.y, b = bh / s.NH, h = bh % s.NH;
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x, r = tid / 4, quad = tid % 4;
  const int64_t hs = s.hs, t = q0 + r;
  for (int e = tid; e < kTile * HD; e += kTiledThreads) {
    const int row = e / HD, d = e % HD;
    const bool in = q0 + row < s.T && d < hs;
    Qs[row * L::row_stride + d] = in ? qkv[s.q(b, h, q0 + row) + d] * s.scale : 0.0f;
    Gs[row * L::row_stride + d] = in ? dout[s.o(b, h, q0 + row) + d] : 0.0f;
  }
  __syncthreads();
  // D = dout . out for this row, summed over the quad's dimensions then
  // across the quad.
  float d_row = 0.0f;
  if (t < s.T)
    for (int d = quad; d < hs; d += 4) d_row += Gs[r * L::row_stride + d] * out[s.o(b, h, t) + d];
  d_row += __shfl_xor_sync(0xffffffffu, d_row, 1);
  d_row += __shfl_xor_sync(0xffffffffu, d_row, 2);
  const float l_row = t < s.T ? lse[(b * s.NH + h) * s.T + t] : 0.0f;
  constexpr int kDims = HD / 4;
  float dq[kDims] = {};
  const int64_t last_key = q0 + kTile < s.T ? q0 + kTile : s.T;
  for (int64_t k0 = 0; k0 < last_key; k0 += kTile) {
    __syncthreads();  // the previous tile's Ks and dS are read
    for (int e = tid; e < kTile * HD; e += kTiledThreads) {
      const int j = e / HD, d = e % HD;
      const bool in = k0 + j < s.T && d < hs;
      Kt[d * L::t_stride + j] = in ? qkv[s.k(b, h, k0 + j) + d] : 0.0f;
      Vt[d * L::t_stride + j] = in ? qkv[s.v(b, h, k0 + j) + d] : 0.0f;
    }
    __syncthreads();
    float sc[kKeysPerThread] = {}, dp[kKeysPerThread] = {};
    for (int d = 0; d < HD; ++d) {
      add_scaled_words(sc, Qs[r * L::row_stride + d], Kt + d * L::t_stride, quad);
      add_scaled_words(dp, Gs[r * L::row_stride + d], Vt + d * L::t_stride, quad);
    }
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int64_t key = k0 + tile_key(u, quad);
      const float p = key <= t && key < s.T ? expf(sc[u] - l_row) : 0.0f;
      dS[r * L::p_stride + tile_key(u, quad)] = p * (dp[u] - d_row);
    }
    __syncthreads();  // Kt and Vt are read; dS is whole
    float* Ks = Kt;   // [kTile][HD]
    for (int e = tid; e < kTile * HD; e += kTiledThreads) {
      const int j = e / HD, d = e % HD;
      Ks[j * HD + d] = k0 + j < s.T && d < hs ? qkv[s.k(b, h, k0 + j) + d] : 0.0f;
    }
    __syncthreads();
    for (int j = 0; j < kTile; ++j) add_scaled_words(dq, dS[r * L::p_stride + j], Ks + j * HD, quad);
  }
  if (t >= s.T) return;
  float* dst = dqkv + s.q(b, h, t);
#pragma unroll
  for (int k = 0; k < kDims; ++k) {
    const int d = tile_key(k, quad);
    if (d < hs) dst[d] += dq[k] * s.scale;
  }
  if (quad == 0) D[(b * s.NH + h) * s.T + t] = d_row;
}

template <int HD>
struct DkDvLayout {
  static constexpr int row_stride = HD + 1, t_stride = kTile + 4, p_stride = kTile + 1;
  static constexpr int k_at = 0, v_at = k_at + kTile * row_stride, qg_at = v_at + kTile * row_stride,
                       p_at = qg_at + 2 * HD * t_stride, ds_at = p_at + kTile * p_stride,
                       floats = ds_at + kTile * p_stride;
  static constexpr size_t bytes = static_cast<size_t>(floats) * sizeof(float);
};

template <int HD>
__global__ void __launch_bounds__(kTiledThreads)
    attention_backward_dkdv_tiled_kernel(float* dqkv, const float* D, const float* dout, const float* lse,
                                         const float* qkv, Shape s) {
  using L = DkDvLayout<HD>;
  extern __shared__ float smem[];
  float* Ks = smem + L::k_at;   // [kTile][row_stride]
  float* Vs = smem + L::v_at;   // [kTile][row_stride]
  float* Qt = smem + L::qg_at;  // [HD][t_stride], pre-scaled; then Qr [kTile][HD]
  float* Gt = Qt + HD * L::t_stride;
  float* Ps = smem + L::p_at;   // [kTile][p_stride]: P[key][query]
  float* dS = smem + L::ds_at;  // [kTile][p_stride]
  const int64_t bh = blockIdx.y, b = bh / s.NH, h = bh % s.NH, rows = bh * s.T;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const int tid = threadIdx.x, r = tid / 4, quad = tid % 4;
  const int64_t hs = s.hs, key = k0 + r;
  for (int e = tid; e < kTile * HD; e += kTiledThreads) {
    const int row = e / HD, d = e % HD;
    const bool in = k0 + row < s.T && d < hs;
    Ks[row * L::row_stride + d] = in ? qkv[s.k(b, h, k0 + row) + d] : 0.0f;
    Vs[row * L::row_stride + d] = in ? qkv[s.v(b, h, k0 + row) + d] : 0.0f;
  }
  constexpr int kDims = HD / 4;
  float dk[kDims] = {}, dv[kDims] = {};
  for (int64_t t0 = k0; t0 < s.T; t0 += kTile) {
    __syncthreads();  // K and V are stored; the previous tile's rows, P and dS are read
    for (int e = tid; e < kTile * HD; e += kTiledThreads) {
      const int i = e / HD, d = e % HD;
      const bool in = t0 + i < s.T && d < hs;
      Qt[d * L::t_stride + i] = in ? qkv[s.q(b, h, t0 + i) + d] * s.scale : 0.0f;
      Gt[d * L::t_stride + i] = in ? dout[s.o(b, h, t0 + i) + d] : 0.0f;
    }
    __syncthreads();
    float sc[kKeysPerThread] = {}, dp[kKeysPerThread] = {};
    for (int d = 0; d < HD; ++d) {
      add_scaled_words(sc, Ks[r * L::row_stride + d], Qt + d * L::t_stride, quad);
      add_scaled_words(dp, Vs[r * L::row_stride + d], Gt + d * L::t_stride, quad);
    }
#pragma unroll
    for (int u = 0; u < kKeysPerThread; ++u) {
      const int i = tile_key(u, quad);
      const int64_t t = t0 + i;
      const bool seen = key <= t && t < s.T && key < s.T;
      const float p = seen ? expf(sc[u] - lse[rows + t]) : 0.0f;
      Ps[r * L::p_stride + i] = p;
      dS[r * L::p_stride + i] = seen ? p * (dp[u] - D[rows + t]) : 0.0f;
    }
    __syncthreads();  // Qt and Gt are read; P and dS are whole
    float* Qr = Qt;   // [kTile][HD]
    float* Gr = Qr + kTile * HD;
    for (int e = tid; e < kTile * HD; e += kTiledThreads) {
      const int i = e / HD, d = e % HD;
      const bool in = t0 + i < s.T && d < hs;
      Qr[i * HD + d] = in ? qkv[s.q(b, h, t0 + i) + d] : 0.0f;
      Gr[i * HD + d] = in ? dout[s.o(b, h, t0 + i) + d] : 0.0f;
    }
    __syncthreads();
    for (int i = 0; i < kTile; ++i) {
      add_scaled_words(dv, Ps[r * L::p_stride + i], Gr + i * HD, quad);
      add_scaled_words(dk, dS[r * L::p_stride + i], Qr + i * HD, quad);
    }
  }
  if (key >= s.T) return;
  float* dst_k = dqkv + s.k(b, h, key);
  float* dst_v = dqkv + s.v(b, h, key);
#pragma unroll
  for (int k = 0; k < kDims; ++k) {
    const int d = tile_key(k, quad);
    if (d < hs) {
      dst_k[d] += dk[k] * s.scale;
      dst_v[d] += dv[k];
    }
  }
}

// Whether a kernel asking for `bytes` of shared memory a block fits this
// device; if so, lets it ask (above 48 KiB a block's dynamic shared memory
// must be asked for).
template <typename Kernel>
bool allow_shared_memory(Kernel kernel, size_t bytes) {
  int device = 0, most = 0;
  LOOM_CUDA_CHECK(cudaGetDevice(&device));
  LOOM_CUDA_CHECK(cudaDeviceGetAttribute(&most, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > static_cast<size_t>(most)) return false;
  LOOM_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return true;
}

dim3 tile_grid(const Shape& s) {
  return dim3(static_cast<unsigned>((s.T + kTile - 1) / kTile), static_cast<unsigned>(s.B * s.NH));
}

// The tiled kernels for a head padded to HD dimensions; false where they
// do not fit the device's shared memory.
template <int HD>
bool forward_tiled(float* out, float* lse, const float* qkv, const Shape& s, cudaStream_t stream) {
  if (!allow_shared_memory(attention_forward_tiled_kernel<HD>, TiledLayout<HD>::bytes)) return false;
  attention_forward_tiled_kernel<HD><<<tile_grid(s), kTiledThreads, TiledLayout<HD>::bytes, stream>>>(out, lse, qkv, s);
  return true;
}

template <int HD>
bool backward_tiled(float* dqkv, float* D, const float* dout, const float* out, const float* lse, const float* qkv,
                    const Shape& s, cudaStream_t stream) {
  if (!allow_shared_memory(attention_backward_dq_tiled_kernel<HD>, DqLayout<HD>::bytes) ||
      !allow_shared_memory(attention_backward_dkdv_tiled_kernel<HD>, DkDvLayout<HD>::bytes))
    return false;
  attention_backward_dq_tiled_kernel<HD>
      <<<tile_grid(s), kTiledThreads, DqLayout<HD>::bytes, stream>>>(dqkv, D, dout, out, lse, qkv, s);
  check_launch();
  attention_backward_dkdv_tiled_kernel<HD>
      <<<tile_grid(s), kTiledThreads, DkDvLayout<HD>::bytes, stream>>>(dqkv, D, dout, lse, qkv, s);
  return true;
}

Shape make_shape(int64_t B, int64_t T, int64_t C, int64_t NH) {
  LOOM_CHECK(NH > 0 && C % NH == 0, "attention: C = ", C, " is not a multiple of NH = ", NH);
  const int64_t hs = C / NH;
  LOOM_CHECK(hs <= 32 * kMaxPerLane, "attention: head size ", hs, " exceeds the CUDA kernel's ", 32 * kMaxPerLane);
  return Shape{B, T, C, NH, hs, 1.0f / std::sqrt(static_cast<float>(hs))};
}

unsigned warp_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock); }

}  // namespace

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       cudaStream_t stream) {
  const Shape s = make_shape(B, T, C, NH);
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  // The tiled kernels pad the head to 32, 64 or 128 dimensions; larger
  // heads, or tiles a device's shared memory cannot hold, take the
  // warp-per-row one.
  const bool tiled = s.hs <= 32    ? forward_tiled<32>(out, lse, qkv, s, stream)
                     : s.hs <= 64  ? forward_tiled<64>(out, lse, qkv, s, stream)
                     : s.hs <= 128 ? forward_tiled<128>(out, lse, qkv, s, stream)
                                   : false;
  if (!tiled) attention_forward_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(out, lse, qkv, s);
  check_launch();
}

void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, cudaStream_t stream) {
  const Shape s = make_shape(B, T, C, NH);
  const int64_t rows = B * NH * T;
  if (rows == 0) return;
  float* D = nullptr;
  LOOM_CUDA_CHECK(cudaMallocAsync(reinterpret_cast<void**>(&D), static_cast<size_t>(rows) * sizeof(float), stream));
  const bool tiled = s.hs <= 32    ? backward_tiled<32>(dqkv, D, dout, out, lse, qkv, s, stream)
                     : s.hs <= 64  ? backward_tiled<64>(dqkv, D, dout, out, lse, qkv, s, stream)
                     : s.hs <= 128 ? backward_tiled<128>(dqkv, D, dout, out, lse, qkv, s, stream)
                                   : false;
  if (!tiled) {
    attention_backward_dq_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(dqkv, D, dout, out, lse,
                                                                                         qkv, s);
    check_launch();
    attention_backward_dkdv_kernel<<<warp_blocks(rows), 32 * kWarpsPerBlock, 0, stream>>>(dqkv, D, dout, lse, qkv, s);
  }
  check_launch();
  LOOM_CUDA_CHECK(cudaFreeAsync(D, stream));
}

}  // namespace loom::cuda
