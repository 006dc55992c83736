// What a communication backend implements behind loom::Communicator, and the
// pieces the backends share.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm.h"

namespace loom::detail {

enum class CollectiveKind : uint8_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier };
const char* collective_name(CollectiveKind kind);

// One rank's part in one collective, as handed to a backend.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::barrier;
  const void* send = nullptr;  // all_reduce and broadcast: the same buffer as recv
  void* recv = nullptr;
  // all_reduce, broadcast: elements of the buffer; reduce_scatter: elements
  // each rank receives; all_gather: elements each rank sends.
  int64_t count = 0;
  DType dtype = DType::u8;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  uint64_t seq = 0;
  // How long to wait for the other members (CommOptions::timeout).
  std::chrono::milliseconds timeout{0};
  // CommOptions::test_double_sums applied to this call: the result is added
  // to itself after the collective.
  bool doubled = false;
  // Set when the caller abandons its asynchronous operations: a backend still
  // waiting for the other ranks to join gives up.
  const std::atomic<bool>* cancelled = nullptr;

  // Whether another rank's call is the same collective.
  bool matches(const CollectiveCall& other) const;
  // "all_reduce #12 (1000 x f32, sum)".
  std::string describe() const;
};

// An operation in flight behind a Work.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  // Blocks until the operation has finished; throws Error if it failed.
  virtual void wait() = 0;
  // Whether the operation has finished; never blocks.
  virtual bool test() = 0;
  // Cancels the operation if no data has moved, otherwise lets it finish; on
  // return the operation no longer touches the caller's buffers.
  virtual void abandon() noexcept = 0;
};

// A backend serves one rank of one group. run_collective and create_group are
// called by one thread at a time (the rank's thread or its communicator's
// progress thread); post_send/post_recv and PendingOp::wait may run
// concurrently with run_collective.
class Backend {
 public:
  virtual ~Backend() = default;
  virtual const char* name() const = 0;
  virtual int rank() const = 0;
  // World rank of every member, by rank in this group.
  virtual const std::vector<int>& world_ranks() const = 0;
  // Runs one collective to completion on the calling thread. Throws Error on
  // timeout, a failed peer, mismatched calls or cancellation.
  virtual void run_collective(const CollectiveCall& call) = 0;
  // `number` counts this rank's sends (or receives) on the communicator, for
  // messages; a wait on the result gives up after `timeout`.
  virtual std::shared_ptr<PendingOp> post_send(const void* buf, size_t bytes, int dst, int tag, uint64_t number,
                                               std::chrono::milliseconds timeout) = 0;
  virtual std::shared_ptr<PendingOp> post_recv(void* buf, size_t bytes, int src, int tag, uint64_t number,
                                               std::chrono::milliseconds timeout) = 0;
  // Called by every rank right after the exchange (collective #seq) that
  // defines the groups of a split: returns this rank's backend for its group,
  // whose `members` are ranks of this group in new-rank order, or nullptr for
  // a negative color (no group). `color` tells the groups of the split apart.
  virtual std::unique_ptr<Backend> split(int color, const std::vector<int>& members, uint64_t seq) = 0;
};

// The balanced partition of `count` elements into `n` slices that the
// reductions use: slice k starts at offset(k); the first count % n slices hold
// one element more than the others.
struct Slices {
  int64_t count;
  int n;
  int64_t offset(int k) const { return k * (count / n) + std::min<int64_t>(k, count % n); }
  int64_t length(int k) const { return count / n + (k < count % n ? 1 : 0); }
};

// "[0-3, 6]": ranks with consecutive runs folded.
std::string format_ranks(const std::vector<int>& ranks);
// "all_reduce #12 (1000 x f32, sum) on world ranks [0-3]".
std::string describe_on_group(const CollectiveCall& call, const std::vector<int>& world_ranks);
// "2.5 s".
std::string format_duration(std::chrono::milliseconds d);

// Throws Error unless the options are usable (a positive timeout).
void check_options(const CommOptions& options);

// The message of the exception being handled (inside a catch block).
std::string current_exception_message();

// Brackets a wait of the calling rank thread on the other ranks: its
// watchdog does not count it as a stall, and its end is progress.
void begin_communication_wait();
void end_communication_wait();

// Writes to stderr without stdio, whose lock a hung thread may hold.
void write_to_stderr(const std::string& text);
// A hung thread cannot be stopped: what is left is ending the process (as
// mpirun ends a failed job's) with exit status 1, after writing `text` to
// stderr and flushing stdout unless a hung thread holds it.
[[noreturn]] void end_process(const std::string& text);

}  // namespace loom::detail
