#include "loom/prune.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <nlohmann/json.hpp>

#include "loom/device.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

const char* prune_method_name(PruneMethod m) {
  switch (m) {
    case PruneMethod::magnitude: return "magnitude";
    case PruneMethod::wanda: return "wanda";
    case PruneMethod::channels: return "channels";
    case PruneMethod::heads: return "heads";
  }
  return "?";
}

const char* sparsity_pattern_name(SparsityPattern p) {
  return p == SparsityPattern::two_four ? "2:4" : "unstructured";
}

PruneMethod parse_prune_method(std::string_view name) {
  for (PruneMethod m : {PruneMethod::magnitude, PruneMethod::wanda, PruneMethod::channels, PruneMethod::heads})
    if (name == prune_method_name(m)) return m;
  throw Error(str("--method ", name, ": choose magnitude, wanda, channels or heads"));
}

SparsityPattern parse_sparsity_pattern(std::string_view name) {
  for (SparsityPattern p : {SparsityPattern::unstructured, SparsityPattern::two_four})
    if (name == sparsity_pattern_name(p)) return p;
  throw Error(str("--pattern ", name, ": choose unstructured or 2:4"));
}

void validate(const PruneOptions& o) {
  if (!(o.sparsity > 0.0 && o.sparsity < 1.0))
    throw Error(str("--sparsity ", o.sparsity,
                    " is outside (0, 1): give the share of each matrix's weights to zero, e.g. 0.5"));
  const bool structured = o.method == PruneMethod::channels || o.method == PruneMethod::heads;
  if (o.pattern == SparsityPattern::two_four && structured)
    throw Error(str("--pattern 2:4 zeroes single weights, and --method ", prune_method_name(o.method),
                    " removes whole ", o.method == PruneMethod::heads ? "heads" : "channels",
                    ": leave --pattern out, or use --method magnitude or wanda"));
  if (o.pattern == SparsityPattern::two_four && o.sparsity != 0.5)
    throw Error(str("--sparsity ", o.sparsity, " with --pattern 2:4, which zeroes 2 of every 4 weights: give "
                                               "--sparsity 0.5 or leave it out, or use --pattern unstructured"));
}

std::vector<int> prunable_params(const ParamLayout& layout) {
  std::vector<int> ids;
  for (size_t i = 0; i < layout.params().size(); ++i)
    if (layout.params()[i].linear_weight) ids.push_back(static_cast<int>(i));
  return ids;
}

namespace {

// Pruning reads and writes fp32 weights.
void check_fp32(const ParamLayout& layout, const ParamStore& params) {
  for (int id = 0; id < static_cast<int>(layout.params().size()); ++id)
    if (params.quantized(id) != nullptr)
      throw Error(str("the checkpoint holds ", layout.param(id).name,
                      " quantized: prune the fp32 checkpoint it was quantized from, then quantize the result"));
}

// Zeroes the `k` lowest-scoring of the elements `idx` of `w` (ties: the lower
// index first).
void zero_lowest(float* w, std::vector<int64_t>& idx, const std::vector<double>& score, int64_t k) {
  if (k <= 0) return;
  const auto lower = [&](int64_t a, int64_t b) { return score[a] < score[b] || (score[a] == score[b] && a < b); };
  std::nth_element(idx.begin(), idx.begin() + (k - 1), idx.end(), lower);
  for (int64_t i = 0; i < k; ++i) w[idx[static_cast<size_t>(i)]] = 0.0f;
}

}  // namespace

int64_t prune_matrix(float* w, int64_t rows, int64_t cols, const PruneOptions& o, std::span<const double> col_norms,
                     std::string_view name) {
  LOOM_CHECK(col_norms.empty() || static_cast<int64_t>(col_norms.size()) == cols, name, ": ", col_norms.size(),
             " input norms for ", cols, " columns");
  const int64_t n = rows * cols;
  std::vector<double> score(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    score[static_cast<size_t>(i)] =
        std::fabs(static_cast<double>(w[i])) * (col_norms.empty() ? 1.0 : col_norms[static_cast<size_t>(i % cols)]);
  std::vector<int64_t> idx;
  if (o.pattern == SparsityPattern::two_four) {
    if (cols % 4 != 0)
      throw Error(str("--pattern 2:4 groups 4 consecutive input weights, and ", name, " has ", cols,
                      " inputs, not a multiple of 4: use --pattern unstructured"));
    for (int64_t g = 0; g < n; g += 4) {
      idx = {g, g + 1, g + 2, g + 3};
      zero_lowest(w, idx, score, 2);
    }
  } else if (col_norms.empty()) {
    idx.resize(static_cast<size_t>(n));
    std::iota(idx.begin(), idx.end(), int64_t{0});
    zero_lowest(w, idx, score, std::llround(o.sparsity * static_cast<double>(n)));
  } else {
    // Wanda compares weights within an output row; the first rows take one
    // more when the total does not divide.
    const int64_t k = std::llround(o.sparsity * static_cast<double>(n));
    for (int64_t r = 0; r < rows; ++r) {
      idx.resize(static_cast<size_t>(cols));
      std::iota(idx.begin(), idx.end(), r * cols);
      zero_lowest(w, idx, score, k / rows + (r < k % rows ? 1 : 0));
    }
  }
  return std::count(w, w + n, 0.0f);
}

WandaCalibration::WandaCalibration()
    : hook_([this](std::span<const int> weights, const float* in, int64_t N, int64_t in_features) {
        // The input is read where the kernels wrote it.
        const HostSection host;
        std::vector<double> squares(static_cast<size_t>(in_features), 0.0);
        for (int64_t t = 0; t < N; ++t)
          for (int64_t j = 0; j < in_features; ++j) {
            const double x = in[t * in_features + j];
            squares[static_cast<size_t>(j)] += x * x;
          }
        for (int id : weights) {
          Sums& s = sums_[id];
          s.squares.resize(squares.size(), 0.0);
          for (size_t j = 0; j < squares.size(); ++j) s.squares[j] += squares[j];
          s.tokens += N;
        }
      }) {}

int64_t WandaCalibration::tokens(int id) const {
  const auto it = sums_.find(id);
  return it == sums_.end() ? 0 : it->second.tokens;
}

std::vector<double> WandaCalibration::input_norms(int id) const {
  const auto it = sums_.find(id);
  LOOM_CHECK(it != sums_.end(), "Wanda's calibration saw no input of parameter ", id);
  std::vector<double> norms = it->second.squares;
  for (double& x : norms) x = std::sqrt(x);
  return norms;
}

PruneReport prune_model(const GPT& model, ParamStore& params, const PruneOptions& o,
                        const WandaCalibration* calibration) {
  validate(o);
  LOOM_CHECK(o.method != PruneMethod::channels && o.method != PruneMethod::heads,
             "structured pruning removes channels or heads (remove_channels, remove_heads)");
  if (o.method == PruneMethod::wanda && !calibration)
    throw Error("--method wanda scores weights by their inputs: give calibration data with --data SHARD");
  const ParamLayout& layout = model.layout();
  check_fp32(layout, params);
  const HostSection host;
  float* flat = params.flat().data<float>();
  PruneReport report;
  report.numel = layout.numel();
  for (int id : prunable_params(layout)) {
    const ParamSpec& p = layout.param(id);
    if (o.method == PruneMethod::wanda && calibration->tokens(id) == 0)
      throw Error(str("Wanda's calibration saw no input of ", p.name,
                      ": run the model's forward over calibration data (--data) while it collects"));
    const std::vector<double> norms = o.method == PruneMethod::wanda ? calibration->input_norms(id)
                                                                     : std::vector<double>{};
    const int64_t zeros = prune_matrix(flat + p.offset, p.shape[0], p.shape[1], o, norms, p.name);
    report.matrices.push_back({p.name, p.numel(), zeros});
  }
  report.nonzeros = report.numel - std::count(flat, flat + layout.numel(), 0.0f);
  return report;
}

namespace {

// The layer whose block is group `group` of `model`.
int64_t layer_of_group(const GPT& model, int group) {
  for (int l = 0; l < model.config().n_layer; ++l)
    if (model.block_group(l) == group) return l;
  LOOM_CHECK(false, "group ", group, " is no block's");
  return -1;
}

// The dimension in which `to`'s parameter of p's name is smaller than p (the
// channel or head dimension), or -1 when it is the same shape.
int pruned_dim(const ParamSpec& p, const GPT& to) {
  const int id = to.layout().find(p.name);
  LOOM_CHECK(id >= 0, p.name, " is missing from the pruned model");
  const Shape& q = to.layout().param(id).shape;
  LOOM_CHECK(q.size() == p.shape.size(), p.name, " changes rank");
  for (size_t d = 0; d < q.size(); ++d)
    if (q[d] != p.shape[d]) return static_cast<int>(d);
  return -1;
}

// Where each query head's slices lie along a dimension of `size` of one of
// c's attention parameters, each head_dim long: q's rows and the output
// projection's columns (n_head * head_dim), GPT-2's packed q | k | v rows
// (three slices), k's and v's rows (the slice of the head's kv head).
std::vector<std::vector<int64_t>> head_slices(const GPTConfig& c, int64_t size) {
  const int64_t hd = c.head_dim(), q = c.q_dim(), group = c.n_head / c.kv_heads();
  std::vector<std::vector<int64_t>> at(static_cast<size_t>(c.n_head));
  for (int64_t h = 0; h < c.n_head; ++h) {
    std::vector<int64_t>& s = at[static_cast<size_t>(h)];
    if (size == q)
      s = {h * hd};
    else if (size == 3 * q)
      s = {h * hd, q + h * hd, 2 * q + h * hd};
    else if (size == c.kv_heads() * hd)
      s = {h / group * hd};
    else
      LOOM_CHECK(false, "a dimension of ", size, " is no attention head's");
  }
  return at;
}

// The indices kept along a dimension of `size` that the pruning shrinks, of
// a parameter of layer `layer` of `from`, ascending.
std::vector<int64_t> kept_indices(const GPTConfig& from, const StructuredPruning& pruning, int64_t layer,
                                  int64_t size) {
  const std::vector<int64_t>& kept = pruning.kept[static_cast<size_t>(layer)];
  if (pruning.config.n_head == from.n_head) {
    LOOM_CHECK(size == from.intermediate(), "a dimension of ", size, " is no MLP channel's");
    return kept;
  }
  const std::vector<std::vector<int64_t>> at = head_slices(from, size);
  std::vector<int64_t> idx;
  for (int64_t h : kept)
    for (int64_t first : at[static_cast<size_t>(h)])
      for (int64_t i = first; i < first + from.head_dim(); ++i) idx.push_back(i);
  std::sort(idx.begin(), idx.end());
  // k and v rows: a kv head is listed once per query head sharing it.
  idx.erase(std::unique(idx.begin(), idx.end()), idx.end());
  return idx;
}

// The sums of squares of the slices of matrix `p` (rows x cols) along its
// dimension `d`: per index of that dimension.
std::vector<double> squares_along(const float* flat, const ParamSpec& p, int d) {
  const int64_t rows = p.shape[0], cols = p.shape[1];
  std::vector<double> squares(static_cast<size_t>(d == 0 ? rows : cols), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const double w = flat[p.offset + r * cols + c];
      squares[static_cast<size_t>(d == 0 ? r : c)] += w * w;
    }
  return squares;
}

}  // namespace

StructuredPruning choose_channels(const GPT& model, const ParamStore& params, double sparsity) {
  validate(PruneOptions{.method = PruneMethod::channels, .sparsity = sparsity});
  const int64_t I = model.config().intermediate();
  const int64_t keep = I - std::llround(sparsity * static_cast<double>(I));
  if (keep < 1)
    throw Error(str("--sparsity ", sparsity, " removes all ", I, " MLP channels of each layer: give a smaller one"));
  StructuredPruning pruning;
  pruning.config = model.config();
  pruning.config.intermediate_size = keep;
  pruning.config.validate();
  const GPT to(pruning.config);
  check_fp32(model.layout(), params);
  const HostSection host;
  const float* flat = params.flat().data<float>();
  std::vector<std::vector<double>> importance(static_cast<size_t>(model.config().n_layer),
                                              std::vector<double>(static_cast<size_t>(I), 1.0));
  for (const ParamSpec& p : model.layout().params()) {
    const int d = pruned_dim(p, to);
    if (d < 0 || p.shape.size() != 2) continue;
    std::vector<double>& layer = importance[static_cast<size_t>(layer_of_group(model, p.group))];
    const std::vector<double> squares = squares_along(flat, p, d);
    for (size_t ch = 0; ch < squares.size(); ++ch) layer[ch] *= std::sqrt(squares[ch]);
  }
  for (const std::vector<double>& layer : importance) {
    std::vector<int64_t> order(static_cast<size_t>(I));
    std::iota(order.begin(), order.end(), int64_t{0});
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return layer[static_cast<size_t>(a)] > layer[static_cast<size_t>(b)];
    });
    order.resize(static_cast<size_t>(keep));
    std::sort(order.begin(), order.end());
    pruning.kept.push_back(std::move(order));
  }
  return pruning;
}

StructuredPruning choose_heads(const GPT& model, const ParamStore& params, double sparsity,
                               const WandaCalibration* calibration) {
  validate(PruneOptions{.method = PruneMethod::heads, .sparsity = sparsity});
  const GPTConfig& c = model.config();
  const int64_t groups = c.kv_heads(), group = c.n_head / groups, hd = c.head_dim();
  const int64_t removed = std::llround(sparsity * static_cast<double>(groups));
  const std::string unit = group > 1 ? str("key/value groups (of ", group, " query heads)") : std::string("heads");
  if (removed < 1)
    throw Error(str("--sparsity ", sparsity, " removes none of the ", groups, " ", unit,
                    " of each layer (round(sparsity * ", groups, ") = 0): give at least ",
                    0.5 / static_cast<double>(groups)));
  if (removed >= groups)
    throw Error(str("--sparsity ", sparsity, " removes all ", groups, " ", unit,
                    " of each layer: give a smaller one, below ", (static_cast<double>(groups) - 0.5) / static_cast<double>(groups)));
  StructuredPruning pruning;
  pruning.config = c;
  pruning.config.n_head = c.n_head - removed * group;
  if (c.n_kv_head > 0) pruning.config.n_kv_head = groups - removed;
  pruning.config.head_size = hd;
  pruning.config.validate();
  const GPT to(pruning.config);
  check_fp32(model.layout(), params);
  const HostSection host;
  const float* flat = params.flat().data<float>();
  std::vector<std::vector<double>> score(static_cast<size_t>(c.n_layer),
                                         std::vector<double>(static_cast<size_t>(c.n_head), 1.0));
  for (int id = 0; id < static_cast<int>(model.layout().params().size()); ++id) {
    const ParamSpec& p = model.layout().param(id);
    const int d = pruned_dim(p, to);
    if (d < 0 || !p.linear_weight) continue;
    // The output projection is the matrix that reads the heads (its input
    // shrinks); with calibration only it scores, by its input too.
    const bool reads_heads = d == 1;
    if (calibration && !reads_heads) continue;
    std::vector<double> squares = squares_along(flat, p, d);
    std::vector<double> inputs;
    if (calibration) {
      if (calibration->tokens(id) == 0)
        throw Error(str("the heads' calibration saw no input of ", p.name,
                        ": run the model's forward over calibration data (--data) while it collects"));
      inputs = calibration->input_norms(id);
    }
    std::vector<double>& layer = score[static_cast<size_t>(layer_of_group(model, p.group))];
    const std::vector<std::vector<int64_t>> at = head_slices(c, p.shape[static_cast<size_t>(d)]);
    for (int64_t h = 0; h < c.n_head; ++h)
      for (int64_t first : at[static_cast<size_t>(h)]) {
        double w = 0.0, x = 0.0;
        for (int64_t i = first; i < first + hd; ++i) {
          w += squares[static_cast<size_t>(i)];
          if (calibration) x += inputs[static_cast<size_t>(i)] * inputs[static_cast<size_t>(i)];
        }
        layer[static_cast<size_t>(h)] *= std::sqrt(w) * (calibration ? std::sqrt(x) : 1.0);
      }
  }
  for (const std::vector<double>& layer : score) {
    std::vector<double> group_score(static_cast<size_t>(groups), 0.0);
    for (int64_t h = 0; h < c.n_head; ++h) group_score[static_cast<size_t>(h / group)] += layer[static_cast<size_t>(h)];
    std::vector<int64_t> order(static_cast<size_t>(groups));
    std::iota(order.begin(), order.end(), int64_t{0});
    // Lowest first, ties to the lower index: the first `removed` go.
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      return group_score[static_cast<size_t>(a)] < group_score[static_cast<size_t>(b)];
    });
    std::vector<int64_t> kept(order.begin() + removed, order.end());
    std::sort(kept.begin(), kept.end());
    std::vector<int64_t> heads;
    for (int64_t g : kept)
      for (int64_t h = g * group; h < (g + 1) * group; ++h) heads.push_back(h);
    pruning.kept.push_back(std::move(heads));
  }
  return pruning;
}

void copy_kept(const GPT& from, const ParamStore& src, const StructuredPruning& pruning, const GPT& to,
               ParamStore& dst) {
  LOOM_CHECK(to.config() == pruning.config, "the pruned model is not of the pruning's config");
  const HostSection host;
  const float* in = src.flat().data<float>();
  float* out = dst.flat().data<float>();
  for (const ParamSpec& p : from.layout().params()) {
    const ParamSpec& q = to.layout().param(to.layout().find(p.name));
    const int d = pruned_dim(p, to);
    if (d < 0) {
      std::copy(in + p.offset, in + p.offset + p.numel(), out + q.offset);
      continue;
    }
    // [outer, size, inner] with the pruned dimension d in the middle.
    int64_t outer = 1, inner = 1;
    for (int k = 0; k < d; ++k) outer *= p.shape[static_cast<size_t>(k)];
    for (size_t k = static_cast<size_t>(d) + 1; k < p.shape.size(); ++k) inner *= p.shape[k];
    const int64_t size = p.shape[static_cast<size_t>(d)];
    const std::vector<int64_t> kept = kept_indices(from.config(), pruning, layer_of_group(from, p.group), size);
    const int64_t left = static_cast<int64_t>(kept.size());
    LOOM_CHECK(left == q.shape[static_cast<size_t>(d)], p.name, ": ", left, " kept of ", size);
    for (int64_t o = 0; o < outer; ++o)
      for (int64_t k = 0; k < left; ++k)
        std::copy_n(in + p.offset + (o * size + kept[static_cast<size_t>(k)]) * inner, inner,
                    out + q.offset + (o * left + k) * inner);
  }
}

namespace {

SmallerModel smaller_model(const GPT& model, const ParamStore& params, StructuredPruning pruning) {
  SmallerModel s;
  s.pruning = std::move(pruning);
  s.model = std::make_unique<GPT>(s.pruning.config);
  s.params = std::make_unique<ParamStore>(s.model->layout(), 0);
  copy_kept(model, params, s.pruning, *s.model, *s.params);
  const HostSection host;
  const float* flat = s.params->flat().data<float>();
  s.report.numel = s.model->layout().numel();
  s.report.nonzeros = s.report.numel - std::count(flat, flat + s.report.numel, 0.0f);
  return s;
}

}  // namespace

SmallerModel remove_channels(const GPT& model, const ParamStore& params, double sparsity) {
  return smaller_model(model, params, choose_channels(model, params, sparsity));
}

SmallerModel remove_heads(const GPT& model, const ParamStore& params, double sparsity,
                          const WandaCalibration* calibration) {
  return smaller_model(model, params, choose_heads(model, params, sparsity, calibration));
}

void check_prune_output(const fs::path& out) {
  std::error_code ec;
  if (fs::exists(out, ec))
    throw Error(str("--out '", out.string(), "' exists: loom prune writes a new run directory and never "
                                             "replaces one; choose another path or remove it"));
}

fs::path write_pruned_checkpoint(const fs::path& out, const GPT& model, const ParamStore& params,
                                 const PruneOptions& o, const PruneReport& report,
                                 const PrunedCheckpointSource& source) {
  check_prune_output(out);
  // A run's own checkpoint writer, so the result is what training writes:
  // a reference Trainer of the same model holding the pruned weights.
  Trainer trainer(model.config(), TrainOptions{});
  const Tensor flat = params.flat();
  trainer.load_weights([&](const ParamLayout&, FlatRange r, float* dst) {
    std::copy(flat.data<float>() + r.begin, flat.data<float>() + r.end, dst);
  });
  nlohmann::json matrices = nlohmann::json::array();
  for (const PruneReport::Matrix& m : report.matrices) matrices.push_back(m.name);
  const nlohmann::json fields = {{"tokenizer", source.tokenizer.string()},
                                 {"tokenizer_sha256", source.tokenizer_sha256},
                                 {kPruningField,
                                  {{"method", prune_method_name(o.method)},
                                   {"pattern", sparsity_pattern_name(o.pattern)},
                                   {"sparsity", o.sparsity},
                                   {"source", source.checkpoint},
                                   {"params", matrices}}}};
  return save_checkpoint(out, trainer, fields, 0);
}

}  // namespace loom
