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

// The world as a mesh, with this rank's group along every axis: the ranks
// that differ from this one only in that coordinate, ranked by it.
class DeviceMesh {
 public:
  // Validates the shape against the world (Error before any group exists),
  // then creates the groups; collective over `world`, which must outlive the
  // mesh.
  DeviceMesh(Communicator& world, const MeshShape& shape);

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
struct TensorParallel {
  Communicator* group = nullptr;  // nullptr: no tensor parallelism
  bool sequence_parallel = false;

  int size() const { return group ? group->size() : 1; }
  int rank() const { return group ? group->rank() : 0; }
  // Whether activations outside the tensor-parallel regions are split by token.
  bool splits_tokens() const { return sequence_parallel && size() > 1; }
  // Token rows this rank holds outside the regions, of `rows` in the micro-batch.
  int64_t local_rows(int64_t rows) const { return splits_tokens() ? rows / size() : rows; }
  // The first of them.
  int64_t first_row(int64_t rows) const { return splits_tokens() ? rank() * (rows / size()) : 0; }
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
