#include <algorithm>

#include "loom/device.h"
#include "loom/store.h"

namespace loom {

int ParamLayout::add_group(std::string name) {
  group_names_.push_back(std::move(name));
  group_ranges_.emplace_back(numel_, numel_);
  return num_groups() - 1;
}

namespace {

// This rank's extent of the split dimension: `blocks` pieces of
// ceil(block / parts).
int64_t piece_extent(const TensorSplit& s, int64_t global) { return (global / s.blocks + s.parts - 1) / s.parts; }

// Where local coordinate `local` of a split dimension lies in the global one
// (-1: padding), and how many coordinates from it on continue the same way.
struct SplitCoord {
  int64_t global = 0, run = 0;
};
SplitCoord map_split(const TensorSplit& s, int64_t global_extent, int64_t local) {
  if (s.parts == 1) return {local, global_extent - local};
  const int64_t block = global_extent / s.blocks, piece = piece_extent(s, global_extent);
  const int64_t b = local / piece, in_piece = local % piece;
  // Coordinates of this piece inside the block; the rest are padding.
  const int64_t real = std::clamp<int64_t>(block - s.index * piece, 0, piece);
  if (in_piece >= real) return {-1, piece - in_piece};
  return {b * block + s.index * piece + in_piece, real - in_piece};
}

}  // namespace

int64_t ParamSpec::global_index(int64_t local, int64_t* run) const {
  LOOM_CHECK(local >= 0 && local < numel(), "element ", local, " outside ", name, " ", shape_str(shape));
  const TensorSplit& s = parallel.split;
  if (!parallel.is_split()) {
    if (run) *run = numel() - local;
    return local;
  }
  if (parallel.col_split.parts == 1) {
    // One cut: the elements inside a dimension's run are consecutive in
    // both spaces, with every dimension inside it whole.
    const size_t d = static_cast<size_t>(s.dim);
    int64_t inner = 1;
    for (size_t i = d + 1; i < shape.size(); ++i) inner *= shape[i];
    const int64_t outer = local / (shape[d] * inner), rest = local % (shape[d] * inner);
    const int64_t row = rest / inner, col = rest % inner;
    const SplitCoord c = map_split(s, global_shape[d], row);
    if (run) *run = c.run * inner - col;
    if (c.global < 0) return -1;
    return (outer * global_shape[d] + c.global) * inner + col;
  }
  // Two cuts: map every coordinate; a run ends with the last dimension's.
  int64_t rest = local, global = 0, stride = 1, last_run = 0;
  bool padding = false;
  for (size_t i = shape.size(); i-- > 0;) {
    const int64_t coord = rest % shape[i];
    rest /= shape[i];
    SplitCoord c{coord, global_shape[i] - coord};
    if (s.parts > 1 && static_cast<size_t>(s.dim) == i) c = map_split(s, global_shape[i], coord);
    if (parallel.col_split.parts > 1 && static_cast<size_t>(parallel.col_split.dim) == i)
      c = map_split(parallel.col_split, global_shape[i], coord);
    if (i + 1 == shape.size()) last_run = c.run;
    padding = padding || c.global < 0;
    global += c.global * stride;
    stride *= global_shape[i];
  }
  if (run) *run = padding && shape.size() > 1 ? shape.back() - local % shape.back() : last_run;
  return padding ? -1 : global;
}

int ParamLayout::add(std::string name, Shape shape, ParamInit init, bool weight_decay, int group,
                     const ParamParallel& parallel) {
  // Groups are contiguous ranges of the flat space, so parameters of a group
  // must be declared together, groups in order.
  LOOM_CHECK(group == num_groups() - 1, "parameter ", name, " declared for group ", group,
             " while group ", num_groups() - 1, " is open");
  LOOM_CHECK(find(name) < 0, "duplicate parameter name ", name);
  Shape local = shape;
  for (const TensorSplit& s : {parallel.split, parallel.col_split}) {
    if (s.parts == 1) continue;
    LOOM_CHECK(s.dim >= 0 && static_cast<size_t>(s.dim) < shape.size() && s.index >= 0 && s.index < s.parts &&
                   s.blocks >= 1 && shape[static_cast<size_t>(s.dim)] % s.blocks == 0,
               "bad split of ", name, " ", shape_str(shape));
    local[static_cast<size_t>(s.dim)] = s.blocks * piece_extent(s, shape[static_cast<size_t>(s.dim)]);
  }
  LOOM_CHECK(parallel.split.parts == 1 || parallel.col_split.parts == 1 || parallel.split.dim != parallel.col_split.dim,
             "two cuts of one dimension of ", name);
  ParamSpec spec{std::move(name), std::move(local), std::move(shape), init, weight_decay, group, numel_, parallel,
                 added_trainable_};
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
    const uint64_t key = stream_key(seed, p.name);
    for (int64_t local = lo - p.offset; local < hi - p.offset;) {
      int64_t run = 0;
      const int64_t global = p.global_index(local, &run);
      run = std::min(run, hi - p.offset - local);
      float* dst = out + (p.offset + local - first);
      if (global < 0)
        std::fill(dst, dst + run, 0.0f);
      else if (p.init.kind == ParamInit::Kind::constant)
        std::fill(dst, dst + run, p.init.mean);
      else if (p.init.kind == ParamInit::Kind::uniform)
        for (int64_t k = 0; k < run; ++k)
          dst[k] = p.init.std * (2.0f * philox_uniform(key, static_cast<uint64_t>(global + k)) - 1.0f);
      else
        fill_normal(dst, run, key, static_cast<uint64_t>(global), p.init.mean, p.init.std);
      local += run;
    }
  }
}

ParamStore::ParamStore(const ParamLayout& layout, uint64_t seed) : layout_(layout) {
  // Initialization draws each element on the host.
  const HostSection host;
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
