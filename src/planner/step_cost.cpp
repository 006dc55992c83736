#include <cmath>

#include "loom/planner.h"

namespace loom {

double layer_matmul_weights(const GPTConfig& cfg) {
  const double h = static_cast<double>(cfg.n_embd), I = static_cast<double>(cfg.intermediate());
  const double q = static_cast<double>(cfg.q_dim()), kv = static_cast<double>(cfg.kv_heads() * cfg.head_dim());
  return 2.0 * h * q + 2.0 * h * kv + (cfg.mlp == MlpKind::swiglu ? 3.0 : 2.0) * h * I;
}

namespace {
// Per token, a weight costs 2 FLOPs in forward, 2 in its input's gradient and
// 2 in its own gradient, which a frozen weight (LoRA's base) skips.
double weight_passes(const GPTConfig& cfg) { return cfg.lora.enabled() ? 4.0 : 6.0; }
}  // namespace

double block_training_flops(const GPTConfig& cfg, int64_t seq_len) {
  const double s = static_cast<double>(seq_len), q = static_cast<double>(cfg.q_dim());
  // The adapters' own weights train.
  const double adapters = static_cast<double>(cfg.num_adapter_params()) / static_cast<double>(cfg.n_layer);
  return s * (weight_passes(cfg) * layer_matmul_weights(cfg) + 12.0 * s * q + 6.0 * adapters);
}

double head_training_flops(const GPTConfig& cfg, int64_t seq_len) {
  return weight_passes(cfg) * static_cast<double>(seq_len) * static_cast<double>(cfg.n_embd) *
         static_cast<double>(cfg.vocab_size);
}

double training_flops_per_step(const GPTConfig& cfg, int64_t B, int64_t T) {
  return static_cast<double>(B) *
         (static_cast<double>(cfg.n_layer) * block_training_flops(cfg, T) + head_training_flops(cfg, T));
}

double activation_bytes_per_layer(const GPTConfig& cfg, int64_t B, int64_t T, int tp, bool sequence_parallel,
                                  bool checkpoint_activations) {
  const double N = static_cast<double>(B * T), h = static_cast<double>(cfg.n_embd);
  const double a = static_cast<double>(cfg.n_head), t = static_cast<double>(tp);
  const double I = static_cast<double>(cfg.intermediate()), hs = static_cast<double>(cfg.head_dim());
  const double q = static_cast<double>(cfg.q_dim());
  // Token rows outside the tensor-parallel regions.
  const double rows = sequence_parallel && tp > 1 ? N / t : N;
  if (checkpoint_activations) return 4.0 * rows * h;
  // Outside the regions: x, ln_1 out, r, ln_2 out (4 h per row) and the two
  // norms' statistics (LayerNorm: mean and rstd, RMSNorm: rstd). Inside,
  // every token of this rank's heads and MLP columns: q | k | v (k and v of
  // its kv heads: split, or the one it shares), attention out (q each, q =
  // n_head * head_dim), the MLP's input projection (I, SwiGLU's gate | up 2I)
  // and activation (I), and attention's log-sum-exp (a / t). GPT-2: 12 h / t
  // + a / t.
  const double stats = cfg.norm == NormKind::layernorm ? 4.0 : 2.0;
  const double kv = cfg.kv_heads() % tp == 0 ? static_cast<double>(cfg.kv_heads()) * hs / t : hs;
  const double fc = cfg.mlp == MlpKind::swiglu ? 2.0 * I : I;
  return 4.0 * (rows * (4.0 * h + stats) + N * ((2.0 * q + fc + I + a) / t + 2.0 * kv));
}

double grid_activation_bytes_per_layer(const GPTConfig& cfg, int64_t B, int64_t T, const TensorGridShape& grid,
                                       bool checkpoint_activations) {
  LOOM_CHECK(grid.q >= 2, "a grid of side ", grid.q);
  const double q = grid.q, rows = static_cast<double>(B * T) / (q * grid.depth);
  const double h = static_cast<double>(cfg.n_embd), a = static_cast<double>(cfg.n_head);
  if (checkpoint_activations) return 4.0 * rows * h / q;
  // As activation_bytes_per_layer's, every width a q-th: x, ln_1 out, r,
  // ln_2 out; q | k | v, attention out, the MLP's input projection and
  // activation, the log-sum-exp of the rank's heads; and each norm's
  // statistics of the rank's rows, whole.
  const double I = static_cast<double>(cfg.intermediate()), qd = static_cast<double>(cfg.q_dim());
  const double kv = static_cast<double>(cfg.kv_heads() * cfg.head_dim());
  const double stats = cfg.norm == NormKind::layernorm ? 4.0 : 2.0;
  const double fc = cfg.mlp == MlpKind::swiglu ? 2.0 * I : I;
  return 4.0 * rows * ((4.0 * h + 2.0 * qd + 2.0 * kv + fc + I + a) / q + stats);
}

double tensor_parallel_param_elements(const GPTConfig& cfg, int tp, const TensorGridShape& grid) {
  const double h = static_cast<double>(cfg.n_embd), Q = static_cast<double>(cfg.q_dim());
  const double KV = static_cast<double>(cfg.kv_heads() * cfg.head_dim()), I = static_cast<double>(cfg.intermediate());
  const double fc = cfg.mlp == MlpKind::swiglu ? 2.0 * I : I, V = static_cast<double>(cfg.vocab_size);
  const double L = static_cast<double>(cfg.n_layer), tables = cfg.tied_embeddings ? 1.0 : 2.0;
  const double norm = (cfg.norm == NormKind::layernorm ? 2.0 : 1.0) * h;  // one Norm's weight (and bias)
  const double positions = cfg.positions == PositionKind::learned ? static_cast<double>(cfg.block_size) * h : 0.0;
  const double entering_bias = (cfg.attention_bias ? Q + 2.0 * KV : 0.0) + (cfg.mlp_bias ? fc : 0.0);
  const double leaving_bias = (cfg.attention_bias ? h : 0.0) + (cfg.mlp_bias ? h : 0.0);
  const auto ceil_div = [](double a, double b) { return std::ceil(a / b); };
  if (grid.ranks() > 1) {
    // Matrices over q^2 (SUMMA) or q^3 (a cube) ranks, vectors over q.
    const double q = grid.q, matrix_parts = grid.cube ? q * q * q : q * q;
    double matrices = 0.0;
    for (const MatrixShape& m : cfg.block_matmuls()) matrices += static_cast<double>(m.out * m.in);
    const double table = ceil_div(V, grid.cube ? q * q : q) * h / q;
    return L * (matrices / matrix_parts + (2.0 * norm + entering_bias + leaving_bias) / q) +
           tables * table + (norm + positions) / q;
  }
  // 1D: k and v (and their biases) whole on every rank when the kv heads do
  // not split over the ranks.
  const double t = tp;
  const bool kv_split = cfg.kv_heads() % tp == 0;
  const double kv = kv_split ? 2.0 * KV / t : 2.0 * KV;
  const double matrices = (Q / t + kv) * h + h * Q / t + fc * h / t + h * I / t;
  const double column_bias = (cfg.attention_bias ? Q / t + kv : 0.0) + (cfg.mlp_bias ? fc / t : 0.0);
  return L * (matrices + 2.0 * norm + column_bias + leaving_bias) + tables * ceil_div(V, t) * h + norm + positions;
}

double grid_linear_elements_sent(int64_t out, int64_t in, int64_t N, const TensorGridShape& grid) {
  LOOM_CHECK(grid.q >= 2, "a grid of side ", grid.q);
  const double q = grid.q, o = static_cast<double>(out), i = static_cast<double>(in);
  const double n = static_cast<double>(N) / (q * grid.depth);
  if (grid.cube)
    // Forward: x and W gathered, the partial output scattered; backward: dy,
    // W and x gathered, dx and dW scattered.
    return 3.0 * (q - 1.0) * o * i / (q * q * q) + (q - 1.0) * n * (3.0 * i + 2.0 * o) / q;
  // Forward: the panels gathered, the partial outputs scattered; backward:
  // dy and the panels gathered, dW scattered.
  return 3.0 * (q - 1.0) * o * i / (q * q) + 2.0 * (q - 1.0) * n * o / q;
}

double grid_step_elements_sent(const GPTConfig& cfg, int64_t B, int64_t T, int64_t micro_batches,
                               const TensorGridShape& grid) {
  LOOM_CHECK(grid.q >= 2, "a grid of side ", grid.q);
  const int64_t q = grid.q, N = B * T, C = cfg.n_embd, I = cfg.intermediate(), V = cfg.vocab_size;
  const int64_t KV = cfg.kv_heads() * cfg.head_dim(), Q = cfg.q_dim(), fc = cfg.mlp == MlpKind::swiglu ? 2 * I : I;
  const double n = static_cast<double>(N) / (q * grid.depth), Cq = static_cast<double>(C / q);
  // An all-reduce of `count` over g ranks sends 2 (g - 1) / g of it.
  const auto all_reduce = [](double count, int64_t g) { return 2.0 * (g - 1.0) / static_cast<double>(g) * count; };
  const double statistics = cfg.norm == NormKind::layernorm ? 2.0 : 1.0;
  const double norm = statistics * all_reduce(n, q) + all_reduce(2.0 * n, q);
  double block = 2.0 * norm;
  for (const MatrixShape& m : cfg.block_matmuls()) block += grid_linear_elements_sent(m.out, m.in, N, grid);
  const int64_t table_group = grid.cube ? q * q : q, vocab_parts = grid.cube ? q * q : q;
  const int64_t padded_vocab = (V + vocab_parts - 1) / vocab_parts * vocab_parts;
  const double embedding = 2.0 * static_cast<double>(table_group - 1) * n * Cq;
  const double head = norm + grid_linear_elements_sent(padded_vocab, C, N, grid) + all_reduce(3.0 * n, q);
  const double L = static_cast<double>(cfg.n_layer);
  double step = static_cast<double>(micro_batches) * (L * block + embedding + head);

  // The partial gradients, one all-reduce per set of axes. Over the token
  // axes between blocks (q depth ranks): every norm, the positions, the
  // leaving layers' biases and, on 2D/2.5D, the entering layers' too.
  const double norm_params = statistics * Cq;
  const double entering_bias = static_cast<double>(((cfg.attention_bias ? Q + 2 * KV : 0) + (cfg.mlp_bias ? fc : 0)) / q);
  const double leaving_bias = static_cast<double>(((cfg.attention_bias ? C : 0) + (cfg.mlp_bias ? C : 0)) / q);
  const double positions = cfg.positions == PositionKind::learned ? static_cast<double>(cfg.block_size) * Cq : 0.0;
  const int64_t token_ranks = q * grid.depth;
  step += all_reduce(L * (2.0 * norm_params + leaving_bias + (grid.cube ? 0.0 : entering_bias)) + norm_params +
                         positions,
                     token_ranks);
  // A cube's entering biases over the (layer, column) pairs inside a block.
  if (grid.cube && entering_bias > 0.0) step += all_reduce(L * entering_bias, q * q);
  // 2.5D's copies of every matrix and of the token table over the depth.
  if (!grid.cube && grid.depth > 1) {
    for (const MatrixShape& m : cfg.block_matmuls()) step += L * grid_weight_gradient_elements_sent(m.out, m.in, grid);
    const double table = static_cast<double>((V + q - 1) / q) * Cq * (cfg.tied_embeddings ? 1.0 : 2.0);
    step += all_reduce(table, grid.depth);
  }
  // The loss's sum (one f64 per loss term) over the inner token group.
  return step + all_reduce(1.0, token_ranks);
}

double grid_weight_gradient_elements_sent(int64_t out, int64_t in, const TensorGridShape& grid) {
  if (grid.cube || grid.depth == 1) return 0.0;
  const double q = grid.q, d = grid.depth;
  return 2.0 * (d - 1.0) / d * static_cast<double>(out) * static_cast<double>(in) / (q * q);
}

double zero_model_state_bytes(int stage, DType precision, double params, int ranks) {
  LOOM_CHECK(stage >= 0 && stage <= 3 && ranks >= 1, "ZeRO stage ", stage, " on ", ranks, " ranks");
  const double psi = params, n = ranks;
  const bool fp32 = precision == DType::f32;
  switch (stage) {
    case 0: return 16 * psi;
    case 1: return fp32 ? 8 * psi + 8 * psi / n : 4 * psi + 12 * psi / n;
    case 2: return fp32 ? 4 * psi + 12 * psi / n : 2 * psi + 16 * psi / n;
    default: return fp32 ? 16 * psi / n : 18 * psi / n;
  }
}

}  // namespace loom
