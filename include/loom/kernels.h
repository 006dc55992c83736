// loom CPU kernels: the numerical contracts every backend implements.
//
// Conventions (shared by every kernel here, and by the CUDA backend later):
// - fp32, contiguous, row-major; N is a row count (usually B*T).
// - Backward kernels ACCUMULATE (+=) into every gradient they write: that
//   makes gradient accumulation, tied weights and residual branches free.
//   A kernel whose input gradient is often a fresh buffer takes a GradWrite
//   for it instead: `overwrite` writes it (the buffer may be uninitialized),
//   so no buffer is zeroed only to be accumulated into. Both give the values
//   that accumulating into zeros gives.
// - Results do not depend on the number of threads: reductions run over fixed
//   chunks in a fixed order, so a run is bit-identical to itself whatever the
//   thread budget of its rank.
// - Kernels never throw on user input; callers validate (token ids, shapes).
#pragma once

#include <cstddef>
#include <cstdint>

#include "loom/core.h"

namespace loom::cpu {

// How a backward kernel writes its input gradient (see the conventions above).
enum class GradWrite { accumulate, overwrite };

// ---------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------

// Threads the calling thread's parallel regions (every kernel here, GEMMs
// included) may use.
int num_threads();
// Sets that budget for the calling thread only (OpenMP ICVs are per thread),
// so ranks-as-threads split the cores.
void set_num_threads(int n);

// ---------------------------------------------------------------------------
// GEMM
// ---------------------------------------------------------------------------

// How a GEMM groups the rows of C into BLAS calls. by_shape: as the shape
// suits BLAS (training). fixed: in blocks of kFixedRowBlock rows whatever M,
// the last one padded, every block one call of the same shape: BLAS picks its
// kernels by shape (and a row's bits with them), so only then is a row of C a
// function of its own row of op(A) alone, whatever M and the other rows
// (generation, where a sequence's logits must not depend on the batch). B is
// packed again per block; linear_forward instead computes each element as
// one dot product in column order (as the quantized linears do), which
// needs no blocks and no packed copy of the weights.
enum class RowBlocking { by_shape, fixed };
inline constexpr int64_t kFixedRowBlock = 8;

// C[M,N] = alpha * op(A)[M,K] * op(B)[K,N] + beta * C, row-major, through CBLAS.
// BLAS runs single-threaded on tiles of C fixed by the shape, the tiles in
// parallel under the caller's budget: BLAS's own threading rounds differently
// for different thread counts. Inside a parallel region it runs on the caller.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
          const float* B, int64_t ldb, float beta, float* C, int64_t ldc, RowBlocking rows = RowBlocking::by_shape);

// This machine's cblas_sgemm GFLOP/s with the calling thread's budget on an
// n x n x n product (best of `reps` after a warm-up): the baseline that MFU
// and the benchmarks' ratios are quoted against.
double measure_sgemm_gflops(int64_t n = 2048, int reps = 5);

// ---------------------------------------------------------------------------
// Linear: out[N,OC] = inp[N,C] @ weight[OC,C]^T + bias[OC] (PyTorch layout).
// bias may be null. backward: dinp (+)= dout @ weight as dinp_write says,
// dweight += dout^T @ inp, dbias += column sums of dout, each skipped when its
// pointer is null.
// ---------------------------------------------------------------------------

void linear_forward(float* out, const float* inp, const float* weight, const float* bias, int64_t N, int64_t C,
                    int64_t OC, RowBlocking rows = RowBlocking::by_shape);
void linear_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int64_t N, int64_t C, int64_t OC,
                     GradWrite dinp_write = GradWrite::accumulate);
// out[i, :] += bias for each of N rows (a row-parallel layer's bias, added
// after its partial products are summed).
void add_bias(float* out, const float* bias, int64_t N, int64_t OC);

// ---------------------------------------------------------------------------
// Weight-only quantized linear (inference): out[N, :OC] (rows ldo apart) =
// inp[N,C] @ W^T + bias[OC], W [OC,C] dequantized in registers, each output
// a dot product in a fixed order: a row of out depends on its own input row
// alone, whatever N and the thread count (no RowBlocking needed).
// Formats (what quantize_int8/int4 of quant.h write):
// - int8: w[o,c] = scale[o] * q[o,c], q int8 in [-127, 127].
// - int4: `group` input columns share a scale and a zero point (group a
//   power of two, at least kInt4Block, dividing C): w[o,c] = scale[o,g] * (q[o,c] -
//   zero[o,g]) with g = c / group, q and zero in [0, 15]. Row o packs q in
//   C/2 bytes: in each block of kInt4Block columns from column b, byte
//   b/2 + j holds column b + j in its low nibble and column b + 16 + j in its
//   high nibble, so one 16-byte load gives 32 consecutive columns.
// Dequantization computes (float)(q - zero) * scale, so dequantize_* and the
// linear kernels see bit-identical weights.
// ---------------------------------------------------------------------------

inline constexpr int64_t kInt4Block = 32;

void linear_forward_int8(float* out, int64_t ldo, const float* inp, const int8_t* w, const float* scale,
                         const float* bias, int64_t N, int64_t C, int64_t OC);
void linear_forward_int4(float* out, int64_t ldo, const float* inp, const uint8_t* w, const float* scale,
                         const uint8_t* zero, const float* bias, int64_t N, int64_t C, int64_t OC, int64_t group);
// out[OC,C] = W dequantized.
void dequantize_int8(float* out, const int8_t* w, const float* scale, int64_t OC, int64_t C);
void dequantize_int4(float* out, const uint8_t* w, const float* scale, const uint8_t* zero, int64_t OC, int64_t C,
                     int64_t group);
// out[i, :] = row tokens[i] of W dequantized, for i < N: the lookup of a
// quantized token table (ids already validated).
void embedding_lookup_int8(float* out, const int32_t* tokens, const int8_t* w, const float* scale, int64_t N,
                           int64_t C);
void embedding_lookup_int4(float* out, const int32_t* tokens, const uint8_t* w, const float* scale,
                           const uint8_t* zero, int64_t N, int64_t C, int64_t group);

// ---------------------------------------------------------------------------
// W8A8 linear (inference, SmoothQuant): int8 weights as linear_forward_int8's
// and int8 activations quantized per token on the fly. Each input row is
// first divided by the weight's smoothing factors (x'[c] = x[c] *
// inv_smooth[c], fp32; inv_smooth null: no smoothing), then quantized:
// xscale = max|x'| / 127, qx[c] = round(x'[c] / xscale) to nearest even in
// fp32 (an all-zero row: xscale 0, qx 0). Then
//   out[t, o] = float(sum_c qx[t,c] * q[o,c]) * xscale[t] * scale[o] + bias[o]
// with the sum an exact int32 (C at most kW8A8MaxColumns). The integer GEMM
// runs in oneDNN (s8 x s8 -> s32, where the build has it and the CPU sums
// int8 products without saturating: VNNI) or in loom's own AVX2 kernel
// (int8 widened to int16, vpmaddwd); both compute the same integers, so the
// output is bit-identical whatever the path, N, a row's neighbours or the
// thread count. `fastest` takes the own kernel for one row (decode: about
// 1.5x faster than oneDNN there) and oneDNN from 2 rows on products of at
// least 2M multiply-adds (prefill: 2.5-4x faster at 32-512 rows), as
// bench/compression_bench measures.
// ---------------------------------------------------------------------------

enum class Int8Gemm : uint8_t { fastest, onednn, own };
inline constexpr int64_t kW8A8MaxColumns = (int64_t{1} << 31) / (127 * 127);
// Whether Int8Gemm::onednn runs oneDNN (else it runs the own kernel).
bool onednn_int8_gemm_available();
// The activation quantization alone: q [N, C] and xscale [N].
void quantize_activations_int8(int8_t* q, float* xscale, const float* inp, const float* inv_smooth, int64_t N,
                               int64_t C);
void linear_forward_w8a8(float* out, int64_t ldo, const float* inp, const float* inv_smooth, const int8_t* w,
                         const float* scale, const float* bias, int64_t N, int64_t C, int64_t OC,
                         Int8Gemm gemm = Int8Gemm::fastest);

// ---------------------------------------------------------------------------
// Embedding: out[b,t,:] = wte[tokens[b,t],:] + wpe[pos0 + t,:].
// Token ids must already be validated to lie in [0, V).
// backward: dwte[token] += dout, dwpe[pos0 + t] += dout (either may be null).
// ---------------------------------------------------------------------------

void embedding_forward(float* out, const int32_t* tokens, const float* wte, const float* wpe, int64_t B, int64_t T,
                       int64_t C, int64_t pos0);
void embedding_backward(float* dwte, float* dwpe, const float* dout, const int32_t* tokens, int64_t B, int64_t T,
                        int64_t C, int64_t pos0);

// The vocabulary-parallel pieces. A rank holds token rows [first, first + rows)
// of the table. lookup: out[i] = wte[tokens[i] - first] for tokens in range,
// zero otherwise; its backward adds dout[i] into those rows (in row order per
// element, as embedding_backward). position: out[i] += wpe[pos0 + (row0 + i) % T]
// for the N rows starting at row row0 of the micro-batch; its backward adds
// them into dwpe.
void embedding_lookup_range(float* out, const int32_t* tokens, const float* wte, int64_t first, int64_t rows,
                            int64_t N, int64_t C);
void embedding_lookup_range_backward(float* dwte, const float* dout, const int32_t* tokens, int64_t first,
                                     int64_t rows, int64_t N, int64_t C);
void position_embedding_add(float* out, const float* wpe, int64_t row0, int64_t N, int64_t T, int64_t C,
                            int64_t pos0);
// A null dwte or dwpe (a frozen table) is skipped.
void position_embedding_backward(float* dwpe, const float* dout, int64_t row0, int64_t N, int64_t T, int64_t C);

// ---------------------------------------------------------------------------
// LayerNorm over the last dimension, eps = 1e-5 (as PyTorch's default).
// forward saves mean[N] and rstd[N] for backward; backward writes dinp as
// dinp_write says and accumulates dweight and dbias (each skipped when null:
// a frozen parameter's gradient).
// ---------------------------------------------------------------------------

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight, const float* bias,
                       int64_t N, int64_t C);
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int64_t N, int64_t C,
                        GradWrite dinp_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// RMSNorm over the last dimension (LLaMA): out = x * rstd * weight with
// rstd = 1 / sqrt(mean(x^2) + eps), in that order as Hugging Face's
// LlamaRMSNorm (no mean subtraction, no bias). forward saves rstd[N];
// backward writes dinp as dinp_write says and accumulates dweight (summed
// over fixed row chunks in chunk order, as layernorm's).
// ---------------------------------------------------------------------------

void rmsnorm_forward(float* out, float* rstd, const float* inp, const float* weight, int64_t N, int64_t C, float eps);
void rmsnorm_backward(float* dinp, float* dweight, const float* dout, const float* inp, const float* weight,
                      const float* rstd, int64_t N, int64_t C, GradWrite dinp_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// LayerNorm and RMSNorm over a hidden dimension split across ranks (a 2D or
// 2.5D tensor-parallel grid): each rank holds C columns of rows C_total wide,
// and the caller all-reduces each row's partial sums over the ranks between
// the steps. Forward, LayerNorm:
//   norm_row_sums(s, x)                  -> all-reduce -> scale(s, 1/C_total): the mean
//   norm_row_square_sums(q, x, mean)     -> all-reduce -> norm_rstd(rstd, q)
//   norm_apply(out, x, mean, rstd, w, b)
// RMSNorm: the same without the mean (null) and the bias. Backward:
//   norm_backward_sums(s, dout, x, w, mean, rstd) -> all-reduce
//   norm_backward_apply(dinp, dw, db, dout, x, w, mean, rstd, s)
// which is layernorm_backward's (rmsnorm_backward's) arithmetic with the row
// sums over the whole width; dweight and dbias (null: skipped) are summed
// over row chunks as theirs are.
// ---------------------------------------------------------------------------

// sums[i] = sum_c x[i, c].
void norm_row_sums(float* sums, const float* x, int64_t N, int64_t C);
// sums[i] = sum_c (x[i, c] - center[i])^2 (center null: 0).
void norm_row_square_sums(float* sums, const float* x, const float* center, int64_t N, int64_t C);
// rstd[i] = 1 / sqrt(square_sums[i] / C_total + eps); may be in place.
void norm_rstd(float* rstd, const float* square_sums, int64_t N, int64_t C_total, float eps);
// out = (x - mean) * rstd * weight + bias (mean and bias null: x * rstd * weight).
void norm_apply(float* out, const float* x, const float* mean, const float* rstd, const float* weight,
                const float* bias, int64_t N, int64_t C);
// sums [N, 2]: sum_c h and sum_c h * xhat, with h = dout * weight and
// xhat = (x - mean) * rstd.
void norm_backward_sums(float* sums, const float* dout, const float* x, const float* weight, const float* mean,
                        const float* rstd, int64_t N, int64_t C);
// dinp = rstd (h - mean(h) - xhat mean(h xhat)) with the means over C_total
// (RMSNorm, mean null: no mean(h) term).
void norm_backward_apply(float* dinp, float* dweight, float* dbias, const float* dout, const float* x,
                         const float* weight, const float* mean, const float* rstd, const float* sums, int64_t N,
                         int64_t C, int64_t C_total, GradWrite dinp_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// Rotary position embedding, rotate-half form (Hugging Face LLaMA, GPT-NeoX).
// With half = head_dim / 2 (head_dim even) and, for i < half,
// angle = inv_freq[i] * position:
//   out[i]        = x[i] cos - x[i + half] sin
//   out[i + half] = x[i + half] cos + x[i] sin.
// ---------------------------------------------------------------------------

enum class RopeScalingType { none, linear, llama3 };

// rope_scaling of a Hugging Face config. linear: inverse frequencies divided
// by factor (as transformers does it; positions divided by factor in exact
// arithmetic). llama3 (Llama 3.1): wavelengths
// longer than original_max_position_embeddings / low_freq_factor divided by
// factor, shorter than original_max_position_embeddings / high_freq_factor
// kept, smoothly interpolated between.
struct RopeScaling {
  RopeScalingType type = RopeScalingType::none;
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  int64_t original_max_position_embeddings = 8192;
  bool operator==(const RopeScaling&) const = default;
};

// inv_freq[head_dim / 2] for base theta, computed as transformers'
// _compute_default_rope_parameters (+ _linear_scaling_ / _llama3_) does in
// float32 tensors: every step rounded to float32, in its order, so the table
// matches Hugging Face's to the last bit or so (pow may differ by an ulp).
// Host code (a table of head_dim / 2 floats), not a device kernel.
void rope_inv_freq(float* inv_freq, int64_t head_dim, double theta, const RopeScaling& scaling = {});

// cos[T, half] and sin[T, half] for positions pos0 .. pos0 + T - 1, as
// LlamaRotaryEmbedding forms them: angle = inv_freq * float(position) rounded
// to float32, then its cosine and sine.
void rope_tables(float* cos, float* sin, const float* inv_freq, int64_t T, int64_t half, int64_t pos0);

// Rotates x[B, T, n_heads, head_dim] whose tokens lie `stride` floats apart
// (n_heads * head_dim when contiguous; q or k inside a packed qkv row, see
// attention) by the tables of rope_tables for those T positions. out has the
// same layout and may be inp (in place, the usual use on qkv). backward is the
// inverse rotation (sin -> -sin) of dout into dinp, written as dinp_write
// says; in place (dinp == dout) it must overwrite.
void rope_forward(float* out, const float* inp, const float* cos, const float* sin, int64_t B, int64_t T,
                  int64_t n_heads, int64_t head_dim, int64_t stride);
void rope_backward(float* dinp, const float* dout, const float* cos, const float* sin, int64_t B, int64_t T,
                   int64_t n_heads, int64_t head_dim, int64_t stride, GradWrite dinp_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// SwiGLU's elementwise part (LLaMA MLP): h = silu(g) * u, silu(g) = g
// sigmoid(g), over N rows of I elements. g and u are read with leading
// dimension ld: a fused gate|up GEMM output [N, 2I] passes g = gu, u = gu + I,
// ld = 2I (gate first, then up); separate [N, I] buffers pass ld = I. dg and
// du are written with the same ld (so the fused gradient [N, 2I] feeds one
// backward GEMM), as dgu_write says.
// ---------------------------------------------------------------------------

void swiglu_forward(float* h, const float* g, const float* u, int64_t N, int64_t I, int64_t ld);
void swiglu_backward(float* dg, float* du, const float* dh, const float* g, const float* u, int64_t N, int64_t I,
                     int64_t ld, GradWrite dgu_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// GELU, tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
// ---------------------------------------------------------------------------

void gelu_forward(float* out, const float* inp, int64_t n);
void gelu_backward(float* dinp, const float* inp, const float* dout, int64_t n,
                   GradWrite dinp_write = GradWrite::accumulate);

// out = a + b (out may alias a or b). Backward of a residual is `accumulate`.
void add(float* out, const float* a, const float* b, int64_t n);
// y += x
void accumulate(float* y, const float* x, int64_t n);
// x *= s
void scale(float* x, int64_t n, float s);
// dst = src over `bytes`, split across the threads: one thread does not
// saturate memory bandwidth, and moving chunks between tiers is the CPU's
// stand-in for a DMA copy.
void copy_bytes(void* dst, const void* src, std::size_t bytes);
// Sum of squares in double, in a fixed order (for gradient-norm clipping).
double sum_squares(const float* x, int64_t n);

// Buffers in a working precision dt (f32, bf16 or f16), computed in fp32:
// dst = round(dst + src), one rounding to dt per call (a micro-batch's fp32
// gradient added into a working-precision accumulator); the same with src in
// dt too; the number of elements that are not finite; the sum of squares in
// double.
void add_rounded(void* dst, DType dt, const float* src, int64_t n);
void add_rounded(void* dst, const void* src, DType dt, int64_t n);
int64_t count_non_finite(const void* x, DType dt, int64_t n);
double sum_squares(const void* x, DType dt, int64_t n);

// ---------------------------------------------------------------------------
// Causal self-attention, flash-attention style, with grouped-query attention.
// NH query heads and NKV key/value heads of hs = C/NH each (NH % NKV == 0;
// NKV == NH is multi-head attention, NKV == 1 multi-query): query head h
// attends with kv head h / (NH / NKV). qkv[B, T, C + 2 NKV hs] holds
// q (C) | k (NKV hs) | v (NKV hs) per token (GPT-2's c_attn emits this with
// NKV == NH); head h uses columns [h*hs, (h+1)*hs) of its part; scale
// 1/sqrt(hs). forward writes out[B,T,C] (heads concatenated) and lse[B,NH,T],
// the log-sum-exp of each query row's scaled scores. No B*NH*T*T matrix is
// kept: backward recomputes the scores tile by tile from qkv and lse, so saved
// activation memory is linear in T. backward writes dqkv (qkv's layout) as
// dqkv_write says; a kv head's dk and dv sum over its query heads in head order.
// ---------------------------------------------------------------------------

void attention_forward(float* out, float* lse, const float* qkv, int64_t B, int64_t T, int64_t C, int64_t NH,
                       int64_t NKV);
void attention_backward(float* dqkv, const float* dout, const float* out, const float* lse, const float* qkv,
                        int64_t B, int64_t T, int64_t C, int64_t NH, int64_t NKV,
                        GradWrite dqkv_write = GradWrite::accumulate);
// Generation: the new positions of S sequences against their KV caches, the
// sequences' rows packed into one batch. Sequence s owns rows
// [row_offsets[s], row_offsets[s + 1]) of qkv (the layout above, N =
// row_offsets[S] rows, also passed for the launch) and of out [N, C]; its cache holds cache_lens[s]
// earlier positions, and k_cache[s], v_cache[s] point to its keys and values
// [NKV, max_len, hs] (one layer's; cache_lens[s] + its rows <= max_len). The
// new rows' keys and values are written at positions cache_lens[s].., then
// row i of sequence s (position cache_lens[s] + i) attends to positions
// [0, cache_lens[s] + i] with the heads, scale and grouping of
// attention_forward, which a whole sequence's rows over an empty cache
// reproduce. lse [N, NH] (may be null): each row's log-sum-exp as there.
// Every array is device memory; a sequence's result does not depend on the
// other sequences of the batch.
void attention_decode(float* out, float* lse, float* const* k_cache, float* const* v_cache, const float* qkv,
                      const int32_t* cache_lens, const int32_t* row_offsets, int64_t S, int64_t N, int64_t C,
                      int64_t NH, int64_t NKV, int64_t max_len);

// ---------------------------------------------------------------------------
// Fused softmax + cross-entropy over V classes.
// forward: losses[i] = lse_i - logits[i, targets[i]], and saves lse[N]; a target
// of -1 is ignored (loss 0, gradient 0). Returns nothing: callers reduce losses.
// backward: dlogits[i,:] = dloss[i] * (softmax(logits[i,:]) - onehot(targets[i]))
// written (not accumulated: the logits are consumed here), and dlogits may alias
// logits, so the largest activation of the model is reused in place.
// ---------------------------------------------------------------------------

void cross_entropy_forward(float* losses, float* lse, const float* logits, const int32_t* targets, int64_t N,
                           int64_t V);
void cross_entropy_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                            const float* dloss, int64_t N, int64_t V);
// forward and backward in one pass over the rows, for a training step whose
// dloss is known before the forward: writes losses and lse as forward does
// and the gradient over the logits (read first) as backward does, the same bits.
void cross_entropy_forward_backward(float* losses, float* lse, float* logits, const int32_t* targets,
                                    const float* dloss, int64_t N, int64_t V);
// *sum += x[0] + x[1] + ... + x[n-1], added in double in this order, so a
// loss sum does not depend on the thread count and keeps its digits over
// many micro-batches.
void add_sum_f64(double* sum, const float* x, int64_t n);

// Vocabulary-parallel cross-entropy (Megatron): a rank holds columns
// [first, first + V) of the logits, of which the first `real` are classes (the
// rest padding, ignored). Around two all-reduces over the ranks:
//   shard_max:  row_max[i] = max over this rank's classes   -> all-reduce max
//   shard_sums: sums[2i] = sum exp(logit - row_max[i]),
//               sums[2i+1] = the target's logit if it is here, else 0
//                                                            -> all-reduce sum
//   lse = row_max + log(sums[2i]); loss = lse - sums[2i+1].
// shard_backward writes dlogits = dloss * (softmax - onehot) over this rank's
// columns (zero for padding and for rows without a target); dlogits may alias
// logits.
void cross_entropy_shard_max(float* row_max, const float* logits, int64_t N, int64_t V, int64_t real);
void cross_entropy_shard_sums(float* sums, const float* logits, const float* row_max, const int32_t* targets,
                              int64_t first, int64_t N, int64_t V, int64_t real);
void cross_entropy_shard_backward(float* dlogits, const float* logits, const float* lse, const int32_t* targets,
                                  const float* dloss, int64_t first, int64_t N, int64_t V, int64_t real);
// After the two all-reduces: lse[i] = row_max[i] + log(sums[2i]) and
// losses[i] = lse[i] - sums[2i+1] (0 for a target of -1).
void cross_entropy_shard_loss(float* losses, float* lse, const float* row_max, const float* sums,
                              const int32_t* targets, int64_t N);

// ---------------------------------------------------------------------------
// Knowledge distillation (Hinton et al.): a student's logits x against a
// teacher's z over V classes, at temperature T with weight alpha. Per row i
// with a target (a target of -1 gives 0 everywhere, as cross-entropy does):
//   kl[i]     = KL(softmax(z_i / T) || softmax(x_i / T))
//   ce[i]     = lse(x_i) - x_i[target]
//   losses[i] = alpha * T^2 * kl[i] + (1 - alpha) * ce[i]
// stats[3i..3i+2] = lse(x_i), lse(x_i / T), lse(z_i / T): what backward
// needs. Every log-softmax subtracts its row's max first; the KL is
//   sum_j p_j (z_j - x_j) / T - lse(z/T) + lse(x/T),  p = softmax(z / T),
// so the vocabulary-parallel form needs only sums over the columns.
// backward writes (not accumulates; dlogits may alias logits)
//   dlogits = dloss_i * (alpha T (softmax(x/T) - p) + (1 - alpha)(softmax(x) - onehot)).
// ---------------------------------------------------------------------------

struct Distillation {
  float temperature = 1.0f;  // > 0
  float alpha = 0.5f;        // weight of the KL term, in [0, 1]
};

void distill_forward(float* losses, float* kl, float* ce, float* stats, const float* logits, const float* teacher,
                     const int32_t* targets, Distillation d, int64_t N, int64_t V);
void distill_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                      const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V);
// Both in one pass over the rows, the same bits as the two calls.
void distill_forward_backward(float* losses, float* kl, float* ce, float* stats, float* logits, const float* teacher,
                              const int32_t* targets, const float* dloss, Distillation d, int64_t N, int64_t V);

// Vocabulary-parallel distillation, columns [first, first + V) of both
// logits of which the first `real` are classes, around two all-reduces:
//   shard_max:  row_max[2i] = max of x, row_max[2i+1] = max of z  -> all-reduce max
//   shard_sums: sums[5i..5i+4] = sum exp(x - mx), sum exp((x - mx) / T),
//               sum exp((z - mz) / T), sum exp((z - mz) / T) (z - x), and the
//               target's logit if it is here, else 0                -> all-reduce sum
//   shard_loss: losses, kl, ce and stats from them.
// shard_backward writes this rank's columns of the gradient (zero for padding).
void distill_shard_max(float* row_max, const float* logits, const float* teacher, int64_t N, int64_t V, int64_t real);
void distill_shard_sums(float* sums, const float* logits, const float* teacher, const float* row_max,
                        const int32_t* targets, Distillation d, int64_t first, int64_t N, int64_t V, int64_t real);
void distill_shard_loss(float* losses, float* kl, float* ce, float* stats, const float* row_max, const float* sums,
                        const int32_t* targets, Distillation d, int64_t N);
void distill_shard_backward(float* dlogits, const float* logits, const float* teacher, const float* stats,
                            const int32_t* targets, const float* dloss, Distillation d, int64_t first, int64_t N,
                            int64_t V, int64_t real);

// ---------------------------------------------------------------------------
// Dropout with counter-based masks over a [rows, cols] block (contiguous)
// of a larger tensor whose rows are `stride` elements apart (stride == cols:
// a contiguous range; rows 1: n = cols elements): element (i, j) is kept iff
// philox_uniform(key, first + i * stride + j) >= p, kept values scaled by
// 1/(1-p). The mask is a function of (key, global index) alone, so backward
// regenerates it and any layout draws the same mask, also one that splits a
// tensor by columns (a row-parallel layer's input).
// ---------------------------------------------------------------------------

void dropout_forward(float* out, const float* inp, int64_t rows, int64_t cols, int64_t stride, float p,
                     uint64_t key, uint64_t first);
// backward writes dinp as dinp_write says (dropped elements: 0 or unchanged).
void dropout_backward(float* dinp, const float* dout, int64_t rows, int64_t cols, int64_t stride, float p,
                      uint64_t key, uint64_t first, GradWrite dinp_write = GradWrite::accumulate);

// ---------------------------------------------------------------------------
// AdamW (decoupled weight decay, Loshchilov & Hutter), PyTorch semantics:
//   p *= 1 - lr * wd;  m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2;
//   p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)
// with g = grad * grad_scale (unscaling and clipping folded in). The bias
// corrections bc1 = 1 - b1^t, bc2 = 1 - b2^t are computed once per step.
// ---------------------------------------------------------------------------

struct AdamWStep {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float bias_correction1 = 1.0f;  // 1 - beta1^t
  float bias_correction2 = 1.0f;  // 1 - beta2^t
  float grad_scale = 1.0f;
  // An element whose parameter is exactly zero keeps it and its moments (a
  // pruned matrix's masks, AdamWConfig::keep_zeros).
  bool keep_zeros = false;

  // Fills the bias corrections for step t (1-based).
  static AdamWStep at(int64_t t, float lr, float beta1, float beta2, float eps, float weight_decay);
};

void adamw_update(float* param, const float* grad, float* m, float* v, int64_t n, const AdamWStep& s);

}  // namespace loom::cpu
