// loom communication: one Communicator interface for collectives and
// point-to-point messages over process groups, with interchangeable backends:
// "local" (ranks are threads of one process sharing memory) and "mpi" (one
// process per rank through MPI, any number of hosts). docs/comm.md describes
// the algorithms and how to launch.
//
// Contracts every backend keeps:
// - Every member of a group issues the group's collectives in the same order.
//   Each collective gets the next sequence number (1, 2, ...) of its
//   communicator; errors name the operation by it ("all_reduce #12").
// - Reductions are deterministic. Element i of a reduced result is
//       op(... op(op(x_0[i], x_1[i]), x_2[i]) ..., x_{n-1}[i])
//   over the members' inputs in group-rank order, accumulated in fp32 for
//   f32/bf16/f16 (rounded once, to nearest even, at the end) and in 64-bit
//   integers for i32/i64/u8 (wrapping). avg is the sum divided by n at the end
//   (truncating for integers); max/min propagate NaN. Every backend computes
//   exactly this, so a result is bit-identical across runs, ranks and backends.
// - Asynchronous forms return a Work to wait on. The collectives of one
//   communicator run in issue order; a synchronous collective first waits for
//   the asynchronous ones issued before it. Point-to-point operations are
//   posted at once and are not ordered with respect to collectives.
// - Failures are loom::Error. A collective some member never joins fails after
//   CommOptions::timeout naming the operation, its sequence number and the
//   missing ranks. When a rank fails, the launcher ends every rank naming it
//   (run_local, run_mpi). After a failed collective the communicator is
//   unusable: later operations throw.
// - A communicator is used by one thread at a time (its own progress thread
//   aside).
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "loom/core.h"

namespace loom {

enum class ReduceOp : uint8_t { sum, avg, max, min };
const char* reduce_op_name(ReduceOp op);

struct CommOptions {
  // How long a rank waits for the other members of a group to join a
  // collective, or for the other side of a send/recv, before failing.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // For tests only: floating-point sum reductions (all_reduce, reduce_scatter)
  // add their result to itself, as a reduction applied twice would, so that a
  // test can show its comparison catches a gradient off by a constant factor.
  bool test_double_sums = false;
  // How long a launched rank may go without progress (report_progress) while
  // not waiting on communication before every rank is ended naming it (see
  // Watchdog, run_local, run_mpi); 0 turns the watchdog off.
  std::chrono::milliseconds watchdog_timeout{0};
};

// Largest tag a send/recv may use (the smallest MPI_TAG_UB MPI allows).
constexpr int kMaxTag = 32767;

// Volume of one kind of operation on one rank, cumulative. `elements` and
// `bytes` are what this rank sends under the bandwidth-optimal (ring) cost
// model, for a group of n ranks and a buffer of `count` elements:
//   all_reduce      2(n-1)/n * count
//   reduce_scatter  (n-1)/n * (n * recv_count)
//   all_gather      (n-1)/n * (n * send_count)
//   broadcast       count (every rank forwards the buffer once in a pipeline)
//   barrier         0
//   send            the message (elements are bytes)
//   recv            the message received (not part of sent())
// A group of one rank sends nothing.
struct CommVolume {
  int64_t calls = 0;
  double elements = 0;
  double bytes = 0;
};

struct CommStats {
  CommVolume all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv;
  // Everything this rank sent: the collectives plus point-to-point sends.
  CommVolume sent() const;
};

namespace detail {
struct Activity;
class Backend;
class PendingOp;
class CollectiveQueue;
struct CollectiveCall;
enum class CollectiveKind : uint8_t;
}  // namespace detail

// A handle on an asynchronous operation. wait() blocks until the operation has
// finished and rethrows its failure as loom::Error. Destroying a handle whose
// operation has not finished abandons the operation: it is cancelled if it has
// not started moving data (which leaves the communicator unusable, since the
// ranks no longer agree on the sequence) and otherwise allowed to finish, so
// the caller's buffers are never touched after the handle is gone. This makes
// an exception between issue and wait safe; keep handles until wait().
class [[nodiscard]] Work {
 public:
  Work() = default;
  explicit Work(std::shared_ptr<detail::PendingOp> op);
  // `name` (static storage) and the group's size label the wait in a trace.
  Work(std::shared_ptr<detail::PendingOp> op, const char* name, int group_size);
  Work(Work&&) noexcept = default;
  Work& operator=(Work&& other) noexcept;
  ~Work();

  void wait();
  // True when the operation has finished (or there is none); never blocks.
  bool done() const;

 private:
  std::shared_ptr<detail::PendingOp> op_;
  const char* name_ = "wait";
  int group_size_ = 0;
};

// A group of ranks that communicate. Buffers hold `count` elements of `dtype`;
// u8 is raw bytes (reduced as unsigned integers). Collectives block until this
// rank's part is complete; *_async forms return at once.
class Communicator {
 public:
  // Communicators come from the launchers (run_local, MpiRuntime) and from
  // split/new_group, which inherit the options; the backend is internal.
  Communicator(std::unique_ptr<detail::Backend> backend, const CommOptions& options);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  // The world rank of each member, indexed by rank in this group.
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const char* backend() const;
  const CommOptions& options() const { return options_; }
  // Applies to operations issued from now on; throws Error for a timeout <= 0.
  void set_options(const CommOptions& options);
  // Sequence number of the last collective issued (0 before the first).
  uint64_t collectives_issued() const { return seq_; }
  CommStats stats() const;

  // In place: every rank ends with the reduction of all ranks' `buf`.
  void all_reduce(void* buf, int64_t count, DType dtype, ReduceOp op = ReduceOp::sum);
  // `send` holds size() blocks of `recv_count` elements; rank r receives the
  // reduction of every rank's block r. recv may be send's block r (in place).
  void reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op = ReduceOp::sum);
  // Rank r's `send_count` elements land in block r of every rank's `recv`
  // (size() blocks). send may be recv's block rank() (in place).
  void all_gather(const void* send, void* recv, int64_t send_count, DType dtype);
  void broadcast(void* buf, int64_t count, DType dtype, int root);
  void barrier();
  // Point-to-point, matched by (source, tag) in posting order. A synchronous
  // send returns once the receiver has the data, so two ranks that both send
  // first deadlock: exchange with send_async.
  void send(const void* buf, size_t bytes, int dst, int tag);
  void recv(void* buf, size_t bytes, int src, int tag);

  Work all_reduce_async(void* buf, int64_t count, DType dtype, ReduceOp op = ReduceOp::sum);
  Work reduce_scatter_async(const void* send, void* recv, int64_t recv_count, DType dtype,
                            ReduceOp op = ReduceOp::sum);
  Work all_gather_async(const void* send, void* recv, int64_t send_count, DType dtype);
  Work broadcast_async(void* buf, int64_t count, DType dtype, int root);
  Work barrier_async();
  Work send_async(const void* buf, size_t bytes, int dst, int tag);
  Work recv_async(void* buf, size_t bytes, int src, int tag);

  // Tensor forms: whole contiguous tensors, dtype taken from the tensor.
  void all_reduce(const Tensor& t, ReduceOp op = ReduceOp::sum);
  void reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op = ReduceOp::sum);
  void all_gather(const Tensor& send, const Tensor& recv);
  void broadcast(const Tensor& t, int root);
  void send(const Tensor& t, int dst, int tag);
  void recv(const Tensor& t, int src, int tag);
  Work all_reduce_async(const Tensor& t, ReduceOp op = ReduceOp::sum);
  Work reduce_scatter_async(const Tensor& send, const Tensor& recv, ReduceOp op = ReduceOp::sum);
  Work all_gather_async(const Tensor& send, const Tensor& recv);
  Work broadcast_async(const Tensor& t, int root);
  Work send_async(const Tensor& t, int dst, int tag);
  Work recv_async(const Tensor& t, int src, int tag);

  // Collective over this communicator (MPI_Comm_split semantics): ranks that
  // pass the same color >= 0 form a group, ordered by (key, rank); a negative
  // color joins no group and gets nullptr.
  std::unique_ptr<Communicator> split(int color, int key);
  // Collective over this communicator; every rank passes the same list of
  // distinct ranks (of this communicator). Members get a group whose rank i is
  // ranks[i]; the others get nullptr.
  std::unique_ptr<Communicator> new_group(const std::vector<int>& ranks);

 private:
  // Validates a collective, numbers it and counts its volume.
  detail::CollectiveCall issue(detail::CollectiveKind kind, const void* send, void* recv, int64_t count, DType dtype,
                               ReduceOp op, int root);
  // Runs a validated collective on the calling thread, or queues it.
  void run_blocking(detail::CollectiveCall call);
  Work run_async(detail::CollectiveCall call);
  // Validates a send or recv, counts its bytes and returns its call number.
  uint64_t issue_point_to_point(const char* what, CommVolume CommStats::*volume, const void* buf, size_t bytes,
                                int peer, int tag);
  // Exchanges (color, key, check) and builds this rank's group; `check` must
  // agree across ranks (new_group passes a digest of its rank list).
  std::unique_ptr<Communicator> split_checked(int color, int key, int64_t check, const char* what);

  std::unique_ptr<detail::Backend> backend_;
  CommOptions options_;
  int rank_;
  int size_;
  std::vector<int> world_ranks_;
  uint64_t seq_ = 0;
  mutable std::mutex stats_mu_;
  CommStats stats_;
  // Runs asynchronous collectives in issue order on a progress thread; it
  // also records the first failure, after which every operation throws.
  std::unique_ptr<detail::CollectiveQueue> queue_;
};

// Seconds the calling thread has spent blocked on communication since it
// started: in synchronous operations and in Work::wait. The difference across
// a training step is the communication time that compute did not hide.
double blocked_seconds();

// ---------------------------------------------------------------------------
// Progress and the watchdog
// ---------------------------------------------------------------------------

// Progress points of the calling rank thread, for its Watchdog: the phase it
// enters, "<what>[ step <step>][ <item> <index>]" ("forward step 12
// micro-batch 3"; a negative step or a null item is left out), and plain
// reports that the phase is still advancing (a tensor written). `what` and
// `item` must have static storage: a report is a thread-local load, a clock
// read and a few relaxed atomic stores, with no allocation and no lock.
// Without a watchdog on the thread they do nothing.
void report_progress(const char* what, int64_t step = -1, const char* item = nullptr, int64_t index = -1);
void report_progress();

// Watches ranks' progress from a thread of its own that wakes every
// timeout / 4 (it sleeps in between, so it costs no core). A rank is watched
// from its first report until its Watch ends; one that is not blocked on
// communication (a Communicator call or Work::wait, which count as waiting
// for the other ranks) and has reported nothing for `timeout` is stalled:
// hung in compute, stuck in I/O or deadlocked. `on_stall` is then called once,
// on the watchdog's thread, with the rank and a message naming its phase and
// how long it has been stalled; nothing more is reported after it. A zero
// timeout watches nothing.
class Watchdog {
 public:
  using OnStall = std::function<void(int rank, const std::string& message)>;
  // `ranks` are the ranks' names in messages (world ranks).
  Watchdog(std::vector<int> ranks, std::chrono::milliseconds timeout, OnStall on_stall);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  std::chrono::milliseconds timeout() const { return timeout_; }

  // While it lives, the calling thread's progress reports are those of
  // ranks[i], which stops being watched when it ends (the rank returned).
  class Watch {
   public:
    Watch(Watchdog& watchdog, size_t i);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    detail::Activity* mine_ = nullptr;
    detail::Activity* previous_ = nullptr;
  };

 private:
  void run();

  std::vector<int> ranks_;
  std::chrono::milliseconds timeout_;
  OnStall on_stall_;
  std::unique_ptr<detail::Activity[]> activities_;
  std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::thread thread_;
};

// Runs `fn` on the calling thread, watched as rank 0 alone (a run without
// ranks, such as the single-rank reference): if it stalls for `timeout`,
// "loom: rank 0 failed: made no progress for ..." goes to stderr and the
// process ends with exit status 1, since nothing else could stop the thread.
// A zero timeout runs `fn` unwatched.
void run_watched(std::chrono::milliseconds timeout, const std::function<void()>& fn);

// ---------------------------------------------------------------------------
// Launching ranks
// ---------------------------------------------------------------------------

using RankFunction = std::function<void(Communicator&)>;

// Runs `fn` on `nproc` ranks as threads of this process (the local backend).
// Each rank thread sets loom::current_rank(), installs its own MemoryContext
// (budgets and high-water marks are per rank; tensors must not outlive the
// run) and gets max(1, hardware threads / nproc) OpenMP threads. If `fn`
// throws on any rank, the other ranks' pending and next communication calls
// throw, and run_local rethrows one Error naming the first failing rank and
// its message once every rank has returned. A rank that returns while others
// wait for it in a collective makes those collectives fail at once.
// With CommOptions::watchdog_timeout, a stalled rank (Watchdog) fails the run
// the same way ("rank R failed: made no progress for ..."); since a hung
// thread cannot be stopped, once every other rank has returned (or another
// watchdog timeout has passed) and it still has not, run_local prints the
// failure to stderr and ends the process with exit status 1.
void run_local(int nproc, const RankFunction& fn, const CommOptions& options = {});

// MPI for this process: MPI_Init_thread (MPI_THREAD_MULTIPLE, for the progress
// threads) on construction unless MPI is already initialized, MPI_Finalize on
// destruction if it initialized. Sets this process's OpenMP threads to
// max(1, hardware threads / ranks on this host). Throws Error when loom was
// built without MPI. Communicators split from world() must be destroyed first.
class MpiRuntime {
 public:
  explicit MpiRuntime(const CommOptions& options = {});
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;
  Communicator& world() { return *world_; }

 private:
  bool owns_mpi_ = false;
  std::unique_ptr<Communicator> world_;
};

// Runs `fn` on this process's rank of MPI_COMM_WORLD (the mpi backend, under
// mpirun). An exception escaping `fn` prints "loom: rank R failed: <message>"
// to stderr and calls MPI_Abort, so every rank of the job exits non-zero.
// With CommOptions::watchdog_timeout, a stalled rank does the same from its
// watchdog's thread ("loom: rank R failed: made no progress for ...").
void run_mpi(const RankFunction& fn, const CommOptions& options = {});

// Whether this build has the mpi backend (LOOM_WITH_MPI).
bool mpi_available();
// Whether this process was started by OpenMPI's mpirun (OMPI_COMM_WORLD_SIZE).
bool launched_by_mpirun();
// "mpi" when launched by mpirun, otherwise "local".
std::string default_backend();
// Runs `fn` on every rank of the named backend: "local" (nproc threads), "mpi"
// (the ranks mpirun started; nproc must be 0 or their number) or "auto"
// (default_backend()). Throws Error naming the problem for an unknown backend
// or an nproc that does not fit.
void launch(std::string_view backend, int nproc, const RankFunction& fn, const CommOptions& options = {});

}  // namespace loom
