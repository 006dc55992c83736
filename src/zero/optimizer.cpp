#include <algorithm>

#include "loom/zero.h"
#include "working_precision.h"
#include "loom/device.h"

namespace loom {

using zero_detail::at;

ZeroOptimizer::ZeroOptimizer(const ParamLayout& layout, const ZeroPartition& partition, Communicator& dp,
                             const ZeroOptions& opts, const AdamWConfig& cfg, uint64_t seed, ZeroParamStore& params,
                             ZeroGradStore& grads)
    : layout_(layout), partition_(partition), dp_(dp), opts_(opts), params_(params), grads_(grads) {
  // Stage 0 updates every element on every rank (the replicas stay equal
  // because their reduced gradients are bit-identical); stages 1-3 update
  // only the rank's own blocks.
  for (const ZeroBucket& b : partition.buckets()) {
    const FlatRange r = opts.stage == 0 ? FlatRange{b.begin, b.end} : partition.owned(b);
    if (r.numel() > 0) ranges_.push_back(r);
  }
  int64_t total = 0;
  for (const FlatRange& r : ranges_) {
    master_offset_.push_back(total);
    total += r.numel();
  }
  if (opts.precision != DType::f32) {
    // Initialization draws each element on the host.
    const HostSection host;
    master_ = Tensor::empty({total});
    for (size_t i = 0; i < ranges_.size(); ++i)
      layout.initialize(master(i), ranges_[i].begin, ranges_[i].numel(), seed);
  }
  adamw_ = std::make_unique<AdamW>(layout, cfg, ranges_);
}

ZeroOptimizer::~ZeroOptimizer() = default;

float* ZeroOptimizer::master(size_t range) const {
  // In fp32 the working parameters are the master weights.
  if (opts_.precision == DType::f32) return static_cast<float*>(params_.working(ranges_.at(range).begin));
  return master_.data<float>() + master_offset_.at(range);
}

void ZeroOptimizer::count_norm_over(Communicator& model_parallel, std::vector<FlatRange> duplicates) {
  std::sort(duplicates.begin(), duplicates.end(), [](FlatRange a, FlatRange b) { return a.begin < b.begin; });
  model_parallel_ = &model_parallel;
  duplicates_ = std::move(duplicates);
}

GradientCheck ZeroOptimizer::check_gradients() {
  GradientCheck local;
  // The parts of an owned range that no other model-parallel rank counts.
  const auto counted_squares = [&](FlatRange r, const Tensor& g) {
    double sum = 0.0;
    int64_t at_elem = r.begin;
    const auto add = [&](int64_t end) {
      if (end > at_elem)
        sum += ops::sum_squares(zero_detail::at(g.raw(), g.dtype(), at_elem - r.begin), g.dtype(), end - at_elem);
    };
    for (const FlatRange& d : duplicates_) {
      if (d.end <= at_elem || d.begin >= r.end) continue;
      add(std::min(d.begin, r.end));
      at_elem = std::max(at_elem, std::min(d.end, r.end));
    }
    add(r.end);
    return sum;
  };
  // Stage 0 replicas check everything they would apply; the sum of squares
  // counts each element once, on its owner.
  if (opts_.stage == 0)
    local.non_finite = ops::count_non_finite(grads_.storage().raw(), grads_.storage().dtype(), grads_.storage().numel());
  for (const ZeroBucket& b : partition_.buckets()) {
    const FlatRange r = partition_.owned(b);
    if (r.numel() == 0) continue;
    const Tensor g = grads_.owned(r);
    if (opts_.stage > 0) local.non_finite += ops::count_non_finite(g.raw(), g.dtype(), r.numel());
    local.sum_squares += counted_squares(r, g);
  }
  // Every rank decides from the same reduced figures, so all skip or all
  // step together.
  double both[2] = {local.sum_squares, static_cast<double>(local.non_finite)};
  dp_.all_reduce(both, 2, DType::f64, ReduceOp::sum);
  if (model_parallel_) model_parallel_->all_reduce(both, 2, DType::f64, ReduceOp::sum);
  return {both[0], static_cast<int64_t>(both[1])};
}

void ZeroOptimizer::step(float lr, float grad_scale) {
  adamw_->begin_step(lr, grad_scale);
  Tensor converted;
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const FlatRange r = ranges_[i];
    const Tensor g = grads_.owned(r);
    const float* grad = nullptr;
    if (g.dtype() == DType::f32) {
      grad = g.data<float>();
    } else {
      if (!converted.defined() || converted.numel() < r.numel()) converted = Tensor::empty({r.numel()});
      ops::convert(g.raw(), g.dtype(), converted.raw(), DType::f32, r.numel());
      grad = converted.data<float>();
    }
    adamw_->update(i, master(i), grad);
    params_.assign(r, master(i));
  }
  converted = Tensor();
  params_.publish();
}

void ZeroOptimizer::gather_state(Tensor& params, Tensor& exp_avg, Tensor& exp_avg_sq) {
  params_.synchronize();
  const float* m = adamw_->exp_avg().data<float>();
  const float* v = adamw_->exp_avg_sq().data<float>();
  Tensor* outs[3] = {&params, &exp_avg, &exp_avg_sq};
  gather_owned(outs, [&](int kind, size_t i) -> const float* {
    return kind == 0 ? master(i) : (kind == 1 ? m : v) + adamw_->offset(i);
  });
}

Tensor ZeroOptimizer::gather_gradients() {
  Tensor grads, converted;
  Tensor* outs[1] = {&grads};
  gather_owned(outs, [&](int, size_t i) -> const float* {
    const FlatRange r = ranges_[i];
    const Tensor g = grads_.owned(r);
    if (g.dtype() == DType::f32) return g.data<float>();
    converted = Tensor::empty({r.numel()}, DType::f32, Tier::host);
    convert(g.raw(), g.dtype(), converted.raw(), DType::f32, r.numel());
    return converted.data<float>();
  });
  return grads;
}

void ZeroOptimizer::gather_owned(std::span<Tensor* const> outs,
                                 const std::function<const float*(int kind, size_t range)>& values) {
  const int64_t n = layout_.numel();
  // The values are read on the host, straight from the shards.
  const HostSection host;
  // Staged on the host tier: a checkpoint must not need a device budget
  // for a whole model that only fits sharded.
  for (Tensor* t : outs) *t = Tensor::zeros({n}, DType::f32, Tier::host);
  if (opts_.stage == 0) {
    for (size_t i = 0; i < ranges_.size(); ++i)
      for (size_t k = 0; k < outs.size(); ++k)
        std::copy_n(values(static_cast<int>(k), i), ranges_[i].numel(), outs[k]->data<float>() + ranges_[i].begin);
    return;
  }
  // Each bucket: every rank's block (padding included) gathered, then the
  // real elements copied into layout order.
  size_t i = 0;
  for (const ZeroBucket& b : partition_.buckets()) {
    const FlatRange own = partition_.owned(b);
    const bool has = own.numel() > 0;
    Tensor block = Tensor::zeros({b.shard}, DType::f32, Tier::host);
    Tensor whole = Tensor::empty({b.shard * partition_.ranks()}, DType::f32, Tier::host);
    for (size_t k = 0; k < outs.size(); ++k) {
      block.zero_();
      if (has) std::copy_n(values(static_cast<int>(k), i), own.numel(), block.data<float>());
      dp_.all_gather(block.raw(), whole.raw(), b.shard, DType::f32);
      std::copy_n(whole.data<float>(), b.numel(), outs[k]->data<float>() + b.begin);
    }
    if (has) ++i;
  }
}

void ZeroOptimizer::visit_state(const StateVisitor& visit) {
  Tensor p, m, v;
  gather_state(p, m, v);
  visit({0, p.numel()}, p.data<float>(), m.data<float>(), v.data<float>());
}

void ZeroOptimizer::visit_owned_state(const StateVisitor& visit) {
  params_.synchronize();
  const HostSection host;
  for (size_t i = 0; i < ranges_.size(); ++i)
    visit(ranges_[i], master(i), adamw_->exp_avg().data<float>() + adamw_->offset(i),
          adamw_->exp_avg_sq().data<float>() + adamw_->offset(i));
}

void ZeroOptimizer::load_state(const StateFiller& fill) { load_pieces(fill, /*owned_only=*/false); }

void ZeroOptimizer::load_owned_state(const StateFiller& fill) { load_pieces(fill, /*owned_only=*/true); }

void ZeroOptimizer::load_pieces(const StateFiller& fill, bool owned_only) {
  // Where the state lies in host memory (the CPU backend), owned elements
  // are filled in place: a sharded load then moves each byte once, from the
  // file into the state. Elsewhere they go through the staging buffer.
  const bool in_place = owned_only && adamw_->exp_avg().device().kind == DeviceKind::cpu;
  // Each parameter with elements this rank owns: whole, or just those
  // elements (one piece per owned range it meets, with that range), in flat
  // order.
  struct Piece {
    FlatRange elements;
    size_t range;
  };
  std::vector<Piece> pieces;
  for (const ParamSpec& p : layout_.params()) {
    const FlatRange param{p.offset, p.offset + p.numel()};
    for (size_t i = 0; i < ranges_.size(); ++i) {
      const FlatRange owned{std::max(ranges_[i].begin, param.begin), std::min(ranges_[i].end, param.end)};
      if (owned.begin >= owned.end) continue;
      if (!owned_only) {
        pieces.push_back({param, i});
        break;
      }
      // Owned elements go in blocks. Staged, they are small enough that the
      // values are still in cache when they are copied on; in place, each
      // kind's block is one read of the checkpoint, large enough (8 MiB)
      // that the device streams it (checkpoint_bench: loads from the device
      // at 0.75-0.8 of dd's speed with 1 MiB blocks, 0.96 with 8 MiB).
      const int64_t block = in_place ? int64_t(1) << 21 : int64_t(1) << 18;
      for (int64_t b = owned.begin; b < owned.end; b += block)
        pieces.push_back({{b, std::min(owned.end, b + block)}, i});
    }
  }
  // One staging buffer, for the largest piece: the host holds at most one
  // parameter's state beyond the rank's own at any time.
  int64_t largest = 0;
  if (!in_place)
    for (const Piece& piece : pieces) largest = std::max(largest, piece.elements.numel());
  Tensor staged = Tensor::empty({3 * largest}, DType::f32, Tier::host);
  for (const Piece& piece : pieces) {
    if (in_place) {
      const int64_t into = piece.elements.begin - ranges_[piece.range].begin;
      const int64_t at = adamw_->offset(piece.range) + into;
      fill(piece.elements, master(piece.range) + into, adamw_->exp_avg().data<float>() + at,
           adamw_->exp_avg_sq().data<float>() + at);
      continue;
    }
    const int64_t n = piece.elements.numel();
    float* values = staged.data<float>();
    fill(piece.elements, values, values + n, values + 2 * n);
    take_owned(piece.elements, values, values + n, values + 2 * n);
    // The copies read the staging buffer; the next parameter replaces it.
    ops::synchronize();
  }
  publish_loaded();
}

void ZeroOptimizer::visit_gradients(const GradientVisitor& visit) {
  const Tensor g = gather_gradients();
  visit({0, g.numel()}, g.data<float>());
}

void ZeroOptimizer::load_state(const Tensor& params, const Tensor& exp_avg, const Tensor& exp_avg_sq) {
  const int64_t n = layout_.numel();
  LOOM_CHECK(params.numel() == n && exp_avg.numel() == n && exp_avg_sq.numel() == n, "state of ", params.numel(),
             " elements for a model of ", n);
  take_owned({0, n}, params.data<float>(), exp_avg.data<float>(), exp_avg_sq.data<float>());
  publish_loaded();
}

void ZeroOptimizer::take_owned(FlatRange piece, const float* params, const float* exp_avg, const float* exp_avg_sq) {
  float* m = adamw_->exp_avg().data<float>();
  float* v = adamw_->exp_avg_sq().data<float>();
  for (size_t i = 0; i < ranges_.size(); ++i) {
    const FlatRange r = ranges_[i];
    const int64_t begin = std::max(r.begin, piece.begin), end = std::min(r.end, piece.end);
    if (begin >= end) continue;
    const size_t bytes = static_cast<size_t>(end - begin) * 4;
    const int64_t into = begin - r.begin, from = begin - piece.begin;
    ops::copy(master(i) + into, params + from, bytes);
    ops::copy(m + adamw_->offset(i) + into, exp_avg + from, bytes);
    ops::copy(v + adamw_->offset(i) + into, exp_avg_sq + from, bytes);
  }
}

void ZeroOptimizer::publish_loaded() {
  for (size_t i = 0; i < ranges_.size(); ++i) params_.assign(ranges_[i], master(i));
  params_.publish();
  // The host's state was copied in stream order; the caller may free it when
  // this returns.
  ops::synchronize();
}

}  // namespace loom
