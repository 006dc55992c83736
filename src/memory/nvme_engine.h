// The two ways an NvmeFile moves bytes (io_uring, a pool of threads) and the
// bookkeeping of its requests that both share.
#pragma once

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "loom/memory.h"
#include "memory/scratch_file.h"

namespace loom {

// Tickets, completions and statistics of one file's requests. Engines report
// completions from any thread; the file waits and collects failures here.
class IoTracker {
 public:
  explicit IoTracker(std::filesystem::path dir);

  // Records a request now in flight and returns its ticket.
  uint64_t begin(IoKind kind, uint64_t bytes, uint64_t offset);
  // The request has finished; `failure` says why it failed, empty on success.
  void complete(uint64_t ticket, std::string failure);
  bool finished(uint64_t ticket) const;
  // Blocks until the request has finished (completed by another thread).
  void await(uint64_t ticket) const;
  // Forgets a finished request; throws Error when it failed.
  void retire(uint64_t ticket);
  // The tickets not yet retired, oldest first.
  std::vector<uint64_t> outstanding() const;
  NvmeStats stats() const;

 private:
  using Clock = std::chrono::steady_clock;
  struct Record {
    IoKind kind;
    uint64_t bytes, offset;
    bool finished = false;
    std::string failure;
  };
  // Wall time with at least one request of a kind in flight.
  struct BusyTime {
    int in_flight = 0;
    Clock::time_point since;
    double seconds = 0.0;
  };

  const Record& record(uint64_t ticket) const;

  std::filesystem::path dir_;
  mutable std::mutex mu_;
  mutable std::condition_variable finished_cv_;
  std::map<uint64_t, Record> records_;
  uint64_t next_ticket_ = 1;
  BusyTime busy_[2];
  NvmeStats totals_;
};

class IoEngine {
 public:
  virtual ~IoEngine() = default;
  // Starts moving `bytes` between `buf` and the file at `offset`; reports the
  // completion to the tracker under `ticket`.
  virtual void start(uint64_t ticket, IoKind kind, char* buf, uint64_t bytes, uint64_t offset) = 0;
};

// nullptr when the kernel refuses io_uring (too old, or a seccomp profile).
std::unique_ptr<IoEngine> make_uring_engine(const ScratchFile& file, IoTracker& tracker, int queue_depth);
std::unique_ptr<IoEngine> make_thread_engine(const ScratchFile& file, IoTracker& tracker, int threads);

}  // namespace loom
