// The local backend: ranks are threads of one process and collectives work
// directly on each other's buffers through shared memory.
//
// A collective has three phases. Arrive: each rank publishes its call
// (buffers, count, dtype) in its slot of the group and waits until every
// member has. Work: rank r owns slice r of the data and does all of that
// slice's work, reading the other ranks' buffers in place; for all_reduce it
// folds slice r of every rank's buffer in rank order 0..n-1 and writes the
// result into slice r of every rank's buffer (a reduce-scatter and an
// all-gather in one pass, so each rank moves about as many bytes as a memcpy
// of the buffer). Depart: each rank waits until every member has finished
// before returning, because the others may still be reading or writing its
// buffers. Only rank r ever touches slice r, so no locks guard the data.
//
// Arrivals and departures are counted by two monotonic counters: collective
// #s has fully arrived once arrivals >= n*s. A rank that stops waiting
// (timeout, a failed rank, cancellation) withdraws its arrival with a
// compare-and-swap that only succeeds while the count is short, so either the
// collective runs on every rank or on none.
#include <algorithm>
#include <condition_variable>
#include <deque>
#include <map>
#include <numeric>
#include <thread>
#include <tuple>

#include "comm/backend.h"
#include "comm/buffer_ops.h"
#include "loom/kernels.h"

namespace loom {
namespace detail {
namespace {

using Clock = std::chrono::steady_clock;

// Yields tried before sleeping: a peer usually arrives within microseconds.
constexpr int kSpins = 200;
// Sleeps are this short so failures and timeouts are noticed promptly.
constexpr auto kWaitSlice = std::chrono::milliseconds(10);

class LocalGroup;

// What all ranks of one run_local share: the first failure, which ranks have
// returned, and the groups being formed by splits.
class LocalWorld : public std::enable_shared_from_this<LocalWorld> {
 public:
  explicit LocalWorld(int size) : exited_(static_cast<size_t>(size)) {}

  void fail(int rank, const std::string& message) {
    std::lock_guard lock(mu_);
    if (failed_.load()) return;  // later failures are consequences of the first
    failure_ = str("rank ", rank, " failed: ", message);
    failed_.store(true);
  }
  bool failed() const { return failed_.load(); }
  std::string failure() const {
    std::lock_guard lock(mu_);
    return failure_;
  }

  void mark_exited(int rank) { exited_[static_cast<size_t>(rank)].store(true); }
  bool exited(int rank) const { return exited_[static_cast<size_t>(rank)].load(); }

  std::shared_ptr<LocalGroup> create_group(std::vector<int> world_ranks);
  // The group identified by `key` (parent group, split sequence number,
  // color): created by the first member to ask, forgotten once all have.
  std::shared_ptr<LocalGroup> join_group(std::tuple<uint64_t, uint64_t, int> key, std::vector<int> world_ranks);

 private:
  mutable std::mutex mu_;
  std::atomic<bool> failed_{false};
  std::string failure_;
  std::vector<std::atomic<bool>> exited_;
  uint64_t next_group_id_ = 0;
  std::map<std::tuple<uint64_t, uint64_t, int>, std::pair<std::shared_ptr<LocalGroup>, size_t>> forming_;
};

// The two sides of a point-to-point message, once matched.
struct P2PState {
  std::atomic<int> status{0};  // kPending, kDone or kFailed
  std::string error;           // written before status becomes kFailed
};
constexpr int kPending = 0, kDone = 1, kFailed = 2;

// A send or receive waiting in a mailbox for its match.
struct Posted {
  int from;
  int tag;
  const void* send;
  void* recv;
  size_t bytes;
  std::string what;
  std::shared_ptr<P2PState> state;
};

// Messages addressed to one rank.
struct Mailbox {
  std::mutex mu;
  std::deque<Posted> sends;
  std::deque<Posted> recvs;
};

// A rank's part in the current collective.
struct alignas(64) Slot {
  CollectiveCall call;
  std::atomic<uint64_t> arrived{0};  // sequence number of the last collective joined
};

class LocalGroup {
 public:
  LocalGroup(std::shared_ptr<LocalWorld> world, uint64_t id, std::vector<int> world_ranks)
      : world(std::move(world)),
        id(id),
        world_ranks(std::move(world_ranks)),
        n(static_cast<int>(this->world_ranks.size())),
        slots(static_cast<size_t>(n)),
        mailboxes(static_cast<size_t>(n)) {}

  // Call after changing what a waiter waits for. Taking the lock orders the
  // notification after any waiter's check of its condition, so none is lost.
  void notify() {
    { std::lock_guard lock(mu); }
    cv.notify_all();
  }

  // Waits until ready() holds and returns true, or returns false once
  // interrupted() does (checked between short sleeps).
  template <typename Ready, typename Interrupted>
  bool wait(Ready ready, Interrupted interrupted) {
    for (int i = 0; i < kSpins; ++i) {
      if (ready()) return true;
      std::this_thread::yield();
    }
    std::unique_lock lock(mu);
    while (!ready()) {
      if (interrupted()) return false;
      cv.wait_for(lock, kWaitSlice);
    }
    return true;
  }

  // Members that returned from their rank function while `pending()` says
  // they are still needed.
  template <typename Pending>
  std::vector<int> exited_members(Pending pending) const {
    std::vector<int> out;
    for (int k = 0; k < n; ++k)
      if (pending(k) && world->exited(world_ranks[k])) out.push_back(world_ranks[k]);
    return out;
  }

  const std::shared_ptr<LocalWorld> world;
  const uint64_t id;
  const std::vector<int> world_ranks;
  const int n;
  std::vector<Slot> slots;
  alignas(64) std::atomic<uint64_t> arrivals{0};
  alignas(64) std::atomic<uint64_t> departures{0};
  std::vector<Mailbox> mailboxes;  // by receiving rank

 private:
  std::mutex mu;
  std::condition_variable cv;
};

std::shared_ptr<LocalGroup> LocalWorld::create_group(std::vector<int> world_ranks) {
  uint64_t id;
  {
    std::lock_guard lock(mu_);
    id = next_group_id_++;
  }
  return std::make_shared<LocalGroup>(shared_from_this(), id, std::move(world_ranks));
}

std::shared_ptr<LocalGroup> LocalWorld::join_group(std::tuple<uint64_t, uint64_t, int> key,
                                                   std::vector<int> world_ranks) {
  std::lock_guard lock(mu_);
  auto it = forming_.find(key);
  if (it == forming_.end()) {
    const size_t members = world_ranks.size();
    auto group = std::make_shared<LocalGroup>(shared_from_this(), next_group_id_++, std::move(world_ranks));
    it = forming_.emplace(key, std::make_pair(std::move(group), members)).first;
  }
  std::shared_ptr<LocalGroup> group = it->second.first;
  if (--it->second.second == 0) forming_.erase(it);
  return group;
}

// One side of a point-to-point message.
class LocalP2P : public PendingOp {
 public:
  LocalP2P(std::shared_ptr<LocalGroup> group, int mailbox, int peer, std::string what,
           std::chrono::milliseconds timeout)
      : group_(std::move(group)), mailbox_(mailbox), peer_(peer), what_(std::move(what)), timeout_(timeout) {}

  const std::shared_ptr<P2PState>& state() const { return state_; }
  const std::string& what() const { return what_; }

  void wait() override {
    const auto start = Clock::now();
    const auto deadline = start + timeout_;
    auto ready = [&] { return state_->status.load() != kPending; };
    auto interrupted = [&] {
      return group_->world->failed() || group_->world->exited(group_->world_ranks[peer_]) || Clock::now() >= deadline;
    };
    if (!group_->wait(ready, interrupted) && withdraw()) {
      const int peer = group_->world_ranks[peer_];
      if (group_->world->failed()) throw Error(str(what_, " failed: ", group_->world->failure()));
      if (group_->world->exited(peer))
        throw Error(str(what_, " cannot complete: world rank ", peer, " returned without matching it"));
      throw Error(str(what_, " timed out after ", format_duration(timeout_), ": world rank ", peer,
                      " posted no match; check the ranks, tags and order of the sends and receives"));
    }
    // Matched: the side that matched is copying, which always finishes.
    group_->wait(ready, [] { return false; });
    if (state_->status.load() == kFailed) throw Error(state_->error);
  }

  bool test() override { return state_->status.load() != kPending; }

  void abandon() noexcept override {
    if (withdraw()) return;
    group_->wait([&] { return state_->status.load() != kPending; }, [] { return false; });
  }

 private:
  // Takes this operation out of its mailbox if it is still unmatched.
  bool withdraw() {
    Mailbox& box = group_->mailboxes[static_cast<size_t>(mailbox_)];
    std::lock_guard lock(box.mu);
    for (auto* queue : {&box.sends, &box.recvs}) {
      auto it = std::find_if(queue->begin(), queue->end(), [&](const Posted& p) { return p.state == state_; });
      if (it != queue->end()) {
        queue->erase(it);
        return true;
      }
    }
    return false;
  }

  std::shared_ptr<LocalGroup> group_;
  int mailbox_;
  int peer_;
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<P2PState> state_ = std::make_shared<P2PState>();
};

class LocalBackend : public Backend {
 public:
  LocalBackend(std::shared_ptr<LocalGroup> group, int rank) : group_(std::move(group)), rank_(rank) {}

  const char* name() const override { return "local"; }
  int rank() const override { return rank_; }
  const std::vector<int>& world_ranks() const override { return group_->world_ranks; }

  void run_collective(const CollectiveCall& call) override {
    arrive(call);
    work(call);
    depart(call.seq);
  }

  std::shared_ptr<PendingOp> post_send(const void* buf, size_t bytes, int dst, int tag, uint64_t number,
                                       std::chrono::milliseconds timeout) override {
    auto op = std::make_shared<LocalP2P>(
        group_, dst, dst,
        str("send #", number, " to world rank ", group_->world_ranks[dst], " (tag ", tag, ", ", bytes, " bytes)"),
        timeout);
    Mailbox& box = group_->mailboxes[static_cast<size_t>(dst)];
    std::unique_lock lock(box.mu);
    auto it = std::find_if(box.recvs.begin(), box.recvs.end(),
                           [&](const Posted& p) { return p.from == rank_ && p.tag == tag; });
    if (it == box.recvs.end()) {
      box.sends.push_back({rank_, tag, buf, nullptr, bytes, op->what(), op->state()});
      return op;
    }
    Posted match = std::move(*it);
    box.recvs.erase(it);
    lock.unlock();
    deliver(buf, bytes, op->what(), *op->state(), match.recv, match.bytes, match.what, *match.state);
    return op;
  }

  std::shared_ptr<PendingOp> post_recv(void* buf, size_t bytes, int src, int tag, uint64_t number,
                                       std::chrono::milliseconds timeout) override {
    auto op = std::make_shared<LocalP2P>(
        group_, rank_, src,
        str("recv #", number, " from world rank ", group_->world_ranks[src], " (tag ", tag, ", ", bytes, " bytes)"),
        timeout);
    Mailbox& box = group_->mailboxes[static_cast<size_t>(rank_)];
    std::unique_lock lock(box.mu);
    auto it = std::find_if(box.sends.begin(), box.sends.end(),
                           [&](const Posted& p) { return p.from == src && p.tag == tag; });
    if (it == box.sends.end()) {
      box.recvs.push_back({src, tag, nullptr, buf, bytes, op->what(), op->state()});
      return op;
    }
    Posted match = std::move(*it);
    box.sends.erase(it);
    lock.unlock();
    deliver(match.send, match.bytes, match.what, *match.state, buf, bytes, op->what(), *op->state());
    return op;
  }

  std::unique_ptr<Backend> split(int color, const std::vector<int>& members, uint64_t seq) override {
    if (color < 0) return nullptr;
    std::vector<int> world_ranks;
    for (int m : members) world_ranks.push_back(group_->world_ranks[m]);
    auto group = group_->world->join_group({group_->id, seq, color}, std::move(world_ranks));
    const int rank = static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
    return std::make_unique<LocalBackend>(std::move(group), rank);
  }

 private:
  void arrive(const CollectiveCall& call) {
    LocalGroup& g = *group_;
    Slot& mine = g.slots[static_cast<size_t>(rank_)];
    mine.call = call;
    mine.call.cancelled = nullptr;
    mine.arrived.store(call.seq);
    const uint64_t target = static_cast<uint64_t>(g.n) * call.seq;
    g.arrivals.fetch_add(1);
    g.notify();

    const auto deadline = Clock::now() + call.timeout;
    auto missing = [&](int k) { return g.slots[static_cast<size_t>(k)].arrived.load() < call.seq; };
    auto ready = [&] { return g.arrivals.load() >= target; };
    auto interrupted = [&] {
      return g.world->failed() || (call.cancelled && call.cancelled->load()) || Clock::now() >= deadline ||
             !g.exited_members(missing).empty();
    };
    if (!g.wait(ready, interrupted)) {
      std::vector<int> absent;
      for (int k = 0; k < g.n; ++k)
        if (missing(k)) absent.push_back(g.world_ranks[k]);
      const std::vector<int> exited = g.exited_members(missing);
      // Withdraw, unless the last member arrived meanwhile: then the others
      // may already be using this rank's buffers and the collective must run.
      uint64_t seen = g.arrivals.load();
      while (seen < target && !g.arrivals.compare_exchange_weak(seen, seen - 1)) {
      }
      if (seen < target) {
        const std::string what = describe_on_group(call, g.world_ranks);
        if (g.world->failed()) throw Error(str(what, " failed: ", g.world->failure()));
        if (call.cancelled && call.cancelled->load()) throw Error(str(what, " was cancelled"));
        if (!exited.empty())
          throw Error(str(what, " cannot complete: world rank(s) ", format_ranks(exited), " returned without joining it"));
        throw Error(str(what, " timed out after ", format_duration(call.timeout), " waiting for world rank(s) ",
                        format_ranks(absent),
                        " to join; every rank must issue the same collectives in the same order (raise the "
                        "communication timeout if a rank is legitimately slower)"));
      }
    }
    for (int k = 0; k < g.n; ++k) {
      const CollectiveCall& theirs = g.slots[static_cast<size_t>(k)].call;
      if (!theirs.matches(call))
        throw Error(str(describe_on_group(call, g.world_ranks), " does not match world rank ", g.world_ranks[k],
                        ", which called ", theirs.describe(), "; every rank must issue the same collectives"));
    }
  }

  void work(const CollectiveCall& call) {
    LocalGroup& g = *group_;
    const size_t esz = dtype_size(call.dtype);
    auto slot_call = [&](int k) -> const CollectiveCall& { return g.slots[static_cast<size_t>(k)].call; };
    switch (call.kind) {
      case CollectiveKind::all_reduce: {
        const Slices slices{call.count, g.n};
        const size_t offset = static_cast<size_t>(slices.offset(rank_)) * esz;
        std::vector<void*> buffers(static_cast<size_t>(g.n));
        for (int k = 0; k < g.n; ++k) buffers[k] = static_cast<char*>(slot_call(k).recv) + offset;
        reduce_into(buffers.data(), g.n, buffers.data(), g.n, slices.length(rank_), call.dtype, call.op);
        return;
      }
      case CollectiveKind::reduce_scatter: {
        const size_t offset = static_cast<size_t>(rank_) * static_cast<size_t>(call.count) * esz;
        std::vector<const void*> inputs(static_cast<size_t>(g.n));
        for (int k = 0; k < g.n; ++k) inputs[k] = static_cast<const char*>(slot_call(k).send) + offset;
        void* output = call.recv;
        reduce_into(inputs.data(), g.n, &output, 1, call.count, call.dtype, call.op);
        return;
      }
      case CollectiveKind::all_gather: {
        const size_t block = static_cast<size_t>(call.count) * esz;
        for (int k = 0; k < g.n; ++k)
          copy_bytes(static_cast<char*>(call.recv) + static_cast<size_t>(k) * block, slot_call(k).send, block);
        return;
      }
      case CollectiveKind::broadcast:
        if (rank_ != call.root)
          copy_bytes(call.recv, slot_call(call.root).recv, static_cast<size_t>(call.count) * esz);
        return;
      case CollectiveKind::barrier: return;
    }
  }

  // Every member has arrived, so every member finishes its bounded work and
  // departs: this wait cannot hang and must not be cut short.
  void depart(uint64_t seq) {
    LocalGroup& g = *group_;
    const uint64_t target = static_cast<uint64_t>(g.n) * seq;
    g.departures.fetch_add(1);
    g.notify();
    g.wait([&] { return g.departures.load() >= target; }, [] { return false; });
  }

  // Completes a matched message. As with MPI, a size mismatch fails the
  // receive only.
  void deliver(const void* send, size_t send_bytes, const std::string& send_what, P2PState& send_state, void* recv,
               size_t recv_bytes, const std::string& recv_what, P2PState& recv_state) {
    if (send_bytes == recv_bytes) {
      copy_bytes(recv, send, send_bytes);
      recv_state.status.store(kDone);
    } else {
      recv_state.error = str(recv_what, " was matched by ", send_what, ": the sizes must agree");
      recv_state.status.store(kFailed);
    }
    send_state.status.store(kDone);
    group_->notify();
  }

  std::shared_ptr<LocalGroup> group_;
  int rank_;
};

}  // namespace
}  // namespace detail

void run_local(int nproc, const RankFunction& fn, const CommOptions& options) {
  if (nproc < 1) throw Error(str("run_local: the number of ranks must be at least 1, not ", nproc));
  detail::check_options(options);
  auto world = std::make_shared<detail::LocalWorld>(nproc);
  std::vector<int> ranks(static_cast<size_t>(nproc));
  std::iota(ranks.begin(), ranks.end(), 0);
  auto group = world->create_group(ranks);
  // The caller's thread budget (by default the hardware threads) is divided
  // among the ranks.
  const int threads_per_rank = std::max(1, cpu::num_threads() / nproc);

  // Rank threads signal `returned` as they return; a stall is recorded under
  // `mu` with the time it was reported.
  std::mutex mu;
  std::condition_variable returned;
  int stalled = -1;
  std::chrono::steady_clock::time_point stalled_at;
  std::string stall;
  Watchdog watchdog(ranks, options.watchdog_timeout, [&](int rank, const std::string& message) {
    world->fail(rank, message);
    {
      std::lock_guard lock(mu);
      stalled = rank;
      stalled_at = std::chrono::steady_clock::now();
      stall = str("rank ", rank, " failed: ", message);
    }
    returned.notify_all();
  });

  std::vector<std::thread> threads;
  for (int r = 0; r < nproc; ++r) {
    threads.emplace_back([&, r] {
      set_current_rank(r);
      MemoryContext memory;
      MemoryContext::Install install(memory);
      cpu::set_num_threads(threads_per_rank);
      Watchdog::Watch watch(watchdog, static_cast<size_t>(r));
      Communicator comm(std::make_unique<detail::LocalBackend>(group, r), options);
      try {
        fn(comm);
      } catch (...) {
        world->fail(r, detail::current_exception_message());
      }
      world->mark_exited(r);
      { std::lock_guard lock(mu); }
      returned.notify_all();
    });
  }
  {
    // After a stall the other ranks fail at their next communication call;
    // the stalled rank is given until they have all returned, or another
    // watchdog timeout.
    std::unique_lock lock(mu);
    for (;;) {
      std::vector<int> running;
      for (int r = 0; r < nproc; ++r)
        if (!world->exited(r)) running.push_back(r);
      if (running.empty()) break;
      if (stalled < 0) {
        returned.wait(lock);
        continue;
      }
      const auto deadline = stalled_at + watchdog.timeout();
      if (running == std::vector<int>{stalled} || std::chrono::steady_clock::now() >= deadline) {
        // The stall may have come after another rank's failure: both are told.
        const std::string first = world->failure();
        detail::end_process(str("loom: ", first, "\n", first == stall ? "" : str("loom: ", stall, "\n"),
                                "loom: rank(s) ", detail::format_ranks(running),
                                " did not return after the failure and cannot be stopped; ending the process\n"));
      }
      returned.wait_until(lock, deadline);
    }
  }
  for (auto& t : threads) t.join();
  if (world->failed()) throw Error(world->failure());
}

}  // namespace loom
