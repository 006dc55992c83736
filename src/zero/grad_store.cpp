#include "loom/zero.h"
#include "working_precision.h"
#include "loom/device.h"

namespace loom {

using zero_detail::at;

struct ZeroGradStore::Bucket {
  int groups_left = 0;  // groups of the bucket not yet ready in this micro-batch
  // fp32, padded: where the model accumulates. Stages 0-1 keep it across the
  // step's micro-batches (Megatron's main_grad) and round it to the working
  // precision once, before the reduction; stages 2-3 hand it over after each
  // micro-batch.
  Tensor scratch;
};

struct ZeroGradStore::InFlight {
  size_t bucket = 0;
  Tensor buffer;  // stages 2-3: the reduce-scattered bucket (working precision)
  Work work;
};

namespace {
// Buckets whose reduce-scatter may be outstanding at once under stages 2-3:
// enough to overlap with backward, few enough to bound the transient memory.
constexpr size_t kMaxInFlight = 2;
}  // namespace

ZeroGradStore::ZeroGradStore(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                             const ZeroOptions& opts)
    : GradStore(layout, NoStorage{}), partition_(partition), dp_(dp), opts_(opts), buckets_(partition.buckets().size()) {
  validate(opts);
  // Stages 2-3 reduce every micro-batch, so the accumulation across
  // micro-batches happens in the shard: fp32 whatever the precision.
  storage_ = opts.stage >= 2 ? Tensor::zeros({partition.shard_numel()})
                             : Tensor::zeros({partition.padded_numel()}, opts.precision);
  for (size_t i = 0; i < buckets_.size(); ++i) {
    const ZeroBucket& b = partition.buckets()[i];
    buckets_[i].groups_left = b.end_group - b.first_group;
  }
}

ZeroGradStore::~ZeroGradStore() = default;

Tensor ZeroGradStore::grad(int id) const {
  const ParamSpec& p = layout_.param(id);
  const int index = partition_.bucket_index(p.group);
  const ZeroBucket& b = partition_.buckets()[static_cast<size_t>(index)];
  // Stages 0-1 in fp32 accumulate straight into the reduced buffer.
  if (opts_.stage <= 1 && opts_.precision == DType::f32)
    return Tensor::borrow(at(storage_.raw(), DType::f32, partition_.padded(b, p.offset)), p.shape, DType::f32,
                          storage_.tier());
  Bucket& s = buckets_[static_cast<size_t>(index)];
  if (!s.scratch.defined()) s.scratch = Tensor::zeros({b.shard * partition_.ranks()});
  return s.scratch.flat(p.offset - b.begin, p.numel()).view(p.shape);
}

void ZeroGradStore::zero() {
  LOOM_CHECK(in_flight_.empty(), "gradients zeroed while reductions are in flight");
  storage_.zero_();
  for (Bucket& s : buckets_) s.scratch = Tensor();
  reduce_ = true;
}

void ZeroGradStore::group_ready(int group) {
  check_group(group);
  const int index = partition_.bucket_index(group);
  const ZeroBucket& b = partition_.buckets()[static_cast<size_t>(index)];
  Bucket& s = buckets_[static_cast<size_t>(index)];
  LOOM_CHECK(s.groups_left > 0, "group ", layout_.group_name(group), " ready twice in one micro-batch");
  if (--s.groups_left > 0) return;
  s.groups_left = b.end_group - b.first_group;
  launch(static_cast<size_t>(index));
}

void ZeroGradStore::launch(size_t index) {
  const ZeroBucket& b = partition_.buckets()[index];
  Bucket& s = buckets_[index];
  const DType dt = opts_.precision;
  const int64_t padded = b.shard * partition_.ranks();
  if (opts_.stage <= 1) {
    if (reduce_) communicate(index);
    return;
  }
  // Stages 2-3: no rank keeps the whole gradient, so every micro-batch's
  // bucket goes to its owners at once, rounded to the working precision
  // (the volume of stages 0-1), and the owners accumulate it in fp32
  // (DeepSpeed's bf16 ZeRO-2: working-precision reduce-scatter, fp32
  // gradient accumulation).
  LOOM_CHECK(s.scratch.defined(), "bucket of groups ", b.first_group, "-", b.end_group - 1, " ready without gradients");
  InFlight op{index, Tensor(), Work()};
  if (dt == DType::f32) {
    op.buffer = std::move(s.scratch);
  } else {
    op.buffer = Tensor::empty({padded}, dt);
    ops::convert(s.scratch.raw(), DType::f32, op.buffer.raw(), dt, padded);
  }
  s.scratch = Tensor();
  op.work = dp_.reduce_scatter_async(op.buffer.raw(), at(op.buffer.raw(), dt, partition_.rank() * b.shard), b.shard, dt);
  in_flight_.push_back(std::move(op));
  retire_finished(kMaxInFlight);
}

void ZeroGradStore::communicate(size_t index) {
  const ZeroBucket& b = partition_.buckets()[index];
  const DType dt = opts_.precision;
  void* bucket = at(storage_.raw(), dt, b.padded_begin);
  Bucket& s = buckets_[index];
  if (s.scratch.defined()) {
    // bf16/f16: the fp32 sum of the step's micro-batches is rounded once and
    // reduced in the working precision, as stages 2-3 reduce (Megatron keeps
    // bf16 reductions in fp32 at twice the volume; the rounding of a sum
    // loses no small micro-batch contribution, only the last bits).
    ops::convert(s.scratch.raw(), DType::f32, bucket, dt, b.shard * partition_.ranks());
    s.scratch = Tensor();
  }
  InFlight op{index, Tensor(), Work()};
  if (opts_.stage == 0)
    op.work = dp_.all_reduce_async(bucket, b.numel(), dt, ReduceOp::sum);
  else
    op.work = dp_.reduce_scatter_async(bucket, at(bucket, dt, partition_.rank() * b.shard), b.shard, dt);
  in_flight_.push_back(std::move(op));
}

Tensor ZeroGradStore::accumulated(int id) const {
  LOOM_CHECK(opts_.stage <= 1, "only stages 0-1 keep a whole local gradient");
  return grad(id);
}

void ZeroGradStore::reduce_all() {
  LOOM_CHECK(opts_.stage <= 1 && !reduce_ && in_flight_.empty(), "reduce_all after micro-batches that reduced");
  for (size_t i = 0; i < buckets_.size(); ++i) communicate(i);
}

void ZeroGradStore::retire(InFlight& op) {
  op.work.wait();
  if (opts_.stage <= 1) return;
  const ZeroBucket& b = partition_.buckets()[op.bucket];
  const DType dt = opts_.precision;
  float* shard = storage_.data<float>() + b.shard_begin;
  if (dt == DType::f32) {
    ops::add_rounded(shard, DType::f32, op.buffer.data<float>() + partition_.rank() * b.shard, b.shard);
  } else {
    Tensor widened = Tensor::empty({b.shard});
    ops::convert(at(op.buffer.raw(), dt, partition_.rank() * b.shard), dt, widened.raw(), DType::f32, b.shard);
    ops::add_rounded(shard, DType::f32, widened.data<float>(), b.shard);
  }
  op.buffer = Tensor();
}

void ZeroGradStore::retire_finished(size_t keep_in_flight) {
  while (!in_flight_.empty() && (in_flight_.size() > keep_in_flight || in_flight_.front().work.done())) {
    retire(in_flight_.front());
    in_flight_.pop_front();
  }
}

void ZeroGradStore::finish() { retire_finished(0); }

Tensor ZeroGradStore::owned(FlatRange range) const {
  const ZeroBucket& b = partition_.bucket_containing(range.begin);
  const FlatRange own = partition_.owned(b);
  LOOM_CHECK(opts_.stage == 0 || (own.begin <= range.begin && range.end <= own.end), "range [", range.begin, ", ",
             range.end, ") is not owned by rank ", partition_.rank());
  const int64_t pos = opts_.stage >= 2 ? partition_.shard_position(range.begin) : partition_.padded(b, range.begin);
  return Tensor::borrow(at(storage_.raw(), storage_.dtype(), pos), {range.numel()}, storage_.dtype(), storage_.tier());
}

}  // namespace loom
