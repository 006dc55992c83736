#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "memory/nvme_engine.h"

namespace loom {
namespace {

// Workers take requests in the order they were started and move each with
// blocking pread/pwrite; as many requests are in flight as there are workers.
class ThreadEngine final : public IoEngine {
 public:
  ThreadEngine(const ScratchFile& file, IoTracker& tracker, int threads) : file_(file), tracker_(tracker) {
    for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { work(); });
  }
  // Drains the queue before the workers leave.
  ~ThreadEngine() override {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
    }
    jobs_cv_.notify_all();
    for (auto& w : workers_) w.join();
  }
  ThreadEngine(const ThreadEngine&) = delete;
  ThreadEngine& operator=(const ThreadEngine&) = delete;

  void start(uint64_t ticket, IoKind kind, char* buf, uint64_t bytes, uint64_t offset) override {
    {
      std::lock_guard lock(mu_);
      jobs_.push_back(Job{ticket, kind, buf, bytes, offset});
    }
    jobs_cv_.notify_one();
  }


 private:
  struct Job {
    uint64_t ticket;
    IoKind kind;
    char* buf;
    uint64_t bytes, offset;
  };

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mu_);
        jobs_cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = jobs_.front();
        jobs_.pop_front();
      }
      tracker_.complete(job.ticket, file_.transfer(job.kind, job.buf, job.bytes, job.offset));
    }
  }

  const ScratchFile& file_;
  IoTracker& tracker_;
  std::mutex mu_;
  std::condition_variable jobs_cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // last: started once the rest exists
};

}  // namespace

std::unique_ptr<IoEngine> make_thread_engine(const ScratchFile& file, IoTracker& tracker, int threads) {
  return std::make_unique<ThreadEngine>(file, tracker, threads);
}

}  // namespace loom
