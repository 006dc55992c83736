// Output: every rank's spans as one Chrome trace file, gathered to rank 0.
#include <algorithm>
#include <limits>
#include <nlohmann/json.hpp>

#include "loom/comm.h"
#include "loom/core.h"
#include "loom/io.h"
#include "loom/trace.h"

namespace loom {

namespace {

// A rank's spans in the order they opened, with idle spans added in the gaps
// between each step's direct children (and at its ends), so that the depth-1
// spans of a step tile it.
std::vector<TraceSpan> with_idle(const std::vector<TraceSpan>& spans) {
  std::vector<TraceSpan> out;
  out.reserve(spans.size());
  auto idle = [&](int64_t from, int64_t to) {
    if (to > from) out.push_back({"idle", TraceCategory::idle, from, to, 1});
  };
  int64_t cursor = 0;
  int64_t step_end = 0;
  bool in_step = false;
  for (const TraceSpan& s : spans) {
    if (s.depth == 0) {
      if (in_step) idle(cursor, step_end);
      in_step = true;
      cursor = s.begin_ns;
      step_end = s.end_ns;
    } else if (s.depth == 1) {
      idle(cursor, s.begin_ns);
      cursor = s.end_ns;
    }
    out.push_back(s);
  }
  if (in_step) idle(cursor, step_end);
  return out;
}

nlohmann::json spans_to_json(const std::vector<TraceSpan>& spans) {
  nlohmann::json out = nlohmann::json::array();
  for (const TraceSpan& s : spans)
    out.push_back({s.name, static_cast<int>(s.category), s.begin_ns, s.end_ns, s.depth});
  return out;
}

std::vector<TraceSpan> spans_from_json(const nlohmann::json& in) {
  std::vector<TraceSpan> out;
  for (const nlohmann::json& s : in)
    out.push_back({s[0].get<std::string>(), static_cast<TraceCategory>(s[1].get<int>()), s[2].get<int64_t>(),
                   s[3].get<int64_t>(), s[4].get<int>()});
  return out;
}

}  // namespace

std::string chrome_trace_json(const std::vector<std::vector<TraceSpan>>& ranks, double ticks_per_us) {
  int64_t t0 = std::numeric_limits<int64_t>::max();
  for (const auto& spans : ranks)
    for (const TraceSpan& s : spans) t0 = std::min(t0, s.begin_ns);
  auto us = [ticks_per_us](int64_t ticks) { return static_cast<double>(ticks) / ticks_per_us; };
  nlohmann::json events = nlohmann::json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    const int pid = static_cast<int>(r);
    events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                      {"args", {{"name", str("rank ", r)}}}});
    events.push_back({{"name", "process_sort_index"}, {"ph", "M"}, {"pid", pid}, {"tid", 0},
                      {"args", {{"sort_index", pid}}}});
    for (const TraceSpan& s : with_idle(ranks[r]))
      events.push_back({{"name", s.name},
                        {"cat", trace_category_name(s.category)},
                        {"ph", "X"},
                        {"ts", us(s.begin_ns - t0)},
                        {"dur", us(s.end_ns - s.begin_ns)},
                        {"pid", pid},
                        {"tid", 0},
                        {"args", {{"depth", s.depth}}}});
  }
  return nlohmann::json{{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}}.dump();
}

void write_trace(const std::filesystem::path& path, const TraceRecorder& recorder, Communicator* world) {
  const std::string mine = spans_to_json(recorder.spans()).dump();
  std::vector<std::vector<TraceSpan>> ranks;
  if (!world) {
    ranks.push_back(recorder.spans());
  } else {
    // Variable-length gather from fixed-size pieces: every rank's text padded
    // to the longest.
    const int n = world->size();
    std::vector<int64_t> sizes(static_cast<size_t>(n));
    const int64_t size = static_cast<int64_t>(mine.size());
    world->all_gather(&size, sizes.data(), 1, DType::i64);
    const int64_t longest = *std::max_element(sizes.begin(), sizes.end());
    std::string padded = mine;
    padded.resize(static_cast<size_t>(longest));
    std::string all(static_cast<size_t>(longest * n), '\0');
    world->all_gather(padded.data(), all.data(), longest, DType::u8);
    if (world->rank() != 0) return;
    for (int r = 0; r < n; ++r)
      ranks.push_back(spans_from_json(nlohmann::json::parse(
          std::string_view(all).substr(static_cast<size_t>(r * longest), static_cast<size_t>(sizes[r])))));
  }
  write_file_atomic(path, chrome_trace_json(ranks));
}

}  // namespace loom
