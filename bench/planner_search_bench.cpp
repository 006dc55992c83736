// Does the layout search choose well? On a problem small enough to measure
// every layout it considers:
//
//   planner_search_bench [ranks] [steps] [calibration.json]
//
// calibrates this machine (unless a calibration is given), searches every
// layout of `ranks` local ranks (default 8) for a small GPT, first without a
// budget and then under a device budget that the median layout's predicted
// peak sets (so about half the valid layouts are predicted not to fit), and
// trains every layout the search says fits, `steps` timed steps each (the
// slowest rank's median) under that budget. The fastest of one noisy pass
// is its luckiest measurement, so the five fastest measured and the
// search's three first are then timed again, in three interleaved rounds
// of `steps` steps each (median of all). It prints:
// - the layouts predicted to fit that ran out of memory (target: none);
// - the search's first choice over the fastest of the second pass (target:
//   within 10%), and where the first choice ranks in the first pass;
// - the ten fastest by prediction and by measurement, each with the other's
//   rank.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "bench_common.h"
#include "planned_step.h"
#include "loom/config.h"
#include "loom/planner.h"
#include "loom/train.h"

using namespace loom;

namespace {

const std::vector<std::string> kModel = {
    "model.preset=custom", "model.n_layer=4",  "model.n_head=4",     "model.n_embd=128", "model.vocab_size=1024",
    "model.block_size=64", "data.vocab_size=1024", "train.seq_len=64", "train.batch_size=16", "model.dropout=0"};

struct Measured {
  const RankedLayout* ranked;
  double seconds = 0.0;  // infinity: it did not run
  std::string failure;
};

std::string settings_of(const Layout& layout) {
  std::string line;
  for (const std::string& s : layout_settings(layout)) line += (line.empty() ? "" : " ") + s;
  return line;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t ranks = argc > 1 ? std::atoll(argv[1]) : 8;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 3;
  if (ranks < 1 || steps < 1) {
    std::fprintf(stderr, "usage: planner_search_bench [ranks >= 1] [steps >= 1] [calibration.json]\n");
    return 2;
  }
  MachineRates rates;
  if (argc > 3) {
    rates = load_machine_rates(argv[3]);
  } else {
    std::printf("calibrating this machine\n");
    CalibrationOptions o;
    o.progress = [](const std::string& line) { std::printf("  %s\n", line.c_str()); };
    rates = calibrate_machine(o);
  }

  Config cfg(loom_schema());
  for (const std::string& s : kModel) cfg.set_override(s);
  const LayoutSearch unlimited = search_layouts(cfg, rates, ranks, std::numeric_limits<double>::infinity());
  std::vector<double> peaks;
  for (const RankedLayout& r : unlimited.ranked) peaks.push_back(r.device_peak);
  const double budget = std::floor(bench::median(peaks));
  cfg.set_override(str("memory.device_budget=", static_cast<int64_t>(budget)));
  const LayoutSearch search = search_layouts(cfg, rates, ranks, budget);
  std::printf("search: %lld layouts of %lld ranks, %zu valid; under a device budget of %s, %zu predicted to fit, "
              "%lld not\n",
              static_cast<long long>(search.candidates), static_cast<long long>(ranks), unlimited.ranked.size(),
              format_bytes(budget).c_str(), search.ranked.size(), static_cast<long long>(search.too_large));

  const GPTConfig model = model_config_from(cfg);
  const std::vector<int32_t> data =
      bench::random_tokens(cfg.get<int64_t>("train.batch_size"), cfg.get<int64_t>("train.seq_len"), model.vocab_size);
  std::vector<Measured> measured;
  for (const RankedLayout& r : search.ranked) {
    Config c = cfg;
    for (const std::string& s : layout_settings(r.layout)) c.set_override(s);
    Measured m{&r, std::numeric_limits<double>::infinity(), ""};
    try {
      m.seconds = bench::measure_planned_step(plan_training(c), data, steps);
    } catch (const std::exception& e) {
      m.failure = e.what();
    }
    measured.push_back(m);
    if (measured.size() % 20 == 0 || measured.size() == search.ranked.size()) {
      std::printf("  measured %zu of %zu\n", measured.size(), search.ranked.size());
      std::fflush(stdout);
    }
  }

  int failures = 0;
  for (const Measured& m : measured)
    if (!m.failure.empty()) {
      ++failures;
      std::printf("FAILED (predicted peak %s): %s\n  %s\n", format_bytes(m.ranked->device_peak).c_str(),
                  settings_of(m.ranked->layout).c_str(), m.failure.c_str());
    }
  std::printf("layouts predicted to fit that failed to run (out of memory or otherwise): %d of %zu (target: 0)\n",
              failures, measured.size());

  // Ranks by prediction (the search's order) and by measurement.
  std::vector<size_t> by_measured(measured.size());
  for (size_t i = 0; i < by_measured.size(); ++i) by_measured[i] = i;
  std::stable_sort(by_measured.begin(), by_measured.end(),
                   [&](size_t a, size_t b) { return measured[a].seconds < measured[b].seconds; });
  std::vector<size_t> measured_rank(measured.size());
  for (size_t k = 0; k < by_measured.size(); ++k) measured_rank[by_measured[k]] = k;
  if (measured.empty() || std::isinf(measured[0].seconds)) return 1;

  // The second pass: the first pass's five fastest and the search's three
  // first, timed again in interleaved rounds.
  std::vector<size_t> finalists;
  for (size_t k = 0; k < std::min<size_t>(5, by_measured.size()); ++k) finalists.push_back(by_measured[k]);
  for (size_t i = 0; i < std::min<size_t>(3, measured.size()); ++i)
    if (measured[i].failure.empty() && std::find(finalists.begin(), finalists.end(), i) == finalists.end())
      finalists.push_back(i);
  std::vector<std::vector<double>> again(finalists.size());
  for (int round = 0; round < 3; ++round)
    for (size_t f = 0; f < finalists.size(); ++f) {
      Config c = cfg;
      for (const std::string& setting : layout_settings(measured[finalists[f]].ranked->layout)) c.set_override(setting);
      again[f].push_back(bench::measure_planned_step(plan_training(c), data, steps));
    }
  std::printf("\nsecond pass (median of 3 rounds of %d steps):\n%6s %11s %11s  %s\n", steps, "rank", "measured",
              "predicted", "layout");
  double fastest = std::numeric_limits<double>::infinity(), first_choice = 0.0;
  for (size_t f = 0; f < finalists.size(); ++f) {
    const double t = bench::median(again[f]);
    fastest = std::min(fastest, t);
    if (finalists[f] == 0) first_choice = t;
    std::printf("%6zu %9.2fms %9.2fms  %s\n", finalists[f] + 1, t * 1e3,
                measured[finalists[f]].ranked->time.step_s * 1e3,
                settings_of(measured[finalists[f]].ranked->layout).c_str());
  }
  std::printf("the search's first choice: measured %.2f ms, %.3f x the fastest measured (%.2f ms) (target <= 1.10); "
              "in the first pass it ranked %zu of %zu by measurement\n",
              first_choice * 1e3, first_choice / fastest, fastest * 1e3, measured_rank[0] + 1, measured.size());

  const size_t shown = std::min<size_t>(10, measured.size());
  std::printf("\nfastest by prediction:\n%6s %11s %11s %9s  %s\n", "rank", "predicted", "measured", "measured#",
              "layout");
  for (size_t i = 0; i < shown; ++i)
    std::printf("%6zu %9.2fms %9.2fms %9zu  %s\n", i + 1, measured[i].ranked->time.step_s * 1e3,
                measured[i].seconds * 1e3, measured_rank[i] + 1, settings_of(measured[i].ranked->layout).c_str());
  std::printf("\nfastest by measurement:\n%6s %11s %11s %10s  %s\n", "rank", "measured", "predicted", "predicted#",
              "layout");
  for (size_t k = 0; k < shown; ++k) {
    const size_t i = by_measured[k];
    std::printf("%6zu %9.2fms %9.2fms %10zu  %s\n", k + 1, measured[i].seconds * 1e3,
                measured[i].ranked->time.step_s * 1e3, i + 1, settings_of(measured[i].ranked->layout).c_str());
  }
  std::printf("\nevery layout, in the search's order:\n%6s %11s %11s %7s %9s %9s %9s  %s\n", "rank", "predicted",
              "measured", "ratio", "compute", "comm", "bubble", "layout");
  for (size_t i = 0; i < measured.size(); ++i) {
    const StepTimePrediction& p = measured[i].ranked->time;
    std::printf("%6zu %9.2fms %9.2fms %7.3f %7.2fms %7.2fms %7.2fms  %s\n", i + 1, p.step_s * 1e3,
                measured[i].seconds * 1e3, p.step_s / measured[i].seconds, p.compute_s * 1e3,
                p.communication_s * 1e3, p.bubble_s * 1e3, settings_of(measured[i].ranked->layout).c_str());
  }
  return failures == 0 ? 0 : 1;
}
