// `loom plan`: what a config's layout will cost before it runs, and the
// search over every layout of a world size for the fastest that fits.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <map>
#include <ostream>

#include "comm/backend.h"
#include "loom/config.h"
#include "loom/io.h"
#include "loom/planner.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

MachineRates find_machine_rates(const RatesSource& source) {
  if (!source.rates.empty()) return load_machine_rates(source.rates);
  if (!source.hardware.empty()) return load_machine_rates(source.hardware);
  const fs::path calibration = default_calibration_path();
  std::error_code ec;
  if (fs::exists(calibration, ec)) return load_machine_rates(calibration);
  throw Error(str("the planner needs the machine's rates, and there is no calibration at ", calibration.string(),
                  ": run `loom calibrate` to measure this machine, or pass --hardware hardware/h100-sxm.json "
                  "(or --rates FILE) to plan for another"));
}

double plan_device_budget(const Config& cfg, const RatesSource& source, const MachineRates& rates) {
  const size_t budget = cfg.get_bytes("memory.device_budget");
  if (budget != kUnlimited) return static_cast<double>(budget);
  if (source.rates.empty() && !source.hardware.empty()) return rates.device_memory_bytes;
  return std::numeric_limits<double>::infinity();
}

namespace {

// memory.* but the policy, which each layout chooses; the micro-batches per
// step follow the layout.
MemoryOptions memory_options_for(const Config& cfg, const LayoutProblem& problem, const Layout& layout) {
  MemoryOptions m;
  m.policy = layout.memory_policy;
  m.offload_param_frac = cfg.get<double>("memory.offload_param_frac");
  m.offload_optim_frac = cfg.get<double>("memory.offload_optim_frac");
  m.nvme_dir = cfg.get<std::string>("memory.nvme_dir");
  m.nvme_io_uring = cfg.get<bool>("memory.nvme_io_uring");
  m.prefetch = static_cast<int>(cfg.get<int64_t>("memory.prefetch"));
  // "unlimited" is refused by plan_training; here it only must not wrap.
  m.chunk_bytes = static_cast<int64_t>(std::min(cfg.get_bytes("memory.chunk_bytes"), size_t{1} << 62));
  m.micro_batches = problem.global_batch / (layout.dp * layout.micro_batch);
  return m;
}

StepMemoryOptions step_memory_options(const Config& cfg, const LayoutProblem& problem, const Layout& layout) {
  StepMemoryOptions o;
  o.precision = parse_dtype(cfg.get<std::string>("precision"));
  o.bucket_bytes = cfg.get<int64_t>("zero.bucket_mb") << 20;
  o.memory = memory_options_for(cfg, problem, layout);
  return o;
}

double worst_device_peak(const std::vector<RankMemory>& ranks) {
  double most = 0.0;
  for (const RankMemory& r : ranks) most = std::max(most, r.peak(Tier::device));
  return most;
}

// Times to four significant digits in a unit that suits them.
std::string format_seconds(double s) {
  char buf[32];
  if (s >= 1.0)
    std::snprintf(buf, sizeof buf, "%.4g s", s);
  else if (s >= 1e-3)
    std::snprintf(buf, sizeof buf, "%.4g ms", s * 1e3);
  else
    std::snprintf(buf, sizeof buf, "%.4g us", s * 1e6);
  return buf;
}

std::string format_budget(double bytes) { return std::isinf(bytes) ? "unlimited" : format_bytes(bytes); }

// "--set parallel.dp=2 parallel.tp=1 ...", as `loom train` takes it.
std::string settings_line(const Layout& layout) {
  std::string line = "--set";
  for (const std::string& s : layout_settings(layout)) line += " " + s;
  return line;
}

// A hardware file's description runs on with its sources: its first sentence.
std::string first_sentence(const std::string& text) {
  const size_t end = text.find(". ");
  return end == std::string::npos ? text : text.substr(0, end + 1);
}


// The ranks whose peaks are the same on every tier: one role each (the dp
// replicas of a stage, usually), printed once.
void print_memory(const std::vector<RankMemory>& ranks, std::ostream& out) {
  std::vector<bool> done(ranks.size(), false);
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (done[i]) continue;
    std::vector<int> same;
    for (size_t j = i; j < ranks.size(); ++j) {
      bool equal = ranks[j].pp_stage == ranks[i].pp_stage;
      for (Tier t : {Tier::device, Tier::host, Tier::nvme}) equal = equal && ranks[j].peak(t) == ranks[i].peak(t);
      if (equal) {
        done[j] = true;
        same.push_back(static_cast<int>(j));
      }
    }
    const RankMemory& r = ranks[i];
    out << "  ranks " << detail::format_ranks(same) << " (pipeline stage " << r.pp_stage << "): device "
        << format_bytes(r.peak(Tier::device)) << ", host " << format_bytes(r.peak(Tier::host)) << ", nvme "
        << format_bytes(r.peak(Tier::nvme)) << "\n";
    const TierPeak& device = r.tiers[static_cast<int>(Tier::device)];
    std::vector<MemoryTerm> terms = device.terms;
    std::stable_sort(terms.begin(), terms.end(),
                     [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes > b.bytes; });
    terms.resize(std::min<size_t>(terms.size(), 4));
    out << "    device peak in " << device.phase << ", largest:";
    for (size_t k = 0; k < terms.size(); ++k) out << (k ? "," : "") << " " << terms[k].name << " " << format_bytes(terms[k].bytes);
    out << "\n";
  }
}

// --trace FILE, like trace.path: a new file in an existing directory (the
// trace never replaces a file silently), checked before anything is priced.
void check_trace_path(const fs::path& path) {
  if (path.empty()) return;
  std::error_code ec;
  if (fs::exists(path, ec))
    throw Error(str("plan: --trace '", path.string(), "' already exists: remove it, or pass --trace a new file"));
  const fs::path dir = path.parent_path();
  if (!dir.empty() && !fs::is_directory(dir, ec))
    throw Error(str("plan: --trace '", path.string(), "': its directory '", dir.string(),
                    "' does not exist: create it, or pass --trace a file in an existing directory"));
}

// The layout's predicted step as a Chrome trace at `path` (predict_step_trace),
// and the line saying so.
void write_predicted_trace(const fs::path& path, const Config& cfg, const LayoutProblem& problem,
                           const Layout& layout, const MachineRates& rates, const std::string& which,
                           std::ostream& out) {
  const StepMemoryOptions memory = step_memory_options(cfg, problem, layout);
  const PredictedTrace trace = predict_step_trace(problem, layout, memory, rates);
  write_file_atomic(path, trace.json());
  out << "trace: wrote " << path.string() << ", the predicted step of " << which << " on its "
      << trace.ranks.size() << " ranks (open it beside a measured trace.path in ui.perfetto.dev)\n";
}

void print_config_plan(const Config& cfg, const MachineRates& rates, double device_budget, const fs::path& trace,
                       std::ostream& out) {
  const TrainPlan plan = plan_training(cfg);
  const LayoutProblem problem = layout_problem_of(cfg, plan.model);
  const Layout layout = layout_of(cfg);
  const StepMemoryOptions memory = step_memory_options(cfg, problem, layout);
  const std::vector<RankMemory> ranks = predict_step_memory(problem, layout, memory);
  const StepTimePrediction t = predict_step_time(problem, layout, memory, rates);
  out << "layout: " << settings_line(layout) << "\n";
  out << "rates: " << first_sentence(rates.description) << "\n";
  const size_t host = cfg.get_bytes("memory.host_budget");
  out << "memory per rank (device budget " << format_budget(device_budget) << ", host budget "
      << format_budget(host == kUnlimited ? std::numeric_limits<double>::infinity() : static_cast<double>(host))
      << "):\n";
  print_memory(ranks, out);
  const double worst = worst_device_peak(ranks);
  if (worst > device_budget)
    out << "  does not fit: the largest device peak " << format_bytes(worst) << " exceeds the budget\n";
  out << "step time: " << describe_step_time(t) << "\n";
  out << "  compute " << format_seconds(t.compute_s) << ", exposed communication " << format_seconds(t.communication_s)
      << ", bubble " << format_seconds(t.bubble_s) << ", optimizer " << format_seconds(t.optimizer_s)
      << ", exposed transfers " << format_seconds(t.transfer_s) << "\n";
  if (const std::string moved = describe(t.traffic.bytes()); !moved.empty())
    out << "  offloaded state moves per step (data-parallel rank " << t.traffic.dp_rank << "): " << moved << "\n";
  if (!trace.empty()) write_predicted_trace(trace, cfg, problem, layout, rates, "the config's layout", out);
}

void print_search(const LayoutSearch& s, int64_t top, std::ostream& out) {
  out << "search: " << s.candidates << " layouts of " << s.world << " ranks, device budget "
      << format_budget(s.device_budget) << "\n";
  for (const RuleRejections& r : s.rules)
    out << "  " << r.count << " rejected by " << r.rule << ", e.g. " << r.example << "\n";
  if (s.equivalent > 0)
    out << "  " << s.equivalent << " left out: without a pipeline (parallel.pp = 1) their parallel.schedule "
        << "runs the same step as " << pipeline_schedule_name(Layout{}.schedule) << "\n";
  if (s.too_large > 0)
    out << "  " << s.too_large << " do not fit: the smallest of their device peaks is "
        << format_bytes(s.too_large_least_peak) << "\n";
  if (s.policy_refused > 0)
    out << "  " << s.policy_refused << " refused by loom train's check of the chunk stores (memory.policy), e.g. "
        << s.policy_refused_example << "\n";
  out << s.ranked.size() << " fit";
  if (s.ranked.empty()) {
    out << "\n";
    return;
  }
  const size_t shown = std::min<size_t>(s.ranked.size(), static_cast<size_t>(std::max<int64_t>(top, 0)));
  out << "; the fastest " << shown << ":\n";
  for (size_t i = 0; i < shown; ++i) {
    const RankedLayout& r = s.ranked[i];
    out << "  " << i + 1 << ". " << describe_step_time(r.time) << ", device peak " << format_bytes(r.device_peak) << "\n"
        << "     " << settings_line(r.layout) << "\n";
  }
}

}  // namespace

std::string describe_step_time(const StepTimePrediction& t) {
  char rate[64];
  std::snprintf(rate, sizeof rate, "%.0f tokens/s, MFU %.2f%%", t.tokens_per_s, 100.0 * t.mfu);
  return str(format_seconds(t.step_s), " per step (", rate, ")");
}

LayoutSearch search_layouts(const Config& cfg, const MachineRates& rates, int64_t world, double device_budget) {
  LayoutSearch s;
  s.world = world;
  s.device_budget = device_budget;
  const LayoutProblem problem = layout_problem_of(cfg, model_config_from(cfg));
  const std::vector<Layout> candidates = layout_candidates(problem, world);
  s.candidates = static_cast<int64_t>(candidates.size());
  std::map<std::string, RuleRejections> by_rule;
  s.too_large_least_peak = std::numeric_limits<double>::infinity();
  std::vector<const Layout*> valid;
  for (const Layout& layout : candidates) {
    if (const std::optional<LayoutViolation> broken = check_layout(problem, layout)) {
      RuleRejections& r = by_rule[broken->rule];
      if (r.count++ == 0) r.example = str(broken->key, ": ", broken->problem);
      continue;
    }
    // Without a pipeline the schedule runs the same step: one of them is kept.
    if (layout.pp == 1 && layout.schedule != Layout{}.schedule) {
      ++s.equivalent;
      continue;
    }
    valid.push_back(&layout);
  }
  // The valid layouts are priced independently, on every thread (a cluster's
  // search prices thousands of them over hundreds of ranks), and taken in
  // candidate order, so the result does not depend on the thread count.
  struct Priced {
    double peak = 0.0;
    std::string policy_refusal;  // check_memory_policy_fits' error
    StepTimePrediction time;
  };
  TierBytes budgets;
  budgets[Tier::device] = static_cast<int64_t>(
      std::min(device_budget, static_cast<double>(std::numeric_limits<int64_t>::max() / 4)));
  budgets[Tier::host] = static_cast<int64_t>(
      std::min(cfg.get_bytes("memory.host_budget"), static_cast<size_t>(std::numeric_limits<int64_t>::max())));
  budgets[Tier::nvme] = std::numeric_limits<int64_t>::max();
  std::vector<Priced> priced(valid.size());
  std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic)
  for (size_t i = 0; i < valid.size(); ++i) {
    try {
      const Layout& layout = *valid[i];
      const StepMemoryOptions memory = step_memory_options(cfg, problem, layout);
      priced[i].peak = worst_device_peak(predict_step_memory(problem, layout, memory));
      if (priced[i].peak > device_budget) continue;
      if (layout.memory_policy != MemoryPolicy::none) {
        try {
          check_memory_policy_fits(cfg, problem.model, layout, memory, {}, budgets);
        } catch (const Error& e) {
          priced[i].policy_refusal = e.what();
          continue;
        }
      }
      priced[i].time = predict_step_time(problem, layout, memory, rates);
    } catch (...) {
#pragma omp critical
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
  for (size_t i = 0; i < valid.size(); ++i) {
    if (priced[i].peak > device_budget) {
      ++s.too_large;
      s.too_large_least_peak = std::min(s.too_large_least_peak, priced[i].peak);
      continue;
    }
    if (!priced[i].policy_refusal.empty()) {
      if (s.policy_refused++ == 0) s.policy_refused_example = priced[i].policy_refusal;
      continue;
    }
    s.ranked.push_back({.layout = *valid[i], .time = priced[i].time, .device_peak = priced[i].peak});
  }
  for (const LayoutRule& rule : layout_rules())
    if (auto it = by_rule.find(rule.name); it != by_rule.end()) {
      it->second.rule = rule.name;
      s.rules.push_back(it->second);
    }
  std::stable_sort(s.ranked.begin(), s.ranked.end(), [](const RankedLayout& a, const RankedLayout& b) {
    if (a.time.step_s != b.time.step_s) return a.time.step_s < b.time.step_s;
    return a.device_peak < b.device_peak;
  });
  return s;
}

void run_plan(const Config& cfg, const PlanCommandOptions& options, std::ostream& out) {
  check_trace_path(options.trace);
  const int64_t layout_ranks =
      cfg.get<int64_t>("parallel.dp") * cfg.get<int64_t>("parallel.tp") * cfg.get<int64_t>("parallel.pp");
  if (options.nodes > 0 && options.rates.hardware.empty())
    throw Error("plan: --nodes plans for several machines of a hardware file (its ranks_per_node and inter_node "
                "link); a calibration describes this machine alone: pass --hardware FILE (e.g. "
                "hardware/h100-sxm.json)");
  if (options.nodes > 0 && options.ranks > 0)
    throw Error("plan: give the world size once: --nodes N (N * ranks_per_node ranks) or --ranks N, not both");
  const MachineRates rates = find_machine_rates(options.rates);
  const int64_t node_ranks = options.nodes * rates.ranks_per_node;
  if (options.nodes > 0 && !options.search && layout_ranks != node_ranks) {
    const int64_t model_ranks = cfg.get<int64_t>("parallel.tp") * cfg.get<int64_t>("parallel.pp");
    throw Error(str("plan: --nodes ", options.nodes, " of ", rates.ranks_per_node, " ranks (",
                    options.rates.hardware.string(), ") hold ", node_ranks,
                    " ranks, but the layout uses parallel.dp * parallel.tp * parallel.pp = ", layout_ranks,
                    ": set the layout to fill them",
                    node_ranks % model_ranks == 0 ? str(" (parallel.dp = ", node_ranks / model_ranks, ")") : "",
                    ", or add --search to find the best layout of ", node_ranks, " ranks"));
  }
  const double budget = plan_device_budget(cfg, options.rates, rates);
  if (options.nodes > 0)
    out << "machines: " << options.nodes << " x " << rates.ranks_per_node << " ranks = " << node_ranks
        << " ranks\n";
  if (!options.search) {
    print_config_plan(cfg, rates, budget, options.trace, out);
    return;
  }
  const int64_t world = options.nodes > 0 ? node_ranks : options.ranks > 0 ? options.ranks : layout_ranks;
  const LayoutSearch search = search_layouts(cfg, rates, world, budget);
  print_search(search, options.top, out);
  if (options.trace.empty()) return;
  if (search.ranked.empty())
    throw Error(str("plan: no layout of ", world, " ranks fits, so --trace has none to write '",
                    options.trace.string(), "' for: raise memory.device_budget, or plan for more ranks"));
  write_predicted_trace(options.trace, cfg, layout_problem_of(cfg, model_config_from(cfg)), search.ranked[0].layout,
                        rates, "the best layout (1. above)", out);
}

}  // namespace loom
