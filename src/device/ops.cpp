// The dispatch point: every kernel of the contract, enqueued on the calling
// thread's current stream, for the backend of that stream's device.
//
// Arguments are captured by value: in the asynchronous CPU mode the kernel
// runs later on the stream's worker, after the caller has returned.
#include <cstring>

#include "device/stream_impl.h"
#include "loom/device.h"

namespace loom::ops {

namespace {

// Runs `kernel` (a closure over the CPU implementation) on the current
// stream. A CUDA build adds its own arm here, with the CUDA kernel of the
// same name on the stream's native handle.
template <typename CpuKernel>
void launch(CpuKernel&& kernel) {
  const Stream s = current_stream();
  switch (s.device().kind) {
    case DeviceKind::cpu:
      s.enqueue(std::forward<CpuKernel>(kernel));
      return;
    case DeviceKind::cuda: break;
  }
  LOOM_CHECK(false, "this build of loom has no kernels for ", s.device().name());
}

// Runs a kernel that returns a value to the host and waits for it.
template <typename Result, typename CpuKernel>
Result launch_and_read(CpuKernel kernel) {
  Result result{};
  launch([&result, kernel] { result = kernel(); });
  current_stream().synchronize();
  return result;
}

}  // namespace

namespace {
// The calling thread's mode, read where a kernel is enqueued (not where a
// stream's worker runs it).
thread_local bool t_fixed_rows = false;
cpu::RowBlocking row_blocking() { return t_fixed_rows ? cpu::RowBlocking::fixed : cpu::RowBlocking::by_shape; }
}  // namespace

// One line per kernel: the CPU implementation of the same name and arguments.
#define LOOM_LAUNCH(kernel, ...) launch([=] { cpu::kernel(__VA_ARGS__); })

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  const cpu::RowBlocking rows = row_blocking();
  LOOM_LAUNCH(gemm, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc, rows);
}
void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC) {
  const cpu::RowBlocking rows = row_blocking();
  LOOM_LAUNCH(linear_forward, out, inp, weight, bias, N, C, OC, rows);
}
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC, GradWrite dinp_write) {
  LOOM_LAUNCH(linear_backward, dinp, dweight, dbias, dout, inp, weight, N, C, OC, dinp_write);
}
void add_bias(float* out, const float* bias, int64_t N, int64_t OC) { LOOM_LAUNCH(add_bias, out, bias, N, OC); }
void linear_forward_int8(float* out, int64_t ldo, const float* inp, const int8_t* w, const float* scale,
                         const float* bias, int64_t N, int64_t C, int64_t OC) {
  LOOM_LAUNCH(linear_forward_int8, out, ldo, inp, w, scale, bias, N, C, OC);
}
void linear_forward_int4(float* out, int64_t ldo, const float* inp, const uint8_t* w, const float* scale,
                         const uint8_t* zero, const float* bias, int64_t N, int64_t C, int64_t OC, int64_t group) {
  LOOM_LAUNCH(linear_forward_int4, out, ldo, inp, w, scale, zero, bias, N, C, OC, group);
}
void dequantize_int8(float* out, const int8_t* w, const float* scale, int64_t OC, int64_t C) {
  LOOM_LAUNCH(dequantize_int8, out, w, scale, OC, C);
}
void dequantize_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t OC, int64_t C,
                     int64_t group) {
  LOOM_LAUNCH(dequantize_int4, out, w, scale, zero, OC, C, group);
}
void embedding_lookup_int8(float* out, const int32_t* tokens, const int8_t* w, const float* scale, int64_t N,
                           int64_t C) {
  LOOM_LAUNCH(embedding_lookup_int8, out, tokens, w, scale, N, C);
}
void embedding_lookup_int4(float* out, const int32_t* tokens, const uint8_t* w, const float* scale,
                           const uint8_t* zero, int64_t N, int64_t C, int64_t group) {
  LOOM_LAUNCH(embedding_lookup_int4, out, tokens, w, scale, zero, N, C, group);
}
void linear_forward_w8a8(float* out, int64_t ldo, const float* inp, const float* inv_smooth, const int8_t* w,
                         const float* scale, const float* bias, int64_t N, int64_t C, int64_t OC, Int8Gemm gemm) {
  LOOM_LAUNCH(linear_forward_w8a8, out, ldo, inp, inv_smooth, w, scale, bias, N, C, OC, gemm);
}

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0) {
  LOOM_LAUNCH(embedding_forward, out, tokens, wte, wpe, B, T, C, pos0);
}
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0) {
  LOOM_LAUNCH(embedding_backward, dwte, dwpe, dout, tokens, B, T, C, pos0);
}
void embedding_lookup_range(float* out, const int32_t* tokens, const float* wte, int64_t first, int64_t rows,
                            int64_t N, int64_t C) {
  LOOM_LAUNCH(embedding_lookup_range, out, tokens, wte, first, rows, N, C);
}
void embedding_lookup_range_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t first,
                                     int64_t rows, int64_t N, int64_t C) {
  LOOM_LAUNCH(embedding_lookup_range_backward, dwte, dout, tokens, first, rows, N, C);
}
void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t N, int64_t T, int64_t C,
                            int64_t pos0) {
  LOOM_LAUNCH(position_embedding_add, out, wpe, row0, N, T, C, pos0);
}
void position_embedding_backward(float* dwpe, const float* dout, int64_t row0, int64_t N, int64_t T, int64_t C) {
  LOOM_LAUNCH(position_embedding_backward, dwpe, dout, row0, N, T, C);
}

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C) {
  LOOM_LAUNCH(layernorm_forward, out, mean, rstd, inp, weight, bias, N, C);
}
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        GradWrite dinp_write) {
  LOOM_LAUNCH(layernorm_backward, dinp, dweight, dbias, dout, inp, weight, mean, rstd, N, C, dinp_write);
}

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps) {
  LOOM_LAUNCH(rmsnorm_forward, out, rstd, inp, weight, N, C, eps);
}
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradWrite dinp_write) {
  LOOM_LAUNCH(rmsnorm_backward, dinp, dweight, dout, inp, weight, rstd, N, C, dinp_write);
}

void norm_row_sums(float* sums, const float* x, int64_t N, int64_t C) { LOOM_LAUNCH(norm_row_sums, sums, x, N, C); }
void norm_row_square_sums(float* sums, const float* x, const float* center, int64_t N, int64_t C) {
  LOOM_LAUNCH(norm_row_square_sums, sums, x, center, N, C);
}
void norm_rstd(float* rstd, const float* square_sums, int64_t N, int64_t C_total, float eps) {
  LOOM_LAUNCH(norm_rstd, rstd, square_sums, N, C_total, eps);
}
void norm_apply(float* out, const float* x, const float* mean, const float* rstd, const float* weight,
                const float* bias, int64_t N, int64_t C) {
  LOOM_LAUNCH(norm_apply, out, x, mean, rstd, weight, bias, N, C);
}
void norm_backward_sums(float* sums, const float* dout, const float* x, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C) {
  LOOM_LAUNCH(norm_backward_sums, sums, dout, x, weight, mean, rstd, N, C);
}
void norm_backward_apply(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                         const float* weight, const float* mean, const float* rstd, const float* sums, int64_t N,
                         int64_t C, int64_t C_total, GradWrite dinp_write) {
  LOOM_LAUNCH(norm_backward_apply, dinp, dweight, dbias, dout, x, weight, mean, rstd, sums, N, C, C_total,
              dinp_write);
}

void rope_tables(float* cos, float* sin, const float* inv_freq, int64_t T, int64_t half, int64_t pos0) {
  LOOM_LAUNCH(rope_tables, cos, sin, inv_freq, T, half, pos0);
}
void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T,
                  int64_t n_heads, int64_t head_dim, int64_t stride) {
  LOOM_LAUNCH(rope_forward, out, inp, cos, sin, B, T, n_heads, head_dim, stride);
}
void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t B, int64_t T,
                   int64_t n_heads, int64_t head_dim, int64_t stride, GradWrite dinp_write) {
  LOOM_LAUNCH(rope_backward, dinp, dout, cos, sin, B, T, n_heads, head_dim, stride, dinp_write);
}

void swiglu_forward(float* h, const float* g, const float* u, int64_t N, int64_t I, int64_t ld) {
  LOOM_LAUNCH(swiglu_forward, h, g, u, N, I, ld);
}
void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t N, int64_t I,
                     int64_t ld, GradWrite dgu_write) {
  LOOM_LAUNCH(swiglu_backward, dg, du, dh, g, u, N, I, ld, dgu_write);
}

void gelu_forward(float* out, const float* inp, int64_t n) { LOOM_LAUNCH(gelu_forward, out, inp, n); }
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n, GradWrite dinp_write) {
  LOOM_LAUNCH(gelu_backward, dinp, inp, dout, n, dinp_write);
}
void add(float* out, const float* a, const float* b, int64_t n) { LOOM_LAUNCH(add, out, a, b, n); }
void accumulate(float* y, const float* x, int64_t n) { LOOM_LAUNCH(accumulate, y, x, n); }
void scale(float* x, int64_t n, float s) { LOOM_LAUNCH(scale, x, n, s); }

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       int64_t NKV) {
  LOOM_LAUNCH(attention_forward, out, lse, qkv, B, T, C, NH, NKV);
}
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, int64_t NKV, GradWrite dqkv_write) {
  LOOM_LAUNCH(attention_backward, dqkv, dout, out, lse, qkv, B, T, C, NH, NKV, dqkv_write);
}

void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len) {
  LOOM_LAUNCH(attention_decode, out, lse, k_cache, v_cache, qkv, cache_lens, row_offsets, S, N, C, NH, NKV,
              max_len);
}

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V) {
  LOOM_LAUNCH(cross_entropy_forward, losses, lse, logits, targets, N, V);
}
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V) {
  LOOM_LAUNCH(cross_entropy_backward, dlogits, logits, lse, targets, dloss, N, V);
}
void cross_entropy_forward_backward(float* losses, float* lse, float* logits, const int32_t* targets,
                                    const float* dloss, int64_t N, int64_t V) {
  LOOM_LAUNCH(cross_entropy_forward_backward, losses, lse, logits, targets, dloss, N, V);
}
void add_sum_f64(double* sum, const float* x, int64_t n) { LOOM_LAUNCH(add_sum_f64, sum, x, n); }
void cross_entropy_shard_max(float* row_max, const float* logits, int64_t N, int64_t V, int64_t real) {
  LOOM_LAUNCH(cross_entropy_shard_max, row_max, logits, N, V, real);
}
void cross_entropy_shard_sums(float* sums, const float* logits, const float* row_max, const int32_t* targets,
                              int64_t first, int64_t N, int64_t V, int64_t real) {
  LOOM_LAUNCH(cross_entropy_shard_sums, sums, logits, row_max, targets, first, N, V, real);
}
void cross_entropy_shard_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  const float* dloss, int64_t first, int64_t N, int64_t V, int64_t real) {
  LOOM_LAUNCH(cross_entropy_shard_backward, dlogits, logits, lse, targets, dloss, first, N, V, real);
}

void cross_entropy_shard_loss(float* losses, float* lse, const float* row_max, const float* sums,
                              const int32_t* targets, int64_t N) {
  LOOM_LAUNCH(cross_entropy_shard_loss, losses, lse, row_max, sums, targets, N);
}

void distill_forward(float* losses, float* kl, float* ce, float* stats, const float* logits, const float* teacher,
                     const int32_t* targets, Distillation d, int64_t N, int64_t V) {
  LOOM_LAUNCH(distill_forward, losses, kl, ce, stats, logits, teacher, targets, d, N, V);
}
void distill_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                      const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V) {
  LOOM_LAUNCH(distill_backward, dlogits, logits, teacher, stats, targets, dloss, d, N, V);
}
void distill_forward_backward(float* losses, float* kl, float* ce, float* stats, float* logits, const float* teacher,
                              const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V) {
  LOOM_LAUNCH(distill_forward_backward, losses, kl, ce, stats, logits, teacher, targets, dloss, d, N, V);
}
void distill_shard_max(float* row_max, const float* logits, const float* teacher, int64_t N, int64_t V, int64_t real) {
  LOOM_LAUNCH(distill_shard_max, row_max, logits, teacher, N, V, real);
}
void distill_shard_sums(float* sums, const float* logits, const float* teacher, const float* row_max,
                        const int32_t* targets, Distillation d, int64_t first, int64_t N, int64_t V, int64_t real) {
  LOOM_LAUNCH(distill_shard_sums, sums, logits, teacher, row_max, targets, d, first, N, V, real);
}
void distill_shard_loss(float* losses, float* kl, float* ce, float* stats, const float* row_max, const float* sums,
                        const int32_t* targets, Distillation d, int64_t N) {
  LOOM_LAUNCH(distill_shard_loss, losses, kl, ce, stats, row_max, sums, targets, d, N);
}
void distill_shard_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                            const int32_t* targets, const float* dloss, Distillation d, int64_t first, int64_t N,
                            int64_t V, int64_t real) {
  LOOM_LAUNCH(distill_shard_backward, dlogits, logits, teacher, stats, targets, dloss, d, first, N, V, real);
}

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first) {
  LOOM_LAUNCH(dropout_forward, out, inp, rows, cols, stride, p, key, first);
}
void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, GradWrite dinp_write) {
  LOOM_LAUNCH(dropout_backward, dinp, dout, rows, cols, stride, p, key, first, dinp_write);
}

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s) {
  LOOM_LAUNCH(adamw_update, param, grad, m, v, n, s);
}

double sum_squares(const float* x, int64_t n) {
  return launch_and_read<double>([=] { return cpu::sum_squares(x, n); });
}

void add_rounded(void* dst, DType dt, const float* src, int64_t n) {
  launch([=] { cpu::add_rounded(dst, dt, src, n); });
}
void add_rounded(void* dst, const void* src, DType dt, int64_t n) {
  launch([=] { cpu::add_rounded(dst, src, dt, n); });
}

int64_t count_non_finite(const void* x, DType dt, int64_t n) {
  return launch_and_read<int64_t>([=] { return cpu::count_non_finite(x, dt, n); });
}

double sum_squares(const void* x, DType dt, int64_t n) {
  return launch_and_read<double>([=] { return cpu::sum_squares(x, dt, n); });
}

void copy(void* dst, const void* src, std::size_t bytes) { launch([=] { cpu::copy_bytes(dst, src, bytes); }); }

void convert(const void* src, DType src_dt, void* dst, DType dst_dt, int64_t n) {
  launch([=] { loom::convert(src, src_dt, dst, dst_dt, n); });
}

void round_to(float* x, int64_t n, DType dt) { launch([=] { loom::round_to(x, n, dt); }); }

void fill(void* dst, DType dt, int64_t n, float value) {
  launch([=] { loom::fill(dst, dt, n, value); });
}

void zero(void* dst, std::size_t bytes) { launch([=] { std::memset(dst, 0, bytes); }); }

double measure_gemm_gflops(int64_t n, int reps) {
  synchronize();
  return cpu::measure_sgemm_gflops(n, reps);
}

void synchronize() {
  MemoryContext& ctx = MemoryContext::current();
  for (auto role : {MemoryContext::StreamRole::compute, MemoryContext::StreamRole::copy})
    Stream(ctx.stream(role)).synchronize();
}

#undef LOOM_LAUNCH

}  // namespace loom::ops

namespace loom {

FixedRowBlocks::FixedRowBlocks() : previous_(ops::t_fixed_rows) { ops::t_fixed_rows = true; }
FixedRowBlocks::~FixedRowBlocks() { ops::t_fixed_rows = previous_; }

}  // namespace loom
