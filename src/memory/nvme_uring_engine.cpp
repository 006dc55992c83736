#include <liburing.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <thread>
#include <unordered_map>

#include "memory/nvme_engine.h"

namespace loom {
namespace {

// Requests are cut to this size per submission (the kernel moves at most
// about 2 GiB per read or write anyway); kIoAlign-aligned, so a remainder
// stays aligned for O_DIRECT.
constexpr uint64_t kMaxSubmission = uint64_t(1) << 30;

// One ring, used by the file's thread alone: start() submits at once, and
// completions are reaped when the ring is full, opportunistically after each
// submission, and in await(). At most `depth` submissions are in the ring, so
// its completion queue (twice that) never overflows.
class UringEngine final : public IoEngine {
 public:
  UringEngine(const ScratchFile& file, IoTracker& tracker, int depth)
      : file_(file), tracker_(tracker), depth_(depth) {
    init_ = io_uring_queue_init(static_cast<unsigned>(depth), &ring_, 0);
  }
  ~UringEngine() override {
    if (ready()) io_uring_queue_exit(&ring_);
  }
  UringEngine(const UringEngine&) = delete;
  UringEngine& operator=(const UringEngine&) = delete;

  bool ready() const { return init_ == 0; }

  void start(uint64_t ticket, IoKind kind, char* buf, uint64_t bytes, uint64_t offset) override {
    transfers_.emplace(ticket, Transfer{kind, buf, bytes, offset, 0});
    queued_.push_back(ticket);
    pump();
    while (io_uring_cqe* cqe = peek()) handle(cqe);
    pump();
  }

  void await(uint64_t ticket) override {
    while (!tracker_.finished(ticket)) {
      pump();
      if (tracker_.finished(ticket)) break;
      LOOM_CHECK(in_ring_ > 0, "NVMe ticket ", ticket, " is not in the ring");
      reap_one();
    }
  }

 private:
  struct Transfer {
    IoKind kind;
    char* buf;
    uint64_t bytes, offset;
    uint64_t done = 0;
  };

  // Moves queued transfers into the ring, reaping completions while it is full.
  void pump() {
    while (!queued_.empty()) {
      if (in_ring_ == depth_) {
        reap_one();
        continue;
      }
      uint64_t ticket = queued_.front();
      queued_.pop_front();
      const Transfer& t = transfers_.at(ticket);
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      LOOM_CHECK(sqe != nullptr, "io_uring submission queue full with ", in_ring_, " of ", depth_, " in flight");
      auto n = static_cast<unsigned>(std::min(t.bytes - t.done, kMaxSubmission));
      if (t.kind == IoKind::read)
        io_uring_prep_read(sqe, file_.fd(), t.buf + t.done, n, t.offset + t.done);
      else
        io_uring_prep_write(sqe, file_.fd(), t.buf + t.done, n, t.offset + t.done);
      io_uring_sqe_set_data64(sqe, ticket);
      submit();
      ++in_ring_;
    }
  }

  // Submits the one prepared entry. Interrupted or short of kernel memory, it
  // tries again once something in flight has completed.
  void submit() {
    for (;;) {
      int rc = io_uring_submit(&ring_);
      if (rc > 0) return;
      LOOM_CHECK(rc == -EINTR || rc == -EAGAIN || rc == -EBUSY, "io_uring_submit failed: ", std::strerror(-rc));
      if (rc != -EINTR && in_ring_ > 0)
        reap_one();
      else
        std::this_thread::yield();
    }
  }

  io_uring_cqe* peek() {
    io_uring_cqe* cqe = nullptr;
    return io_uring_peek_cqe(&ring_, &cqe) == 0 ? cqe : nullptr;
  }

  void reap_one() {
    io_uring_cqe* cqe = nullptr;
    int rc;
    while ((rc = io_uring_wait_cqe(&ring_, &cqe)) == -EINTR) {
    }
    LOOM_CHECK(rc == 0, "io_uring_wait_cqe failed: ", std::strerror(-rc));
    handle(cqe);
  }

  // Finishes a transfer, or queues the rest of a short or interrupted one.
  void handle(io_uring_cqe* cqe) {
    uint64_t ticket = io_uring_cqe_get_data64(cqe);
    int res = cqe->res;
    io_uring_cqe_seen(&ring_, cqe);
    --in_ring_;
    auto it = transfers_.find(ticket);
    LOOM_CHECK(it != transfers_.end(), "io_uring completed unknown NVMe ticket ", ticket);
    Transfer& t = it->second;
    if (res == -EINTR || res == -EAGAIN) {
      queued_.push_back(ticket);
      return;
    }
    std::string failure;
    if (res < 0)
      failure = std::strerror(-res);
    else if (res == 0)
      failure = str("the file ended after ", t.done, " bytes");
    else
      t.done += static_cast<uint64_t>(res);
    if (failure.empty() && t.done < t.bytes) {
      queued_.push_back(ticket);
      return;
    }
    transfers_.erase(it);
    tracker_.complete(ticket, std::move(failure));
  }

  const ScratchFile& file_;
  IoTracker& tracker_;
  int depth_;
  io_uring ring_{};
  int init_ = -1;
  int in_ring_ = 0;
  std::unordered_map<uint64_t, Transfer> transfers_;
  std::deque<uint64_t> queued_;  // waiting for a submission slot
};

}  // namespace

std::unique_ptr<IoEngine> make_uring_engine(const ScratchFile& file, IoTracker& tracker, int queue_depth) {
  auto engine = std::make_unique<UringEngine>(file, tracker, queue_depth);
  if (!engine->ready()) return nullptr;
  return engine;
}

}  // namespace loom
