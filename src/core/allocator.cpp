#include <cstdlib>

#include "loom/core.h"

namespace loom {

const char* tier_name(Tier t) {
  switch (t) {
    case Tier::device: return "device";
    case Tier::host: return "host";
    case Tier::nvme: return "nvme";
  }
  LOOM_CHECK(false, "unknown tier");
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

Allocator::Allocator(Tier tier, size_t budget) : tier_(tier), budget_(budget) {}

void Allocator::reserve(size_t bytes) {
  size_t used = used_.load();
  size_t budget = budget_.load();
  do {
    if (bytes > budget || used > budget - bytes) {
      throw Error(str("out of ", tier_name(tier_), " memory: asked for ", format_bytes(bytes), " with ",
                      format_bytes(used), " in use of a ", format_bytes(budget), " budget",
                      current_rank() >= 0 ? str(" on rank ", current_rank()) : std::string(),
                      "; raise memory.", tier_name(tier_), "_budget or offload more"));
    }
  } while (!used_.compare_exchange_weak(used, used + bytes));
  raise_peak(used + bytes);
}

void Allocator::release(size_t bytes) {
  size_t before = used_.fetch_sub(bytes);
  LOOM_CHECK(before >= bytes, "released more ", tier_name(tier_), " bytes than reserved");
}

void* Allocator::allocate(size_t bytes) {
  reserve(bytes);
  // Round up so aligned_alloc's size requirement holds; account the request.
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  if (p == nullptr) {
    release(bytes);
    throw Error(str("the system refused ", format_bytes(bytes), " for the ", tier_name(tier_), " tier"));
  }
  return p;
}

void Allocator::deallocate(void* p, size_t bytes) {
  free_memory(p, bytes);
  release(bytes);
}

void Allocator::free_memory(void* p, size_t) { std::free(p); }

void Allocator::raise_peak(size_t bytes) {
  size_t peak = peak_.load();
  while (bytes > peak && !peak_.compare_exchange_weak(peak, bytes)) {
  }
}

void Allocator::set_budget(size_t bytes) {
  if (bytes < used_.load())
    throw Error(str("cannot set the ", tier_name(tier_), " budget to ", format_bytes(bytes), ": ",
                    format_bytes(used_.load()), " are already in use"));
  budget_.store(bytes);
}

MemoryContext::MemoryContext() {
  for (int t = 0; t < kNumTiers; ++t) tiers_[t] = std::make_unique<Allocator>(static_cast<Tier>(t));
}

namespace {
thread_local MemoryContext* t_context = nullptr;
}

MemoryContext& MemoryContext::current() {
  if (t_context) return *t_context;
  static MemoryContext process_default;
  return process_default;
}

MemoryContext::Install::Install(MemoryContext& ctx) : previous_(t_context) { t_context = &ctx; }
MemoryContext::Install::~Install() { t_context = previous_; }

}  // namespace loom
