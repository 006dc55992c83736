// loom device layer: devices, streams, events, and the one dispatch point
// through which the model, the optimizer and the stores run kernels and move
// bytes, whatever backend the rank's device is.
//
// A rank computes on one Device (its MemoryContext's). Work on device memory
// is enqueued on a Stream and runs in the stream's order; the host learns that
// it finished through an Event (or Stream::synchronize). Host code never reads
// or writes device memory directly: it goes through `ops::` (kernels, copies,
// fills, conversions), and reads a result only after synchronizing.
//
// The CPU backend runs stream work in one of two modes:
//   sync  - the work runs on the calling thread when it is enqueued (the
//           default: as fast as calling the kernel directly);
//   async - each stream has its own worker thread, as a GPU stream would, so
//           a missing synchronization shows up as a wrong result on a machine
//           without a GPU. Chosen with set_cpu_stream_mode or the environment
//           variable LOOM_CPU_STREAMS=async (read once, at the first stream).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "loom/core.h"
#include "loom/kernels.h"

namespace loom {

enum class CpuStreamMode : uint8_t { sync, async };
CpuStreamMode cpu_stream_mode();
// Applies to streams created afterwards (set it before building a Trainer).
void set_cpu_stream_mode(CpuStreamMode mode);
const char* cpu_stream_mode_name(CpuStreamMode mode);

// An ordered queue of work on one device. Streams are owned by the rank's
// MemoryContext (compute and copy); copies of a Stream refer to the same one.
class Stream {
 public:
  explicit Stream(std::shared_ptr<detail::StreamImpl> impl) : impl_(std::move(impl)) {}
  Device device() const;
  // Blocks the host until everything enqueued so far has run. Rethrows an
  // exception thrown by the stream's work.
  void synchronize() const;
  // Enqueues host-side work that must run in stream order (the CPU backend's
  // kernels; a deferred free). `work` must not throw for bad input: callers
  // validate before enqueueing.
  void enqueue(std::function<void()> work) const;
  friend bool operator==(const Stream& a, const Stream& b) { return a.impl_ == b.impl_; }
  detail::StreamImpl& impl() const { return *impl_; }
  const std::shared_ptr<detail::StreamImpl>& impl_shared() const { return impl_; }

 private:
  std::shared_ptr<detail::StreamImpl> impl_;
};

// A point in a stream's work. Default-constructed events are complete.
class Event {
 public:
  Event() = default;
  // Marks everything enqueued on `stream` so far.
  static Event record(const Stream& stream);
  // The host waits until the marked work has run.
  void synchronize() const;
  // Whether the marked work has run (never blocks).
  bool query() const;
  // Work enqueued on `stream` after this call runs after the marked work,
  // without blocking the host.
  void wait(const Stream& stream) const;

 private:
  std::shared_ptr<detail::StreamImpl> stream_;
  uint64_t ticket_ = 0;
};

// Threads the calling thread's host-side parallel work may use (its rank's
// share of the cores).
int host_threads();

// The calling thread's stream for new work: the rank's compute stream unless
// a StreamGuard says otherwise.
Stream current_stream();

// The calling thread's stream for moves between memory tiers: the rank's copy
// stream, so that moves overlap the compute stream's kernels, or inside a
// HostSection the section's own stream (host code expects its moves done).
Stream copy_stream();

// Makes `stream` the calling thread's current stream for its lifetime (the
// chunk manager's copies run on the copy stream this way).
class StreamGuard {
 public:
  explicit StreamGuard(const Stream& stream);
  ~StreamGuard();
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;

 private:
  std::shared_ptr<detail::StreamImpl> previous_;
};

// While one lives, the calling thread's ops::gemm and ops::linear_forward
// run with RowBlocking::fixed (kernels.h): generation's forward, where a
// sequence's rows must come out the same whatever else is in the batch.
class FixedRowBlocks {
 public:
  FixedRowBlocks();
  ~FixedRowBlocks();
  FixedRowBlocks(const FixedRowBlocks&) = delete;
  FixedRowBlocks& operator=(const FixedRowBlocks&) = delete;

 private:
  bool previous_;
};

// Host code that works on the CPU device's memory directly (the chunk
// manager's moves and CPU optimizer): the rank's streams are drained at
// entry, and device-layer calls inside run at once on the calling thread, so
// host and device work interleave as written. The device must be the CPU.
class HostSection {
 public:
  HostSection();
  HostSection(const HostSection&) = delete;
  HostSection& operator=(const HostSection&) = delete;

 private:
  StreamGuard guard_;
};

// ---------------------------------------------------------------------------
// ops: the dispatch point. Each kernel of the kernels.h contract (same
// arguments, same semantics), enqueued on the current stream of the current
// rank's device. Results of kernels that return a value to the host
// (sum_squares) synchronize the stream first.
// ---------------------------------------------------------------------------

namespace ops {

using cpu::AdamWStep;
using cpu::Distillation;
using cpu::GradWrite;
using cpu::Int8Gemm;

// C[M,N] = alpha op(A) op(B) + beta C with leading dimensions (kernels.h's
// gemm): for products over a band of columns of a wider matrix.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc);
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC);
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC,
                     GradWrite dinp_write = GradWrite::accumulate);
void add_bias(float* out, const float* bias, int64_t N, int64_t OC);
void linear_forward_int8(float* out, int64_t ldo, const float* inp, const int8_t* w, const float* scale,
                         const float* bias, int64_t N, int64_t C, int64_t OC);
void linear_forward_int4(float* out, int64_t ldo, const float* inp, const uint8_t* w, const float* scale,
                         const uint8_t* zero, const float* bias, int64_t N, int64_t C, int64_t OC, int64_t group);
void dequantize_int8(float* out, const int8_t* w, const float* scale, int64_t OC, int64_t C);
void dequantize_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t OC, int64_t C,
                     int64_t group);
void embedding_lookup_int8(float* out, const int32_t* tokens, const int8_t* w, const float* scale, int64_t N,
                           int64_t C);
void embedding_lookup_int4(float* out, const int32_t* tokens, const uint8_t* w, const float* scale,
                           const uint8_t* zero, int64_t N, int64_t C, int64_t group);
void linear_forward_w8a8(float* out, int64_t ldo, const float* inp, const float* inv_smooth, const int8_t* w,
                         const float* scale, const float* bias, int64_t N, int64_t C, int64_t OC,
                         Int8Gemm gemm = Int8Gemm::fastest);

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0);
void embedding_lookup_range(float* out, const int32_t* tokens, const float* wte, int64_t first, int64_t rows,
                            int64_t N, int64_t C);
void embedding_lookup_range_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t first,
                                     int64_t rows, int64_t N, int64_t C);
void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t N, int64_t T, int64_t C,
                            int64_t pos0);
void position_embedding_backward(float* dwpe, const float* dout, int64_t row0, int64_t N, int64_t T, int64_t C);

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        GradWrite dinp_write = GradWrite::accumulate);

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradWrite dinp_write = GradWrite::accumulate);

// Norms over a split hidden dimension (kernels.h).
void norm_row_sums(float* sums, const float* x, int64_t N, int64_t C);
void norm_row_square_sums(float* sums, const float* x, const float* center, int64_t N, int64_t C);
void norm_rstd(float* rstd, const float* square_sums, int64_t N, int64_t C_total, float eps);
void norm_apply(float* out, const float* x, const float* mean, const float* rstd, const float* weight,
                const float* bias, int64_t N, int64_t C);
void norm_backward_sums(float* sums, const float* dout, const float* x, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C);
void norm_backward_apply(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                         const float* weight, const float* mean, const float* rstd, const float* sums, int64_t N,
                         int64_t C, int64_t C_total, GradWrite dinp_write = GradWrite::accumulate);

// inv_freq: cpu::rope_inv_freq's table (host code, once per model), copied to the device.
void rope_tables(float* cos, float* sin, const float* inv_freq, int64_t T, int64_t half, int64_t pos0);
void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T,
                  int64_t n_heads, int64_t head_dim, int64_t stride);
void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t B, int64_t T,
                   int64_t n_heads, int64_t head_dim, int64_t stride, GradWrite dinp_write = GradWrite::accumulate);

void swiglu_forward(float* h, const float* g, const float* u, int64_t N, int64_t I, int64_t ld);
void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t N, int64_t I,
                     int64_t ld, GradWrite dgu_write = GradWrite::accumulate);

void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                   GradWrite dinp_write = GradWrite::accumulate);
void add(float* out, const float* a, const float* b, int64_t n);
void accumulate(float* y, const float* x, int64_t n);
void scale(float* x, int64_t n, float s);

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       int64_t NKV);
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, int64_t NKV,
                        GradWrite dqkv_write = GradWrite::accumulate);
void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len);

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V);
void cross_entropy_forward_backward(float* losses, float* lse, float* logits, const int32_t* targets,
                                    const float* dloss, int64_t N, int64_t V);
void add_sum_f64(double* sum, const float* x, int64_t n);
void cross_entropy_shard_max(float* row_max, const float* logits, int64_t N, int64_t V, int64_t real);
void cross_entropy_shard_sums(float* sums, const float* logits, const float* row_max, const int32_t* targets,
                              int64_t first, int64_t N, int64_t V, int64_t real);
void cross_entropy_shard_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  const float* dloss, int64_t first, int64_t N, int64_t V, int64_t real);
void cross_entropy_shard_loss(float* losses, float* lse, const float* row_max, const float* sums,
                              const int32_t* targets, int64_t N);
void distill_forward(float* losses, float* kl, float* ce, float* stats, const float* logits, const float* teacher,
                     const int32_t* targets, Distillation d, int64_t N, int64_t V);
void distill_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                      const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V);
void distill_forward_backward(float* losses, float* kl, float* ce, float* stats, float* logits, const float* teacher,
                              const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V);
void distill_shard_max(float* row_max, const float* logits, const float* teacher, int64_t N, int64_t V, int64_t real);
void distill_shard_sums(float* sums, const float* logits, const float* teacher, const float* row_max,
                        const int32_t* targets, Distillation d, int64_t first, int64_t N, int64_t V, int64_t real);
void distill_shard_loss(float* losses, float* kl, float* ce, float* stats, const float* row_max, const float* sums,
                        const int32_t* targets, Distillation d, int64_t N);
void distill_shard_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                            const int32_t* targets, const float* dloss, Distillation d, int64_t first, int64_t N,
                            int64_t V, int64_t real);

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first);
void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, GradWrite dinp_write = GradWrite::accumulate);

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s);

// Sum of squares of x in double, in a fixed order; synchronizes (the host
// reads it).
double sum_squares(const float* x, int64_t n);

// The working-precision forms (kernels.h); the two that return a value to
// the host synchronize.
void add_rounded(void* dst, DType dt, const float* src, int64_t n);
void add_rounded(void* dst, const void* src, DType dt, int64_t n);
int64_t count_non_finite(const void* x, DType dt, int64_t n);
double sum_squares(const void* x, DType dt, int64_t n);

// Bytes and element moves. `copy` moves bytes between any two tiers of the
// rank (host <-> device is the backend's transfer); `convert` copies between
// floating dtypes with round-to-nearest-even; `round_to` rounds f32 values to
// what `dt` can represent; `fill` writes `value` (converted to dt).
void copy(void* dst, const void* src, std::size_t bytes);
void convert(const void* src, DType src_dt, void* dst, DType dst_dt, int64_t n);
void round_to(float* x, int64_t n, DType dt);
void fill(void* dst, DType dt, int64_t n, float value);
void zero(void* dst, std::size_t bytes);

// This device's fp32 GEMM rate in GFLOP/s on an n x n x n product (best of
// `reps` after a warm-up): the baseline MFU and the benchmarks quote.
double measure_gemm_gflops(int64_t n = 2048, int reps = 5);

// Blocks the host until every stream of the calling rank has run what was
// enqueued: the host may then read or write any memory that work touched.
void synchronize();

}  // namespace ops

}  // namespace loom
