// Runs one communicator's collectives in issue order: asynchronous ones on a
// progress thread, synchronous ones on the caller's thread once the queue is
// empty. Records the first failure, after which every operation throws,
// because the ranks no longer agree on which collective comes next.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "comm/backend.h"

namespace loom {
class MemoryContext;
}

namespace loom::detail {

class QueuedCollective;

class CollectiveQueue {
 public:
  // The progress thread takes on the creating thread's rank, memory context
  // and OpenMP thread budget.
  explicit CollectiveQueue(Backend& backend);
  // Lets queued collectives finish (or fail), then joins the progress thread.
  ~CollectiveQueue();
  CollectiveQueue(const CollectiveQueue&) = delete;
  CollectiveQueue& operator=(const CollectiveQueue&) = delete;

  // Runs `call` on the calling thread after every queued collective.
  void run_now(CollectiveCall call);
  std::shared_ptr<PendingOp> enqueue(CollectiveCall call);

  // Throws Error naming `what` if an earlier operation failed.
  void throw_if_failed(const std::string& what) const;
  // Makes the communicator unusable (the first reason is kept).
  void record_failure(const std::string& reason);
  // Makes the communicator unusable for `reason` and cancels every queued and
  // running collective that has not started moving data; used when a handle
  // is abandoned.
  void cancel_all(const std::string& reason) {
    record_failure(reason);
    cancelled_.store(true);
  }
  Backend& backend() { return backend_; }

 private:
  void progress_loop();
  void run_task(QueuedCollective& task);

  Backend& backend_;
  int rank_;
  MemoryContext* memory_;
  int threads_;
  std::atomic<bool> cancelled_{false};

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // the progress thread waits for tasks
  std::condition_variable idle_cv_;  // run_now waits for the queue to drain
  std::deque<std::shared_ptr<QueuedCollective>> tasks_;
  bool running_ = false;
  bool stopping_ = false;
  std::string failure_;
  std::thread thread_;  // started by the first enqueue
};

}  // namespace loom::detail
