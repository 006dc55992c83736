#include <gtest/gtest.h>

#include <thread>

#include "loom/core.h"

namespace loom {
namespace {

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
