#include <algorithm>

#include "loom/store.h"

namespace loom {

int ParamLayout::add_group(std::string name) {
  group_names_.push_back(std::move(name));
  group_ranges_.emplace_back(numel_, numel_);
  return num_groups() - 1;
}

int ParamLayout::add(std::string name, Shape shape, ParamInit init, bool weight_decay, int group) {
  // Groups are contiguous ranges of the flat space, so parameters of a group
  // must be declared together, groups in order.
  LOOM_CHECK(group == num_groups() - 1, "parameter ", name, " declared for group ", group,
             " while group ", num_groups() - 1, " is open");
  LOOM_CHECK(find(name) < 0, "duplicate parameter name ", name);
  ParamSpec spec{std::move(name), std::move(shape), init, weight_decay, group, numel_};
  numel_ += spec.numel();
  group_ranges_.back().second = numel_;
  params_.push_back(std::move(spec));
  return static_cast<int>(params_.size()) - 1;
}

int ParamLayout::find(std::string_view name) const {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].name == name) return static_cast<int>(i);
  return -1;
}

std::pair<int64_t, int64_t> ParamLayout::group_range(int g) const {
  return group_ranges_.at(static_cast<size_t>(g));
}

void ParamLayout::initialize(float* out, int64_t first, int64_t n, uint64_t seed) const {
  int64_t end = first + n;
  for (const ParamSpec& p : params_) {
    int64_t lo = std::max(first, p.offset), hi = std::min(end, p.offset + p.numel());
    if (lo >= hi) continue;
    float* dst = out + (lo - first);
    if (p.init.kind == ParamInit::Kind::constant) {
      std::fill(dst, dst + (hi - lo), p.init.mean);
    } else {
      fill_normal(dst, hi - lo, stream_key(seed, p.name), static_cast<uint64_t>(lo - p.offset), p.init.mean,
                  p.init.std);
    }
  }
}

ParamStore::ParamStore(const ParamLayout& layout, uint64_t seed) : layout_(layout) {
  flat_ = Tensor::empty({layout.numel()});
  layout.initialize(flat_.data<float>(), 0, layout.numel(), seed);
}

void ParamStore::check_group(int group) const {
  LOOM_CHECK(group >= 0 && group < layout_.num_groups(), "bad group ", group);
}
void ParamStore::acquire(int group) { check_group(group); }
void ParamStore::release(int group) { check_group(group); }

Tensor ParamStore::param(int id) const {
  const ParamSpec& p = layout_.param(id);
  return flat_.flat(p.offset, p.numel()).view(p.shape);
}

GradStore::GradStore(const ParamLayout& layout) : layout_(layout) { flat_ = Tensor::zeros({layout.numel()}); }

Tensor GradStore::grad(int id) const {
  const ParamSpec& p = layout_.param(id);
  return flat_.flat(p.offset, p.numel()).view(p.shape);
}

void GradStore::zero() { flat_.zero_(); }

void GradStore::check_group(int group) const {
  LOOM_CHECK(group >= 0 && group < layout_.num_groups(), "bad group ", group);
}
void GradStore::group_ready(int group) { check_group(group); }

}  // namespace loom
