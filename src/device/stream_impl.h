// The CPU backend's stream: an ordered queue of host closures, run on the
// enqueueing thread (sync mode) or on a worker thread of the stream's own
// (async mode). Work is numbered by tickets; an event is a (stream, ticket).
#pragma once

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>

#include "loom/device.h"

namespace loom::detail {

class StreamImpl {
 public:
  // The worker (async) takes on the creating thread's rank, memory context
  // and OpenMP thread budget, as the communicator's progress thread does.
  StreamImpl(Device device, CpuStreamMode mode);
  // Runs what is queued, then joins the worker.
  ~StreamImpl();
  StreamImpl(const StreamImpl&) = delete;
  StreamImpl& operator=(const StreamImpl&) = delete;

  Device device() const { return device_; }
  CpuStreamMode mode() const { return mode_; }

  // Returns the work's ticket. After a failure, later work is skipped (the
  // failure is rethrown at the next wait).
  uint64_t enqueue(std::function<void()> work);
  // The ticket of the last work enqueued (0: none).
  uint64_t last_ticket() const;
  // Blocks until work `ticket` has run; rethrows the stream's failure.
  void wait_for(uint64_t ticket);
  bool done(uint64_t ticket) const;

 private:
  void worker_loop();

  Device device_;
  CpuStreamMode mode_;
  int rank_;
  MemoryContext* memory_;
  int threads_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the worker waits for work
  std::condition_variable done_cv_;  // waiters wait for tickets
  std::deque<std::function<void()>> queue_;
  uint64_t enqueued_ = 0;
  uint64_t completed_ = 0;
  std::exception_ptr failure_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace loom::detail
