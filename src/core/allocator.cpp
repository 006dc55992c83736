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
