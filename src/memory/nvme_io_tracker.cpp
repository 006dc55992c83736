#include <utility>

#include "memory/nvme_engine.h"

namespace loom {

IoTracker::IoTracker(std::filesystem::path dir) : dir_(std::move(dir)) {}

uint64_t IoTracker::begin(IoKind kind, uint64_t bytes, uint64_t offset) {
  std::lock_guard lock(mu_);
  uint64_t ticket = next_ticket_++;
  records_.emplace(ticket, Record{kind, bytes, offset, false, {}});
  BusyTime& busy = busy_[static_cast<int>(kind)];
  if (busy.in_flight++ == 0) busy.since = Clock::now();
  return ticket;
}

void IoTracker::complete(uint64_t ticket, std::string failure) {
  {
    std::lock_guard lock(mu_);
    auto it = records_.find(ticket);
    LOOM_CHECK(it != records_.end() && !it->second.finished, "NVMe ticket ", ticket, " completed twice");
    Record& r = it->second;
    r.finished = true;
    r.failure = std::move(failure);
    BusyTime& busy = busy_[static_cast<int>(r.kind)];
    if (--busy.in_flight == 0) busy.seconds += std::chrono::duration<double>(Clock::now() - busy.since).count();
    if (r.failure.empty()) {
      auto bytes = static_cast<int64_t>(r.bytes);
      if (r.kind == IoKind::read) {
        totals_.reads++;
        totals_.bytes_read += bytes;
      } else {
        totals_.writes++;
        totals_.bytes_written += bytes;
      }
    }
  }
  finished_cv_.notify_all();
}

const IoTracker::Record& IoTracker::record(uint64_t ticket) const {
  auto it = records_.find(ticket);
  LOOM_CHECK(it != records_.end(), "NVMe ticket ", ticket, " is not in flight (never issued, or already waited for)");
  return it->second;
}

bool IoTracker::finished(uint64_t ticket) const {
  std::lock_guard lock(mu_);
  return record(ticket).finished;
}

void IoTracker::await(uint64_t ticket) const {
  std::unique_lock lock(mu_);
  finished_cv_.wait(lock, [&] { return record(ticket).finished; });
}

void IoTracker::retire(uint64_t ticket) {
  std::lock_guard lock(mu_);
  const Record& r = record(ticket);
  LOOM_CHECK(r.finished, "NVMe ticket ", ticket, " retired while in flight");
  std::string failure = r.failure.empty() ? std::string() : io_failure(dir_, r.kind, r.bytes, r.offset, r.failure);
  records_.erase(ticket);
  if (!failure.empty()) throw Error(failure);
}

std::vector<uint64_t> IoTracker::outstanding() const {
  std::lock_guard lock(mu_);
  std::vector<uint64_t> tickets;
  tickets.reserve(records_.size());
  for (const auto& [ticket, r] : records_) tickets.push_back(ticket);
  return tickets;
}

NvmeStats IoTracker::stats() const {
  std::lock_guard lock(mu_);
  NvmeStats s = totals_;
  // A kind still in flight counts up to now.
  auto now = Clock::now();
  auto seconds = [&](const BusyTime& b) {
    return b.seconds + (b.in_flight > 0 ? std::chrono::duration<double>(now - b.since).count() : 0.0);
  };
  s.read_seconds = seconds(busy_[static_cast<int>(IoKind::read)]);
  s.write_seconds = seconds(busy_[static_cast<int>(IoKind::write)]);
  return s;
}

}  // namespace loom
