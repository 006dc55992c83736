#include <atomic>
#include <cstdlib>
#include <cstring>

#include "device/stream_impl.h"

namespace loom {

std::string Device::name() const {
  switch (kind) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::cuda: return str("cuda:", index);
  }
  LOOM_CHECK(false, "unknown device kind");
}

// ---------------------------------------------------------------------------
// CPU stream mode
// ---------------------------------------------------------------------------

namespace {

CpuStreamMode mode_from_environment() {
  const char* v = std::getenv("LOOM_CPU_STREAMS");
  if (v == nullptr || std::strcmp(v, "") == 0 || std::strcmp(v, "sync") == 0) return CpuStreamMode::sync;
  if (std::strcmp(v, "async") == 0) return CpuStreamMode::async;
  throw Error(str("LOOM_CPU_STREAMS = \"", v, "\": use \"sync\" (the default) or \"async\""));
}

std::atomic<CpuStreamMode>& mode_setting() {
  static std::atomic<CpuStreamMode> mode{mode_from_environment()};
  return mode;
}

}  // namespace

CpuStreamMode cpu_stream_mode() { return mode_setting().load(); }
void set_cpu_stream_mode(CpuStreamMode mode) { mode_setting().store(mode); }

const char* cpu_stream_mode_name(CpuStreamMode mode) {
  return mode == CpuStreamMode::async ? "async" : "sync";
}

// ---------------------------------------------------------------------------
// StreamImpl
// ---------------------------------------------------------------------------

namespace detail {

StreamImpl::StreamImpl(Device device, CpuStreamMode mode)
    : device_(device), mode_(mode), rank_(current_rank()), memory_(&MemoryContext::current()),
      threads_(cpu::num_threads()) {
  LOOM_CHECK(device.kind == DeviceKind::cpu, "the CPU stream runs CPU work, not ", device.name());
  if (mode_ == CpuStreamMode::async) worker_ = std::thread([this] { worker_loop(); });
}

StreamImpl::~StreamImpl() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    work_cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
}

uint64_t StreamImpl::enqueue(std::function<void()> work) {
  if (mode_ == CpuStreamMode::sync) {
    // Tickets still count, so events and waits mean the same in both modes.
    // A failure propagates to the caller at once, as the kernel call would.
    work();
    std::lock_guard lock(mu_);
    completed_ = ++enqueued_;
    return enqueued_;
  }
  std::lock_guard lock(mu_);
  queue_.push_back(std::move(work));
  work_cv_.notify_one();
  return ++enqueued_;
}

uint64_t StreamImpl::last_ticket() const {
  std::lock_guard lock(mu_);
  return enqueued_;
}

bool StreamImpl::done(uint64_t ticket) const {
  std::lock_guard lock(mu_);
  return completed_ >= ticket;
}

void StreamImpl::wait_for(uint64_t ticket) {
  std::unique_lock lock(mu_);
  done_cv_.wait(lock, [&] { return completed_ >= ticket || failure_; });
  if (failure_) std::rethrow_exception(failure_);
}

void StreamImpl::worker_loop() {
  set_current_rank(rank_);
  MemoryContext::Install install(*memory_);
  cpu::set_num_threads(threads_);
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (queue_.empty()) return;
    std::function<void()> work = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    std::exception_ptr error;
    if (!failure_) {
      try {
        work();
      } catch (...) {
        error = std::current_exception();
      }
    }
    work = nullptr;  // the closure's captures are released in stream order
    lock.lock();
    if (error && !failure_) failure_ = error;
    ++completed_;
    done_cv_.notify_all();
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Stream, Event, current stream
// ---------------------------------------------------------------------------

Device Stream::device() const { return impl_->device(); }
void Stream::synchronize() const { impl_->wait_for(impl_->last_ticket()); }
void Stream::enqueue(std::function<void()> work) const { impl_->enqueue(std::move(work)); }

Event Event::record(const Stream& stream) {
  Event e;
  e.stream_ = stream.impl_shared();
  e.ticket_ = e.stream_->last_ticket();
  return e;
}

void Event::synchronize() const {
  if (stream_) stream_->wait_for(ticket_);
}

bool Event::query() const { return !stream_ || stream_->done(ticket_); }

void Event::wait(const Stream& stream) const {
  if (!stream_ || stream_.get() == &stream.impl() || stream_->done(ticket_)) return;
  stream.enqueue([source = stream_, ticket = ticket_] { source->wait_for(ticket); });
}

int host_threads() { return cpu::num_threads(); }

namespace {
thread_local std::shared_ptr<detail::StreamImpl> t_stream_override;

// A HostSection's stream runs work as it is enqueued; one per thread, created
// by the thread that uses it.
Stream host_section_stream() {
  thread_local const auto stream = std::make_shared<detail::StreamImpl>(Device::cpu(), CpuStreamMode::sync);
  return Stream(stream);
}
}  // namespace

Stream current_stream() {
  if (t_stream_override) return Stream(t_stream_override);
  return Stream(MemoryContext::current().stream(MemoryContext::StreamRole::compute));
}

Stream copy_stream() {
  const Stream host = host_section_stream();
  if (t_stream_override == host.impl_shared()) return host;
  return Stream(MemoryContext::current().stream(MemoryContext::StreamRole::copy));
}

StreamGuard::StreamGuard(const Stream& stream) : previous_(std::move(t_stream_override)) {
  t_stream_override = stream.impl_shared();
}

StreamGuard::~StreamGuard() { t_stream_override = std::move(previous_); }


HostSection::HostSection() : guard_((ops::synchronize(), host_section_stream())) {
  LOOM_CHECK(MemoryContext::current().device().kind == DeviceKind::cpu,
             "host code touches device memory directly on ", MemoryContext::current().device().name());
}

// ---------------------------------------------------------------------------
// MemoryContext's streams
// ---------------------------------------------------------------------------

MemoryContext::~MemoryContext() {
  // Work still queued may free into this context's allocators: the streams
  // run it (their destructors drain the queue) before the allocators go.
  for (auto& s : streams_) s.reset();
}

const std::shared_ptr<detail::StreamImpl>& MemoryContext::stream(StreamRole role) {
  std::lock_guard lock(streams_mu_);
  auto& s = streams_[static_cast<size_t>(role)];
  // Created by the rank's own thread (the only one that enqueues on it), so
  // the worker inherits that thread's rank and thread budget.
  if (!s) s = std::make_shared<detail::StreamImpl>(device_, cpu_stream_mode());
  return s;
}

}  // namespace loom
