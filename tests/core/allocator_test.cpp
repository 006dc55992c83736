#include <gtest/gtest.h>

#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "loom/core.h"

namespace loom {
namespace {

// Host memory that counts the calls reaching it and can be told to refuse.
class CountingResource final : public MemoryResource {
 public:
  void* allocate(size_t bytes) override {
    if (refuse) return nullptr;
    ++allocations;
    outstanding += bytes;
    return host_memory_resource().allocate(bytes);
  }
  void deallocate(void* p, size_t bytes) override {
    ++frees;
    outstanding -= bytes;
    host_memory_resource().deallocate(p, bytes);
  }
  const char* name() const override { return "counting"; }

  std::atomic<int> allocations{0}, frees{0};
  std::atomic<size_t> outstanding{0};
  bool refuse = false;
};

TEST(Allocator, TracksUsageAndHighWaterMark) {
  Allocator a(Tier::host, 1000);
  void* p = a.allocate(600);
  void* q = a.allocate(300);
  EXPECT_EQ(a.used(), 900u);
  a.deallocate(p, 600);
  EXPECT_EQ(a.used(), 300u);
  EXPECT_EQ(a.peak(), 900u);
  a.deallocate(q, 300);
  a.reset_peak();
  EXPECT_EQ(a.peak(), 0u);
  // A peak measured in intervals is put back together; it never lowers.
  a.raise_peak(700);
  a.raise_peak(500);
  EXPECT_EQ(a.peak(), 700u);
}

TEST(Allocator, OverBudgetIsAnErrorNamingTierAndBudget) {
  Allocator a(Tier::device, 1024);
  void* p = a.allocate(1000);
  try {
    a.allocate(100);
    FAIL() << "expected out-of-memory";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1.00 KiB budget"), std::string::npos) << msg;
  }
  EXPECT_EQ(a.used(), 1000u);  // the failed request left no trace
  a.deallocate(p, 1000);
}

TEST(Allocator, BudgetCannotDropBelowUse) {
  Allocator a(Tier::host);
  void* p = a.allocate(512);
  EXPECT_THROW(a.set_budget(100), Error);
  a.set_budget(512);
  EXPECT_THROW(a.reserve(1), Error);
  a.deallocate(p, 512);
}

TEST(Allocator, ConcurrentReservationsNeverExceedBudget) {
  Allocator a(Tier::host, 100 * 64);
  std::vector<std::thread> threads;
  std::atomic<int> granted{0};
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) {
        try {
          a.reserve(64);
          granted++;
        } catch (const Error&) {
        }
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(granted.load(), 100);
  EXPECT_EQ(a.peak(), 100u * 64);
}

TEST(Allocator, SecondIdenticalCycleReachesTheSystemForNothing) {
  CountingResource res;
  Allocator a(Tier::device, kUnlimited, res);
  const std::vector<size_t> sizes = {24, 1000, 4096, 100000, 3 << 20, 40 << 20};
  std::set<void*> first;
  for (int cycle = 0; cycle < 2; ++cycle) {
    std::vector<void*> ptrs;
    for (size_t s : sizes) ptrs.push_back(a.allocate(s));
    for (size_t i = 0; i < sizes.size(); ++i) a.deallocate(ptrs[i], sizes[i]);
    if (cycle == 0)
      first.insert(ptrs.begin(), ptrs.end());
    else
      EXPECT_EQ(std::set<void*>(ptrs.begin(), ptrs.end()), first);
  }
  EXPECT_EQ(a.system_allocations(), sizes.size());
  EXPECT_EQ(res.allocations.load(), static_cast<int>(sizes.size()));
  EXPECT_EQ(a.system_frees(), 0u);
  EXPECT_EQ(res.frees.load(), 0);
  // A nearby size shares a block (one size class) rather than a new one.
  void* p = a.allocate(990);
  EXPECT_EQ(a.system_allocations(), sizes.size());
  a.deallocate(p, 990);
}

TEST(Allocator, UsedIsExactAndReservedCountsWhatTheCacheHolds) {
  CountingResource res;
  Allocator a(Tier::host, kUnlimited, res);
  const size_t n1 = 1000, n2 = 70000;
  void* p = a.allocate(n1);
  void* q = a.allocate(n2);
  EXPECT_EQ(a.used(), n1 + n2);
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  EXPECT_GE(a.reserved(), a.used());
  // Size classes round up by at most a sixteenth (plus the alignment).
  EXPECT_LE(a.reserved(), n1 + n2 + (n1 + n2) / 16 + 2 * kMemoryAlignment);
  a.deallocate(q, n2);
  EXPECT_EQ(a.used(), n1);
  EXPECT_EQ(a.peak(), n1 + n2);
  EXPECT_EQ(a.reserved(), res.outstanding.load());  // the freed block is cached
  EXPECT_EQ(a.peak_reserved(), a.reserved());
  a.reset_peak();
  EXPECT_EQ(a.peak(), n1);
  EXPECT_EQ(a.peak_reserved(), a.reserved());
  a.empty_cache();
  EXPECT_EQ(res.frees.load(), 1);
  EXPECT_EQ(a.system_frees(), 1u);
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  EXPECT_LT(a.reserved(), n1 + kMemoryAlignment);
  a.deallocate(p, n1);
  a.empty_cache();
  EXPECT_EQ(a.reserved(), 0u);
  EXPECT_EQ(res.outstanding.load(), 0u);
  // reserve() accounts bytes that are not in the cache in both figures.
  a.reserve(n2);
  EXPECT_EQ(a.used(), n2);
  EXPECT_EQ(a.reserved(), n2);
  a.release(n2);
  EXPECT_EQ(a.reserved(), 0u);
}

TEST(Allocator, BudgetFlushesTheCacheBeforeFailing) {
  CountingResource res;
  const size_t budget = 8192;
  Allocator a(Tier::device, budget, res);
  void* p = a.allocate(5000);
  a.deallocate(p, 5000);
  // Nothing is in use, so a request of another size class fits once the
  // cached block is returned.
  void* q = a.allocate(6000);
  EXPECT_EQ(res.frees.load(), 1);
  EXPECT_EQ(a.system_frees(), 1u);
  EXPECT_EQ(a.used(), 6000u);
  EXPECT_LE(a.reserved(), budget);
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  a.deallocate(q, 6000);
  // reserve() makes room the same way.
  a.reserve(budget);
  EXPECT_EQ(res.outstanding.load(), 0u);
  EXPECT_EQ(a.reserved(), budget);
  a.release(budget);
  // When even an empty cache leaves no room for the rounded size class, the
  // block is only as large as the alignment needs: real memory stays within
  // the budget.
  const size_t tight = 2050;
  a.set_budget(tight + kMemoryAlignment);
  void* r = a.allocate(tight);
  EXPECT_LE(a.reserved(), a.budget());
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  a.deallocate(r, tight);
  // Lowering the budget below what is cached returns the cache.
  a.set_budget(0);
  EXPECT_EQ(a.reserved(), 0u);
  EXPECT_EQ(res.outstanding.load(), 0u);
}

TEST(Allocator, OutOfBudgetCountsOnlyBytesInUse) {
  Allocator a(Tier::device, 4096);
  void* p = a.allocate(3000);
  a.deallocate(p, 3000);
  void* q = a.allocate(1000);
  try {
    a.allocate(3500);
    FAIL() << "expected out-of-memory";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& part : {str("out of device memory: asked for ", format_bytes(3500)),
                                    str(format_bytes(1000), " in use of a ", format_bytes(4096), " budget"),
                                    std::string("raise memory.device_budget or offload more")})
      EXPECT_NE(msg.find(part), std::string::npos) << msg << "\nmissing: " << part;
  }
  EXPECT_EQ(a.used(), 1000u);
  // What the failed request was refused is exactly what is in use.
  void* r = a.allocate(3096);
  a.deallocate(r, 3096);
  a.deallocate(q, 1000);
}

TEST(Allocator, StreamOrderedFreeCachesTheBlockWhenTheMemoryReturns) {
  CountingResource res;
  Allocator a(Tier::device, kUnlimited, res);
  const size_t n = 5000;
  void* p = a.allocate(n);
  const size_t held = a.reserved();
  a.release(n);  // the host lets go
  EXPECT_EQ(a.used(), 0u);
  a.free_memory(p, n);  // the stream's earlier work has run
  EXPECT_EQ(a.reserved(), held);
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  EXPECT_EQ(a.allocate(n), p);
  EXPECT_EQ(res.allocations.load(), 1);
  a.deallocate(p, n);
  EXPECT_EQ(a.reserved(), held);
}

TEST(Allocator, TakesItsMemoryFromItsResource) {
  CountingResource first, second;
  Allocator a(Tier::host, kUnlimited, first);
  EXPECT_EQ(&a.resource(), &first);
  void* p = a.allocate(256);
  a.deallocate(p, 256);
  // Switching empties the cache into the previous resource.
  a.set_resource(second);
  EXPECT_EQ(first.frees.load(), 1);
  EXPECT_EQ(first.outstanding.load(), 0u);
  p = a.allocate(256);
  EXPECT_EQ(second.allocations.load(), 1);
  EXPECT_EQ(first.allocations.load(), 1);
  EXPECT_DEATH(a.set_resource(first), "while 256 bytes of blocks are in use");
  a.deallocate(p, 256);
  // A refusal is an Error naming the resource and leaves no trace.
  a.empty_cache();
  second.refuse = true;
  try {
    a.allocate(512);
    FAIL() << "expected a refusal";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("counting memory resource refused"), std::string::npos) << e.what();
  }
  EXPECT_EQ(a.used(), 0u);
  EXPECT_EQ(a.reserved(), 0u);
}

TEST(Allocator, ThreadsAllocatingAndFreeingEachOthersBlocks) {
  CountingResource res;
  Allocator a(Tier::host, 256 << 10, res);
  // Each thread frees the blocks its neighbour allocated, as chunk-manager
  // and NVMe threads free into a rank's allocator.
  constexpr int kThreads = 4, kRounds = 200;
  std::mutex mu;
  std::vector<std::vector<std::pair<void*, size_t>>> handed(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        const size_t bytes = 64 + static_cast<size_t>((t * 7919 + i * 104729) % 20000);
        void* p = nullptr;
        try {
          p = a.allocate(bytes);
          std::memset(p, t, bytes);
        } catch (const Error&) {
          // Refused under contention: the budget holds.
        }
        std::vector<std::pair<void*, size_t>> mine;
        {
          std::lock_guard lock(mu);
          if (p) handed[static_cast<size_t>((t + 1) % kThreads)].emplace_back(p, bytes);
          mine.swap(handed[static_cast<size_t>(t)]);
        }
        for (auto [q, n] : mine) a.deallocate(q, n);
      }
    });
  for (auto& t : threads) t.join();
  for (auto& list : handed)
    for (auto [q, n] : list) a.deallocate(q, n);
  EXPECT_EQ(a.used(), 0u);
  EXPECT_LE(a.peak(), a.budget());
  EXPECT_EQ(a.reserved(), res.outstanding.load());
  EXPECT_EQ(a.system_allocations() - a.system_frees(),
            static_cast<uint64_t>(res.allocations.load() - res.frees.load()));
  a.empty_cache();
  EXPECT_EQ(res.outstanding.load(), 0u);
}

TEST(MemoryContext, InstalledContextIsPerThread) {
  MemoryContext mine;
  {
    MemoryContext::Install install(mine);
    Tensor t = Tensor::empty({16}, DType::f32, Tier::device);
    EXPECT_EQ(mine.tier(Tier::device).used(), 64u);
    std::thread other([&] { EXPECT_NE(&MemoryContext::current(), &mine); });
    other.join();
  }
  EXPECT_EQ(mine.tier(Tier::device).used(), 0u);
  EXPECT_EQ(mine.tier(Tier::device).peak(), 64u);
}

}  // namespace
}  // namespace loom
