#include "comm/collective_queue.h"

#include "comm/buffer_ops.h"
#include "loom/kernels.h"

namespace loom::detail {

namespace {

// Runs a collective, then applies CommOptions::test_double_sums to its result.
void run_on(Backend& backend, const CollectiveCall& call) {
  backend.run_collective(call);
  if (!call.doubled) return;
  const void* twice[2] = {call.recv, call.recv};
  reduce_into(twice, 2, &call.recv, 1, call.count, call.dtype, ReduceOp::sum);
}

}  // namespace

// The handle's side of a queued collective.
class QueuedCollective : public PendingOp {
 public:
  QueuedCollective(CollectiveCall call, CollectiveQueue& queue) : call_(call), queue_(queue) {}

  const CollectiveCall& call() const { return call_; }

  void finish(std::string error) {
    std::lock_guard lock(mu_);
    error_ = std::move(error);
    finished_ = true;
    cv_.notify_all();
  }

  void wait() override {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_; });
    if (!error_.empty()) throw Error(error_);
  }

  bool test() override {
    std::lock_guard lock(mu_);
    return finished_;
  }

  void abandon() noexcept override {
    queue_.cancel_all(str(describe_on_group(call_, queue_.backend().world_ranks()),
                          " was abandoned: its Work was destroyed before wait()"));
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return finished_; });
  }

 private:
  CollectiveCall call_;
  CollectiveQueue& queue_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool finished_ = false;
  std::string error_;
};

CollectiveQueue::CollectiveQueue(Backend& backend)
    : backend_(backend), rank_(current_rank()), memory_(&MemoryContext::current()), threads_(cpu::num_threads()) {}

CollectiveQueue::~CollectiveQueue() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    work_cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

void CollectiveQueue::throw_if_failed(const std::string& what) const {
  std::lock_guard lock(mu_);
  if (!failure_.empty()) throw Error(str(what, ": the communicator is unusable after an earlier failure: ", failure_));
}

void CollectiveQueue::record_failure(const std::string& reason) {
  std::lock_guard lock(mu_);
  if (failure_.empty()) failure_ = reason;
}

void CollectiveQueue::run_now(CollectiveCall call) {
  call.cancelled = &cancelled_;
  {
    std::unique_lock lock(mu_);
    idle_cv_.wait(lock, [&] { return tasks_.empty() && !running_; });
  }
  throw_if_failed(describe_on_group(call, backend_.world_ranks()));
  try {
    run_on(backend_, call);
  } catch (...) {
    record_failure(current_exception_message());
    throw;
  }
}

std::shared_ptr<PendingOp> CollectiveQueue::enqueue(CollectiveCall call) {
  call.cancelled = &cancelled_;
  auto task = std::make_shared<QueuedCollective>(call, *this);
  std::lock_guard lock(mu_);
  tasks_.push_back(task);
  if (!thread_.joinable()) thread_ = std::thread([this] { progress_loop(); });
  work_cv_.notify_one();
  return task;
}

void CollectiveQueue::progress_loop() {
  set_current_rank(rank_);
  MemoryContext::Install install(*memory_);
  cpu::set_num_threads(threads_);
  std::unique_lock lock(mu_);
  while (true) {
    work_cv_.wait(lock, [&] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;
    std::shared_ptr<QueuedCollective> task = std::move(tasks_.front());
    tasks_.pop_front();
    running_ = true;
    lock.unlock();
    run_task(*task);
    lock.lock();
    running_ = false;
    if (tasks_.empty()) idle_cv_.notify_all();
  }
}

void CollectiveQueue::run_task(QueuedCollective& task) {
  const std::string what = describe_on_group(task.call(), backend_.world_ranks());
  try {
    throw_if_failed(what);
    if (cancelled_.load()) throw Error(str(what, " was cancelled before it started"));
    run_on(backend_, task.call());
    task.finish({});
  } catch (...) {
    const std::string message = current_exception_message();
    record_failure(message);
    task.finish(message);
  }
}

}  // namespace loom::detail
