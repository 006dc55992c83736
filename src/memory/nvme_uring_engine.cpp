#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "memory/nvme_engine.h"

namespace loom {
namespace {

// Requests are cut to this size per submission (the kernel moves at most
// about 2 GiB per read or write anyway); kIoAlign-aligned, so a remainder
// stays aligned for O_DIRECT.
constexpr uint64_t kMaxSubmission = uint64_t(1) << 30;

// The user data of the no-op that tells the completion thread to leave.
// Tickets count up from 1 and never reach it.
constexpr uint64_t kStopData = ~uint64_t(0);

// One ring, two threads. The file's thread submits new requests; the engine's
// completion thread blocks on the completion queue and finishes each request
// the moment the kernel reports it, so the tracker's busy time is the disk's
// and not stretched to the file's thread's next call (the ChunkManager
// computes for milliseconds between them), and the rest of a short transfer
// goes back to the disk at once. Both threads submit, so the submission queue
// is guarded by `mu_`; the completion queue is the completion thread's alone.
// At most `depth` requests are in the ring (a new one waits for a slot), so
// the completion queue (twice that) never overflows, and a resubmission, which
// takes over the slot of the completion it follows, always finds a free
// submission entry.
class UringEngine final : public IoEngine {
 public:
  UringEngine(const ScratchFile& file, IoTracker& tracker, int depth)
      : file_(file), tracker_(tracker), depth_(depth) {
    init_ = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
    if (!ready()) return;
    try {
      completer_ = std::thread([this] { complete_until_stopped(); });
    } catch (...) {
      io_uring_queue_exit(&ring_);
      throw;
    }
  }
  // Lets the requests in the ring finish first: the kernel may still be
  // moving their buffers.
  ~UringEngine() override {
    if (!ready()) return;
    {
      std::unique_lock lock(mu_);
      slot_cv_.wait(lock, [&] { return in_ring_ == 0; });
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      LOOM_CHECK(sqe != nullptr, "io_uring submission queue full with nothing in flight");
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data64(sqe, kStopData);
      submit_prepared();
    }
    completer_.join();
    io_uring_queue_exit(&ring_);
  }
  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  bool ready() const { return init_ == 0; }

  void start(uint64_t ticket, IoKind kind, char* buf, uint64_t bytes, uint64_t offset) override {
    std::unique_lock lock(mu_);
    slot_cv_.wait(lock, [&] { return in_ring_ < depth_; });
    auto [it, inserted] = transfers_.emplace(ticket, Transfer{kind, buf, bytes, offset, 0});
    LOOM_CHECK(inserted, "NVMe ticket ", ticket, " started twice");
    ++in_ring_;
    submit(ticket, it->second);
  }


 private:
  struct Transfer {
    IoKind kind;
    char* buf;
    uint64_t bytes, offset;
    uint64_t done = 0;
  };

  // Puts what is left of the transfer into the ring. Called with `mu_` held.
  void submit(uint64_t ticket, const Transfer& t) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    LOOM_CHECK(sqe != nullptr, "io_uring submission queue full with ", in_ring_, " of ", depth_, " in flight");
    auto n = static_cast<unsigned>(std::min(t.bytes - t.done, kMaxSubmission));
    if (t.kind == IoKind::read)
      io_uring_prep_read(sqe, file_.fd(), t.buf + t.done, n, t.offset + t.done);
    else
      io_uring_prep_write(sqe, file_.fd(), t.buf + t.done, n, t.offset + t.done);
    io_uring_sqe_set_data64(sqe, ticket);
    submit_prepared();
  }

  // Submits the one prepared entry. Interrupted or short of kernel memory, it
  // tries again; the kernel frees that memory as requests in flight complete,
  // without waiting for anyone to reap them.
  void submit_prepared() {
    for (;;) {
      int rc = io_uring_submit(&ring_);
      if (rc > 0) return;
      LOOM_CHECK(rc == -EINTR || rc == -EAGAIN || rc == -EBUSY, "io_uring_submit failed: ", std::strerror(-rc));
      std::this_thread::yield();
    }
  }

  // The completion thread. An entry is marked seen before `mu_` is taken, so
  // the completion queue drains even while the file's thread holds the lock.
  void complete_until_stopped() {
    for (;;) {
      io_uring_cqe* cqe = nullptr;
      int rc = io_uring_wait_cqe(&ring_, &cqe);
      if (rc == -EINTR) continue;
      LOOM_CHECK(rc == 0, "io_uring_wait_cqe failed: ", std::strerror(-rc));
      uint64_t data = io_uring_cqe_get_data64(cqe);
      int res = cqe->res;
      io_uring_cqe_seen(&ring_, cqe);
      if (data == kStopData) return;
      handle(data, res);
    }
  }

  // Finishes a transfer, or resubmits the rest of a short or interrupted one.
  void handle(uint64_t ticket, int res) {
    std::string failure;
    {
      std::lock_guard lock(mu_);
      auto it = transfers_.find(ticket);
      LOOM_CHECK(it != transfers_.end(), "io_uring completed unknown NVMe ticket ", ticket);
      Transfer& t = it->second;
      if (res == -EINTR || res == -EAGAIN) {
        submit(ticket, t);
        return;
      }
      if (res < 0)
        failure = std::strerror(-res);
      else if (res == 0)
        failure = str("the file ended after ", t.done, " bytes");
      else
        t.done += static_cast<uint64_t>(res);
      if (failure.empty() && t.done < t.bytes) {
        submit(ticket, t);
        return;
      }
      transfers_.erase(it);
      --in_ring_;
    }
    slot_cv_.notify_all();
    tracker_.complete(ticket, std::move(failure));
  }

  const ScratchFile& file_;
  IoTracker& tracker_;
  int depth_;
  io_uring ring_{};
  int init_ = -1;
  std::mutex mu_;                    // the submission queue, in_ring_ and transfers_
  std::condition_variable slot_cv_;  // a request left the ring
  int in_ring_ = 0;
  std::unordered_map<uint64_t, Transfer> transfers_;
  std::thread completer_;
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const ScratchFile& file, IoTracker& tracker, int queue_depth) {
  auto engine = std::make_unique<UringEngine>(file, tracker, queue_depth);
  if (!engine->ready()) return nullptr;
  return engine;
}

}  // namespace loom
