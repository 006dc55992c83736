#include <algorithm>
#include <vector>

#include "loom/device.h"
#include "loom/store.h"

namespace loom {

ParamLayout trainable_layout(const ParamLayout& layout, const std::vector<bool>& frozen, std::vector<int>* to_model) {
  const size_t n = layout.params().size();
  LOOM_CHECK(frozen.size() == n, "frozen flags for ", frozen.size(), " of ", n, " parameters");
  ParamLayout trainable;
  std::vector<int> groups(static_cast<size_t>(layout.num_groups()), -1);
  for (size_t id = 0; id < n; ++id) {
    if (frozen[id]) continue;
    const ParamSpec& p = layout.params()[id];
    int& g = groups[static_cast<size_t>(p.group)];
    if (g < 0) g = trainable.add_group(layout.group_name(p.group));
    trainable.add(p.name, p.global_shape, p.init, p.weight_decay, g, p.parallel);
    if (to_model) to_model->push_back(static_cast<int>(id));
  }
  if (trainable.params().empty()) throw Error("every parameter of the model is frozen: nothing would train");
  return trainable;
}

FrozenParams::FrozenParams(const ParamLayout& layout, const std::vector<bool>& frozen, DType dtype, uint64_t seed)
    : layout_(layout), to_model_(), trainable_(trainable_layout(layout, frozen, &to_model_)), dtype_(dtype) {
  const size_t n = layout.params().size();
  to_trainable_.assign(n, -1);
  groups_.assign(static_cast<size_t>(layout.num_groups()), -1);
  for (size_t t = 0; t < to_model_.size(); ++t) {
    const int id = to_model_[t];
    to_trainable_[static_cast<size_t>(id)] = static_cast<int>(t);
    groups_[static_cast<size_t>(layout.param(id).group)] = trainable_.param(static_cast<int>(t)).group;
  }
  stored_.resize(n);
  // Initialization draws each element on the host.
  const HostSection host;
  std::vector<float> values;
  for (size_t id = 0; id < n; ++id) {
    if (!frozen[id]) continue;
    const ParamSpec& p = layout.params()[id];
    values.resize(static_cast<size_t>(p.numel()));
    layout.initialize(values.data(), p.offset, p.numel(), seed);
    stored_[id] = Tensor::empty(p.shape, dtype);
    convert(values.data(), DType::f32, stored_[id].raw(), dtype, p.numel());
  }
}

void FrozenParams::load(int id, const float* values) {
  const HostSection host;
  const Tensor& t = stored(id);
  LOOM_CHECK(t.defined(), "parameter ", layout_.param(id).name, " is not frozen");
  convert(values, DType::f32, t.raw(), dtype_, t.numel());
}

int64_t FrozenParams::numel() const { return layout_.numel() - trainable_.numel(); }

FrozenParamStore::FrozenParamStore(const FrozenParams& frozen, std::unique_ptr<ParamStore> trainable)
    : ParamStore(frozen.layout()), frozen_(frozen), trainable_(std::move(trainable)),
      acquired_(static_cast<size_t>(frozen.layout().num_groups()), 0),
      working_(frozen.layout().params().size()) {}

void FrozenParamStore::acquire(int group) {
  check_group(group);
  if (const int g = frozen_.trainable_group(group); g >= 0) trainable_->acquire(g);
  if (acquired_[static_cast<size_t>(group)]++ > 0 || frozen_.dtype() == DType::f32) return;
  for (size_t id = 0; id < layout_.params().size(); ++id) {
    const int i = static_cast<int>(id);
    if (layout_.param(i).group != group || !frozen_.frozen(i)) continue;
    const Tensor& s = frozen_.stored(i);
    working_[id] = Tensor::empty(s.shape());
    ops::convert(s.raw(), s.dtype(), working_[id].raw(), DType::f32, s.numel());
  }
}

void FrozenParamStore::release(int group) {
  check_group(group);
  if (const int g = frozen_.trainable_group(group); g >= 0) trainable_->release(g);
  int& n = acquired_[static_cast<size_t>(group)];
  LOOM_CHECK(n > 0, "release of group ", layout_.group_name(group), " that is not acquired");
  if (--n > 0) return;
  for (size_t id = 0; id < layout_.params().size(); ++id)
    if (layout_.params()[id].group == group) working_[id] = Tensor();
}

Tensor FrozenParamStore::param(int id) const {
  if (!frozen_.frozen(id)) return trainable_->param(frozen_.trainable_id(id));
  if (frozen_.dtype() == DType::f32) return frozen_.stored(id);
  const Tensor& w = working_.at(static_cast<size_t>(id));
  LOOM_CHECK(w.defined(), "frozen parameter ", layout_.param(id).name, " read outside acquire/release of its group");
  return w;
}

FrozenGradStore::FrozenGradStore(const FrozenParams& frozen, std::unique_ptr<GradStore> trainable)
    : GradStore(frozen.layout(), NoStorage{}), frozen_(frozen), trainable_(std::move(trainable)) {}

Tensor FrozenGradStore::grad(int id) const {
  return frozen_.frozen(id) ? Tensor() : trainable_->grad(frozen_.trainable_id(id));
}

void FrozenGradStore::group_ready(int group) {
  check_group(group);
  if (const int g = frozen_.trainable_group(group); g >= 0) trainable_->group_ready(g);
}

FrozenOptimizer::FrozenOptimizer(FrozenParams& frozen, std::unique_ptr<OptimizerStore> trainable, bool saves_frozen)
    : frozen_(frozen), trainable_(std::move(trainable)), saves_frozen_(saves_frozen) {}

namespace {

// Calls on_trainable(model id, trainable-flat offset within the piece) for
// each parameter of every piece the trainable store visits and
// on_frozen(model id) for the frozen ones between them, so that the model's
// parameters come in their flat order. With `owned_only` the trainable
// store may skip parameters it holds nothing of (a ZeRO store loads only its
// own); otherwise it must visit every one.
template <typename Visit, typename OnTrainable, typename OnFrozen>
void in_model_order(const FrozenParams& f, Visit visit_trainable, OnTrainable on_trainable, OnFrozen on_frozen,
                    bool owned_only = false) {
  const int n = static_cast<int>(f.layout().params().size());
  int next = 0;
  const auto frozen_until = [&](int end) {
    for (; next < end; ++next) {
      if (!f.frozen(next)) {
        LOOM_CHECK(owned_only, "trainable parameter ", f.layout().param(next).name, " skipped by the store");
        continue;
      }
      on_frozen(next);
    }
  };
  visit_trainable([&](FlatRange r) {
    const std::vector<ParamSpec>& params = f.trainable().params();
    for (size_t t = 0; t < params.size(); ++t) {
      const ParamSpec& p = params[t];
      if (p.offset < r.begin || p.offset >= r.end) continue;
      const int id = f.model_id(static_cast<int>(t));
      frozen_until(id);
      on_trainable(id, p.offset - r.begin);
      next = id + 1;
    }
  });
  frozen_until(n);
}

FlatRange range_of(const ParamSpec& p) { return {p.offset, p.offset + p.numel()}; }

// The pieces of a trainable store's own state (ranges of the trainable
// layout, which may split parameters) put back in the model's flat order,
// with the frozen parameters between them. Fed the store's ranges in
// increasing order: each splits into the parts that lie together in the
// model, and the frozen parameters before a part come first.
class OwnedInModelOrder {
 public:
  // with_frozen: whether the frozen parameters are visited at all.
  OwnedInModelOrder(const FrozenParams& f, bool with_frozen) : f_(f), with_frozen_(with_frozen) {}

  // on_frozen(model id) for each frozen parameter before `r`'s parts;
  // on_part(model range, its first element's offset into `r`) for each part.
  template <typename OnFrozen, typename OnPart>
  void trainable_range(FlatRange r, OnFrozen on_frozen, OnPart on_part) {
    const std::vector<ParamSpec>& params = f_.trainable().params();
    // The first trainable parameter that ends after r.begin.
    auto it = std::upper_bound(params.begin(), params.end(), r.begin,
                               [](int64_t at, const ParamSpec& p) { return at < p.offset + p.numel(); });
    for (; it != params.end() && it->offset < r.end; ++it) {
      const int64_t begin = std::max(r.begin, it->offset), end = std::min(r.end, it->offset + it->numel());
      const ParamSpec& in_model = f_.layout().param(f_.model_id(static_cast<int>(it - params.begin())));
      const FlatRange part{in_model.offset + (begin - it->offset), in_model.offset + (end - it->offset)};
      frozen_before(part.begin, on_frozen);
      on_part(part, begin - r.begin);
    }
  }

  // on_frozen for the frozen parameters after the last part.
  template <typename OnFrozen>
  void finish(OnFrozen on_frozen) {
    frozen_before(f_.layout().numel(), on_frozen);
  }

 private:
  template <typename OnFrozen>
  void frozen_before(int64_t at, OnFrozen on_frozen) {
    const int n = static_cast<int>(f_.layout().params().size());
    for (; next_ < n && f_.layout().param(next_).offset < at; ++next_)
      if (with_frozen_ && f_.frozen(next_)) on_frozen(next_);
  }

  const FrozenParams& f_;
  bool with_frozen_;
  int next_ = 0;  // the model's parameters before this one are done
};

}  // namespace

std::vector<FlatRange> FrozenOptimizer::owned_ranges() const {
  std::vector<FlatRange> ranges;
  OwnedInModelOrder order(frozen_, saves_frozen_);
  const auto frozen = [&](int id) { ranges.push_back(range_of(frozen_.layout().param(id))); };
  for (const FlatRange r : trainable_->owned_ranges())
    order.trainable_range(r, frozen, [&](FlatRange part, int64_t) { ranges.push_back(part); });
  order.finish(frozen);
  for (size_t i = 1; i < ranges.size(); ++i)
    LOOM_CHECK(ranges[i - 1].end <= ranges[i].begin, "owned ranges of the trainable store out of order");
  return ranges;
}

void FrozenOptimizer::visit_owned_state(const StateVisitor& visit) {
  const HostSection host;
  OwnedInModelOrder order(frozen_, saves_frozen_);
  // One frozen parameter at a time staged in fp32 (the host tier counts it).
  const auto frozen = [&](int id) {
    const Tensor& s = frozen_.stored(id);
    const Tensor values = Tensor::empty({s.numel()}, DType::f32, Tier::host);
    const Tensor zeros = Tensor::zeros({s.numel()}, DType::f32, Tier::host);
    convert(s.raw(), s.dtype(), values.raw(), DType::f32, s.numel());
    visit(range_of(frozen_.layout().param(id)), values.data<float>(), zeros.data<float>(), zeros.data<float>());
  };
  trainable_->visit_owned_state([&](FlatRange r, const float* p, const float* m, const float* v) {
    order.trainable_range(r, frozen, [&](FlatRange part, int64_t at) { visit(part, p + at, m + at, v + at); });
  });
  order.finish(frozen);
}

void FrozenOptimizer::load_owned_state(const StateFiller& fill) {
  const HostSection host;
  // Every replica holds the frozen parameters, so every rank loads them,
  // one at a time staged in fp32 with their (unused) moments.
  OwnedInModelOrder order(frozen_, /*with_frozen=*/true);
  const auto frozen = [&](int id) {
    const ParamSpec& p = frozen_.layout().param(id);
    const Tensor staged = Tensor::empty({3, p.numel()}, DType::f32, Tier::host);
    float* values = staged.data<float>();
    fill(range_of(p), values, values + p.numel(), values + 2 * p.numel());
    frozen_.load(id, values);
  };
  trainable_->load_owned_state([&](FlatRange r, float* pp, float* pm, float* pv) {
    order.trainable_range(r, frozen, [&](FlatRange part, int64_t at) { fill(part, pp + at, pm + at, pv + at); });
  });
  order.finish(frozen);
}

void FrozenOptimizer::visit_state(const StateVisitor& visit) {
  const ParamLayout& layout = frozen_.layout();
  const HostSection host;
  std::vector<float> values, zeros;
  const float *p = nullptr, *m = nullptr, *v = nullptr;
  in_model_order(
      frozen_,
      [&](auto piece) {
        trainable_->visit_state([&](FlatRange r, const float* params, const float* exp_avg, const float* exp_avg_sq) {
          p = params, m = exp_avg, v = exp_avg_sq;
          piece(r);
        });
      },
      [&](int id, int64_t at) { visit(range_of(layout.param(id)), p + at, m + at, v + at); },
      [&](int id) {
        const Tensor& s = frozen_.stored(id);
        values.resize(static_cast<size_t>(s.numel()));
        zeros.assign(static_cast<size_t>(s.numel()), 0.0f);
        convert(s.raw(), s.dtype(), values.data(), DType::f32, s.numel());
        visit(range_of(layout.param(id)), values.data(), zeros.data(), zeros.data());
      });
}

void FrozenOptimizer::load_state(const StateFiller& fill) {
  const ParamLayout& layout = frozen_.layout();
  std::vector<float> values, m, v;
  float *pp = nullptr, *pm = nullptr, *pv = nullptr;
  in_model_order(
      frozen_,
      [&](auto piece) {
        trainable_->load_state([&](FlatRange r, float* params, float* exp_avg, float* exp_avg_sq) {
          pp = params, pm = exp_avg, pv = exp_avg_sq;
          piece(r);
        });
      },
      [&](int id, int64_t at) { fill(range_of(layout.param(id)), pp + at, pm + at, pv + at); },
      [&](int id) {
        const int64_t n = layout.param(id).numel();
        for (auto* b : {&values, &m, &v}) b->resize(static_cast<size_t>(n));
        fill(range_of(layout.param(id)), values.data(), m.data(), v.data());
        frozen_.load(id, values.data());
      },
      true);
}

void FrozenOptimizer::visit_gradients(const GradientVisitor& visit) {
  const ParamLayout& layout = frozen_.layout();
  std::vector<float> zeros;
  const float* g = nullptr;
  in_model_order(
      frozen_,
      [&](auto piece) {
        trainable_->visit_gradients([&](FlatRange r, const float* grads) {
          g = grads;
          piece(r);
        });
      },
      [&](int id, int64_t at) { visit(range_of(layout.param(id)), g + at); },
      [&](int id) {
        zeros.assign(static_cast<size_t>(layout.param(id).numel()), 0.0f);
        visit(range_of(layout.param(id)), zeros.data());
      });
}

}  // namespace loom
