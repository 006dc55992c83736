// loom zero: data parallelism with ZeRO sharding and mixed precision.
//
// Every data-parallel rank runs the whole model on its slice of the global
// batch. What the stages change is who holds which model state (Rajbhandari et
// al., "ZeRO", 2020), never the model code:
//
//   stage 0  every rank holds everything; gradients are all-reduced (DDP)
//   stage 1  optimizer state (fp32 master weights, Adam moments) sharded;
//            gradients reduce-scattered, updated parameters all-gathered
//   stage 2  + gradients sharded: each bucket is reduce-scattered into its
//            owners' shards as soon as it is complete, then freed
//   stage 3  + parameters sharded: a group's parameters are all-gathered when
//            the model acquires it, the next group's prefetched, and freed on
//            release
//
// The unit of sharding is a bucket: consecutive parameter groups (modules),
// packed up to ZeroOptions::bucket_bytes under stages 0-2 and one group per
// bucket under stage 3 (the unit that is gathered and freed). A bucket of n
// elements is padded to N * ceil(n / N) for N ranks and rank r owns block r,
// so any parameter count works with any dp size. The three stores below play
// the roles of ParamStore, GradStore and OptimStore in ARCHITECTURE.md.
//
// Mixed precision: working parameters and gradients are stored and
// communicated in ZeroOptions::precision (bf16 or f16); the optimizer keeps
// fp32 master weights for the elements it owns and rounds them into the working
// copy after each update. Kernels compute in fp32 on converted operands and
// each micro-batch's gradient is rounded once into the working precision.
#pragma once

#include <deque>
#include <functional>
#include <span>
#include <vector>

#include "loom/comm.h"
#include "loom/optim.h"
#include "loom/store.h"

namespace loom {

struct ZeroOptions {
  int stage = 0;
  DType precision = DType::f32;              // working parameters and gradients: f32, bf16 or f16
  int64_t bucket_bytes = int64_t(25) << 20;  // gradient bucket size under stages 0-2, in working-precision bytes
};
// Throws Error naming the field for a stage outside 0-3, a precision other
// than f32/bf16/f16 or a bucket size <= 0.
void validate(const ZeroOptions& opts);

// One bucket of the partition: groups [first_group, end_group), flat layout
// elements [begin, end), `shard` elements per rank.
struct ZeroBucket {
  int first_group = 0, end_group = 0;
  int64_t begin = 0, end = 0;
  int64_t shard = 0;
  int64_t padded_begin = 0;  // where the bucket starts in the padded space (ranks * shard per bucket)
  int64_t shard_begin = 0;   // where this bucket's block starts in a rank's shard
  int64_t numel() const { return end - begin; }
};

// The flat parameter space cut into buckets and their per-rank blocks.
class ZeroPartition {
 public:
  // bucket_numel <= 0: one bucket per group.
  ZeroPartition(const ParamLayout& layout, int ranks, int rank, int64_t bucket_numel);

  int ranks() const { return ranks_; }
  int rank() const { return rank_; }
  const std::vector<ZeroBucket>& buckets() const { return buckets_; }
  int bucket_index(int group) const { return bucket_of_group_.at(static_cast<size_t>(group)); }
  const ZeroBucket& bucket_of_group(int group) const { return buckets_[static_cast<size_t>(bucket_index(group))]; }
  // The bucket holding flat element `flat`.
  const ZeroBucket& bucket_containing(int64_t flat) const;
  int64_t padded_numel() const { return padded_numel_; }
  int64_t shard_numel() const { return shard_numel_; }
  // Position in the padded space of flat element `flat` (any element of `bucket`).
  int64_t padded(const ZeroBucket& b, int64_t flat) const { return b.padded_begin + (flat - b.begin); }
  // The real (unpadded) elements rank `r` owns in bucket b: flat [begin, end).
  FlatRange owned(const ZeroBucket& b, int r) const;
  FlatRange owned(const ZeroBucket& b) const { return owned(b, rank_); }
  // Position in this rank's shard of flat element `flat`, which it must own.
  int64_t shard_position(int64_t flat) const;

 private:
  int ranks_, rank_;
  std::vector<ZeroBucket> buckets_;
  std::vector<int> bucket_of_group_;
  int64_t padded_numel_ = 0, shard_numel_ = 0;
};

// Working parameters. Stages 0-2 keep every bucket in the padded space;
// stage 3 keeps this rank's shard and gathers a group on acquire. Within a
// training step (begin_step .. end_step) stage 3 records the order in which
// groups are acquired; in later steps it prefetches the next group of that
// order while the current one computes, and keeps a group that is acquired
// again immediately after its release.
class ZeroParamStore final : public ParamStore {
 public:
  ZeroParamStore(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                 const ZeroOptions& opts, uint64_t seed);
  ~ZeroParamStore() override;

  void acquire(int group) override;
  void release(int group) override;
  Tensor param(int id) const override;
  void begin_step() override;
  void end_step() override;

  // What this rank stores: the padded space (stages 0-2) or its shard (stage 3).
  Tensor storage() const { return storage_; }
  // The working copy of flat element `flat`, which this rank must store.
  void* working(int64_t flat) const;
  // Writes the master values of the elements `range` (owned by this rank)
  // into the working copy, rounding to the working precision.
  void assign(FlatRange range, const float* master);
  // After each rank has assigned its blocks: stages 1-2 start all-gathering
  // every bucket, in bucket order, and the first acquire of a group waits for
  // its bucket only, so the gathers overlap the next forward; stage 3 drops
  // every gathered group (they are stale).
  void publish();
  // Waits for every all-gather publish() started.
  void synchronize();

 private:
  struct Resident;
  // Whether group is the next one the recorded order expects.
  bool expected_next(int group) const;
  // Stage 3: starts all-gathering the group's bucket.
  void gather(int group);
  void drop(int group);

  const ZeroPartition& partition_;
  Communicator& dp_;
  ZeroOptions opts_;
  Tensor storage_;
  std::vector<Resident> resident_;
  std::vector<Work> publishing_;  // stages 1-2: per bucket, the all-gather of publish()
  // Stage 3 prefetching: the acquisition order of the last complete step and
  // the position in it; `recording_` while that order is being learned.
  std::vector<int> order_;
  std::vector<int> recorded_;
  size_t cursor_ = 0;
  bool in_step_ = false, recording_ = true;
};

// Gradients. The model accumulates in fp32; a bucket is handed to its
// collective when the last of its groups is ready:
//   stages 0-1: the fp32 sum over the step's micro-batches (in the padded
//     buffer itself when f32, in an fp32 bucket otherwise, rounded once into
//     the working-precision buffer), all-reduced (stage 0) or
//     reduce-scattered (stage 1) on the last micro-batch of the step only;
//   stages 2-3: a transient fp32 bucket, rounded to the working precision and
//     reduce-scattered on every micro-batch (no rank keeps a whole gradient),
//     then added into this rank's fp32 shard; at most two buckets in flight.
class ZeroGradStore final : public GradStore {
 public:
  ZeroGradStore(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                const ZeroOptions& opts);
  ~ZeroGradStore() override;

  Tensor grad(int id) const override;
  void zero() override;
  void set_reduce(bool reduce) override { reduce_ = reduce; }
  void group_ready(int group) override;
  void finish() override;

  // This rank's reduced gradient of the elements `range` (owned by it): in
  // the working precision under stages 0-1, fp32 under stages 2-3; valid
  // after finish().
  Tensor owned(FlatRange range) const;

  // Model parallelism reduces some gradients over other groups before the
  // data-parallel reduction (tensor-parallel partial sums, the pipeline's
  // tied embedding). For that, stages 0-1 run every micro-batch with
  // set_reduce(false); then accumulated() gives a parameter's local gradient
  // (the fp32 sum, before its rounding) to reduce, and reduce_all() starts every bucket's
  // data-parallel reduction, in bucket order (finish() waits for them).
  Tensor accumulated(int id) const;
  void reduce_all();
  // Everything this rank stores: the padded space (stages 0-1) or its shard.
  Tensor storage() const { return storage_; }

 private:
  struct Bucket;
  struct InFlight;
  Bucket& bucket_state(const ZeroBucket& b) const;
  void launch(size_t bucket);
  void communicate(size_t bucket);
  void retire(InFlight& op);
  void retire_finished(size_t keep_in_flight);

  const ZeroPartition& partition_;
  Communicator& dp_;
  ZeroOptions opts_;
  Tensor storage_;
  mutable std::vector<Bucket> buckets_;
  std::deque<InFlight> in_flight_;
  bool reduce_ = true;
};

// Optimizer state: AdamW moments (and, for bf16/f16, fp32 master weights) of
// the elements this rank owns: all of them under stage 0, its blocks under
// stages 1-3.
class ZeroOptimizer final : public OptimizerStore {
 public:
  ZeroOptimizer(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                const ZeroOptions& opts, const AdamWConfig& cfg, uint64_t seed, ZeroParamStore& params,
                ZeroGradStore& grads);
  ~ZeroOptimizer();

  // Under model parallelism the gradient norm spans every rank of the model:
  // check_gradients also sums over `model_parallel` (the ranks of one data-
  // parallel replica), leaving out `duplicates`, the elements whose gradient
  // another of those ranks counts (tensor-parallel replicas, the tied copy of
  // the token table). Call before the first step.
  void count_norm_over(Communicator& model_parallel, std::vector<FlatRange> duplicates);
  // Collective: the gradients' global sum of squares and non-finite count.
  GradientCheck check_gradients() override;
  // Collective: one AdamW update of the owned elements with every gradient
  // multiplied by grad_scale, then the working parameters republished.
  void step(float lr, float grad_scale) override;
  int64_t steps() const override { return adamw_->steps(); }
  void set_steps(int64_t t) override { adamw_->set_steps(t); }
  // One piece: the whole model, gathered on the host tier of every rank.
  void visit_state(const StateVisitor& visit) override;
  // One parameter at a time, only those with elements this rank owns: a rank
  // stages one parameter beyond its own blocks, never the whole model.
  void load_state(const StateFiller& fill) override;
  // Only the owned elements of those parameters, through the same buffer.
  void load_owned_state(const StateFiller& fill) override;
  // ranges(), in place: nothing is staged.
  std::vector<FlatRange> owned_ranges() const override { return ranges_; }
  void visit_owned_state(const StateVisitor& visit) override;
  void visit_gradients(const GradientVisitor& visit) override;

  // Collective: the whole model's fp32 weights (the master weights) and
  // moments, in the layout's flat order, on every rank.
  void gather_state(Tensor& params, Tensor& exp_avg, Tensor& exp_avg_sq);
  // Collective: the step's reduced gradient of the whole model in fp32 (still
  // multiplied by the loss scale), in the layout's flat order, on every rank
  // (host tier); valid between the gradient store's finish() and step().
  Tensor gather_gradients();
  // Collective: takes this rank's elements from whole-model tensors and
  // republishes the working parameters.
  void load_state(const Tensor& params, const Tensor& exp_avg, const Tensor& exp_avg_sq);

  AdamW& adamw() { return *adamw_; }
  // The ranges this rank updates, in the order of the moments.
  const std::vector<FlatRange>& ranges() const { return ranges_; }
  // fp32 values of the owned elements, per range (the master weights, or the
  // working parameters themselves in fp32).
  float* master(size_t range) const;

 private:
  // Collective: whole-model fp32 tensors (host tier) assembled from every
  // rank's owned ranges; values(k, i) gives the fp32 values of range i for
  // outs[k], read before the next call.
  void gather_owned(std::span<Tensor* const> outs, const std::function<const float*(int kind, size_t range)>& values);
  // load_state (whole parameters) or load_owned_state (owned elements).
  void load_pieces(const StateFiller& fill, bool owned_only);
  // Copies the owned elements of flat elements `piece` (host values) into the
  // master weights and moments, in stream order.
  void take_owned(FlatRange piece, const float* params, const float* exp_avg, const float* exp_avg_sq);
  // The working parameters rounded from the master weights and republished.
  void publish_loaded();

  const ParamLayout& layout_;
  const ZeroPartition& partition_;
  Communicator& dp_;
  ZeroOptions opts_;
  ZeroParamStore& params_;
  ZeroGradStore& grads_;
  std::vector<FlatRange> ranges_;
  Communicator* model_parallel_ = nullptr;
  std::vector<FlatRange> duplicates_;  // sorted, disjoint
  std::vector<int64_t> master_offset_;  // per range, into master_
  Tensor master_;                       // bf16/f16 only
  std::unique_ptr<AdamW> adamw_;
};

}  // namespace loom
