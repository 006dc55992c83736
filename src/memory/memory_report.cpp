#include <algorithm>

#include "loom/memory.h"

namespace loom {

namespace {

std::string throughput(int64_t bytes, double seconds) {
  return seconds > 0.0 ? str(" at ", format_bytes(static_cast<double>(bytes) / seconds), "/s") : std::string();
}

}  // namespace

TierTraffic& TierTraffic::operator+=(const TierTraffic& o) {
  for (size_t f = 0; f < kNumTiers; ++f)
    for (size_t t = 0; t < kNumTiers; ++t) moved[f][t] += o.moved[f][t];
  return *this;
}

TierTraffic& TierTraffic::operator-=(const TierTraffic& o) {
  for (size_t f = 0; f < kNumTiers; ++f)
    for (size_t t = 0; t < kNumTiers; ++t) moved[f][t] -= o.moved[f][t];
  return *this;
}

std::string describe(const TierTraffic& t) {
  std::string out;
  for (int from = 0; from < kNumTiers; ++from)
    for (int to = 0; to < kNumTiers; ++to) {
      const int64_t bytes = t.at(static_cast<Tier>(from), static_cast<Tier>(to));
      if (bytes == 0) continue;
      out += str(out.empty() ? "" : ", ", tier_name(static_cast<Tier>(from)), "->", tier_name(static_cast<Tier>(to)),
                 " ", format_bytes(static_cast<double>(bytes)));
    }
  return out;
}

MemoryReport allocator_report() {
  MemoryReport r;
  for (int t = 0; t < kNumTiers; ++t) {
    const Allocator& a = MemoryContext::current().tier(static_cast<Tier>(t));
    r.peak.bytes[static_cast<size_t>(t)] = static_cast<int64_t>(a.peak());
    r.peak_reserved.bytes[static_cast<size_t>(t)] = static_cast<int64_t>(a.peak_reserved());
    r.budget.bytes[static_cast<size_t>(t)] = a.budget() == kUnlimited ? -1 : static_cast<int64_t>(a.budget());
  }
  return r;
}

std::string describe(const MemoryReport& r) {
  if (r.policy == MemoryPolicy::none) {
    // No chunks: the allocators' figures, every tier's model state unknown.
    std::string out = "memory (policy none):";
    for (int i = 0; i < kNumTiers; ++i) {
      const Tier t = static_cast<Tier>(i);
      out += str(" ", tier_name(t), " peak ", format_bytes(static_cast<double>(r.peak[t])),
                 t == Tier::nvme ? std::string()
                                 : str(" (", format_bytes(static_cast<double>(r.peak_reserved[t])), " reserved)"),
                 " of ",
                 r.budget[t] < 0 ? std::string("unlimited") : format_bytes(static_cast<double>(r.budget[t])),
                 i + 1 < kNumTiers ? "," : "\n");
    }
    return out;
  }
  std::string out = str("memory policy ", memory_policy_name(r.policy), ": ", r.num_chunks, " chunks of ",
                        r.chunk_numel, " elements\n");
  for (int i = 0; i < kNumTiers; ++i) {
    const Tier t = static_cast<Tier>(i);
    // What the tier held at its high-water mark besides model state:
    // activations and working buffers (on the device), staging (host).
    const int64_t other = std::max<int64_t>(0, r.peak[t] - r.model_state[t]);
    out += str("  ", tier_name(t), ": model state ", format_bytes(static_cast<double>(r.model_state[t])), ", peak ",
               format_bytes(static_cast<double>(r.peak[t])),
               t == Tier::nvme ? std::string()
                               : str(" (", format_bytes(static_cast<double>(other)), " besides model state, ",
                                     format_bytes(static_cast<double>(r.peak_reserved[t])), " reserved)"),
               ", budget ",
               r.budget[t] < 0 ? std::string("unlimited") : format_bytes(static_cast<double>(r.budget[t])), "\n");
  }
  if (r.traced_non_model >= 0) {
    out += str("  traced device peak besides model state: ", format_bytes(static_cast<double>(r.traced_non_model)));
    const auto largest = std::max_element(r.traced_modules.begin(), r.traced_modules.end(),
                                          [](const auto& a, const auto& b) { return a.second < b.second; });
    if (largest != r.traced_modules.end()) out += str(" (largest at ", largest->first, ")");
    out += "\n";
  }
  if (const std::string moved = describe(r.traffic); !moved.empty()) out += str("  moved: ", moved, "\n");
  std::string io;
  if (r.nvme.reads > 0)
    io = str(r.nvme.reads, " reads of ", format_bytes(static_cast<double>(r.nvme.bytes_read)),
             throughput(r.nvme.bytes_read, r.nvme.read_seconds));
  if (r.nvme.writes > 0)
    io += str(io.empty() ? "" : ", ", r.nvme.writes, " writes of ",
              format_bytes(static_cast<double>(r.nvme.bytes_written)),
              throughput(r.nvme.bytes_written, r.nvme.write_seconds));
  if (!io.empty()) out += str("  nvme I/O: ", io, "\n");
  return out;
}

}  // namespace loom
