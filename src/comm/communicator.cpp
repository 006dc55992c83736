#include <algorithm>
#include <cstdio>

#include "comm/backend.h"
#include "comm/collective_queue.h"
#include "loom/device.h"
#include "loom/trace.h"

namespace loom {

using detail::CollectiveCall;
using detail::CollectiveKind;

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  LOOM_CHECK(false, "unknown reduce op");
}

CommVolume CommStats::sent() const {
  CommVolume total;
  for (const CommVolume* v : {&all_reduce, &reduce_scatter, &all_gather, &broadcast, &barrier, &send}) {
    total.calls += v->calls;
    total.elements += v->elements;
    total.bytes += v->bytes;
  }
  return total;
}

namespace detail {

const char* collective_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::barrier: return "barrier";
  }
  LOOM_CHECK(false, "unknown collective");
}

static bool is_reduction(CollectiveKind kind) {
  return kind == CollectiveKind::all_reduce || kind == CollectiveKind::reduce_scatter;
}

bool CollectiveCall::matches(const CollectiveCall& other) const {
  if (kind != other.kind || seq != other.seq) return false;
  if (kind == CollectiveKind::barrier) return true;
  return count == other.count && dtype == other.dtype && (!is_reduction(kind) || op == other.op) &&
         (kind != CollectiveKind::broadcast || root == other.root);
}

std::string CollectiveCall::describe() const {
  std::string what = str(collective_name(kind), " #", seq);
  switch (kind) {
    case CollectiveKind::all_reduce: return str(what, " (", count, " x ", dtype_name(dtype), ", ", reduce_op_name(op), ")");
    case CollectiveKind::reduce_scatter:
      return str(what, " (", count, " x ", dtype_name(dtype), " per rank, ", reduce_op_name(op), ")");
    case CollectiveKind::all_gather: return str(what, " (", count, " x ", dtype_name(dtype), " per rank)");
    case CollectiveKind::broadcast: return str(what, " (", count, " x ", dtype_name(dtype), " from rank ", root, ")");
    case CollectiveKind::barrier: return what;
  }
  LOOM_CHECK(false, "unknown collective");
}

std::string format_ranks(const std::vector<int>& ranks) {
  std::string out = "[";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (i) out += ", ";
    out += j == i ? std::to_string(ranks[i]) : str(ranks[i], j == i + 1 ? ", " : "-", ranks[j]);
    i = j + 1;
  }
  return out + "]";
}

std::string describe_on_group(const CollectiveCall& call, const std::vector<int>& world_ranks) {
  return str(call.describe(), " on world ranks ", format_ranks(world_ranks));
}

std::string format_duration(std::chrono::milliseconds d) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", static_cast<double>(d.count()) / 1000.0);
  return buf;
}

void check_options(const CommOptions& options) {
  if (options.timeout.count() <= 0)
    throw Error(str("the communication timeout must be positive, not ", options.timeout.count(), " ms"));
  if (options.watchdog_timeout.count() < 0)
    throw Error(str("the watchdog timeout must be positive (or 0, off), not ", options.watchdog_timeout.count(), " ms"));
}

std::string current_exception_message() {
  try {
    throw;
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------
// Work
// ---------------------------------------------------------------------------

Work::Work(std::shared_ptr<detail::PendingOp> op) : op_(std::move(op)) {}

Work::Work(std::shared_ptr<detail::PendingOp> op, const char* name, int group_size)
    : op_(std::move(op)), name_(name), group_size_(group_size) {}

Work& Work::operator=(Work&& other) noexcept {
  if (this != &other) {
    if (op_ && !op_->test()) op_->abandon();
    op_ = std::move(other.op_);
    name_ = other.name_;
    group_size_ = other.group_size_;
  }
  return *this;
}

Work::~Work() {
  if (op_ && !op_->test()) op_->abandon();
}

namespace {
thread_local double t_blocked_seconds = 0.0;

// Adds the lifetime of the scope to the calling thread's blocked time; the
// watchdog does not count it against the rank.
class BlockedTimer {
 public:
  BlockedTimer() : start_(std::chrono::steady_clock::now()) { detail::begin_communication_wait(); }
  ~BlockedTimer() {
    detail::end_communication_wait();
    t_blocked_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }
  BlockedTimer(const BlockedTimer&) = delete;
  BlockedTimer& operator=(const BlockedTimer&) = delete;

 private:
  std::chrono::steady_clock::time_point start_;
};
}  // namespace

double blocked_seconds() { return t_blocked_seconds; }

void Work::wait() {
  if (!op_) return;
  std::shared_ptr<detail::PendingOp> op = std::move(op_);
  // An asynchronous operation shows in a trace as the time its rank waits.
  TraceScope trace(TraceCategory::communication, name_, group_size_);
  BlockedTimer timer;
  op->wait();
}

bool Work::done() const { return !op_ || op_->test(); }

// ---------------------------------------------------------------------------
// Communicator
// ---------------------------------------------------------------------------

Communicator::Communicator(std::unique_ptr<detail::Backend> backend, const CommOptions& options)
    : backend_(std::move(backend)),
      options_(options),
      rank_(backend_->rank()),
      size_(static_cast<int>(backend_->world_ranks().size())),
      world_ranks_(backend_->world_ranks()),
      queue_(std::make_unique<detail::CollectiveQueue>(*backend_)) {
  detail::check_options(options);
}

// The queue goes first: its progress thread may still be using the backend.
Communicator::~Communicator() { queue_.reset(); }

const char* Communicator::backend() const { return backend_->name(); }

void Communicator::set_options(const CommOptions& options) {
  detail::check_options(options);
  options_ = options;
}

CommStats Communicator::stats() const {
  std::lock_guard lock(stats_mu_);
  return stats_;
}

CollectiveCall Communicator::issue(CollectiveKind kind, const void* send, void* recv, int64_t count, DType dtype,
                                   ReduceOp op, int root) {
  CollectiveCall call;
  call.kind = kind;
  call.send = send;
  call.recv = recv;
  call.count = count;
  call.dtype = dtype;
  call.op = op;
  call.root = root;
  call.seq = seq_ + 1;
  call.timeout = options_.timeout;
  call.doubled = options_.test_double_sums && detail::is_reduction(kind) && op == ReduceOp::sum &&
                 (dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16);
  const char* name = detail::collective_name(kind);
  if (count < 0) throw Error(str(name, ": element count ", count, " is negative"));
  if (kind == CollectiveKind::broadcast && (root < 0 || root >= size_))
    throw Error(str("broadcast: root ", root, " is not a rank of this group of ", size_));
  LOOM_CHECK(count == 0 || (send != nullptr && recv != nullptr), name, " of ", count, " elements with a null buffer");
  // The buffers are read and written outside the rank's streams (the caller's
  // thread or the progress thread): the device work that produced them runs
  // first.
  ops::synchronize();
  ++seq_;

  const double n = size_;
  double elements = 0;
  switch (kind) {
    case CollectiveKind::all_reduce: elements = 2.0 * (n - 1) / n * static_cast<double>(count); break;
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_gather: elements = (n - 1) * static_cast<double>(count); break;
    case CollectiveKind::broadcast: elements = size_ > 1 ? static_cast<double>(count) : 0.0; break;
    case CollectiveKind::barrier: break;
  }
  std::lock_guard lock(stats_mu_);
  CommVolume& volume = kind == CollectiveKind::all_reduce       ? stats_.all_reduce
                       : kind == CollectiveKind::reduce_scatter ? stats_.reduce_scatter
                       : kind == CollectiveKind::all_gather     ? stats_.all_gather
                       : kind == CollectiveKind::broadcast      ? stats_.broadcast
                                                                : stats_.barrier;
  volume.calls += 1;
  volume.elements += elements;
  volume.bytes += elements * static_cast<double>(dtype_size(dtype));
  return call;
}

void Communicator::run_blocking(CollectiveCall call) {
  TraceScope trace(TraceCategory::communication, detail::collective_name(call.kind), size_);
  BlockedTimer timer;
  queue_->run_now(std::move(call));
}

Work Communicator::run_async(CollectiveCall call) {
  const char* name = detail::collective_name(call.kind);
  return Work(queue_->enqueue(std::move(call)), name, size_);
}

void Communicator::all_reduce(void* buf, int64_t count, DType dtype, ReduceOp op) {
  run_blocking(issue(CollectiveKind::all_reduce, buf, buf, count, dtype, op, 0));
}

void Communicator::reduce_scatter(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) {
  run_blocking(issue(CollectiveKind::reduce_scatter, send, recv, recv_count, dtype, op, 0));
}

void Communicator::all_gather(const void* send, void* recv, int64_t send_count, DType dtype) {
  run_blocking(issue(CollectiveKind::all_gather, send, recv, send_count, dtype, ReduceOp::sum, 0));
}

void Communicator::broadcast(void* buf, int64_t count, DType dtype, int root) {
  run_blocking(issue(CollectiveKind::broadcast, buf, buf, count, dtype, ReduceOp::sum, root));
}

void Communicator::barrier() {
  run_blocking(issue(CollectiveKind::barrier, nullptr, nullptr, 0, DType::u8, ReduceOp::sum, 0));
}

Work Communicator::all_reduce_async(void* buf, int64_t count, DType dtype, ReduceOp op) {
  return run_async(issue(CollectiveKind::all_reduce, buf, buf, count, dtype, op, 0));
}

Work Communicator::reduce_scatter_async(const void* send, void* recv, int64_t recv_count, DType dtype, ReduceOp op) {
  return run_async(issue(CollectiveKind::reduce_scatter, send, recv, recv_count, dtype, op, 0));
}

Work Communicator::all_gather_async(const void* send, void* recv, int64_t send_count, DType dtype) {
  return run_async(issue(CollectiveKind::all_gather, send, recv, send_count, dtype, ReduceOp::sum, 0));
}

Work Communicator::broadcast_async(void* buf, int64_t count, DType dtype, int root) {
  return run_async(issue(CollectiveKind::broadcast, buf, buf, count, dtype, ReduceOp::sum, root));
}

Work Communicator::barrier_async() {
  return run_async(issue(CollectiveKind::barrier, nullptr, nullptr, 0, DType::u8, ReduceOp::sum, 0));
}

uint64_t Communicator::issue_point_to_point(const char* what, CommVolume CommStats::*volume, const void* buf,
                                            size_t bytes, int peer, int tag) {
  if (peer < 0 || peer >= size_) throw Error(str(what, ": rank ", peer, " is not a rank of this group of ", size_));
  if (tag < 0 || tag > kMaxTag) throw Error(str(what, ": tag ", tag, " is outside [0, ", kMaxTag, "]"));
  LOOM_CHECK(bytes == 0 || buf != nullptr, what, " of ", bytes, " bytes with a null buffer");
  ops::synchronize();
  std::lock_guard lock(stats_mu_);
  CommVolume& v = stats_.*volume;
  v.elements += static_cast<double>(bytes);
  v.bytes += static_cast<double>(bytes);
  return static_cast<uint64_t>(++v.calls);
}

Work Communicator::send_async(const void* buf, size_t bytes, int dst, int tag) {
  const uint64_t number = issue_point_to_point("send", &CommStats::send, buf, bytes, dst, tag);
  return Work(backend_->post_send(buf, bytes, dst, tag, number, options_.timeout), "send", size_);
}

Work Communicator::recv_async(void* buf, size_t bytes, int src, int tag) {
  const uint64_t number = issue_point_to_point("recv", &CommStats::recv, buf, bytes, src, tag);
  return Work(backend_->post_recv(buf, bytes, src, tag, number, options_.timeout), "recv", size_);
}

void Communicator::send(const void* buf, size_t bytes, int dst, int tag) { send_async(buf, bytes, dst, tag).wait(); }

void Communicator::recv(void* buf, size_t bytes, int src, int tag) { recv_async(buf, bytes, src, tag).wait(); }

// ---------------------------------------------------------------------------
// Tensor forms
// ---------------------------------------------------------------------------

static void check_block_tensors(const char* what, const Tensor& one, const Tensor& all, int size) {
  if (one.dtype() != all.dtype())
    throw Error(str(what, ": dtypes differ (", dtype_name(one.dtype()), " and ", dtype_name(all.dtype()), ")"));
  if (all.numel() != one.numel() * size)
    throw Error(str(what, ": the full tensor has ", all.numel(), " elements, expected ", size, " x ", one.numel()));
}

void Communicator::all_reduce(const Tensor& t, ReduceOp op) { all_reduce(t.raw(), t.numel(), t.dtype(), op); }

void Communicator::reduce_scatter(const Tensor& send, const Tensor& recv, ReduceOp op) {
  check_block_tensors("reduce_scatter", recv, send, size_);
  reduce_scatter(send.raw(), recv.raw(), recv.numel(), recv.dtype(), op);
}

void Communicator::all_gather(const Tensor& send, const Tensor& recv) {
  check_block_tensors("all_gather", send, recv, size_);
  all_gather(send.raw(), recv.raw(), send.numel(), send.dtype());
}

void Communicator::broadcast(const Tensor& t, int root) { broadcast(t.raw(), t.numel(), t.dtype(), root); }
void Communicator::send(const Tensor& t, int dst, int tag) { send(t.raw(), t.nbytes(), dst, tag); }
void Communicator::recv(const Tensor& t, int src, int tag) { recv(t.raw(), t.nbytes(), src, tag); }

Work Communicator::all_reduce_async(const Tensor& t, ReduceOp op) {
  return all_reduce_async(t.raw(), t.numel(), t.dtype(), op);
}

Work Communicator::reduce_scatter_async(const Tensor& send, const Tensor& recv, ReduceOp op) {
  check_block_tensors("reduce_scatter", recv, send, size_);
  return reduce_scatter_async(send.raw(), recv.raw(), recv.numel(), recv.dtype(), op);
}

Work Communicator::all_gather_async(const Tensor& send, const Tensor& recv) {
  check_block_tensors("all_gather", send, recv, size_);
  return all_gather_async(send.raw(), recv.raw(), send.numel(), send.dtype());
}

Work Communicator::broadcast_async(const Tensor& t, int root) {
  return broadcast_async(t.raw(), t.numel(), t.dtype(), root);
}

Work Communicator::send_async(const Tensor& t, int dst, int tag) { return send_async(t.raw(), t.nbytes(), dst, tag); }
Work Communicator::recv_async(const Tensor& t, int src, int tag) { return recv_async(t.raw(), t.nbytes(), src, tag); }

// ---------------------------------------------------------------------------
// Groups
// ---------------------------------------------------------------------------

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  return split_checked(color, key, 0, "split");
}

std::unique_ptr<Communicator> Communicator::new_group(const std::vector<int>& ranks) {
  std::vector<int> sorted = ranks;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (sorted[i] < 0 || sorted[i] >= size_)
      throw Error(str("new_group: rank ", sorted[i], " is not a rank of this group of ", size_));
    if (i > 0 && sorted[i] == sorted[i - 1]) throw Error(str("new_group: rank ", sorted[i], " is listed twice"));
  }
  // FNV-1a over the list, so ranks that pass different lists are caught.
  uint64_t digest = 0xcbf29ce484222325ull;
  for (int r : ranks) digest = (digest ^ static_cast<uint32_t>(r)) * 0x100000001b3ull;
  const auto position = std::find(ranks.begin(), ranks.end(), rank_);
  const bool member = position != ranks.end();
  return split_checked(member ? 0 : -1, member ? static_cast<int>(position - ranks.begin()) : 0,
                       static_cast<int64_t>(digest >> 1), "new_group");
}

std::unique_ptr<Communicator> Communicator::split_checked(int color, int key, int64_t check, const char* what) {
  const int64_t mine[3] = {color, key, check};
  std::vector<int64_t> all(3 * static_cast<size_t>(size_));
  all_gather(mine, all.data(), 3, DType::i64);
  const uint64_t seq = seq_;
  for (int r = 0; r < size_; ++r)
    if (all[3 * r + 2] != check)
      throw Error(str(what, ": rank ", r, " passed a different rank list than rank ", rank_,
                      "; every rank must pass the same list"));
  std::vector<int> members;
  if (color >= 0) {
    for (int r = 0; r < size_; ++r)
      if (all[3 * r] == color) members.push_back(r);
    std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[3 * a + 1] < all[3 * b + 1]; });
  }
  std::unique_ptr<detail::Backend> backend = backend_->split(color, members, seq);
  if (!backend) return nullptr;
  return std::make_unique<Communicator>(std::move(backend), options_);
}

}  // namespace loom
