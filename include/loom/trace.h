#pragma once
// A timeline of measured training steps (`trace.path`): per rank, spans with a
// name, a category, a begin and a duration, written as one Chrome trace /
// Perfetto JSON file (open it in ui.perfetto.dev or chrome://tracing).
//
// Each rank records into its own TraceRecorder, reachable from the rank's
// thread only while a traced step runs (TraceStep). Code marks work with a
// TraceScope; without an active recorder a scope is one thread-local load and
// a branch, so tracing off costs nothing measurable (no allocation, no lock).
//
// Time is the time the work runs. Kernels may run later on a stream worker
// (LOOM_CPU_STREAMS=async, device.h), so while recording every scope drains
// the rank's streams at its begin and end (ops::synchronize): a span then holds
// exactly its own kernels. That serializes host and device during traced steps
// only; untraced steps keep their overlap. Asynchronous collectives show as
// the time a rank waits for them (Work::wait), which is what delays the step.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

class Communicator;

enum class TraceCategory { step, compute, communication, transfer, optimizer, data, idle };
const char* trace_category_name(TraceCategory category);

struct TraceSpan {
  std::string name;
  TraceCategory category = TraceCategory::compute;
  int64_t begin_ns = 0;  // steady clock (a predicted span: chrome_trace_json's ticks)
  int64_t end_ns = 0;
  int depth = 0;         // 0: a step span; 1: directly inside it; ...
};

// The steps a run records, 1-based and inclusive: "3" or "2-4".
struct TraceSteps {
  int64_t first = 2;
  int64_t last = 4;
  // Nothing when `text` is neither form.
  static std::optional<TraceSteps> parse(std::string_view text);
  bool contains(int64_t step) const { return step >= first && step <= last; }
};

// One rank's spans. Not thread-safe: only its rank's thread records into it.
class TraceRecorder {
 public:
  void open(TraceCategory category, std::string name);
  void close();
  const std::vector<TraceSpan>& spans() const { return spans_; }

 private:
  std::vector<TraceSpan> spans_;
  std::vector<size_t> open_;  // indices of the spans not yet closed
};

namespace detail {
// The calling thread's recorder while a traced step runs, else null.
extern constinit thread_local TraceRecorder* t_trace_recorder;
}  // namespace detail

// Marks the enclosing block as one span of the calling rank's timeline. The
// name is "<name><suffix>" (built only when recording), or "<op> (<n>)" for
// an operation over a group of n ranks.
class TraceScope {
 public:
  TraceScope(TraceCategory category, std::string_view name, std::string_view suffix = {})
      : recorder_(detail::t_trace_recorder) {
    if (recorder_) [[unlikely]] open(category, name, suffix);
  }
  TraceScope(TraceCategory category, const char* op, int group_size) : recorder_(detail::t_trace_recorder) {
    if (recorder_) [[unlikely]] open(category, op, group_size);
  }
  ~TraceScope() {
    if (recorder_) [[unlikely]] close();
  }
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  void open(TraceCategory category, std::string_view name, std::string_view suffix);
  void open(TraceCategory category, const char* op, int group_size);
  void close();
  TraceRecorder* recorder_;
};

// One training step: when `recorder` is non-null, makes it the calling
// thread's recorder and opens the step span "step <n>" until destruction.
class TraceStep {
 public:
  TraceStep(TraceRecorder* recorder, int64_t step);
  ~TraceStep();
  TraceStep(const TraceStep&) = delete;
  TraceStep& operator=(const TraceStep&) = delete;

 private:
  TraceRecorder* recorder_;
};

// Chrome trace JSON of every rank's spans (ranks[r] is rank r's): pid = rank,
// times in microseconds from the earliest span, an "M" event naming each pid
// "rank N", and the gaps between a step's direct children as `idle` events,
// so each rank's depth-1 events tile its step spans. Each "X" event's
// args.depth is its nesting depth (0: the step). The spans' times are in
// ticks of 1 / ticks_per_us microseconds: nanoseconds for a measured trace,
// finer for a predicted one (planner.h's predicted_step_trace), whose pieces
// may be shorter than a nanosecond.
std::string chrome_trace_json(const std::vector<std::vector<TraceSpan>>& ranks, double ticks_per_us = 1e3);

// Gathers every rank's spans of `world` to its rank 0 (collective; null world:
// this rank alone), which writes the trace to `path` atomically.
void write_trace(const std::filesystem::path& path, const TraceRecorder& recorder, Communicator* world);

}  // namespace loom
