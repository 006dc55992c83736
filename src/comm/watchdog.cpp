// The watchdog: each rank thread's activity record, written by its progress
// reports and its communication waits, read by the watchdog's thread.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "comm/backend.h"

namespace loom {
namespace detail {

// One rank's activity. The rank's thread is the only writer; the watchdog
// reads the fields one by one, which is consistent whenever it matters: a
// stalled rank writes nothing.
struct alignas(64) Activity {
  std::atomic<const char*> what{nullptr};  // null until the first report
  std::atomic<int64_t> step{-1};
  std::atomic<const char*> item{nullptr};
  std::atomic<int64_t> index{-1};
  std::atomic<int64_t> last_ns{0};  // steady clock at the last report or end of a wait
  std::atomic<int> waiting{0};      // communication waits in progress
  std::atomic<bool> finished{false};
};

namespace {

thread_local Activity* t_activity = nullptr;

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string describe_phase(const Activity& a) {
  std::string text = a.what.load(std::memory_order_relaxed);
  if (const int64_t step = a.step.load(std::memory_order_relaxed); step >= 0) text += str(" step ", step);
  if (const char* item = a.item.load(std::memory_order_relaxed))
    text += str(" ", item, " ", a.index.load(std::memory_order_relaxed));
  return text;
}

}  // namespace

void begin_communication_wait() {
  if (Activity* a = t_activity) a->waiting.fetch_add(1, std::memory_order_relaxed);
}

void end_communication_wait() {
  if (Activity* a = t_activity) {
    a->last_ns.store(now_ns(), std::memory_order_relaxed);
    a->waiting.fetch_sub(1, std::memory_order_release);
  }
}

void write_to_stderr(const std::string& text) {
  // write(2), not stdio: a hung thread may hold the stream's lock.
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(STDERR_FILENO, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

void end_process(const std::string& text) {
  write_to_stderr(text);
  if (ftrylockfile(stdout) == 0) {
    std::fflush(stdout);
    funlockfile(stdout);
  }
  std::_Exit(1);
}

}  // namespace detail

void report_progress(const char* what, int64_t step, const char* item, int64_t index) {
  detail::Activity* a = detail::t_activity;
  if (!a) return;
  a->step.store(step, std::memory_order_relaxed);
  a->item.store(item, std::memory_order_relaxed);
  a->index.store(index, std::memory_order_relaxed);
  a->what.store(what, std::memory_order_relaxed);
  a->last_ns.store(detail::now_ns(), std::memory_order_release);
}

void report_progress() {
  if (detail::Activity* a = detail::t_activity) a->last_ns.store(detail::now_ns(), std::memory_order_release);
}

Watchdog::Watchdog(std::vector<int> ranks, std::chrono::milliseconds timeout, OnStall on_stall)
    : ranks_(std::move(ranks)), timeout_(timeout), on_stall_(std::move(on_stall)) {
  if (timeout_.count() < 0)
    throw Error(str("the watchdog timeout is ", timeout_.count(), " ms: use a positive timeout, or 0 to turn it off"));
  if (timeout_.count() == 0) return;
  activities_ = std::make_unique<detail::Activity[]>(ranks_.size());
  thread_ = std::thread([this] { run(); });
}

Watchdog::~Watchdog() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

Watchdog::Watch::Watch(Watchdog& watchdog, size_t i) : previous_(detail::t_activity) {
  LOOM_CHECK(i < watchdog.ranks_.size(), "watch ", i, " of a watchdog over ", watchdog.ranks_.size(), " ranks");
  if (watchdog.activities_) mine_ = &watchdog.activities_[i];
  detail::t_activity = mine_;
}

Watchdog::Watch::~Watch() {
  if (mine_) mine_->finished.store(true);
  detail::t_activity = previous_;
}

void run_watched(std::chrono::milliseconds timeout, const std::function<void()>& fn) {
  Watchdog watchdog({0}, timeout, [](int rank, const std::string& message) {
    detail::end_process(str("loom: rank ", rank, " failed: ", message, "\n"));
  });
  Watchdog::Watch watch(watchdog, 0);
  fn();
}

void Watchdog::run() {
  // Sampling at a tenth of the timeout finds a stall within 1.1 timeouts.
  const auto interval = std::max(timeout_ / 10, std::chrono::milliseconds(1));
  const int64_t timeout_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout_).count();
  std::unique_lock lock(mu_);
  while (!wake_.wait_for(lock, interval, [&] { return stopping_; })) {
    for (size_t i = 0; i < ranks_.size(); ++i) {
      const detail::Activity& a = activities_[i];
      if (a.waiting.load(std::memory_order_acquire) > 0 || a.finished.load() || !a.what.load()) continue;
      const int64_t stalled_ns = detail::now_ns() - a.last_ns.load(std::memory_order_acquire);
      if (stalled_ns < timeout_ns) continue;
      const std::string message =
          str("made no progress for ",
              detail::format_duration(std::chrono::duration_cast<std::chrono::milliseconds>(
                  std::chrono::nanoseconds(stalled_ns))),
              " while in '", detail::describe_phase(a), "' (watchdog timeout ", detail::format_duration(timeout_),
              "): it is hung (in compute, I/O or a deadlock) or the phase is slower than the timeout; if it is "
              "legitimately that slow, raise train.watchdog_timeout");
      lock.unlock();
      on_stall_(ranks_[i], message);
      return;
    }
  }
}

}  // namespace loom
