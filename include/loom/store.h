// loom stores: who owns the bytes of parameters, gradients and optimizer state.
//
// Modules never own parameter memory. A model declares its parameters in a
// ParamLayout (name, shape, init, group); the stores allocate and place them.
// Around each group's forward and backward the model calls acquire/release on
// the ParamStore, and after a group's backward it tells the GradStore that the
// group's gradients are complete. In the single-rank reference these calls are
// cheap bookkeeping; they are the seams where data parallelism reduces
// gradients, ZeRO gathers and frees parameter shards, and offload moves chunks.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "loom/core.h"

namespace loom {

struct QuantizedWeight;  // quant.h

// How a parameter's initial values are drawn. Every element's value is a pure
// function of (seed, parameter name, element index), so any shard of any
// layout initializes itself without materializing the whole tensor.
struct ParamInit {
  enum class Kind : uint8_t { normal, constant, uniform } kind = Kind::normal;
  float mean = 0.0f;  // for normal; the value for constant
  float std = 0.02f;  // for normal; the bound b of uniform(-b, b)

  static ParamInit normal_(float std) { return {Kind::normal, 0.0f, std}; }
  static ParamInit constant(float value) { return {Kind::constant, value, 0.0f}; }
  static ParamInit uniform(float bound) { return {Kind::uniform, 0.0f, bound}; }
};

// Elements [begin, end) of the flat parameter space.
struct FlatRange {
  int64_t begin = 0, end = 0;
  int64_t numel() const { return end - begin; }
};

// How a parameter is cut over the tensor-parallel ranks. Dimension `dim` of
// the global shape is viewed as `blocks` equal blocks (c_attn's q | k | v),
// each cut into `parts` equal pieces of ceil(block / parts); rank `index`
// holds piece `index` of every block. A block that does not divide evenly is
// padded at its end (the vocabulary): the padding elements lie past the
// global extent, start at zero and, since nothing reads them, stay zero.
struct TensorSplit {
  int dim = 0;
  int64_t parts = 1;  // 1: every rank holds the whole tensor
  int64_t index = 0;
  int64_t blocks = 1;
};

// Axes of the tensor-parallel ranks, as a set: the rows, columns and depth
// layers of a 2D/2.5D/3D grid (TensorGrid, parallel.h). A 1D group is one axis
// and stands for all of them.
using TpAxes = uint8_t;
inline constexpr TpAxes kTpRows = 1, kTpCols = 2, kTpDepth = 4, kTpAll = 7;

// How a parameter relates to its copies on other model-parallel ranks.
struct ParamParallel {
  TensorSplit split;
  // A second cut, of another dimension: a 2D grid cuts a matrix's rows over
  // its rows of ranks and the columns over its columns of ranks.
  TensorSplit col_split;
  // The tensor-parallel axes the cuts follow. Ranks that differ only along
  // the other axes hold copies of the same piece; the one at coordinate 0 on
  // those axes owns it (saves it, counts it in the gradient norm). 0: every
  // tensor-parallel rank holds the whole parameter.
  TpAxes split_axes = 0;
  // The axes along which each copy computes a partial sum of its gradient
  // (its own tokens: sequence parallelism's norms, a grid's biases): the
  // gradients are all-reduced over them.
  TpAxes partial_grad = 0;
  // Held by several pipeline stages (the token table on the first stage and
  // its copy on the last, for the output head): the copies' gradients are
  // all-reduced between those stages.
  bool tied_across_stages = false;
  // The copy a stage holds of a parameter another stage owns: only the
  // owner's copy is saved and counted in the gradient norm.
  bool tied_copy = false;
  bool is_split() const { return split.parts > 1 || col_split.parts > 1; }
};

struct ParamSpec {
  std::string name;    // global name, e.g. "h.3.attn.c_attn.weight"
  Shape shape;         // this rank's shape (the global shape unless split)
  Shape global_shape;  // the whole tensor's shape
  ParamInit init;
  bool weight_decay = true;  // AdamW decays matrices and embeddings, not biases or norms
  int group = 0;             // unit of acquisition (a module: embedding, one block, final norm)
  int64_t offset = 0;        // first element in the flat parameter space
  ParamParallel parallel;
  // A frozen parameter (false) is read but never updated: it has no
  // gradient and no optimizer state (FrozenParams).
  bool trainable = true;
  // The [out, in] weight of a Linear layer (y = x W^T), the tensors that
  // weight-only quantization converts and pruning zeroes; embeddings, norms
  // and biases are not.
  bool linear_weight = false;
  // The [vocab, n_embd] table the output head multiplies by (the token
  // embedding when tied): quantized with the linear weights (every decoded
  // token reads it whole), never pruned.
  bool output_table = false;
  int64_t numel() const { return shape_numel(shape); }
  // The global index (into the whole tensor, row-major) of this rank's
  // element `local`, or -1 for a padding element; *run receives how many
  // elements from `local` on continue the same way (consecutive global
  // indices, or padding).
  int64_t global_index(int64_t local, int64_t* run = nullptr) const;
};

// The flat parameter space of a model: every parameter in declaration order,
// packed back to back. Groups are contiguous ranges of it.
class ParamLayout {
 public:
  int add_group(std::string name);
  // `shape` is the global shape; a split parameter stores its piece.
  int add(std::string name, Shape shape, ParamInit init, bool weight_decay, int group,
          const ParamParallel& parallel = {});

  // Whether parameter `id` trains (ParamSpec::trainable), and whether
  // parameters added from now on do (a model fine-tuned through adapters
  // adds its base frozen and makes the adapters trainable).
  void set_trainable(int id, bool trainable) { params_.at(static_cast<size_t>(id)).trainable = trainable; }
  void set_added_trainable(bool trainable) { added_trainable_ = trainable; }
  void set_linear_weight(int id) { params_.at(static_cast<size_t>(id)).linear_weight = true; }
  void set_output_table(int id) { params_.at(static_cast<size_t>(id)).output_table = true; }

  const std::vector<ParamSpec>& params() const { return params_; }
  const ParamSpec& param(int id) const { return params_.at(static_cast<size_t>(id)); }
  int find(std::string_view name) const;  // -1 if absent
  int num_groups() const { return static_cast<int>(group_names_.size()); }
  const std::string& group_name(int g) const { return group_names_.at(static_cast<size_t>(g)); }
  // [begin, end) of group g in the flat space.
  std::pair<int64_t, int64_t> group_range(int g) const;
  int64_t numel() const { return numel_; }

  // Writes the initial values of flat elements [first, first + n) into out:
  // each element's value depends on (seed, name, global index) alone.
  void initialize(float* out, int64_t first, int64_t n, uint64_t seed) const;

 private:
  std::vector<ParamSpec> params_;
  std::vector<std::string> group_names_;
  std::vector<std::pair<int64_t, int64_t>> group_ranges_;
  int64_t numel_ = 0;
  bool added_trainable_ = true;
};

// Parameters of one rank. The reference store keeps the whole flat space in
// one fp32 buffer on the device tier; ZeroParamStore (zero.h) shards it.
class ParamStore {
 public:
  ParamStore(const ParamLayout& layout, uint64_t seed);
  virtual ~ParamStore() = default;
  ParamStore(const ParamStore&) = delete;
  ParamStore& operator=(const ParamStore&) = delete;

  const ParamLayout& layout() const { return layout_; }

  // The group's parameters are usable between acquire and release.
  virtual void acquire(int group);
  virtual void release(int group);
  // The full parameter `id` in fp32 (valid while its group is acquired).
  virtual Tensor param(int id) const;
  // Parameter `id` held quantized (a Linear's weight loaded from a quantized
  // checkpoint, quant.h), or null when it is held in fp32: the Linear runs
  // the quantized kernel when its store gives one.
  virtual const QuantizedWeight* quantized(int /*id*/) const { return nullptr; }
  // Bracket one training step's forwards and backwards (stores that
  // prefetch learn the acquisition order from them).
  virtual void begin_step() {}
  virtual void end_step() {}

  // The reference store's whole flat space (undefined for other stores).
  Tensor flat() const { return flat_; }

 protected:
  // For derived stores that allocate their own memory.
  explicit ParamStore(const ParamLayout& layout) : layout_(layout) {}
  void check_group(int group) const;

  const ParamLayout& layout_;
  Tensor flat_;
};

// Gradients of one rank. `group_ready` is called by the model when a group's
// gradients for the current micro-batch are complete; the data-parallel
// GradStore starts reducing there.
class GradStore {
 public:
  explicit GradStore(const ParamLayout& layout);
  virtual ~GradStore() = default;
  GradStore(const GradStore&) = delete;
  GradStore& operator=(const GradStore&) = delete;

  // fp32 gradient of parameter `id` for the current micro-batch; backward
  // kernels accumulate into it.
  virtual Tensor grad(int id) const;
  // The reference store's whole flat space (undefined for other stores).
  Tensor flat() const { return flat_; }
  // Starts a step: every gradient becomes zero.
  virtual void zero();
  // Whether the coming micro-batch's group_ready calls communicate (false for
  // all but the last micro-batch of a gradient accumulation).
  virtual void set_reduce(bool) {}
  virtual void group_ready(int group);
  // Blocks until every reduction started by group_ready has finished.
  virtual void finish() {}

 protected:
  // For derived stores that allocate their own memory.
  struct NoStorage {};
  GradStore(const ParamLayout& layout, NoStorage) : layout_(layout) {}
  void check_group(int group) const;

  const ParamLayout& layout_;
  Tensor flat_;
};

// What a rank's gradients look like across the whole data-parallel group.
struct GradientCheck {
  double sum_squares = 0.0;  // of every gradient element of the model
  int64_t non_finite = 0;    // Inf/NaN elements seen by any rank
};

// A piece of the whole model's fp32 state: the flat elements `range` (whole
// parameters) with their weights and AdamW moments.
using StateVisitor =
    std::function<void(FlatRange range, const float* params, const float* exp_avg, const float* exp_avg_sq)>;
using StateFiller = std::function<void(FlatRange range, float* params, float* exp_avg, float* exp_avg_sq)>;
using GradientVisitor = std::function<void(FlatRange range, const float* grads)>;

// The optimizer state of one rank and the update that applies the step's
// reduced gradients to the parameters: the third store beside ParamStore and
// GradStore. The reference's AdamW over the whole flat space
// (ReferenceOptimizer, optim.h), ZeRO's over the owned blocks (ZeroOptimizer,
// zero.h) and the chunk manager's chunk by chunk on whichever tier holds the
// state (ChunkManager, memory.h) implement it; the Trainer holds one.
class OptimizerStore {
 public:
  virtual ~OptimizerStore() = default;
  // Collective: the sum of squares and non-finite count of the step's
  // reduced gradients (still multiplied by the loss scale).
  virtual GradientCheck check_gradients() = 0;
  // Collective: one AdamW update with every gradient multiplied by
  // grad_scale (clipping and loss-scale unscaling folded in).
  virtual void step(float lr, float grad_scale) = 0;
  // After a skipped update (fp16 overflow): whatever the step's gradients
  // overwrote is restored from the optimizer state.
  virtual void after_skip() {}
  // AdamW updates applied.
  virtual int64_t steps() const = 0;
  virtual void set_steps(int64_t t) = 0;
  // Collective: this rank's layout's whole state in flat order, in pieces of
  // whole parameters, in host memory valid during the call.
  virtual void visit_state(const StateVisitor& visit) = 0;
  // Collective: every rank takes its part of the state `fill` writes, piece
  // by piece.
  virtual void load_state(const StateFiller& fill) = 0;
  // Collective: like load_state, but `fill` is asked only for the elements
  // this rank keeps, in pieces that may split a parameter, so that a sharded
  // store reads no more than its own state (a sharded checkpoint's load). A
  // store that keeps whole parameters takes them as load_state does.
  virtual void load_owned_state(const StateFiller& fill) { load_state(fill); }
  // This rank's own state, for sharded checkpoints; not collective. The flat
  // ranges it holds the fp32 values and moments of, in increasing order
  // (every replica of a store that is not sharded holds them all).
  virtual std::vector<FlatRange> owned_ranges() const = 0;
  // Those ranges in that order, one at a time, in host memory valid during
  // the call (at most one range is staged).
  virtual void visit_owned_state(const StateVisitor& visit) = 0;
  // Collective: the step's reduced gradient (fp32, still multiplied by the
  // loss scale) in flat order, in pieces like visit_state; valid between the
  // gradient store's finish() and step().
  virtual void visit_gradients(const GradientVisitor& visit) = 0;
};

// Frozen parameters (ParamSpec::trainable false, or chosen by the Trainer).
// The stores of any family (reference, ZeRO, chunks) are built over
// trainable(): a layout of the trainable parameters alone, with the same
// names, shapes, splits and initialization (so the same values), and the
// groups that hold a trainable parameter. The frozen ones live here: this
// rank's layout's pieces of them (split over tp as their ParamParallel says;
// not sharded over dp, since they have no optimizer state to shard), stored
// in `dtype` (the working precision: no fp32 master) and initialized as the
// whole layout would. FrozenParamStore, FrozenGradStore and FrozenOptimizer
// put the two back together in the model's layout: the model and the
// Trainer's state see every parameter where the layout puts it.
// The parameters of `layout` that train (frozen[id] false) as a layout of
// their own: the same names, shapes, splits and initialization, and the
// groups that hold one of them. to_model, if given, receives each one's id in
// `layout`. The plan sizes the stores from it before FrozenParams exists.
ParamLayout trainable_layout(const ParamLayout& layout, const std::vector<bool>& frozen,
                             std::vector<int>* to_model = nullptr);

class FrozenParams {
 public:
  // frozen[id]: whether parameter id of `layout` is frozen (at least one
  // parameter must stay trainable).
  FrozenParams(const ParamLayout& layout, const std::vector<bool>& frozen, DType dtype, uint64_t seed);
  FrozenParams(const FrozenParams&) = delete;
  FrozenParams& operator=(const FrozenParams&) = delete;

  const ParamLayout& layout() const { return layout_; }
  const ParamLayout& trainable() const { return trainable_; }
  bool frozen(int id) const { return trainable_id(id) < 0; }
  // The id in trainable() of the model's parameter `id` (-1 when frozen),
  // and back.
  int trainable_id(int id) const { return to_trainable_.at(static_cast<size_t>(id)); }
  int model_id(int trainable_id) const { return to_model_.at(static_cast<size_t>(trainable_id)); }
  // The group of trainable() of the model's group (-1 when it has no
  // trainable parameter).
  int trainable_group(int group) const { return groups_.at(static_cast<size_t>(group)); }
  DType dtype() const { return dtype_; }
  // The stored values of frozen parameter `id` (this rank's piece, dtype()).
  const Tensor& stored(int id) const { return stored_.at(static_cast<size_t>(id)); }
  // Sets frozen parameter `id` from fp32 values on the host.
  void load(int id, const float* values);
  int64_t numel() const;  // frozen elements of this rank

 private:
  const ParamLayout& layout_;
  std::vector<int> to_model_;  // before trainable_, whose initializer fills it
  ParamLayout trainable_;
  std::vector<int> to_trainable_, groups_;
  DType dtype_;
  std::vector<Tensor> stored_;  // by model id; undefined for trainable ones
};

// The model's ParamStore over FrozenParams and a store of trainable().
// Under a working precision below fp32 a group's frozen parameters are
// converted to fp32 while it is acquired, as the ZeRO stores' are.
class FrozenParamStore final : public ParamStore {
 public:
  FrozenParamStore(const FrozenParams& frozen, std::unique_ptr<ParamStore> trainable);
  void acquire(int group) override;
  void release(int group) override;
  Tensor param(int id) const override;
  void begin_step() override { trainable_->begin_step(); }
  void end_step() override { trainable_->end_step(); }
  ParamStore& trainable() { return *trainable_; }

 private:
  const FrozenParams& frozen_;
  std::unique_ptr<ParamStore> trainable_;
  std::vector<int> acquired_;        // per group: acquisitions not yet released
  std::vector<Tensor> working_;      // fp32 copies of acquired frozen parameters (below-fp32 storage)
};

// The model's GradStore: a frozen parameter's gradient is undefined (a null
// pointer, which the backward kernels skip); the rest is the trainable
// store's.
class FrozenGradStore final : public GradStore {
 public:
  FrozenGradStore(const FrozenParams& frozen, std::unique_ptr<GradStore> trainable);
  Tensor grad(int id) const override;
  void zero() override { trainable_->zero(); }
  void set_reduce(bool reduce) override { trainable_->set_reduce(reduce); }
  void group_ready(int group) override;
  void finish() override { trainable_->finish(); }
  GradStore& trainable() { return *trainable_; }

 private:
  const FrozenParams& frozen_;
  std::unique_ptr<GradStore> trainable_;
};

// The model's OptimizerStore: the trainable store's update, gradient check
// and counters (frozen parameters take no part in the norm or the update);
// the state and gradients visited in the model's flat order, a frozen
// parameter with zero moments and a zero gradient.
class FrozenOptimizer final : public OptimizerStore {
 public:
  // saves_frozen: whether this rank's own state (owned_ranges) includes the
  // frozen parameters. They are not sharded over data-parallel ranks, so
  // one replica (data-parallel rank 0) saves them and the others only their
  // part of the trainable state.
  FrozenOptimizer(FrozenParams& frozen, std::unique_ptr<OptimizerStore> trainable, bool saves_frozen);
  GradientCheck check_gradients() override { return trainable_->check_gradients(); }
  void step(float lr, float grad_scale) override { trainable_->step(lr, grad_scale); }
  void after_skip() override { trainable_->after_skip(); }
  int64_t steps() const override { return trainable_->steps(); }
  void set_steps(int64_t t) override { trainable_->set_steps(t); }
  void visit_state(const StateVisitor& visit) override;
  void load_state(const StateFiller& fill) override;
  // The trainable store's own ranges in the model's flat coordinates (a
  // range that spans frozen parameters splits around them) and, where this
  // rank saves them, the frozen parameters (values, and moments of zero),
  // in increasing order.
  std::vector<FlatRange> owned_ranges() const override;
  void visit_owned_state(const StateVisitor& visit) override;
  // The trainable store's own elements (as its load_owned_state asks for
  // them) and every frozen parameter this rank holds.
  void load_owned_state(const StateFiller& fill) override;
  void visit_gradients(const GradientVisitor& visit) override;
  OptimizerStore& trainable() { return *trainable_; }

 private:
  FrozenParams& frozen_;
  std::unique_ptr<OptimizerStore> trainable_;
  bool saves_frozen_;
};

}  // namespace loom
