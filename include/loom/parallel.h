// loom parallelism: the device mesh that names the parallel groups every
// parallel layer communicates over, the communication at the edges of
// tensor-parallel regions, and the pipeline schedules and their executor.
#pragma once

#include <array>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/comm.h"
#include "loom/store.h"

namespace loom {

// ---------------------------------------------------------------------------
// Device mesh
// ---------------------------------------------------------------------------

// Axes of the device mesh, outermost (slowest-varying in the rank) first:
//   pp  pipeline stages: point-to-point activations once per micro-batch,
//       the least traffic, so stages may sit on different hosts
//   dp  data-parallel replicas (ZeRO shards across them)
//   ep  expert parallelism
//   sp  sequence (context) parallelism
//   tp  tensor parallelism: collectives in every layer, the most traffic, so
//       its ranks are neighbours (the same host), as in Megatron-LM
// With sizes PP, DP, EP, SP, TP the rank of coordinates (pp, dp, ep, sp, tp) is
//   (((pp * DP + dp) * EP + ep) * SP + sp) * TP + tp.
enum class MeshAxis : uint8_t { pp, dp, ep, sp, tp };
constexpr int kNumMeshAxes = 5;
constexpr std::array<MeshAxis, kNumMeshAxes> kMeshAxes{MeshAxis::pp, MeshAxis::dp, MeshAxis::ep, MeshAxis::sp,
                                                      MeshAxis::tp};
const char* mesh_axis_name(MeshAxis axis);
// Throws Error naming an unknown axis and listing the known ones.
MeshAxis parse_mesh_axis(std::string_view name);

// A rank's coordinate on every axis, indexed by MeshAxis.
using MeshCoords = std::array<int, kNumMeshAxes>;

// The size of every axis (1 for an axis not in use).
struct MeshShape {
  std::array<int, kNumMeshAxes> sizes{1, 1, 1, 1, 1};

  int& operator[](MeshAxis axis) { return sizes[static_cast<size_t>(axis)]; }
  int operator[](MeshAxis axis) const { return sizes[static_cast<size_t>(axis)]; }
  // Sizes by axis name, e.g. {{"dp", 2}, {"tp", 4}}; throws Error for an
  // unknown name.
  static MeshShape from(const std::map<std::string, int>& sizes);

  // The product of the sizes.
  int64_t ranks() const;
  // Throws Error naming the problem unless every size is at least 1 and the
  // sizes multiply to `world_size`.
  void validate(int world_size) const;
  // "pp=1 x dp=2 x tp=4" (sp and ep only when used).
  std::string describe() const;

  MeshCoords coords_of(int rank) const;
  int rank_of(const MeshCoords& coords) const;
};

// ---------------------------------------------------------------------------
// Tensor-parallel grids
// ---------------------------------------------------------------------------

// How the tensor-parallel ranks split a block's matrices and activations:
//   1d    Megatron-LM: weights split by rows or columns, activations whole
//         on every rank (or split by token between the regions, sequence
//         parallelism), two all-reduces of activations per block;
//   2d    Optimus (Xu et al. 2021): a q x q grid, tp = q^2; every matrix and
//         every activation split by a q x q block grid, linear layers by
//         SUMMA (weight panels gathered along the grid's columns, partial
//         outputs reduce-scattered along its rows);
//   2.5d  Tesseract (Wang et al. 2021): `depth` layers of a q x q grid,
//         tp = q^2 depth; each layer runs 2D on its share of the tokens, the
//         weights are the layers' copies and their gradients are summed over
//         the depth;
//   3d    Bian et al. 2021: a q x q x q cube, tp = q^3; every matrix split
//         over all q^3 ranks, activations over q^3 too, linear layers by the
//         cube's algorithm (input gathered along one axis, weight along
//         another, partial outputs reduce-scattered along the third), which
//         leaves a layer's output split differently from its input.
enum class TensorParallelMode : uint8_t { one_d, two_d, two_and_half_d, three_d };
const char* tensor_parallel_mode_name(TensorParallelMode mode);  // "1d", "2d", "2.5d", "3d"
// Throws Error naming an unknown mode and listing the known ones.
TensorParallelMode parse_tensor_parallel_mode(std::string_view name);

// The size of a grid: tp = q * q * depth ranks (2D: depth 1; 3D: a cube,
// depth q).
struct TensorGridShape {
  int q = 1, depth = 1;
  bool cube = false;
  int ranks() const { return q * q * depth; }
};
// The grid `tp` ranks form under `mode` with `depth` layers (2.5d; 2d and
// 3d ignore it): q 0 when they form none (tp / depth is not the square of a
// q >= 2, or for 3d tp not the cube of one); {1, 1} for 1d.
TensorGridShape tensor_grid_shape(TensorParallelMode mode, int64_t tp, int64_t depth);

// Which way a grid's linear layer maps the activations' split: a layer
// entering a block's inner region (q | k | v, the MLP's first matrix, the
// output head) or leaving it (the projections back to the residual width).
// SUMMA keeps the split; the cube's algorithm swaps two of its axes, and the
// leaving layer swaps them back.
enum class GridSide : uint8_t { entering, leaving };

// A tensor-parallel rank's place in a grid and its groups. Tensor-parallel
// rank t sits at layer t / q^2, row (t / q) % q, column t % q.
//
// Between blocks (the residual stream, norms, embeddings) the activations
// [token rows, hidden] are split alike in every mode: the token rows over the
// q * depth (layer, row) pairs, token block layer * q + row, and the hidden
// dimension over the columns. Inside a block (after an entering layer) 2D and
// 2.5D keep that split; a cube splits the token rows over the (layer, column)
// pairs, token block layer * q + column, and the features over the rows.
//
// 2D/2.5D cut a matrix W [out, in] into q x q blocks, output rows over the
// grid's rows and input columns over its columns, with a copy in each layer.
// A cube cuts W over all q^3 ranks (linear_cut).
struct TensorGrid {
  int q = 1, depth = 1;
  bool cube = false;
  int row = 0, col = 0, layer = 0;
  // The ranks of this rank's row (ranked by column): they split the hidden
  // dimension of the same tokens between blocks (and, on 2D/2.5D, the
  // logits' vocabulary).
  Communicator* hidden_group = nullptr;
  // The ranks of its column in its layer (ranked by row): on 2D/2.5D they
  // hold a matrix's row panels, gathered for every product.
  Communicator* weight_group = nullptr;
  // The same row and column in every layer (ranked by layer): the copies of
  // a weight block (2.5D), the pieces of one (3D).
  Communicator* depth_group = nullptr;
  // Its column in every layer (ranked by layer * q + row): the ranks that
  // split the token rows between blocks.
  Communicator* token_group = nullptr;
  // The ranks that split the token rows inside a block: the token group on
  // 2D/2.5D; on a cube its row in every layer (ranked by layer * q + column).
  Communicator* inner_token_group = nullptr;
  // The ranks holding the token table's vocabulary blocks of this rank's
  // columns, ranked so their token rows are consecutive: the weight group on
  // 2D/2.5D, the token group on a cube.
  Communicator* table_group = nullptr;

  TensorGridShape shape() const { return {q, depth, cube}; }
  int token_parts() const { return q * depth; }
  int token_index() const { return layer * q + row; }
  // This rank's token block inside a block.
  int inner_token_index() const { return cube ? layer * q + col : token_index(); }
  // The axis splitting the features inside a block (and the logits'
  // vocabulary): the columns on 2D/2.5D, the rows on a cube.
  TpAxes inner_feature_axis() const { return cube ? kTpRows : kTpCols; }
  // The first token block of the table group's ranks.
  int table_first_block() const { return cube ? 0 : layer * q; }
  // This rank's coordinate along one axis (kTpRows, kTpCols or kTpDepth).
  int coord(TpAxes axis) const;
  // The group spanning `axes`: kTpCols (hidden_group), kTpRows
  // (weight_group), kTpDepth (depth_group), kTpRows | kTpDepth
  // (token_group) or, on a cube, kTpCols | kTpDepth (inner_token_group).
  Communicator& group_over(TpAxes axes) const;

  // How a grid cuts this rank's pieces of the parameters:
  // a linear layer's weight [out, in] of `blocks` stacked blocks (q | k | v),
  // block by block. 2D/2.5D: output rows over the grid's rows, input columns
  // over its columns, a copy in every layer whose gradient is a partial sum
  // over the depth. A cube: input columns over the axis splitting the
  // layer's input features, output rows over the axis splitting its output
  // features and, within that, over the layers: no copies, whole gradients;
  ParamParallel linear_cut(GridSide side, int64_t blocks = 1) const;
  // a linear layer's bias: cut as the features of the layer's output, a
  // copy on every token row whose gradient is a partial sum over them;
  ParamParallel linear_bias_cut(GridSide side, int64_t blocks = 1) const;
  // a parameter whose dimension `dim` runs along the hidden columns between
  // blocks (norms, positions): cut over the grid's columns, a copy on every
  // token row whose gradient is a partial sum over the rows and the depth.
  ParamParallel column_cut(int dim, int64_t blocks = 1) const;
};

// The world as a mesh, with this rank's group along every axis: the ranks
// that differ from this one only in that coordinate, ranked by it.
class DeviceMesh {
 public:
  // Validates the shape against the world (Error before any group exists),
  // then creates the groups; collective over `world`, which must outlive the
  // mesh. A grid of more than one rank arranges the tp axis as a 2D/2.5D/3D
  // grid (its ranks must be the tp axis's size) and creates its groups.
  DeviceMesh(Communicator& world, const MeshShape& shape, const TensorGridShape& grid = {});
  // The tp axis's grid, or null when it is one group (1D).
  const TensorGrid* tensor_grid() const { return grid_.q > 1 ? &grid_ : nullptr; }

  const MeshShape& shape() const { return shape_; }
  int size(MeshAxis axis) const { return shape_[axis]; }
  // This rank's coordinate along `axis`.
  int coord(MeshAxis axis) const { return coords_[static_cast<size_t>(axis)]; }
  const MeshCoords& coords() const { return coords_; }
  Communicator& group(MeshAxis axis) { return *groups_[static_cast<size_t>(axis)]; }
  Communicator& world() { return world_; }

 private:
  Communicator& world_;
  MeshShape shape_;
  MeshCoords coords_;
  std::array<std::unique_ptr<Communicator>, kNumMeshAxes> groups_;
  TensorGrid grid_;
  std::unique_ptr<Communicator> hidden_group_, weight_group_, depth_group_, token_group_, inner_token_group_;
};

// ---------------------------------------------------------------------------
// Tensor parallelism (Megatron-LM style)
// ---------------------------------------------------------------------------

// The tensor-parallel group a model's layers split their matrices over, and
// whether the regions between them (LayerNorm, dropout, residual) are split
// along the tokens (sequence parallelism, Korthikanti et al.). Under sequence
// parallelism a rank holds rows [rank * N/tp, (rank + 1) * N/tp) of the
// micro-batch's N = B*T token rows; every op in those regions is per token, so
// the flattened token dimension is split, which keeps each shard contiguous.
// On a 2D/2.5D grid the block's activations are split by token rows and by
// hidden columns everywhere (TensorGrid).
struct TensorParallel {
  Communicator* group = nullptr;  // nullptr: no tensor parallelism
  bool sequence_parallel = false;
  const TensorGrid* grid = nullptr;  // nullptr: 1D

  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
  // Whether activations outside the tensor-parallel regions are split by
  // token, sequence parallelism's way.
  bool splits_tokens() const { return sequence_parallel && size() > 1; }
  // How many ways the token rows of a block's activations are split, and
  // this rank's share.
  int64_t token_parts() const { return grid ? grid->token_parts() : splits_tokens() ? size() : 1; }
  int64_t token_index() const { return grid ? grid->token_index() : splits_tokens() ? rank() : 0; }
  // Token rows this rank holds outside the regions, of `rows` in the micro-batch.
  int64_t local_rows(int64_t rows) const { return rows / token_parts(); }
  // The first of them.
  int64_t first_row(int64_t rows) const { return token_index() * (rows / token_parts()); }
  // How many ways the hidden dimension of a block's activations is split
  // (a grid's q), and this rank's share of `width` columns.
  int64_t hidden_parts() const { return grid ? grid->q : 1; }
  int64_t local_width(int64_t width) const { return width / hidden_parts(); }
  int64_t first_col(int64_t width) const { return grid ? grid->col * (width / grid->q) : 0; }
  // The index, in the global [.., width] activations, of this rank's first
  // element of a micro-batch of `rows` token rows whose first is global row
  // `row0`: where its dropout masks start.
  uint64_t first_element(int64_t row0, int64_t rows, int64_t width) const {
    return static_cast<uint64_t>((row0 + first_row(rows)) * width + first_col(width));
  }
  // How many ways a block's inner features (attention heads, the MLP's
  // intermediate columns) are split.
  int64_t feature_parts() const { return grid ? grid->q : size(); }
  // Megatron's cut of a parameter's dimension `dim` (of `blocks` stacked
  // blocks) over the whole group (1D).
  ParamParallel cut(int dim, int64_t blocks = 1) const;
  // Whether this rank holds the owning copy of a parameter replicated along
  // `axes` (coordinate 0 on each of them).
  bool owns_copy(TpAxes axes) const;
  // The group spanning `axes` (the whole group in 1D).
  Communicator& group_over(TpAxes axes) const;
};

// The two conjugate communication pairs at the edges of a tensor-parallel
// region (Megatron's f and g). Tensors are [rows, C] token-row matrices (any
// shape whose first dimension is the token rows). A column-parallel layer
// enters a region, a row-parallel layer leaves it:
//
//                     forward                 backward
//   enter  (tp)       identity                all-reduce
//          (sp)       all-gather of rows      reduce-scatter of rows
//   leave  (tp)       all-reduce              identity
//          (sp)       reduce-scatter of rows  all-gather of rows
//
// With a group of one every function returns its argument.
struct TensorParallelRegion {
  // x: this rank's rows -> every row (sp) or x itself (tp).
  static Tensor enter_forward(const TensorParallel& tp, const Tensor& x);
  // dx: this rank's partial gradient of every row -> the summed gradient of
  // its own rows. Under tp dx is reduced in place and returned.
  static Tensor enter_backward(const TensorParallel& tp, const Tensor& dx);
  // y: this rank's partial sum of every row -> the sum of its own rows. Under
  // tp y is reduced in place and returned.
  static Tensor leave_forward(const TensorParallel& tp, const Tensor& y);
  // dy: the gradient of this rank's rows -> the gradient of every row (sp) or
  // dy itself (tp).
  static Tensor leave_backward(const TensorParallel& tp, const Tensor& dy);
};

// ---------------------------------------------------------------------------
// Pipeline parallelism
// ---------------------------------------------------------------------------

// The order in which each pipeline rank runs the forwards and backwards of a
// step's micro-batches:
//   gpipe            every forward, then every backward (all activations of
//                    the step live at once); with several chunks per rank,
//                    chunk by chunk (forward-only evaluation of an
//                    interleaved model);
//   1f1b             PipeDream-flush: a warm-up of forwards, then one forward
//                    and one backward alternately, then the remaining
//                    backwards (at most `stages` micro-batches in flight);
//   interleaved_1f1b Megatron's interleaved 1F1B: each rank holds several
//                    model chunks (virtual stages) and cycles through them,
//                    dividing the bubble by the number of chunks.
enum class PipelineSchedule : uint8_t { gpipe, one_f_one_b, interleaved_1f1b };
const char* pipeline_schedule_name(PipelineSchedule schedule);
// Throws Error naming an unknown schedule and listing the known ones.
PipelineSchedule parse_pipeline_schedule(std::string_view name);

// One unit of a rank's pipeline work. Chunk c on pipeline rank s is virtual
// stage c * stages + s: activations flow from virtual stage k to k + 1, so
// from rank s to s + 1, and from the last rank's chunk c to the first rank's
// chunk c + 1.
struct PipelineAction {
  enum class Kind : uint8_t { forward, backward } kind = Kind::forward;
  int chunk = 0;
  int micro_batch = 0;
  bool operator==(const PipelineAction&) const = default;
};

// The actions of pipeline rank `stage` (of `stages`) for one step of
// `micro_batches` micro-batches over `chunks` model chunks per rank (1 unless
// interleaved). Every (chunk, micro-batch) appears once as a forward and once
// as a backward, forwards of a chunk in micro-batch order, backwards too.
// LOOM_CHECKs the arguments; plan_training validates them for users
// (interleaving needs chunks > 1 and micro_batches a multiple of stages).
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches,
                                             int chunks);

// What a pipeline rank computes; the executor moves the tensors between ranks.
class PipelineStageWork {
 public:
  virtual ~PipelineStageWork() = default;
  // The shape of the activation entering `chunk` for `micro_batch` (the
  // previous virtual stage's output), so it can be received.
  virtual Shape activation_shape(int chunk, int micro_batch) const = 0;
  // `input` is undefined on virtual stage 0 (it reads its own data). Returns
  // the chunk's output, which is sent on, or an undefined tensor on the last
  // virtual stage (it ends in the loss).
  virtual Tensor forward(int chunk, int micro_batch, const Tensor& input) = 0;
  // `grad_output` is undefined on the last virtual stage. Returns the gradient
  // of the chunk's input, which is sent back (ignored on virtual stage 0).
  virtual Tensor backward(int chunk, int micro_batch, const Tensor& grad_output) = 0;
};

// Where a pipeline rank's time went during one run_pipeline.
struct PipelineTiming {
  double step_seconds = 0.0;  // from the first action to the last send completing
  double idle_seconds = 0.0;  // blocked waiting for a neighbour's activation or gradient
  double bubble_fraction() const { return step_seconds > 0.0 ? idle_seconds / step_seconds : 0.0; }
};

// Runs this rank's actions (pipeline_actions for rank pipeline.rank() of
// pipeline.size()). Activations and their gradients travel point to point
// over `pipeline`; sends are asynchronous and complete before the call
// returns. With forward_only the backwards are left out (evaluation).
// Collective over `pipeline`.
PipelineTiming run_pipeline(Communicator& pipeline, PipelineSchedule schedule, int micro_batches, int chunks,
                            PipelineStageWork& work, bool forward_only = false);

// Splits `costs` (one per layer, in order) into `parts` contiguous ranges of
// at least one layer each, minimizing the costliest part. Returns the parts'
// boundaries: parts + 1 layer indices from 0 to costs.size().
std::vector<int> balance_layers(std::span<const double> costs, int parts);

}  // namespace loom
