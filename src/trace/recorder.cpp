// Recording: the per-rank recorder, scopes, the traced step and the step
// selection.
#include <charconv>
#include <chrono>
#include <exception>

#include "loom/core.h"
#include "loom/device.h"
#include "loom/trace.h"

namespace loom {

namespace detail {
constinit thread_local TraceRecorder* t_trace_recorder = nullptr;
}  // namespace detail

namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

const char* trace_category_name(TraceCategory category) {
  switch (category) {
    case TraceCategory::step: return "step";
    case TraceCategory::compute: return "compute";
    case TraceCategory::communication: return "communication";
    case TraceCategory::transfer: return "transfer";
    case TraceCategory::optimizer: return "optimizer";
    case TraceCategory::data: return "data";
    case TraceCategory::idle: return "idle";
  }
  return "?";
}

std::optional<TraceSteps> TraceSteps::parse(std::string_view text) {
  auto number = [&](std::string_view s, int64_t& out) {
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
    return ec == std::errc() && end == s.data() + s.size() && out >= 1;
  };
  TraceSteps steps;
  const size_t dash = text.find('-');
  const bool ok = dash == std::string_view::npos
                      ? number(text, steps.first) && ((steps.last = steps.first), true)
                      : number(text.substr(0, dash), steps.first) && number(text.substr(dash + 1), steps.last) &&
                            steps.first <= steps.last;
  if (!ok) return std::nullopt;
  return steps;
}

void TraceRecorder::open(TraceCategory category, std::string name) {
  // The work enqueued before the span runs before it begins.
  ops::synchronize();
  open_.push_back(spans_.size());
  spans_.push_back({std::move(name), category, now_ns(), 0, static_cast<int>(open_.size()) - 1});
}

void TraceRecorder::close() {
  LOOM_CHECK(!open_.empty(), "a trace span closed without one open");
  // The span's own kernels finish inside it. close() runs in destructors: a
  // kernel's failure stays with its stream, whose next synchronize outside a
  // destructor rethrows it, and an unwinding step waits for nothing.
  if (std::uncaught_exceptions() == 0) {
    try {
      ops::synchronize();
    } catch (const std::exception&) {
    }
  }
  spans_[open_.back()].end_ns = now_ns();
  open_.pop_back();
}

void TraceScope::open(TraceCategory category, std::string_view name, std::string_view suffix) {
  std::string full;
  full.reserve(name.size() + suffix.size());
  full.append(name).append(suffix);
  recorder_->open(category, std::move(full));
}

void TraceScope::open(TraceCategory category, const char* op, int group_size) {
  recorder_->open(category, str(op, " (", group_size, ")"));
}

void TraceScope::close() { recorder_->close(); }

TraceStep::TraceStep(TraceRecorder* recorder, int64_t step) : recorder_(recorder) {
  if (!recorder_) return;
  LOOM_CHECK(detail::t_trace_recorder == nullptr, "traced steps do not nest");
  recorder_->open(TraceCategory::step, str("step ", step));
  detail::t_trace_recorder = recorder_;
}

TraceStep::~TraceStep() {
  if (!recorder_) return;
  detail::t_trace_recorder = nullptr;
  recorder_->close();
}

}  // namespace loom
