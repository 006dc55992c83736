// MachineRates: pricing GEMMs and collectives from measured or published
// rates, and the JSON file both calibrations and hardware descriptions use.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "loom/io.h"
#include "loom/planner.h"

namespace loom {

namespace {

constexpr Collective kCollectives[] = {Collective::all_reduce, Collective::reduce_scatter, Collective::all_gather,
                                       Collective::send_recv};

// Where x falls among the sorted grid values, in log space: the lower index
// and the weight of the upper one, clamped to the grid's ends.
std::pair<size_t, double> grid_position(const std::vector<int64_t>& grid, int64_t x) {
  if (grid.size() == 1 || x <= grid.front()) return {0, 0.0};
  if (x >= grid.back()) return {grid.size() - 2, 1.0};
  size_t i = 0;
  while (grid[i + 1] < x) ++i;
  const double lo = std::log(static_cast<double>(grid[i])), hi = std::log(static_cast<double>(grid[i + 1]));
  return {i, (std::log(static_cast<double>(x)) - lo) / (hi - lo)};
}

template <size_t D>
using Point = std::array<int64_t, D>;

// The sorted values each dimension takes over the points.
template <size_t D>
std::array<std::vector<int64_t>, D> grid_axes(const std::vector<Point<D>>& points) {
  std::array<std::vector<int64_t>, D> axes;
  for (size_t d = 0; d < D; ++d) {
    std::set<int64_t> values;
    for (const Point<D>& p : points) values.insert(p[d]);
    axes[d].assign(values.begin(), values.end());
  }
  return axes;
}

// Whether the points are every combination of their axes' values, once.
template <size_t D>
bool full_grid(const std::vector<Point<D>>& points) {
  size_t combinations = 1;
  for (const std::vector<int64_t>& axis : grid_axes(points)) combinations *= axis.size();
  return std::set<Point<D>>(points.begin(), points.end()).size() == points.size() && points.size() == combinations;
}

// A rate measured on a full grid of shapes at `x`: multilinear in the logs of
// the sizes over the log of the rate (rates change by orders of magnitude
// between small and large shapes), clamped to the grid's edges.
template <size_t D>
double interpolate_rate(const std::vector<Point<D>>& points, const std::vector<double>& rates, const Point<D>& x) {
  const std::array<std::vector<int64_t>, D> axes = grid_axes(points);
  std::map<Point<D>, double> log_rate;
  for (size_t i = 0; i < points.size(); ++i) log_rate[points[i]] = std::log(rates[i]);
  std::array<std::pair<size_t, double>, D> at;
  for (size_t d = 0; d < D; ++d) at[d] = grid_position(axes[d], x[d]);
  double sum = 0.0;
  for (size_t corner = 0; corner < (size_t(1) << D); ++corner) {
    double w = 1.0;
    Point<D> p;
    for (size_t d = 0; d < D; ++d) {
      const bool upper = (corner >> d) & 1;
      w *= upper ? at[d].second : 1.0 - at[d].second;
      p[d] = axes[d][std::min(at[d].first + (upper ? 1 : 0), axes[d].size() - 1)];
    }
    if (w != 0.0) sum += w * log_rate.at(p);
  }
  return std::exp(sum);
}

// Causal attention of one head over one sequence: QK^T and PV over half the
// T x T scores each. Its backward is priced as 2.5 times that (the scores
// recomputed from the kept log-sum-exp, then four products).
double attention_forward_flops(int64_t seq_len, int64_t head_dim) {
  return 2.0 * static_cast<double>(seq_len) * static_cast<double>(seq_len) * static_cast<double>(head_dim);
}

std::vector<Point<3>> gemm_points(const std::vector<GemmSample>& samples) {
  std::vector<Point<3>> points;
  for (const GemmSample& g : samples) points.push_back({g.m, g.n, g.k});
  return points;
}

std::vector<Point<2>> attention_points(const std::vector<AttentionSample>& samples) {
  std::vector<Point<2>> points;
  for (const AttentionSample& a : samples) points.push_back({a.seq_len, a.head_dim});
  return points;
}

// The thread counts samples were measured at, as they are recorded.
template <typename Sample>
std::set<int> thread_counts(const std::vector<Sample>& samples) {
  std::set<int> counts;
  for (const Sample& s : samples) counts.insert(s.threads);
  return counts;
}

// A sample's thread count, 0 (all) read as the machine's.
int effective_threads(int sample_threads, int machine_threads) {
  return sample_threads > 0 ? sample_threads : std::max(machine_threads, 1);
}

// The samples measured at the thread count nearest to `threads` (0: the
// most), nearest by ratio, the fewer on a tie.
template <typename Sample>
std::vector<Sample> at_nearest_threads(const std::vector<Sample>& samples, int threads, int machine_threads) {
  std::set<int> measured;
  for (const Sample& s : samples) measured.insert(effective_threads(s.threads, machine_threads));
  int chosen = *measured.rbegin();
  if (threads > 0) {
    double best = 1e300;
    for (int t : measured) {
      const double distance = std::abs(std::log(static_cast<double>(t) / threads));
      if (distance < best - 1e-12) {
        best = distance;
        chosen = t;
      }
    }
  }
  std::vector<Sample> out;
  for (const Sample& s : samples)
    if (effective_threads(s.threads, machine_threads) == chosen) out.push_back(s);
  return out;
}

}  // namespace

std::filesystem::path default_calibration_path() {
  const char* cache = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  if (cache && *cache) return std::filesystem::path(cache) / "loom" / "calibration.json";
  if (home && *home) return std::filesystem::path(home) / ".cache" / "loom" / "calibration.json";
  return "calibration.json";
}

const char* collective_name(Collective op) {
  switch (op) {
    case Collective::all_reduce: return "all_reduce";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_gather: return "all_gather";
    case Collective::send_recv: return "send_recv";
  }
  return "?";
}

double MachineRates::gemm_seconds(int64_t m, int64_t n, int64_t k, DType precision, int thread_count) const {
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
  if (gemm.empty()) {
    const double peak = precision != DType::f32 && peak_flops_bf16 > 0 ? peak_flops_bf16 : peak_flops_fp32;
    return flops / (peak * gemm_efficiency);
  }
  const std::vector<GemmSample> samples = at_nearest_threads(gemm, thread_count, threads);
  std::vector<double> rates;
  for (const GemmSample& g : samples) rates.push_back(g.flops_per_s);
  return flops / interpolate_rate(gemm_points(samples), rates, {m, n, k});
}

double MachineRates::attention_seconds(int64_t seq_len, int64_t head_dim, bool backward, DType precision,
                                       int thread_count) const {
  const double flops = (backward ? 2.5 : 1.0) * attention_forward_flops(seq_len, head_dim);
  // Without measurements, at the rate of the (T, T, head_dim) products it
  // consists of.
  if (attention.empty())
    return flops * gemm_seconds(seq_len, seq_len, head_dim, precision, thread_count) /
           (2.0 * static_cast<double>(seq_len * seq_len * head_dim));
  const std::vector<AttentionSample> samples = at_nearest_threads(attention, thread_count, threads);
  std::vector<double> rates;
  for (const AttentionSample& a : samples)
    rates.push_back((backward ? 2.5 : 1.0) * attention_forward_flops(a.seq_len, a.head_dim) /
                    (backward ? a.backward_s : a.forward_s));
  return flops / interpolate_rate(attention_points(samples), rates, {seq_len, head_dim});
}

bool MachineRates::within_node(RankGroup group) const {
  return group.span <= ranks_per_node && ranks_per_node % group.span == 0;
}

double MachineRates::collective_seconds(Collective op, double bytes, RankGroup group) const {
  if (group.size <= 1) return 0.0;
  for (const CollectiveCost& c : collectives)
    if (c.op == op && c.group == group.size) return c.cost.seconds(bytes);
  // A message's cost depends on how many ranks share the machine, not on a
  // group: the measurement with the nearest number of ranks.
  const CollectiveCost* nearest = nullptr;
  for (const CollectiveCost& c : collectives)
    if (c.op == Collective::send_recv && op == Collective::send_recv &&
        (!nearest || std::abs(c.group - group.size) < std::abs(nearest->group - group.size)))
      nearest = &c;
  if (nearest) return nearest->cost.seconds(bytes);
  const LinkCost& link = within_node(group) ? intra_node : inter_node;
  const double g = group.size;
  switch (op) {
    case Collective::all_reduce: return 2.0 * (g - 1) * link.seconds(bytes / g);
    case Collective::reduce_scatter:
    case Collective::all_gather: return (g - 1) * link.seconds(bytes / g);
    case Collective::send_recv: return link.seconds(bytes);
  }
  return 0.0;
}

namespace {

nlohmann::json link_json(const LinkCost& l) { return {{"latency_s", l.latency_s}, {"bytes_per_s", l.bytes_per_s}}; }

// Reads one file's fields, each checked as it is taken, and refuses fields
// it did not take, so a misspelt key is an error rather than a default.
class Reader {
 public:
  Reader(const std::filesystem::path& path, const nlohmann::json& j, std::string prefix = "")
      : path_(path), j_(j), prefix_(std::move(prefix)) {
    if (!j_.is_object()) fail(prefix_.empty() ? "the file" : prefix_, "must be a JSON object");
  }

  [[noreturn]] void fail(const std::string& field, const std::string& problem) const {
    throw Error(str(path_.string(), ": ", field, " ", problem,
                    "; see hardware/h100-sxm.json for the format, or write the file with `loom calibrate`"));
  }
  std::string name(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }
  bool has(const std::string& key) const { return j_.contains(key); }

  const nlohmann::json& take(const std::string& key) {
    if (!j_.contains(key)) fail(name(key), "is missing");
    taken_.insert(key);
    return j_.at(key);
  }
  // A number >= 0, or > 0 when `positive`.
  double number(const std::string& key, bool positive) {
    const nlohmann::json& v = take(key);
    if (!v.is_number()) fail(name(key), "must be a number");
    const double x = v.get<double>();
    if (!std::isfinite(x) || x < 0 || (positive && x == 0))
      fail(name(key), positive ? "must be a positive number" : "must be a number >= 0");
    return x;
  }
  double number_or(const std::string& key, bool positive, double otherwise) {
    return has(key) ? number(key, positive) : otherwise;
  }
  int64_t integer(const std::string& key) {
    const nlohmann::json& v = take(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 1) fail(name(key), "must be a whole number >= 1");
    return v.get<int64_t>();
  }
  // A whole number >= 0, `otherwise` when absent.
  int count_or(const std::string& key, int otherwise) {
    if (!has(key)) return otherwise;
    const nlohmann::json& v = take(key);
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 20))
      fail(name(key), "must be a whole number >= 0");
    return static_cast<int>(v.get<int64_t>());
  }
  std::string text(const std::string& key) {
    const nlohmann::json& v = take(key);
    if (!v.is_string()) fail(name(key), "must be a string");
    return v.get<std::string>();
  }
  LinkCost link(const std::string& key) {
    Reader r(path_, take(key), name(key));
    LinkCost l{r.number("latency_s", false), r.number("bytes_per_s", true)};
    r.done();
    return l;
  }
  void done() const {
    for (const auto& [key, value] : j_.items())
      if (!taken_.count(key)) fail(name(key), "is not a known field");
  }

 private:
  const std::filesystem::path& path_;
  const nlohmann::json& j_;
  std::string prefix_;
  std::set<std::string> taken_;
};

}  // namespace

void save_machine_rates(const MachineRates& r, const std::filesystem::path& path) {
  nlohmann::json j = {{"description", r.description},
                      {"peak_flops", {{"fp32", r.peak_flops_fp32}}},
                      {"gemm_efficiency", r.gemm_efficiency},
                      {"memory_bytes_per_s", r.memory_bytes_per_s},
                      {"device_memory_bytes", r.device_memory_bytes},
                      {"ranks_per_node", r.ranks_per_node},
                      {"shared_by_local_ranks", r.shared_by_local_ranks},
                      {"threads", r.threads},
                      {"intra_node", link_json(r.intra_node)},
                      {"inter_node", link_json(r.inter_node)}};
  if (r.peak_flops_bf16 > 0) j["peak_flops"]["bf16"] = r.peak_flops_bf16;
  if (r.host_device.bytes_per_s > 0) j["host_device"] = link_json(r.host_device);
  if (r.nvme_read_bytes_per_s > 0)
    j["nvme"] = {{"read_bytes_per_s", r.nvme_read_bytes_per_s}, {"write_bytes_per_s", r.nvme_write_bytes_per_s}};
  for (const GemmSample& g : r.gemm)
    j["gemm"].push_back(
        {{"m", g.m}, {"n", g.n}, {"k", g.k}, {"flops_per_s", g.flops_per_s}, {"threads", g.threads}});
  for (const AttentionSample& a : r.attention)
    j["attention"].push_back({{"seq_len", a.seq_len},
                              {"head_dim", a.head_dim},
                              {"forward_s", a.forward_s},
                              {"backward_s", a.backward_s},
                              {"threads", a.threads}});
  for (const CollectiveCost& c : r.collectives)
    j["collectives"].push_back({{"op", collective_name(c.op)},
                                {"group", c.group},
                                {"latency_s", c.cost.latency_s},
                                {"bytes_per_s", c.cost.bytes_per_s}});
  write_file_atomic(path, j.dump(2) + "\n");
}

MachineRates load_machine_rates(const std::filesystem::path& path) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(str(path.string(), ": not valid JSON (", e.what(), "); write it again with `loom calibrate`"));
  }
  Reader top(path, j);
  MachineRates r;
  r.description = top.text("description");
  {
    Reader peaks(path, top.take("peak_flops"), "peak_flops");
    r.peak_flops_fp32 = peaks.number("fp32", true);
    r.peak_flops_bf16 = peaks.number_or("bf16", true, 0.0);
    peaks.done();
  }
  r.gemm_efficiency = top.number_or("gemm_efficiency", true, 1.0);
  if (r.gemm_efficiency > 1.0) top.fail("gemm_efficiency", "must be at most 1 (a fraction of peak_flops)");
  r.memory_bytes_per_s = top.number("memory_bytes_per_s", true);
  r.device_memory_bytes = top.number("device_memory_bytes", true);
  r.ranks_per_node = static_cast<int>(top.integer("ranks_per_node"));
  if (top.has("shared_by_local_ranks")) {
    const nlohmann::json& v = top.take("shared_by_local_ranks");
    if (!v.is_boolean()) top.fail("shared_by_local_ranks", "must be true or false");
    r.shared_by_local_ranks = v.get<bool>();
  }
  r.threads = top.count_or("threads", 0);
  r.intra_node = top.link("intra_node");
  r.inter_node = top.has("inter_node") ? top.link("inter_node") : r.intra_node;
  if (top.has("host_device")) r.host_device = top.link("host_device");
  if (top.has("nvme")) {
    Reader nvme(path, top.take("nvme"), "nvme");
    r.nvme_read_bytes_per_s = nvme.number("read_bytes_per_s", true);
    r.nvme_write_bytes_per_s = nvme.number("write_bytes_per_s", true);
    nvme.done();
  }
  if (top.has("gemm")) {
    const nlohmann::json& list = top.take("gemm");
    if (!list.is_array()) top.fail("gemm", "must be a list of {m, n, k, flops_per_s}");
    for (size_t i = 0; i < list.size(); ++i) {
      Reader g(path, list[i], str("gemm[", i, "]"));
      r.gemm.push_back(
          {g.integer("m"), g.integer("n"), g.integer("k"), g.number("flops_per_s", true), g.count_or("threads", 0)});
      g.done();
    }
    // Interpolation reads every corner of the grid the samples of a thread
    // count span.
    for (int t : thread_counts(r.gemm))
      if (!full_grid(gemm_points(at_nearest_threads(r.gemm, t, r.threads))))
        top.fail("gemm", str("must hold each (m, n, k) of a full grid exactly once (threads ", t, ")"));
  }
  if (top.has("attention")) {
    const nlohmann::json& list = top.take("attention");
    if (!list.is_array()) top.fail("attention", "must be a list of {seq_len, head_dim, forward_s, backward_s}");
    for (size_t i = 0; i < list.size(); ++i) {
      Reader a(path, list[i], str("attention[", i, "]"));
      r.attention.push_back({a.integer("seq_len"), a.integer("head_dim"), a.number("forward_s", true),
                             a.number("backward_s", true), a.count_or("threads", 0)});
      a.done();
    }
    for (int t : thread_counts(r.attention))
      if (!full_grid(attention_points(at_nearest_threads(r.attention, t, r.threads))))
        top.fail("attention", str("must hold each (seq_len, head_dim) of a full grid exactly once (threads ", t, ")"));
  }
  if (top.has("collectives")) {
    const nlohmann::json& list = top.take("collectives");
    if (!list.is_array()) top.fail("collectives", "must be a list of {op, group, latency_s, bytes_per_s}");
    for (size_t i = 0; i < list.size(); ++i) {
      Reader c(path, list[i], str("collectives[", i, "]"));
      const std::string op = c.text("op");
      const Collective* found = std::find_if(std::begin(kCollectives), std::end(kCollectives),
                                             [&](Collective x) { return op == collective_name(x); });
      if (found == std::end(kCollectives))
        c.fail(c.name("op"), str("'", op, "' is not all_reduce, reduce_scatter, all_gather or send_recv"));
      const int group = static_cast<int>(c.integer("group"));
      r.collectives.push_back({*found, group, LinkCost{c.number("latency_s", false), c.number("bytes_per_s", true)}});
      c.done();
    }
  }
  top.done();
  return r;
}

}  // namespace loom
