// loom nn: the GPT-2 model as explicit modules, each with a hand-written
// forward and backward (no general autograd).
//
// Modules hold shapes and parameter ids, never parameter memory: they read
// parameters from a ParamStore and accumulate gradients into a GradStore.
// What a forward keeps for its backward lives in a `Saved` struct owned by the
// caller, so several micro-batches can be in flight (pipeline schedules) and
// activation checkpointing is a matter of keeping less and recomputing.
#pragma once

#include <array>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"
#include "loom/parallel.h"
#include "loom/store.h"

namespace loom {

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

struct HFModelConfig;

// LoRA (Hu et al. 2021) adapters on linear layers, as PEFT adds them: a
// targeted layer computes y = x W^T + b + (alpha / r) drop(x) A^T B^T with A
// [r, in] drawn as PEFT's kaiming_uniform(a = sqrt(5)) (uniform within
// 1 / sqrt(in)) and B [out, r] zero, so training starts from the base model;
// W and b are frozen (ParamSpec::trainable), A and B train; a GPT with
// adapters freezes every other parameter too (PEFT's default). Parameter
// names are PEFT's relative to the module: "<module>.lora_A.weight". A layer
// of several stacked parameters (LLaMA's q | k | v) has one adapter per
// targeted parameter, as PEFT adapts q_proj, k_proj and v_proj separately.
struct LoRAConfig {
  int64_t r = 0;  // 0: no adapters
  float alpha = 8.0f;
  // PEFT's lora_dropout: in training, each adapter drops elements of its
  // own copy of the layer's input (inverted dropout, an independent mask per
  // adapter); the base layer sees the input whole. In [0, 1).
  float dropout = 0.0f;
  // Block modules a target matches by suffix, as PEFT's target_modules do
  // (GPT-2: "c_attn", "c_proj" (attention's and MLP's), "mlp.c_proj", "c_fc";
  // LLaMA: "q", "k", "v", "gate", "up", "c_proj"), or by the module's alias
  // (LLaMA's "o" and "down", its HF o_proj and down_proj).
  std::vector<std::string> targets;
  bool enabled() const { return r > 0; }
  bool operator==(const LoRAConfig&) const = default;
};

// A linear layer of every block: its name within the block ("attn.c_attn"),
// another name lora.targets may use for it (empty if none) and its global
// sizes.
struct BlockLinear {
  std::string name, alias;
  int64_t in = 0, out = 0;
};

// A weight matrix's shape: out rows of in columns.
struct MatrixShape {
  int64_t out = 0, in = 0;
};

// The variants a model is built from, chosen per model by its config (GPT-2:
// LayerNorm, learned positions, GELU MLP, biases, tied head; LLaMA: RMSNorm,
// RoPE, SwiGLU, no biases, grouped-query attention, often an untied head).
enum class NormKind : uint8_t { layernorm, rmsnorm };
enum class PositionKind : uint8_t { learned, rope };
enum class MlpKind : uint8_t { gelu, swiglu };

struct GPTConfig {
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 64;
  int64_t vocab_size = 256;
  int64_t block_size = 64;  // context length (learned positions: the table's rows)
  float dropout = 0.0f;

  NormKind norm = NormKind::layernorm;
  float norm_eps = 1e-5f;  // LayerNorm: only 1e-5 (the kernel's)
  PositionKind positions = PositionKind::learned;
  double rope_theta = 10000.0;
  cpu::RopeScaling rope_scaling{};
  MlpKind mlp = MlpKind::gelu;
  int64_t intermediate_size = 0;  // 0: 4 * n_embd
  int64_t n_kv_head = 0;          // 0: n_head (multi-head attention)
  // The width of one attention head. 0: n_embd / n_head. Set, attention's
  // widths follow the heads alone (q n_head * head_size, k and v
  // n_kv_head * head_size, the output projection's input n_head *
  // head_size), whatever n_embd: some HF models, and a model whose heads
  // were pruned.
  int64_t head_size = 0;
  // One c_attn parameter of q | k | v rows (GPT-2's checkpoints), or three
  // parameters q, k and v (LLaMA's): the same GEMM, other parameter names.
  bool packed_qkv = true;
  bool attention_bias = true;  // q/k/v (c_attn) and the output projection
  bool mlp_bias = true;
  bool tied_embeddings = true;  // the output head multiplies by wte; else its own lm_head
  LoRAConfig lora;

  int64_t head_dim() const { return head_size > 0 ? head_size : n_embd / n_head; }
  // The query projection's and attention output's width.
  int64_t q_dim() const { return n_head * head_dim(); }
  int64_t kv_heads() const { return n_kv_head > 0 ? n_kv_head : n_head; }
  // The kv heads each of tp tensor-parallel ranks holds: its share when they
  // split evenly, else one (the head its query heads share, k and v kept whole).
  int64_t local_kv_heads(int tp) const { return kv_heads() % tp == 0 ? kv_heads() / tp : 1; }
  int64_t intermediate() const { return intermediate_size > 0 ? intermediate_size : 4 * n_embd; }
  // Every block's linear layers, in the block's order.
  std::vector<BlockLinear> block_linears() const;
  // Those layers as the block multiplies them, parts that share an input
  // stacked: q|k|v, the attention output, fc (gate|up under SwiGLU) and the
  // MLP's output.
  std::array<MatrixShape, 4> block_matmuls() const;
  // The adapter the block's linear layer `name` ("attn.q") gets: `lora`
  // when a target names it, else none (r 0).
  LoRAConfig adapter(std::string_view name) const;

  // "tiny", "gpt2" (124M), "gpt2-medium", "gpt2-large", "gpt2-xl";
  // "llama-tiny" (tests), "llama3.2-1b", "llama2-7b", "llama3-8b",
  // "llama2-70b", "llama3-70b".
  static GPTConfig preset(std::string_view name);
  static std::vector<std::string> preset_names();
  // The model a Hugging Face config.json describes (a head_dim other than
  // hidden / heads is head_size). Throws Error for what loom's model cannot
  // express.
  static GPTConfig from_hf(const HFModelConfig& hf);

  // Throws Error naming the field, the constraint and the fix (lora.*: a
  // target that names no linear layer is listed with the valid names).
  void validate() const;
  int64_t num_params() const;  // adapters included
  // The LoRA adapters' parameters, the ones that train (0 without LoRA).
  int64_t num_adapter_params() const;
  // The parameters that train: the adapters with LoRA, else all of them.
  int64_t num_trainable_params() const { return lora.enabled() ? num_adapter_params() : num_params(); }
  bool operator==(const GPTConfig&) const = default;

 private:
  void validate_lora() const;
};

// RoPE scaling types as config files and manifests spell them ("none",
// "linear", "llama3"); an unknown name is an Error listing them.
const char* rope_scaling_name(cpu::RopeScalingType type);
cpu::RopeScalingType rope_scaling_from_name(std::string_view name);

// Per-micro-batch settings of a forward pass.
struct ForwardOptions {
  bool training = true;                 // dropout active (when config.dropout or lora.dropout > 0)
  bool checkpoint_activations = false;  // keep only block inputs; recompute in backward
  uint64_t dropout_key = 0;             // stream key of this step's dropout masks
  int64_t first_sequence = 0;           // global index of the micro-batch's first sequence
  // dObjective/dloss_i when it is known before the forward (training): the
  // loss then writes the logits' gradient in its forward pass, and backward
  // must be given the same value.
  std::optional<float> dloss;
  // A distillation loss's teacher: the teacher model's logits of the same
  // micro-batch over the same vocabulary slice as the student's ([N, local
  // vocab] on the device); undefined for cross-entropy. Freed after the
  // loss's backward.
  Tensor teacher_logits;
};

// Everything a forward pass needs to know about its micro-batch.
struct BatchShape {
  int64_t B = 0;
  int64_t T = 0;
  int64_t N() const { return B * T; }
};

// What a linear layer's adapters need of the micro-batch for their dropout
// (LoRAConfig::dropout). Each adapter draws its own mask from a stream of
// `key` and its lora_A parameter's name, indexed by the global element of the
// layer's input (global token row, global input column), so every parallel
// layout and activation checkpointing's recompute draw the same masks. The
// default draws none (evaluation, inference).
struct AdapterDropout {
  bool training = false;
  uint64_t key = 0;       // the block's stream: the step's dropout key and the layer
  int64_t first_row = 0;  // global token row of the layer input's first row
};

struct DecodeBatch;

// Gradient-carrying context for backward.
struct Grads {
  ParamStore& params;
  GradStore& grads;
};

// ---------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------

// One parameter pair (weight [out, in], optional bias [out]) of a Linear.
struct LinearPart {
  std::string name;  // the parameters are name.weight and name.bias
  int64_t out = 0;   // global output rows
  ParamParallel weight, bias;
  // The rows of this rank's piece the layer multiplies by (rows 0: all).
  int64_t first_row = 0, rows = 0;
  // With r > 0, the part carries an adapter and its weight and bias are
  // frozen.
  LoRAConfig lora;
};

// Sees the input of every linear layer's forward on the calling thread while
// it is installed: the weight ids of the layer's parts (one input feeds them
// all) and the input rows [N, in_features], device memory that asynchronous
// streams may still be writing (read it in a HostSection). Wanda's
// calibration (prune.h) collects its statistics here; uninstalled, a linear
// layer pays one thread-local load.
using LinearInputHook =
    std::function<void(std::span<const int> weights, const float* in, int64_t N, int64_t in_features)>;
class ScopedLinearInputHook {
 public:
  explicit ScopedLinearInputHook(LinearInputHook hook);
  ~ScopedLinearInputHook();
  ScopedLinearInputHook(const ScopedLinearInputHook&) = delete;
  ScopedLinearInputHook& operator=(const ScopedLinearInputHook&) = delete;

 private:
  LinearInputHook hook_;
  const LinearInputHook* previous_;
};

// y = x W^T + b with W stored [out, in] (PyTorch's nn.Linear layout): the
// local matmul of a layer. Under tensor parallelism W and b are this rank's
// pieces (ParamParallel) and in/out the local sizes. W may be several
// parameters stacked by output rows (LLaMA's q | k | v, gate | up): one GEMM
// over their concatenation (copied together per call, a small fraction of
// the GEMM's traffic) writes the packed output the attention and SwiGLU
// kernels read. A part's LoRA adapter adds into the part's output columns.
class Linear {
 public:
  Linear() = default;
  Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std,
         const ParamParallel& weight = {}, const ParamParallel& bias = {}, bool has_bias = true,
         const LoRAConfig& lora = {});
  Linear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in, int group, float init_std,
         bool has_bias);
  // bias: whether the bias is added here (a row-parallel layer adds it after
  // the partial products are summed). backward must be given forward's
  // `drop` (it draws the adapters' masks again).
  void forward(const ParamStore& ps, float* out, const float* in, int64_t N, bool bias = true,
               const AdapterDropout& drop = {}) const;
  // din is written, not accumulated (callers pass a fresh buffer), and may be
  // null (input needs no gradient); with bias false the bias's gradient is
  // left to the caller.
  void backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N, bool bias = true,
                const AdapterDropout& drop = {}) const;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  bool has_bias() const { return has_bias_; }
  // The single part's parameters.
  int weight_id() const;
  int bias_id() const;
  // The single part's adapter's parameters (-1 without one).
  int lora_a_id() const;
  int lora_b_id() const;

 private:
  struct Part {
    int weight = -1, bias = -1;
    int64_t first_row = 0, rows = 0;
    int lora_a = -1, lora_b = -1;
    int64_t rank = 0;
    float scale = 0.0f;
    // The adapter's dropout: its probability, a hash of lora_A's name (the
    // mask stream's), and where this rank's input sits in the global one:
    // rows `in_stride` elements apart, columns from first_col (a
    // row-parallel layer's split input).
    float dropout = 0.0f;
    uint64_t dropout_stream = 0;
    int64_t in_stride = 0, first_col = 0;
    uint64_t mask_key(const AdapterDropout& drop) const;
    uint64_t mask_first(const AdapterDropout& drop) const;
  };
  void add_adapter(ParamLayout& layout, const LinearPart& p, Part& part, int group);
  // The part adapter's input drop(in), or undefined when it draws no mask.
  Tensor adapter_input(const Part& p, const float* in, int64_t N, const AdapterDropout& drop) const;
  // out += scale drop(in) A^T B^T over each adapted part's output columns,
  // and its backward (accumulates dA, dB and din, which may be null).
  void lora_forward(const ParamStore& ps, float* out, const float* in, int64_t N, const AdapterDropout& drop) const;
  void lora_backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N,
                     const AdapterDropout& drop) const;
  // Each part's rows of the weights (or biases), of the parameters or of
  // their gradients.
  std::vector<Tensor> pieces(const ParamStore& ps, bool bias) const;
  std::vector<Tensor> grad_pieces(const GradStore& gs, bool bias) const;
  int64_t in_ = 0, out_ = 0;
  bool has_bias_ = false;
  std::vector<Part> parts_;
};

// Megatron's column-parallel linear layer: W's output rows (and b) are split
// over the tensor-parallel ranks, in `blocks` blocks (c_attn's q | k | v, so
// each rank gets whole heads), and each rank computes its output columns for
// every token. It enters a tensor-parallel region (TensorParallelRegion):
// under sequence parallelism it all-gathers its input's token rows in forward
// and again in backward (the gathered input is not kept), and reduce-scatters
// the input gradient; otherwise it all-reduces the input gradient.
class ColumnParallelLinear {
 public:
  ColumnParallelLinear() = default;
  ColumnParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group,
                       float init_std, const TensorParallel& tp, int64_t blocks = 1, const LoRAConfig& lora = {});
  // Several parameters stacked by output rows (parts' `out` global rows),
  // each split over the ranks (or replicated, as its ParamParallel says):
  // the local output is the parts' local rows side by side.
  ColumnParallelLinear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in, int group,
                       float init_std, const TensorParallel& tp, bool has_bias);
  // x: this rank's token rows [rows, in]. Returns [N, out / tp].
  Tensor forward(const ParamStore& ps, const Tensor& x, const AdapterDropout& drop = {}) const;
  // dy: [N, out / tp]; x and drop as given to forward. Returns the gradient of x.
  Tensor backward(const Grads& g, const Tensor& dy, const Tensor& x, const AdapterDropout& drop = {}) const;
  const Linear& local() const { return linear_; }

 private:
  TensorParallel tp_;
  Linear linear_;
};

// Megatron's row-parallel linear layer: W's input columns are split over the
// tensor-parallel ranks, which each multiply their slice of the features; the
// partial outputs are summed as the layer leaves the region (all-reduce, or
// reduce-scatter of the token rows under sequence parallelism) and the bias,
// replicated, is added after the sum.
class RowParallelLinear {
 public:
  RowParallelLinear() = default;
  RowParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group,
                    float init_std, const TensorParallel& tp, bool has_bias = true, const LoRAConfig& lora = {});
  // x: [N, in / tp]. Returns this rank's token rows [rows, out].
  Tensor forward(const ParamStore& ps, const Tensor& x, const AdapterDropout& drop = {}) const;
  // dy: this rank's token rows [rows, out]. Returns the gradient of x.
  Tensor backward(const Grads& g, const Tensor& dy, const Tensor& x, const AdapterDropout& drop = {}) const;
  const Linear& local() const { return linear_; }

 private:
  TensorParallel tp_;
  Linear linear_;
};

// A parameter of a grid's linear layer: `out` global rows, made of `blocks`
// equal blocks each cut over the grid (q | k | v in one parameter: 3), so
// that every rank's output features are whole heads of each block.
struct GridLinearPart {
  std::string name;  // the parameters are name.weight and name.bias
  int64_t out = 0, blocks = 1;
};

// A linear layer of a 2D/2.5D tensor-parallel grid, by SUMMA in its
// collective form (Optimus; Tesseract adds the depth). W [out, in] is cut
// into q x q blocks: rank (row r, column c) holds output rows r and input
// columns c of W, each of the layer's parts (c_attn's q | k | v, or LLaMA's
// q, k, v parameters) cut alike. x [rows, in / q] holds this rank's token
// rows and input columns c; the output [rows, out / q] its token rows and
// output columns c.
//   forward   the column's W panels are all-gathered (panel k: rank (k, c)'s
//             block), P_k = x W_k^T is this rank's partial sum of output
//             columns k, and the partial sums are reduce-scattered along
//             the row: rank (r, k) gets columns k, summed over the input
//             columns; the bias (split like the output columns) is added.
//   backward  dy is all-gathered along the row, dx = sum_k dY_k W_k over
//             the panels gathered again, and dW_k = dY_k^T x is
//             reduce-scattered along the column: rank (k, c) gets its block,
//             summed over the column's tokens (and, over the depth, by the
//             Trainer: ParamParallel::partial_grad).
class SummaLinear {
 public:
  SummaLinear() = default;
  SummaLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group, float init_std,
              const TensorParallel& tp, bool has_bias);
  // The layer over a [out, in] matrix already in the layout (the output
  // head's token table), without a bias. Its weight must be cut by
  // TensorGrid::linear_cut, as the layer's own are.
  SummaLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp);

  // x: [rows, in / q]. Returns [rows, out / q].
  Tensor forward(const ParamStore& ps, const Tensor& x) const;
  // dy: [rows, out / q]; x as given to forward. Returns the gradient of x.
  Tensor backward(const Grads& g, const Tensor& dy, const Tensor& x) const;

 private:
  struct Piece {
    int weight = -1, bias = -1;
    int64_t rows = 0;  // of this rank's block (padding included)
  };
  // Every piece's weight (or bias) of this rank.
  std::vector<Tensor> params(const ParamStore& ps, bool bias) const;
  // This rank's blocks of every part stacked by rows [out / q, in / q], and
  // the column's stacks gathered [q, out / q, in / q].
  Tensor gather_panels(const ParamStore& ps) const;
  const TensorGrid* grid_ = nullptr;
  int64_t in_ = 0, out_ = 0;  // this rank's: in / q, out / q
  bool has_bias_ = false;
  std::vector<Piece> pieces_;
};

// A linear layer of a 3D tensor-parallel cube (Bian et al. 2021), whose q^3
// ranks each hold one piece of W and of every activation. Three axes of the
// cube play three parts: the input axis splits x's token rows, the output
// axis splits x's features (the input columns) and, after the layer, the
// token rows, and the layers (depth) split W's output rows within a rank's
// share. An entering layer's input axis is the rows and its output axis the
// columns; a leaving layer's are swapped, which restores the split between
// blocks (TensorGrid). For an entering layer, rank (row r, column c, layer
// l) holds x [token block l q + r, input columns c] and W's rows r q + l
// (of q^2 parts, block by block) of input columns c:
//   forward   x is all-gathered along the input axis (the row: token blocks
//             l q + 0 .. q - 1), W along the depth (the rows of output
//             features r), P = x W^T is this rank's partial sum over input
//             columns c, and P is reduce-scattered by token rows along the
//             output axis (the row of ranks): rank (r, k, l) gets token
//             block l q + k of output features r, summed over the input
//             columns; the bias (split like the output features) is added.
//   backward  dy is all-gathered along the output axis, dx = dY W is reduce-
//             scattered along the input axis, and dW = dY^T x (x gathered
//             again) is reduce-scattered over the depth: each rank gets its
//             piece summed over every token, so a cube's weight gradients
//             are whole. The bias's are partial sums over the token axes.
class CubeLinear {
 public:
  CubeLinear() = default;
  CubeLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group, float init_std,
             const TensorParallel& tp, bool has_bias, GridSide side);
  // The entering layer over a [out, in] matrix already in the layout (the
  // output head's token table), cut by TensorGrid::linear_cut, without a bias.
  CubeLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp);

  // x: [rows, in / q]. Returns [rows, out / q].
  Tensor forward(const ParamStore& ps, const Tensor& x) const;
  // dy: [rows, out / q]; x as given to forward. Returns the gradient of x.
  Tensor backward(const Grads& g, const Tensor& dy, const Tensor& x) const;

 private:
  struct Piece {
    int weight = -1, bias = -1;
    int64_t rows = 0, blocks = 1;  // this rank's rows (padding included), in `blocks` blocks
  };
  // Calls f(layer, stacked_row, feature_row, rows) for every run of rows
  // that one layer's piece contributes to this rank's output features:
  // stacked_row counts in the layer's pieces stacked [out / q^2, in / q],
  // feature_row in the rank's output features [out / q, in / q].
  template <typename F>
  void for_each_run(F&& f) const;
  // Every piece's weight (or bias) of this rank.
  std::vector<Tensor> params(const ParamStore& ps, bool bias) const;
  // W's rows of this rank's output features [out / q, in / q], gathered
  // over the depth.
  Tensor gather_weight(const ParamStore& ps) const;
  const TensorGrid* grid_ = nullptr;
  Communicator *input_group_ = nullptr, *output_group_ = nullptr;
  int64_t in_ = 0, out_ = 0;  // this rank's: in / q, out / q
  bool has_bias_ = false;
  std::vector<Piece> pieces_;
};

// A grid's linear layer: SUMMA on a 2D/2.5D grid, the cube's on a 3D one.
class GridLinear {
 public:
  GridLinear() = default;
  GridLinear(ParamLayout& layout, const std::vector<GridLinearPart>& parts, int64_t in, int group, float init_std,
             const TensorParallel& tp, bool has_bias, GridSide side);
  // The output head over the token table `weight` (an entering layer).
  GridLinear(int weight, const ParamLayout& layout, int64_t in, const TensorParallel& tp);
  // How many output features a rank holds of `out` (its logits' vocabulary
  // of the head's table): padded to the grid's cut.
  static int64_t local_features(int64_t out, const TensorGridShape& grid);

  Tensor forward(const ParamStore& ps, const Tensor& x, const AdapterDropout& = {}) const;
  Tensor backward(const Grads& g, const Tensor& dy, const Tensor& x, const AdapterDropout& = {}) const;

 private:
  std::variant<SummaLinear, CubeLinear> layer_;
};

// A module's linear layers: Megatron's column-parallel layer entering the
// tensor-parallel region and row-parallel layer leaving it (1D), or a
// grid's layer for both.
using EnteringLinear = std::variant<ColumnParallelLinear, GridLinear>;
using LeavingLinear = std::variant<RowParallelLinear, GridLinear>;
template <typename Layer>
Tensor parallel_forward(const Layer& layer, const ParamStore& ps, const Tensor& x, const AdapterDropout& drop) {
  return std::visit([&](const auto& l) { return l.forward(ps, x, drop); }, layer);
}
template <typename Layer>
Tensor parallel_backward(const Layer& layer, const Grads& g, const Tensor& dy, const Tensor& x,
                         const AdapterDropout& drop) {
  return std::visit([&](const auto& l) { return l.backward(g, dy, x, drop); }, layer);
}

// The block's and the final normalization: LayerNorm (weight and bias, eps
// 1e-5) or RMSNorm (weight only, the config's eps), as the config says. On a
// grid each rank holds its columns of the hidden dimension (and of the
// weights) and the row statistics are all-reduced over the grid's hidden
// group.
class Norm {
 public:
  Norm() = default;
  Norm(ParamLayout& layout, const std::string& name, const GPTConfig& cfg, int group, const TensorParallel& tp = {});
  struct Saved {
    Tensor out, mean, rstd;  // mean: LayerNorm only
  };
  // in: [N, local width]. Allocates s.out [N, local width] and the statistics.
  void forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const;
  // Adds into din (a residual stream's gradient) when accumulate, else
  // writes it.
  void backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N,
                bool accumulate) const;

 private:
  void split_forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const;
  NormKind kind_ = NormKind::layernorm;
  float eps_ = 1e-5f;
  int64_t C_total_ = 0, C_ = 0;  // the whole width and this rank's
  Communicator* hidden_group_ = nullptr;  // the ranks holding the other columns (a grid)
  int weight_ = -1, bias_ = -1;
};

// Token embedding, plus learned positions unless the model rotates q and k
// (RoPE) instead. Under tensor parallelism the token
// table is vocabulary-parallel: each rank holds ceil(V / tp) rows (the last
// rank's tail is padding), looks up the tokens in its range and the partial
// rows are summed as the embedding leaves the region (reduce-scattered by
// token under sequence parallelism); the position table is replicated.
class Embedding {
 public:
  Embedding() = default;
  // Where the token table lives: on one stage with the output head, on the
  // first stage with a copy on the last, or that copy.
  enum class TableCopies : uint8_t { none, owner, copy };
  Embedding(ParamLayout& layout, const GPTConfig& cfg, int group, const TensorParallel& tp = {},
            TableCopies copies = TableCopies::none);
  // A [vocab, C] table split by vocabulary rows over tp: the token table,
  // the output head's tied copy of it on the last pipeline stage, or an
  // untied head's own table (lm_head.weight).
  static int add_token_table(ParamLayout& layout, int64_t vocab, int64_t C, int group, const TensorParallel& tp,
                             TableCopies copies, const std::string& name = "wte.weight");
  // Throws Error for a token id outside [0, vocab) (host memory, checked
  // before it is copied to the device).
  void check_tokens(const int32_t* tokens, int64_t N) const;
  // tokens: [B*T] int32 on the device, checked. Returns this rank's token
  // rows [rows, C] (all B*T without sequence parallelism). Throws Error for
  // pos0 + T > block_size.
  Tensor forward(const ParamStore& ps, const Tensor& tokens, const BatchShape& bs, int64_t pos0 = 0) const;
  // Generation (tensor parallelism without sequence parallelism): the packed
  // rows of a decode batch, each sequence's from its own position on.
  // Returns [N, C].
  Tensor forward_decode(const ParamStore& ps, const Tensor& tokens, const DecodeBatch& batch) const;
  // dout: the gradient of forward's result.
  void backward(const Grads& g, const Tensor& dout, const Tensor& tokens, const BatchShape& bs) const;
  int wte_id() const { return wte_; }
  int wpe_id() const { return wpe_; }

 private:
  Tensor grid_forward(const ParamStore& ps, const int32_t* tokens, const BatchShape& bs, int64_t pos0) const;
  void grid_backward(const Grads& g, const Tensor& dout, const int32_t* tokens, const BatchShape& bs) const;
  TensorParallel tp_;
  int64_t vocab_ = 0, block_size_ = 0, C_ = 0;
  int wte_ = -1, wpe_ = -1;
};

// Causal self-attention with n_head query heads and n_kv_head key/value
// heads (multi-head, grouped-query or multi-query): the q | k | v projection
// (GPT-2's one c_attn parameter, or LLaMA's q, k, v stacked into one GEMM;
// column-parallel, whole heads per tensor-parallel rank), RoPE on q and k when
// the model uses rotary positions, flash-style attention, c_proj
// (row-parallel). Under tensor parallelism the kv heads are split like the
// query heads when n_kv_head % tp == 0; with fewer kv heads than ranks each
// rank keeps the whole k and v (replicated, their gradients partial sums over
// tp) and multiplies by the rows of the one kv head its query heads use.
class CausalSelfAttention {
 public:
  CausalSelfAttention() = default;
  CausalSelfAttention(ParamLayout& layout, const std::string& prefix, const GPTConfig& cfg, int group,
                      float proj_std, const TensorParallel& tp = {});
  struct Saved {
    Tensor qkv, att, lse;  // this rank's heads, every token (q and k rotated)
  };
  // in: this rank's token rows [rows, C]; returns c_proj(attention(c_attn(in))) for them.
  Tensor forward(const ParamStore& ps, Saved& s, const Tensor& in, const BatchShape& bs,
                 const AdapterDropout& drop) const;
  // Returns the gradient of in.
  Tensor backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s, const BatchShape& bs,
                  const AdapterDropout& drop) const;

  // Generation: in [N, C] are the packed rows of a decode batch; appends
  // their keys and values (this rank's kv heads) to layer `layer` of each
  // sequence's cache and attends each row to its sequence's positions up to
  // its own. Returns c_proj of the result [N, C], summed over tp.
  Tensor forward_decode(const ParamStore& ps, const float* in, const DecodeBatch& batch, int layer) const;

  int64_t n_head() const { return n_head_; }

 private:
  // Rotates (or, backward, rotates back) the q and k parts of a [B, T] qkv
  // buffer (or its gradient) for positions pos0..; nothing without RoPE.
  void rotate(float* qkv, int64_t B, int64_t T, int64_t pos0, bool inverse) const;
  // The same for a decode batch's rows, each at its sequence's positions.
  void rotate(float* qkv, const DecodeBatch& batch) const;
  // Rotates by tables cos, sin [T, hs / 2] (rope_tables').
  void rotate(float* qkv, const Tensor& cos, const Tensor& sin, int64_t B, int64_t T, bool inverse) const;
  int64_t n_head_ = 0, hs_ = 0;
  int64_t local_heads_ = 0, local_kv_heads_ = 0;  // this rank's
  // How many ways the token rows are split (a grid's; attention needs
  // whole sequences, so each share is whole sequences).
  int64_t token_parts_ = 1;
  std::vector<float> inv_freq_;  // RoPE's [hs / 2] (host); empty without RoPE
  EnteringLinear c_attn_;
  LeavingLinear c_proj_;
};

// GELU MLP (c_fc, gelu, c_proj) or SwiGLU (gate | up stacked into one GEMM,
// silu(gate) * up, c_proj as the down projection), column- then row-parallel.
class MLP {
 public:
  MLP() = default;
  MLP(ParamLayout& layout, const std::string& prefix, const GPTConfig& cfg, int group, float proj_std,
      const TensorParallel& tp = {});
  struct Saved {
    Tensor fc, act;  // [N, I / tp] (SwiGLU's fc: gate | up, [N, 2I / tp])
  };
  // in: this rank's token rows [rows, C]; returns theirs.
  Tensor forward(const ParamStore& ps, Saved& s, const Tensor& in, const AdapterDropout& drop) const;
  // The forward up to and including the activation: what backward reads
  // (an activation-checkpoint recompute needs no more).
  void forward_activation(const ParamStore& ps, Saved& s, const Tensor& in, const AdapterDropout& drop) const;
  Tensor backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s,
                  const AdapterDropout& drop) const;

 private:
  MlpKind kind_ = MlpKind::gelu;
  int64_t local_I_ = 0;
  EnteringLinear c_fc_;
  LeavingLinear c_proj_;
};

// Pre-norm transformer block:
//   r = x + drop(attn(ln_1(x)));  y = r + drop(mlp(ln_2(r)))
// The norms, dropouts and residuals work on this rank's token rows (all of
// them unless sequence parallel).
class Block {
 public:
  Block() = default;
  Block(ParamLayout& layout, int index, const GPTConfig& cfg, int group, const TensorParallel& tp = {});

  struct Saved {
    Tensor x;  // the input, kept in both modes
    bool recompute = false;
    Norm::Saved ln_1, ln_2;
    CausalSelfAttention::Saved attn;
    Tensor resid;  // r
    MLP::Saved mlp;
  };
  // x: [rows, C]. Returns y. With opts.checkpoint_activations, s keeps only x.
  Tensor forward(const ParamStore& ps, Saved& s, const Tensor& x, const BatchShape& bs,
                 const ForwardOptions& opts) const;
  // dres holds dL/dy on entry and dL/dx on return (the residual stream's
  // gradient flows through in place).
  void backward(const Grads& g, float* dres, Saved& s, const BatchShape& bs, const ForwardOptions& opts) const;

  // Generation: x, the packed rows of a decode batch [N, C], is updated in
  // place; keys and values are appended to this layer's caches.
  void forward_decode(const ParamStore& ps, float* x, const DecodeBatch& batch) const;

  int index() const { return index_; }
  int group() const { return group_; }

 private:
  // y null: stops after the MLP's activation, which is all backward reads.
  void forward_into(const ParamStore& ps, Saved& s, float* y, const BatchShape& bs, const ForwardOptions& opts) const;
  AdapterDropout adapter_dropout(const BatchShape& bs, const ForwardOptions& opts) const;

  TensorParallel tp_;
  int index_ = 0, group_ = 0;
  int64_t C_total_ = 0, C_ = 0;  // the hidden width and this rank's columns of it
  float dropout_ = 0.0f;
  Norm ln_1_, ln_2_;
  CausalSelfAttention attn_;
  MLP mlp_;
};

// ---------------------------------------------------------------------------
// GPT-2
// ---------------------------------------------------------------------------

// Keys and values of the sequences being generated: up to `capacity` slots,
// one per sequence, each with its own length. A slot's cache, [n_layer, 2 (k,
// v), n_kv_head, max_length, hs], is allocated (device tier of the calling
// thread's MemoryContext) when the slot is taken and freed when it is
// released, so a finished sequence's memory returns at once. A rank's part
// of a split model keeps its own: its kv heads (local_kv_heads) of its
// pipeline stage's layers.
class GPT;
class KVCachePool {
 public:
  // The whole model's. max_length: positions per sequence, at most (and by
  // default) block_size.
  KVCachePool(const GPTConfig& cfg, int64_t capacity, int64_t max_length = 0);
  // The part of the model this rank holds (one chunk of layers).
  KVCachePool(const GPT& model, int64_t capacity, int64_t max_length = 0);
  int64_t capacity() const { return static_cast<int64_t>(slots_.size()); }
  int64_t max_length() const { return max_len_; }
  // Takes a free slot with an empty cache; -1 when every slot is taken.
  int allocate();
  void release(int slot);
  // Forgets the slot's positions, keeping its memory (a context that slides
  // starts over).
  void reset(int slot);
  int64_t length(int slot) const;
  int64_t active() const;
  // Bytes the taken slots' caches hold.
  size_t bytes_in_use() const;
  // Bytes one slot's cache takes.
  size_t slot_bytes() const;

 private:
  friend class GPT;
  struct Slot {
    Tensor kv;
    int64_t length = 0;
  };
  KVCachePool(const GPTConfig& cfg, int64_t capacity, int64_t max_length, int64_t kv_heads, int first_layer,
              int n_layer);
  const Slot& taken(int slot) const;
  int64_t first_layer_ = 0, n_layer_ = 0, kv_heads_ = 0, head_dim_ = 0, max_len_ = 0;
  std::vector<Slot> slots_;
};

// A candidate next token: its logit and id.
struct TokenLogit {
  float logit = 0.0f;
  int32_t id = 0;
};

// One sequence's part of a decode batch: its slot in the pool and its new
// tokens (a prompt's many when prefilling, one when decoding).
struct DecodeInput {
  int slot = -1;
  std::span<const int32_t> tokens;
};

// What every layer needs of a decode batch: S sequences whose new rows are
// packed into N rows (GPT::forward_decode builds it).
struct DecodeBatch {
  int64_t S = 0, N = 0, max_len = 0;
  // Host copies: each sequence's cached positions and its first row
  // (offsets[S] = N).
  std::vector<int32_t> lengths, offsets;
  Tensor cache_lens, row_offsets;  // the same on the device (i32)
  // [n_layer, 2, S] on the device: the address of each sequence's keys, then
  // values, of each layer (what attention_decode reads).
  Tensor caches;
  float* const* keys(int layer) const;
  float* const* values(int layer) const;
};

// Layers [begin, end) of the model.
struct LayerRange {
  int begin = 0, end = 0;
  int size() const { return end - begin; }
};

// What one rank holds of the model and how its matrices are split. The
// default is the whole model, unsplit.
struct ModelParallel {
  TensorParallel tp;
  // The layers of each model chunk (virtual pipeline stage) this rank holds,
  // in order; empty: one chunk of every layer.
  std::vector<LayerRange> chunks;
  bool first_stage = true;  // holds the embedding, before its first chunk
  bool last_stage = true;   // holds the final norm and the output head, after its last chunk
};

// An objective over the output head's logits: cross-entropy, or
// distillation from a teacher's logits.
class Loss {
 public:
  struct Saved {
    Tensor lse;          // per-row statistics for backward ([N] log-sum-exp for cross-entropy)
    bool fused = false;  // forward already wrote the logits' gradient
  };
  virtual ~Loss() = default;
  // The f64 sums forward adds to, by name: the objective ("loss"), then its
  // parts.
  virtual std::vector<std::string_view> term_names() const { return {"loss"}; }
  int64_t terms() const { return static_cast<int64_t>(term_names().size()); }
  // logits: this rank's vocabulary slice [N, local vocab] (the whole
  // vocabulary without tensor parallelism); targets: [N] int32 on the
  // device, -1 ignores a position; teacher: ForwardOptions::teacher_logits.
  // Adds the fixed-order double sums of the per-position losses (and of
  // their parts) to `sum` ([terms()] f64 on the device): the host reads it
  // once per step, not per micro-batch. With dloss, also writes the logits'
  // gradient over them in the same pass (the logits are then gone).
  virtual void forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                       const Tensor& sum, std::optional<float> dloss) const = 0;
  // Writes the logits' gradient over them in place (nothing when forward did).
  virtual void backward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                        float dloss) const = 0;
};

// A loss over this rank's slice of the logits: columns [first, first +
// local vocab) of vocab_size classes, the first `real` of them classes (the
// rest padding); the whole vocabulary without tensor parallelism.
class VocabularyLoss : public Loss {
 public:
  VocabularyLoss() = default;
  VocabularyLoss(int64_t vocab_size, int64_t local_vocab, const TensorParallel& tp)
      : V_(vocab_size), local_vocab_(local_vocab), tp_(tp) {}

 protected:
  struct Slice {
    int64_t first = 0, real = 0;
  };
  Slice slice() const;

  int64_t V_ = 0, local_vocab_ = 0;
  TensorParallel tp_;
};

// Softmax cross-entropy; under tensor parallelism the vocabulary-parallel
// form (Megatron): the ranks agree on each row's max and sums in two
// all-reduces over the tp group, and the full logits never meet.
class CrossEntropyLoss final : public VocabularyLoss {
 public:
  using VocabularyLoss::VocabularyLoss;
  void forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher, const Tensor& sum,
               std::optional<float> dloss) const override;
  void backward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                float dloss) const override;
};

using cpu::Distillation;

// Knowledge distillation (kernels.h's distill_*): per position with a
// target, alpha T^2 KL(teacher || student at temperature T) + (1 - alpha)
// cross-entropy. Its terms are the objective, the KL and the cross-entropy
// (both unweighted). Vocabulary-parallel as CrossEntropyLoss is, with the
// teacher's row max beside the student's and the KL's sums beside the
// cross-entropy's in the same two all-reduces.
class DistillationLoss final : public VocabularyLoss {
 public:
  DistillationLoss(int64_t vocab_size, int64_t local_vocab, const TensorParallel& tp, Distillation d);
  std::vector<std::string_view> term_names() const override { return {"loss", "kl", "ce"}; }
  void forward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher, const Tensor& sum,
               std::optional<float> dloss) const override;
  void backward(Saved& s, const Tensor& logits, const Tensor& targets, const Tensor& teacher,
                float dloss) const override;

 private:
  Distillation d_;
};

// One micro-batch's activations on a rank, from its forward to its backward.
// A pipeline keeps several of them in flight.
struct MicroBatchState {
  BatchShape bs;
  ForwardOptions opts;
  Tensor tokens, targets;  // [N] int32 on the device (first and last stage)
  std::vector<Block::Saved> blocks;  // one per block this rank holds
  // The head (last stage): final norm, its gathered output under sequence
  // parallelism, this rank's vocabulary slice of the logits and per-row lse.
  Tensor x_final;
  Norm::Saved ln_f;
  Tensor head_input, logits;
  Loss::Saved loss;
  // [loss terms] f64 on the device: the last stage adds the losses of the
  // positions with a target to it (an accumulator several micro-batches may
  // share).
  Tensor loss_sum;
  int64_t valid_targets = 0;  // their number
  // loss_sum read on the host (a blocking copy).
  double host_loss_sum() const;
};

class GPT {
 public:
  explicit GPT(const GPTConfig& cfg, const ModelParallel& mp = {});
  // Stores refer to the layout inside: a GPT stays where it is built.
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  const ModelParallel& parallel() const { return mp_; }
  // This rank's parameters. Groups: "embedding" (first stage), one per block
  // "h.<layer>", "ln_f" (last stage) and, on the last stage of a pipeline,
  // "head" (the tied copy of the token table).
  const ParamLayout& layout() const { return layout_; }
  // The group of layer i's block (-1 when another rank holds it).
  int block_group(int layer) const;
  // This rank's vocabulary rows of the token table (vocab_size without
  // tensor parallelism; padded rows included).
  int64_t local_vocab() const { return local_vocab_; }
  // The objective of the head (cross-entropy unless distill() chose another).
  const Loss& loss() const { return *loss_; }
  // Trains against a teacher's logits (ForwardOptions::teacher_logits) with
  // DistillationLoss instead of cross-entropy.
  void distill(Distillation d);

  // Forward of one micro-batch with targets on a rank that holds the whole
  // pipeline, keeping in s what backward needs: s.logits ([B, T, V]; this
  // rank's vocabulary slice [N, local_vocab] under tensor parallelism) until
  // backward, and the losses added to loss_sum (a fresh accumulator in
  // s.loss_sum when undefined). Throws Error for bad token ids or
  // T > block_size.
  void forward(ParamStore& ps, MicroBatchState& s, const int32_t* tokens, const int32_t* targets,
               const BatchShape& bs, const ForwardOptions& opts = {}, const Tensor& loss_sum = {}) const;
  // Backward of s's forward. dloss is dObjective/dloss_i for each position
  // (e.g. 1 / tokens in the global batch, times the loss scale).
  // Accumulates into the GradStore and frees the saved activations.
  void backward(ParamStore& ps, GradStore& gs, MicroBatchState& s, float dloss) const;

  // Pipeline pieces. A micro-batch starts with begin() (on every rank of the
  // pipeline: the first stage reads the tokens, the last the targets), then
  // runs forward_chunk for each of this rank's chunks and backward_chunk in
  // reverse, as the schedule orders them.
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  // Throws Error for a target outside [-1, vocab). loss_sum: the
  // accumulator the losses are added to (a fresh one when undefined).
  void begin(MicroBatchState& s, const int32_t* tokens, const int32_t* targets, const BatchShape& bs,
             const ForwardOptions& opts, const Tensor& loss_sum = {}) const;
  // input: the previous chunk's output (undefined on the first stage's first
  // chunk, which embeds the tokens). Returns this chunk's output, this rank's
  // token rows [rows, C], or an undefined tensor after the last stage's last
  // chunk, which adds the micro-batch's losses to s.loss_sum on the device.
  Tensor forward_chunk(ParamStore& ps, MicroBatchState& s, int chunk, const Tensor& input) const;
  // grad_output: the gradient of forward_chunk's output (ignored on the last
  // stage's last chunk, which starts from the loss with dloss per position).
  // Returns the gradient of the chunk's input (undefined on the first stage's
  // first chunk). Tells the GradStore when each group's gradients are ready.
  Tensor backward_chunk(ParamStore& ps, GradStore& gs, MicroBatchState& s, int chunk, const Tensor& grad_output,
                        float dloss) const;

  // Generation (the model whole, or split over tp without sequence
  // parallelism and over pipeline stages of one chunk each): feeds each
  // sequence's new tokens through the model in one packed batch, appending
  // their keys and values to its cache slot (which must be taken, each at
  // most once in the batch), and returns the logits of each sequence's last
  // new position [S, V], or with all_positions of every new position, [N, V]
  // in batch order. Every rank of a split model calls it with the same
  // batch and gets the same whole logits; `pipeline` is the group of the
  // pipeline stages (rank = stage; needed with more than one), which pass
  // the activations on and get the last stage's logits. Throws Error for bad
  // token ids, a sequence without new tokens or one that would outgrow
  // pool.max_length().
  Tensor forward_decode(ParamStore& ps, KVCachePool& pool, std::span<const DecodeInput> batch,
                        bool all_positions = false, Communicator* pipeline = nullptr) const;
  // forward_decode's k most likely next tokens of each sequence [S][k]
  // (fewer when the vocabulary is smaller), in descending logit, the lower
  // id first among equals, on every rank, without the whole logits: each tp
  // rank's k best of its vocabulary slice are gathered and merged.
  std::vector<std::vector<TokenLogit>> decode_top_k(ParamStore& ps, KVCachePool& pool,
                                                    std::span<const DecodeInput> batch, int64_t k,
                                                    Communicator* pipeline = nullptr) const;
  // The layers of this rank's only chunk (generation).
  LayerRange decode_layers() const;

 private:
  // forward_decode up to the head: the final norm's output for the rows
  // asked for [R, C] on the last stage; undefined on the others.
  Tensor decode_head_input(ParamStore& ps, KVCachePool& pool, std::span<const DecodeInput> batch,
                           bool all_positions, Communicator* pipeline) const;
  // The head: final norm, logits of this rank's vocabulary slice and the loss.
  void head_forward(ParamStore& ps, MicroBatchState& s, const Tensor& x) const;
  // logits[N, V] = h[N, C] @ the output table^T (this rank's V vocabulary
  // rows): quantized when the store holds it so (inference), else fp32.
  void head_logits(const ParamStore& ps, float* logits, const float* h, int64_t N, int64_t V) const;
  Tensor head_backward(ParamStore& ps, GradStore& gs, MicroBatchState& s, float dloss) const;
  // Throw Error for what 1D tensor parallelism, or a grid, cannot
  // split.
  void check_tensor_parallel() const;
  void check_grid() const;
  // The ranks the logits' vocabulary is split over.
  TensorParallel vocab_parallel() const;
  // The group whose token table the head multiplies by.
  int head_group() const { return head_group_ >= 0 ? head_group_ : embedding_group_; }
  int head_table() const { return head_table_ >= 0 ? head_table_ : embedding_.wte_id(); }

  GPTConfig cfg_;
  ModelParallel mp_;
  ParamLayout layout_;
  int64_t local_vocab_ = 0;
  std::vector<LayerRange> chunks_;
  int embedding_group_ = -1, lnf_group_ = -1, head_group_ = -1, head_table_ = -1;
  Embedding embedding_;
  std::vector<Block> blocks_;  // this rank's, in chunk order
  std::vector<int> chunk_first_block_;  // index into blocks_ of each chunk's first block
  Norm ln_f_;
  GridLinear grid_head_;  // the output head on a grid (last stage)
  std::unique_ptr<Loss> loss_;
};

}  // namespace loom
