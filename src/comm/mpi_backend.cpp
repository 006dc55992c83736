// The mpi backend: one process per rank, collectives built on MPI
// point-to-point messages so that the reduction order is loom's (rank order
// 0..n-1, as in the local backend) rather than whatever algorithm MPI picks.
//
// Every collective starts with an arrival exchange: each rank sends a small
// header (sequence number, operation, count, dtype) to every other member and
// waits for theirs. That tells a timed-out rank exactly which members never
// joined, and catches mismatched calls before any data moves.
//
// all_reduce and reduce_scatter use direct reduce-scatter: rank r owns slice
// r; every rank sends each peer that peer's slice of its buffer, and rank r
// folds the n copies of its slice in rank order. The slices travel in
// segments, double-buffered so the next segment arrives while this one is
// reduced. all_reduce then sends each reduced segment to every peer (direct
// all-gather). Each rank sends 2(n-1)/n of the buffer, as a ring does, and
// 16-bit types travel as 16 bits because partial sums never leave the owner.
// all_gather and broadcast send the data directly to every rank; barrier is
// the arrival exchange alone.
#include <algorithm>
#include <array>
#include <cstdio>
#include <optional>
#include <thread>

#include "comm/backend.h"
#include "comm/buffer_ops.h"
#include "loom/kernels.h"

#ifdef LOOM_WITH_MPI
#include <mpi.h>
#endif

namespace loom {

bool mpi_available() {
#ifdef LOOM_WITH_MPI
  return true;
#else
  return false;
#endif
}

#ifdef LOOM_WITH_MPI

namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// Tags on a communicator's private channel for collectives (user messages go
// through a second communicator, so their tags cannot collide with these).
constexpr int kTagArrival = 1;
constexpr int kTagContribution = 2;
constexpr int kTagResult = 3;
constexpr int kTagData = 4;
// MPI counts are ints: longer messages are sent in pieces of this size.
constexpr size_t kMaxMessage = size_t{1} << 30;
// Bytes of a rank's slice exchanged per pipeline round of a reduction: large
// enough that few rounds (each a point where ranks wait for each other) are
// needed, small enough that the scratch of 2(n-1) segments stays modest.
constexpr size_t kSegmentBytes = size_t{4} << 20;

void check_mpi(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return;
  char message[MPI_MAX_ERROR_STRING];
  int length = 0;
  MPI_Error_string(rc, message, &length);
  throw Error(str(what, " failed: ", std::string(message, static_cast<size_t>(length))));
}

// The requests of one phase of an operation, polled against a deadline.
class Requests {
 public:
  enum class Outcome { done, timed_out, cancelled };

  Requests() = default;
  Requests(const Requests&) = delete;
  Requests& operator=(const Requests&) = delete;
  ~Requests() { abandon(); }

  // Messages longer than kMaxMessage go in pieces; both sides split alike.
  void send(const void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    size_t done = 0;
    do {
      const int len = static_cast<int>(std::min(kMaxMessage, bytes - done));
      add(peer, false, len);
      check_mpi(MPI_Isend(static_cast<const char*>(buf) + done, len, MPI_BYTE, peer, tag, comm, &requests_.back()),
                "MPI_Isend");
      done += static_cast<size_t>(len);
    } while (done < bytes);
  }

  void recv(void* buf, size_t bytes, int peer, int tag, MPI_Comm comm) {
    size_t done = 0;
    do {
      const int len = static_cast<int>(std::min(kMaxMessage, bytes - done));
      add(peer, true, len);
      check_mpi(MPI_Irecv(static_cast<char*>(buf) + done, len, MPI_BYTE, peer, tag, comm, &requests_.back()),
                "MPI_Irecv");
      done += static_cast<size_t>(len);
    } while (done < bytes);
  }

  // Polls until every request has completed, the deadline passes or
  // `cancelled` is set.
  Outcome wait(Clock::time_point deadline, const std::atomic<bool>* cancelled = nullptr) {
    // Busy polling, as MPI's own blocking calls do; under mpirun
    // --oversubscribe, MPI yields the core inside MPI_Testall when idle.
    while (!test()) {
      if (cancelled && cancelled->load()) return Outcome::cancelled;
      if (Clock::now() >= deadline) return Outcome::timed_out;
    }
    return Outcome::done;
  }

  bool test() {
    if (requests_.empty()) return true;
    int flag = 0;
    statuses_.resize(requests_.size());
    check_mpi(MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag, statuses_.data()),
              "MPI_Testall");
    if (!flag) return false;
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (!is_recv_[i]) continue;
      int received = 0;
      MPI_Get_count(&statuses_[i], MPI_BYTE, &received);
      if (received != lengths_[i]) short_receive_ = {peers_[i], received, lengths_[i]};
    }
    requests_.clear();
    peers_.clear();
    is_recv_.clear();
    lengths_.clear();
    return true;
  }

  // A receive that completed with fewer bytes than posted: {peer, got, expected}.
  std::optional<std::array<int, 3>> short_receive() const { return short_receive_; }

  // Cancels the receives that have not completed and lets go of the sends,
  // so no buffer is written after this returns. Returns the peers whose
  // receives had not completed.
  std::vector<int> abandon() noexcept {
    std::vector<int> silent;
    for (size_t i = 0; i < requests_.size(); ++i) {
      if (requests_[i] == MPI_REQUEST_NULL) continue;
      int flag = 0;
      MPI_Test(&requests_[i], &flag, MPI_STATUS_IGNORE);
      if (flag) continue;
      if (is_recv_[i]) {
        silent.push_back(peers_[i]);
        MPI_Cancel(&requests_[i]);
        MPI_Wait(&requests_[i], MPI_STATUS_IGNORE);
      } else {
        MPI_Request_free(&requests_[i]);
      }
    }
    requests_.clear();
    peers_.clear();
    is_recv_.clear();
    lengths_.clear();
    std::sort(silent.begin(), silent.end());
    silent.erase(std::unique(silent.begin(), silent.end()), silent.end());
    return silent;
  }

 private:
  void add(int peer, bool is_recv, int length) {
    requests_.push_back(MPI_REQUEST_NULL);
    peers_.push_back(peer);
    is_recv_.push_back(is_recv);
    lengths_.push_back(length);
  }

  std::vector<MPI_Request> requests_;
  std::vector<MPI_Status> statuses_;
  std::vector<int> peers_;
  std::vector<bool> is_recv_;
  std::vector<int> lengths_;
  std::optional<std::array<int, 3>> short_receive_;
};

// What ranks exchange on arrival; enough to name a mismatched call.
struct Header {
  int64_t seq, kind, count, dtype, op, root;
};

Header header_of(const CollectiveCall& c) {
  return {static_cast<int64_t>(c.seq), static_cast<int64_t>(c.kind), c.count, static_cast<int64_t>(c.dtype),
          static_cast<int64_t>(c.op),  c.root};
}

CollectiveCall call_of(const Header& h) {
  CollectiveCall c;
  c.seq = static_cast<uint64_t>(h.seq);
  c.kind = static_cast<CollectiveKind>(h.kind);
  c.count = h.count;
  c.dtype = static_cast<DType>(h.dtype);
  c.op = static_cast<ReduceOp>(h.op);
  c.root = static_cast<int>(h.root);
  return c;
}

std::vector<int> world_ranks_of(MPI_Comm comm) {
  int size = 0;
  MPI_Comm_size(comm, &size);
  MPI_Group group, world;
  MPI_Comm_group(comm, &group);
  MPI_Comm_group(MPI_COMM_WORLD, &world);
  std::vector<int> ranks(static_cast<size_t>(size)), out(static_cast<size_t>(size));
  for (int i = 0; i < size; ++i) ranks[i] = i;
  MPI_Group_translate_ranks(group, size, ranks.data(), world, out.data());
  MPI_Group_free(&group);
  MPI_Group_free(&world);
  return out;
}

// One side of a point-to-point message.
class MpiP2P : public PendingOp {
 public:
  MpiP2P(std::string what, int peer_world_rank, std::chrono::milliseconds timeout)
      : what_(std::move(what)), peer_(peer_world_rank), timeout_(timeout) {}

  Requests& requests() { return requests_; }

  void wait() override {
    Requests::Outcome outcome;
    try {
      outcome = requests_.wait(Clock::now() + timeout_);
    } catch (const Error& e) {
      throw Error(str(what_, ": ", e.what()));
    }
    if (outcome != Requests::Outcome::done) {
      requests_.abandon();
      throw Error(str(what_, " timed out after ", format_duration(timeout_), ": world rank ", peer_,
                      " posted no match; check the ranks, tags and order of the sends and receives"));
    }
    if (auto s = requests_.short_receive())
      throw Error(str(what_, " received ", (*s)[1], " bytes where ", (*s)[2], " were expected: the sizes must agree"));
  }

  bool test() override { return requests_.test(); }
  void abandon() noexcept override { requests_.abandon(); }

 private:
  std::string what_;
  int peer_;
  std::chrono::milliseconds timeout_;
  Requests requests_;
};

class MpiBackend : public Backend {
 public:
  // Owns both communicators: `collectives` carries loom's collective
  // traffic, `messages` the user's sends and receives.
  MpiBackend(MPI_Comm collectives, MPI_Comm messages)
      : collectives_(collectives), messages_(messages), world_ranks_(world_ranks_of(collectives)),
        memory_(MemoryContext::current()) {
    MPI_Comm_rank(collectives_, &rank_);
    MPI_Comm_size(collectives_, &size_);
    MPI_Comm_set_errhandler(collectives_, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(messages_, MPI_ERRORS_RETURN);
  }

  ~MpiBackend() override {
    MPI_Comm_free(&collectives_);
    MPI_Comm_free(&messages_);
  }

  const char* name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  const std::vector<int>& world_ranks() const override { return world_ranks_; }

  void run_collective(const CollectiveCall& call) override {
    arrive(call);
    const auto deadline = Clock::now() + call.timeout;
    switch (call.kind) {
      case CollectiveKind::all_reduce: {
        const Slices slices{call.count, size_};
        char* buf = static_cast<char*>(call.recv);
        reduce_slices(call, buf, slices, buf + slices.offset(rank_) * dtype_size(call.dtype), true, deadline);
        return;
      }
      case CollectiveKind::reduce_scatter:
        reduce_slices(call, static_cast<const char*>(call.send), Slices{call.count * size_, size_},
                      static_cast<char*>(call.recv), false, deadline);
        return;
      case CollectiveKind::all_gather: all_gather(call, deadline); return;
      case CollectiveKind::broadcast: broadcast(call, deadline); return;
      case CollectiveKind::barrier: return;
    }
  }

  std::shared_ptr<PendingOp> post_send(const void* buf, size_t bytes, int dst, int tag, uint64_t number,
                                       std::chrono::milliseconds timeout) override {
    auto op = std::make_shared<MpiP2P>(
        str("send #", number, " to world rank ", world_ranks_[dst], " (tag ", tag, ", ", bytes, " bytes)"),
        world_ranks_[dst], timeout);
    op->requests().send(buf, bytes, dst, tag, messages_);
    return op;
  }

  std::shared_ptr<PendingOp> post_recv(void* buf, size_t bytes, int src, int tag, uint64_t number,
                                       std::chrono::milliseconds timeout) override {
    auto op = std::make_shared<MpiP2P>(
        str("recv #", number, " from world rank ", world_ranks_[src], " (tag ", tag, ", ", bytes, " bytes)"),
        world_ranks_[src], timeout);
    op->requests().recv(buf, bytes, src, tag, messages_);
    return op;
  }

  std::unique_ptr<Backend> split(int color, const std::vector<int>& members, uint64_t) override {
    const int key = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    MPI_Comm collectives = MPI_COMM_NULL;
    check_mpi(MPI_Comm_split(collectives_, color < 0 ? MPI_UNDEFINED : color, key, &collectives), "MPI_Comm_split");
    if (collectives == MPI_COMM_NULL) return nullptr;
    MPI_Comm messages = MPI_COMM_NULL;
    check_mpi(MPI_Comm_dup(collectives, &messages), "MPI_Comm_dup");
    return std::make_unique<MpiBackend>(collectives, messages);
  }

 private:
  void arrive(const CollectiveCall& call) {
    if (size_ == 1) return;
    // Members, not locals: an abandoned send may still read its header.
    sent_header_ = header_of(call);
    received_headers_.resize(static_cast<size_t>(size_));
    Requests requests;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      requests.recv(&received_headers_[peer], sizeof(Header), peer, kTagArrival, collectives_);
      requests.send(&sent_header_, sizeof(Header), peer, kTagArrival, collectives_);
    }
    const auto outcome = requests.wait(Clock::now() + call.timeout, call.cancelled);
    if (outcome != Requests::Outcome::done) {
      std::vector<int> absent;
      for (int peer : requests.abandon()) absent.push_back(world_ranks_[peer]);
      const std::string what = describe_on_group(call, world_ranks_);
      if (outcome == Requests::Outcome::cancelled) throw Error(str(what, " was cancelled"));
      throw Error(str(what, " timed out after ", format_duration(call.timeout), " waiting for world rank(s) ",
                      format_ranks(absent),
                      " to join; every rank must issue the same collectives in the same order (raise the "
                      "communication timeout if a rank is legitimately slower)"));
    }
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      const CollectiveCall theirs = call_of(received_headers_[peer]);
      if (!theirs.matches(call))
        throw Error(str(describe_on_group(call, world_ranks_), " does not match world rank ", world_ranks_[peer],
                        ", which called ", theirs.describe(), "; every rank must issue the same collectives"));
    }
  }

  // Waits for a data phase; every member has arrived, so only a dead or
  // stuck process makes this time out.
  void finish(Requests& requests, const CollectiveCall& call, Clock::time_point deadline) {
    if (requests.wait(deadline) == Requests::Outcome::done) return;
    std::vector<int> silent;
    for (int peer : requests.abandon()) silent.push_back(world_ranks_[peer]);
    throw Error(str(describe_on_group(call, world_ranks_), " stalled for ", format_duration(call.timeout),
                    " after every rank joined, waiting for data from world rank(s) ", format_ranks(silent)));
  }

  // Folds slice `rank_` of every member's `source` (partitioned by `slices`)
  // into `out` in rank order. With `share_result`, `out` lies in `source`
  // and every reduced segment is also sent to all peers, whose reduced
  // segments are received in place: an all-reduce.
  void reduce_slices(const CollectiveCall& call, const char* source, const Slices& slices, char* out,
                     bool share_result, Clock::time_point deadline) {
    if (call.count == 0) return;
    const size_t esz = dtype_size(call.dtype);
    const int64_t segment = static_cast<int64_t>(std::max<size_t>(1, kSegmentBytes / esz));
    const int64_t rounds = (slices.length(0) + segment - 1) / segment;  // slice 0 is the longest
    const size_t peers = static_cast<size_t>(size_ - 1);
    const size_t scratch_bytes = 2 * peers * static_cast<size_t>(segment) * esz;
    if (static_cast<size_t>(scratch_.numel()) < scratch_bytes) {
      // From the context the backend was made in, which outlives it: the
      // caller's may be a shorter-lived one of its own.
      const MemoryContext::Install install(memory_);
      scratch_ = Tensor::empty({static_cast<int64_t>(scratch_bytes)}, DType::u8, Tier::host);
    }
    auto segment_length = [&](int k, int64_t j) {
      return std::clamp<int64_t>(slices.length(k) - j * segment, 0, segment);
    };
    auto at = [&](const char* base, int k, int64_t j) {
      return base + static_cast<size_t>(slices.offset(k) + j * segment) * esz;
    };
    auto scratch = [&](int64_t j, int peer) {
      const size_t index = static_cast<size_t>(j % 2) * peers + static_cast<size_t>(peer < rank_ ? peer : peer - 1);
      return static_cast<char*>(scratch_.raw()) + index * static_cast<size_t>(segment) * esz;
    };

    Requests contributions[2];
    Requests results;
    auto post_round = [&](int64_t j) {
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        if (const int64_t len = segment_length(rank_, j))
          contributions[j % 2].recv(scratch(j, peer), static_cast<size_t>(len) * esz, peer, kTagContribution,
                                    collectives_);
        if (const int64_t len = segment_length(peer, j))
          contributions[j % 2].send(at(source, peer, j), static_cast<size_t>(len) * esz, peer, kTagContribution,
                                    collectives_);
      }
    };

    std::vector<const void*> inputs(static_cast<size_t>(size_));
    post_round(0);
    for (int64_t j = 0; j < rounds; ++j) {
      if (j + 1 < rounds) post_round(j + 1);
      finish(contributions[j % 2], call, deadline);
      const int64_t len = segment_length(rank_, j);
      for (int k = 0; k < size_; ++k) inputs[k] = k == rank_ ? at(source, k, j) : scratch(j, k);
      void* output = out + static_cast<size_t>(j * segment) * esz;
      reduce_into(inputs.data(), size_, &output, 1, len, call.dtype, call.op);
      if (!share_result) continue;
      for (int peer = 0; peer < size_; ++peer) {
        if (peer == rank_) continue;
        if (len) results.send(output, static_cast<size_t>(len) * esz, peer, kTagResult, collectives_);
        // This rank's contribution to that region went out in this round's
        // (completed) sends, so the region may be overwritten now.
        if (const int64_t theirs = segment_length(peer, j))
          results.recv(const_cast<char*>(at(source, peer, j)), static_cast<size_t>(theirs) * esz, peer, kTagResult,
                       collectives_);
      }
    }
    finish(results, call, deadline);
  }

  void all_gather(const CollectiveCall& call, Clock::time_point deadline) {
    const size_t block = static_cast<size_t>(call.count) * dtype_size(call.dtype);
    char* recv = static_cast<char*>(call.recv);
    copy_bytes(recv + static_cast<size_t>(rank_) * block, call.send, block);
    if (block == 0) return;
    Requests requests;
    for (int peer = 0; peer < size_; ++peer) {
      if (peer == rank_) continue;
      requests.recv(recv + static_cast<size_t>(peer) * block, block, peer, kTagData, collectives_);
      requests.send(call.send, block, peer, kTagData, collectives_);
    }
    finish(requests, call, deadline);
  }

  void broadcast(const CollectiveCall& call, Clock::time_point deadline) {
    const size_t bytes = static_cast<size_t>(call.count) * dtype_size(call.dtype);
    if (bytes == 0 || size_ == 1) return;
    Requests requests;
    if (rank_ == call.root) {
      for (int peer = 0; peer < size_; ++peer)
        if (peer != rank_) requests.send(call.recv, bytes, peer, kTagData, collectives_);
    } else {
      requests.recv(call.recv, bytes, call.root, kTagData, collectives_);
    }
    finish(requests, call, deadline);
  }

  MPI_Comm collectives_;
  MPI_Comm messages_;
  std::vector<int> world_ranks_;
  int rank_ = 0;
  int size_ = 1;
  Header sent_header_{};
  std::vector<Header> received_headers_;
  MemoryContext& memory_;
  Tensor scratch_;  // segments received for reduction, kept between collectives
};

}  // namespace
}  // namespace detail

MpiRuntime::MpiRuntime(const CommOptions& options) {
  detail::check_options(options);
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (!initialized) {
    int provided = 0;
    detail::check_mpi(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    owns_mpi_ = true;
  }
  int provided = 0;
  MPI_Query_thread(&provided);
  if (provided < MPI_THREAD_MULTIPLE)
    throw Error(
        "this MPI does not provide MPI_THREAD_MULTIPLE, which loom's progress threads need; use an MPI built with "
        "thread support (OpenMPI 3 or newer)");
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  set_current_rank(world_rank);

  // The ranks on this host share its cores (mpirun may already have bound
  // this process to fewer, which the OpenMP default reflects).
  MPI_Comm host;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &host);
  int ranks_on_host = 1;
  MPI_Comm_size(host, &ranks_on_host);
  MPI_Comm_free(&host);
  const int share = static_cast<int>(std::thread::hardware_concurrency()) / ranks_on_host;
  cpu::set_num_threads(std::max(1, std::min(cpu::num_threads(), share)));

  MPI_Comm collectives, messages;
  detail::check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &collectives), "MPI_Comm_dup");
  detail::check_mpi(MPI_Comm_dup(MPI_COMM_WORLD, &messages), "MPI_Comm_dup");
  world_ = std::make_unique<Communicator>(std::make_unique<detail::MpiBackend>(collectives, messages), options);
}

MpiRuntime::~MpiRuntime() {
  world_.reset();
  if (owns_mpi_) MPI_Finalize();
}

void run_mpi(const RankFunction& fn, const CommOptions& options) {
  MpiRuntime runtime(options);
  // A stalled rank ends the job from its watchdog's thread, as a failure on
  // its own thread does: its other threads may be stuck anywhere.
  Watchdog watchdog({current_rank()}, options.watchdog_timeout, [](int rank, const std::string& message) {
    detail::write_to_stderr(str("loom: rank ", rank, " failed: ", message, "\n"));
    MPI_Abort(MPI_COMM_WORLD, 1);
  });
  Watchdog::Watch watch(watchdog, 0);
  try {
    fn(runtime.world());
  } catch (...) {
    const std::string message = detail::current_exception_message();
    std::fprintf(stderr, "loom: rank %d failed: %s\n", current_rank(), message.c_str());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
}

#else  // !LOOM_WITH_MPI

static const char* const kNoMpi =
    "loom was built without MPI: install OpenMPI (apt-get install libopenmpi-dev openmpi-bin) and reconfigure with "
    "-DLOOM_WITH_MPI=ON, or use the local backend";

MpiRuntime::MpiRuntime(const CommOptions&) { throw Error(kNoMpi); }
MpiRuntime::~MpiRuntime() = default;
void run_mpi(const RankFunction&, const CommOptions&) { throw Error(kNoMpi); }

#endif

}  // namespace loom
