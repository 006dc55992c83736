#include "loom/zero.h"
#include "working_precision.h"
#include "loom/device.h"

namespace loom {

using zero_detail::at;

struct ZeroParamStore::Resident {
  int refs = 0;
  Tensor gathered;  // stage 3: the group's bucket in the padded layout, working precision
  Tensor compute;   // the group's elements in fp32 while acquired (unless they are storage itself)
  Work pending;     // stage 3: the all-gather filling `gathered`
};

ZeroParamStore::ZeroParamStore(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                               const ZeroOptions& opts, uint64_t seed)
    : ParamStore(layout), partition_(partition), dp_(dp), opts_(opts), resident_(layout.num_groups()) {
  validate(opts);
  // Initialization draws each element on the host.
  const HostSection host;
  const bool sharded = opts.stage == 3;
  storage_ = Tensor::zeros({sharded ? partition.shard_numel() : partition.padded_numel()}, opts.precision);
  // Each element's initial value depends only on (seed, name, index), so a
  // shard initializes just its own elements; they are rounded to the working
  // precision as the master weights' copy is.
  for (const ZeroBucket& b : partition.buckets()) {
    const FlatRange r = sharded ? partition.owned(b) : FlatRange{b.begin, b.end};
    if (r.numel() == 0) continue;
    Tensor init = Tensor::empty({r.numel()});
    layout.initialize(init.data<float>(), r.begin, r.numel(), seed);
    ops::convert(init.data<float>(), DType::f32, working(r.begin), opts.precision, r.numel());
  }
}

ZeroParamStore::~ZeroParamStore() {
  // The all-gathers write into storage_, so they must end before it is
  // freed. A failed one has already failed the communicator, and the error
  // reached the caller through the step or the launcher: nothing to report.
  for (Work& w : publishing_) {
    try {
      w.wait();
    } catch (const Error&) {
    }
  }
}

void* ZeroParamStore::working(int64_t flat) const {
  const int64_t pos = opts_.stage < 3 ? partition_.padded(partition_.bucket_containing(flat), flat)
                                      : partition_.shard_position(flat);
  return at(storage_.raw(), opts_.precision, pos);
}

bool ZeroParamStore::expected_next(int group) const {
  return in_step_ && !recording_ && cursor_ < order_.size() && order_[cursor_] == group;
}

void ZeroParamStore::gather(int group) {
  const ZeroBucket& b = partition_.bucket_of_group(group);
  Resident& r = resident_[static_cast<size_t>(group)];
  r.gathered = Tensor::empty({b.shard * partition_.ranks()}, opts_.precision);
  r.pending = dp_.all_gather_async(at(storage_.raw(), opts_.precision, b.shard_begin), r.gathered.raw(), b.shard,
                                   opts_.precision);
}

void ZeroParamStore::acquire(int group) {
  check_group(group);
  if (!publishing_.empty()) publishing_[static_cast<size_t>(partition_.bucket_index(group))].wait();
  if (in_step_) {
    if (recording_) {
      recorded_.push_back(group);
    } else if (expected_next(group)) {
      ++cursor_;
    } else {
      // The model acquired groups in a new order: stop prefetching (it would
      // fetch the wrong groups) and learn the order again next step.
      order_.clear();
    }
  }
  Resident& r = resident_[static_cast<size_t>(group)];
  if (r.refs++ == 0 && !r.compute.defined()) {
    const auto [begin, end] = layout_.group_range(group);
    if (opts_.stage == 3) {
      if (!r.gathered.defined()) gather(group);
      r.pending.wait();
      // With one group per bucket the group starts the gathered buffer.
      r.compute = opts_.precision == DType::f32 ? r.gathered.flat(0, end - begin) : Tensor::empty({end - begin});
      if (opts_.precision != DType::f32)
        ops::convert(r.gathered.raw(), opts_.precision, r.compute.raw(), DType::f32, end - begin);
    } else if (opts_.precision != DType::f32) {
      r.compute = Tensor::empty({end - begin});
      ops::convert(working(begin), opts_.precision, r.compute.raw(), DType::f32, end - begin);
    }
  }
  // Prefetch: the all-gather of the next group runs while this one computes.
  if (opts_.stage == 3 && in_step_ && !recording_ && cursor_ < order_.size()) {
    const int next = order_[cursor_];
    if (!resident_[static_cast<size_t>(next)].gathered.defined()) gather(next);
  }
}

void ZeroParamStore::release(int group) {
  check_group(group);
  Resident& r = resident_[static_cast<size_t>(group)];
  LOOM_CHECK(r.refs > 0, "release of group ", layout_.group_name(group), " which is not acquired");
  // A group acquired again right away (the tied embedding between the
  // forward and the backward of the output head) stays.
  if (--r.refs == 0 && !expected_next(group)) drop(group);
}

void ZeroParamStore::drop(int group) {
  Resident& r = resident_[static_cast<size_t>(group)];
  r.pending.wait();
  r.pending = Work();
  r.gathered = Tensor();
  r.compute = Tensor();
}

Tensor ZeroParamStore::param(int id) const {
  const ParamSpec& p = layout_.param(id);
  if (opts_.stage < 3 && opts_.precision == DType::f32)
    return Tensor::borrow(working(p.offset), p.shape, DType::f32, storage_.tier());
  const Resident& r = resident_[static_cast<size_t>(p.group)];
  LOOM_CHECK(r.compute.defined(), "parameter ", p.name, " used while its group ", layout_.group_name(p.group),
             " is not acquired");
  return r.compute.flat(p.offset - layout_.group_range(p.group).first, p.numel()).view(p.shape);
}

void ZeroParamStore::begin_step() {
  in_step_ = true;
  cursor_ = 0;
  recording_ = order_.empty();
  recorded_.clear();
}

void ZeroParamStore::end_step() {
  if (recording_) order_ = recorded_;
  in_step_ = false;
  for (int g = 0; g < layout_.num_groups(); ++g)
    if (resident_[static_cast<size_t>(g)].refs == 0) drop(g);
}

void ZeroParamStore::assign(FlatRange range, const float* master) {
  synchronize();
  if (range.numel() == 0) return;
  void* dst = working(range.begin);
  if (dst != master) ops::convert(master, DType::f32, dst, opts_.precision, range.numel());
}

void ZeroParamStore::publish() {
  if (opts_.stage == 3) {
    for (int g = 0; g < layout_.num_groups(); ++g) {
      LOOM_CHECK(resident_[static_cast<size_t>(g)].refs == 0, "parameters updated while group ",
                 layout_.group_name(g), " is acquired");
      drop(g);
    }
  }
  if (opts_.stage != 1 && opts_.stage != 2) return;
  synchronize();
  for (const ZeroBucket& b : partition_.buckets()) {
    void* bucket = at(storage_.raw(), opts_.precision, b.padded_begin);
    publishing_.push_back(dp_.all_gather_async(at(bucket, opts_.precision, partition_.rank() * b.shard), bucket,
                                               b.shard, opts_.precision));
  }
}

void ZeroParamStore::synchronize() {
  for (Work& w : publishing_) w.wait();
  publishing_.clear();
}

}  // namespace loom
