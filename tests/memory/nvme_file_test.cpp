#include <gtest/gtest.h>
#include <liburing.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <iostream>
#include <thread>
#include <vector>

#include "loom/memory.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;
using Engine = NvmeFile::Engine;

constexpr uint64_t KiB = 1024, MiB = 1024 * KiB;

const char* engine_name(Engine e) { return e == Engine::io_uring ? "io_uring" : "threads"; }

// Whether this kernel lets the process set up a ring at all (seccomp
// profiles of container runtimes often refuse it).
bool kernel_allows_io_uring() {
  io_uring ring;
  if (io_uring_queue_init(4, &ring, 0) != 0) return false;
  io_uring_queue_exit(&ring);
  return true;
}

// Bytes that differ between buffers and positions, so a block read back into
// the wrong place or from the wrong offset shows.
void fill(IoBuffer& b, uint64_t seed) {
  auto* w = static_cast<uint64_t*>(b.data());
  for (size_t i = 0; i < b.bytes() / sizeof(uint64_t); ++i)
    w[i] = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xD6E8FEB86659FD93ull);
}

bool same_bytes(const IoBuffer& a, const IoBuffer& b) {
  return a.bytes() == b.bytes() && std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Blocks of 64 KiB to 1 MiB laid end to end in one file.
struct Blocks {
  std::vector<uint64_t> sizes{64 * KiB, 1 * MiB, 128 * KiB, 256 * KiB, 64 * KiB, 512 * KiB, 192 * KiB, 1 * MiB};
  std::vector<uint64_t> offsets;
  uint64_t total = 0;
  std::vector<IoBuffer> written, read;

  Blocks() {
    for (size_t i = 0; i < sizes.size(); ++i) {
      offsets.push_back(total);
      total += sizes[i];
      written.emplace_back(sizes[i]);
      fill(written.back(), i);
      read.emplace_back(sizes[i]);
      std::memset(read.back().data(), 0, sizes[i]);
    }
  }
  size_t count() const { return sizes.size(); }
};

class NvmeFileTest : public ::testing::TestWithParam<Engine> {};

TEST_P(NvmeFileTest, RoundTripsManyBlocksInFlight) {
  TempDir dir;
  Blocks blocks;
  // A queue depth below the number of requests, so starting one waits for
  // an earlier one to leave the ring.
  NvmeFile file(dir.path(), blocks.total, GetParam(), 4);
  for (size_t i = 0; i < blocks.count(); ++i)
    file.write(blocks.written[i].data(), blocks.sizes[i], blocks.offsets[i]);
  file.wait_all();
  for (size_t i = 0; i < blocks.count(); ++i) file.read(blocks.read[i].data(), blocks.sizes[i], blocks.offsets[i]);
  file.wait_all();
  for (size_t i = 0; i < blocks.count(); ++i)
    EXPECT_TRUE(same_bytes(blocks.read[i], blocks.written[i])) << "block " << i;

  NvmeStats s = file.stats();
  EXPECT_EQ(s.writes, static_cast<int64_t>(blocks.count()));
  EXPECT_EQ(s.reads, static_cast<int64_t>(blocks.count()));
  EXPECT_EQ(s.bytes_written, static_cast<int64_t>(blocks.total));
  EXPECT_EQ(s.bytes_read, static_cast<int64_t>(blocks.total));
  EXPECT_GT(s.write_seconds, 0.0);
  EXPECT_GT(s.read_seconds, 0.0);
}

TEST_P(NvmeFileTest, WaitsInAnyOrder) {
  TempDir dir;
  Blocks blocks;
  NvmeFile file(dir.path(), blocks.total, GetParam(), 3);
  std::vector<uint64_t> tickets;
  for (size_t i = 0; i < blocks.count(); ++i)
    tickets.push_back(file.write(blocks.written[i].data(), blocks.sizes[i], blocks.offsets[i]));
  for (size_t i = blocks.count(); i-- > 0;) file.wait(tickets[i]);

  tickets.clear();
  for (size_t i = 0; i < blocks.count(); ++i)
    tickets.push_back(file.read(blocks.read[i].data(), blocks.sizes[i], blocks.offsets[i]));
  for (size_t i : {5, 0, 7, 2, 1, 6, 3, 4}) {
    file.wait(tickets[i]);
    EXPECT_TRUE(same_bytes(blocks.read[i], blocks.written[i])) << "block " << i;
  }
  EXPECT_EQ(file.stats().reads, static_cast<int64_t>(blocks.count()));
}

TEST_P(NvmeFileTest, RecordsACompletionWithoutTheOwnerCallingIn) {
  TempDir dir;
  IoBuffer b(1 * MiB);
  fill(b, 5);
  NvmeFile file(dir.path(), 1 * MiB, GetParam());
  uint64_t ticket = file.write(b.data(), b.bytes(), 0);
  // The owner computes (as the ChunkManager does between a write and its
  // next NVMe call); the write's time is the disk's, not the computation's.
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  NvmeStats s = file.stats();
  EXPECT_EQ(s.writes, 1);
  EXPECT_EQ(s.bytes_written, static_cast<int64_t>(1 * MiB));
  EXPECT_GT(s.write_seconds, 0.0);
  EXPECT_LT(s.write_seconds, 0.1);
  file.wait(ticket);
  EXPECT_EQ(file.stats().write_seconds, s.write_seconds);
}

TEST_P(NvmeFileTest, ClosesWithRequestsInFlight) {
  TempDir dir;
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  Blocks blocks;
  void* unmapped = ::mmap(nullptr, 64 * KiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(unmapped, MAP_FAILED);
  {
    // Fewer slots than requests: starting them waits for the ring to make room.
    NvmeFile file(dir.path(), blocks.total, GetParam(), 2);
    for (size_t i = 0; i < blocks.count(); ++i)
      file.write(blocks.written[i].data(), blocks.sizes[i], blocks.offsets[i]);
    file.wait_all();
    for (size_t i = 0; i < blocks.count(); ++i) file.read(blocks.read[i].data(), blocks.sizes[i], blocks.offsets[i]);
    file.read(unmapped, 64 * KiB, 0);  // fails, and nobody asks why
  }
  // The destructor waited for the reads: their buffers hold the data.
  for (size_t i = 0; i < blocks.count(); ++i)
    EXPECT_TRUE(same_bytes(blocks.read[i], blocks.written[i])) << "block " << i;
  EXPECT_EQ(ctx.tier(Tier::nvme).used(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  ::munmap(unmapped, 64 * KiB);
}

TEST_P(NvmeFileTest, RewritesAndReadsPartsOfTheFile) {
  TempDir dir;
  IoBuffer first(256 * KiB), second(64 * KiB), back(256 * KiB);
  fill(first, 1);
  fill(second, 2);
  NvmeFile file(dir.path(), 256 * KiB, GetParam());
  file.wait(file.write(first.data(), first.bytes(), 0));
  file.wait(file.write(second.data(), second.bytes(), 128 * KiB));
  file.wait(file.read(back.data(), back.bytes(), 0));
  auto* b = static_cast<const char*>(back.data());
  EXPECT_EQ(std::memcmp(b, first.data(), 128 * KiB), 0);
  EXPECT_EQ(std::memcmp(b + 128 * KiB, second.data(), 64 * KiB), 0);
  EXPECT_EQ(std::memcmp(b + 192 * KiB, static_cast<const char*>(first.data()) + 192 * KiB, 64 * KiB), 0);
}

TEST_P(NvmeFileTest, AccountsTheRoundedSizeOnTheNvmeTier) {
  TempDir dir;
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  Allocator& nvme = ctx.tier(Tier::nvme);
  nvme.reserve(5 * kIoAlign);  // something else already on the tier
  {
    NvmeFile file(dir.path(), 10000, GetParam());
    EXPECT_EQ(file.size(), 3 * kIoAlign);
    EXPECT_EQ(nvme.used(), 8 * kIoAlign);
  }
  EXPECT_EQ(nvme.used(), 5 * kIoAlign);
  EXPECT_EQ(nvme.peak(), 8 * kIoAlign);
  nvme.release(5 * kIoAlign);
}

TEST_P(NvmeFileTest, LeavesNoFileInTheDirectory) {
  TempDir dir;
  {
    NvmeFile file(dir.path(), 1 * MiB, GetParam());
    IoBuffer b(1 * MiB);
    fill(b, 3);
    file.wait(file.write(b.data(), b.bytes(), 0));
    EXPECT_TRUE(std::filesystem::is_empty(dir.path())) << "the scratch file must be unlinked while in use";
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST_P(NvmeFileTest, FailedRequestIsAnErrorNamingIt) {
  TempDir dir;
  NvmeFile file(dir.path(), 1 * MiB, GetParam());
  // Aligned, but no process may write there: the kernel fails the read.
  void* unmapped = ::mmap(nullptr, 64 * KiB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(unmapped, MAP_FAILED);
  uint64_t ticket = file.read(unmapped, 64 * KiB, 128 * KiB);
  std::string msg = error_of([&] { file.wait(ticket); });
  EXPECT_CONTAINS(msg, dir.path().string());
  EXPECT_CONTAINS(msg, "read of 65536 bytes at offset 131072");
  EXPECT_CONTAINS(msg, std::strerror(EFAULT));

  // wait_all waits for every request and then reports the first failure.
  IoBuffer good(64 * KiB);
  fill(good, 4);
  file.read(unmapped, 64 * KiB, 0);
  file.write(good.data(), good.bytes(), 64 * KiB);
  EXPECT_CONTAINS(error_of([&] { file.wait_all(); }), "read of 65536 bytes at offset 0");
  EXPECT_EQ(file.stats().writes, 1);
  ::munmap(unmapped, 64 * KiB);
}

TEST_P(NvmeFileTest, RequestedEngineIsTheOneUsed) {
  TempDir dir;
  NvmeFile file(dir.path(), 64 * KiB, GetParam());
  Engine expected = GetParam() == Engine::io_uring && kernel_allows_io_uring() ? Engine::io_uring : Engine::threads;
  EXPECT_EQ(file.engine(), expected);
  EXPECT_EQ(file.dir(), dir.path());
  std::cout << "[ NVMe     ] asked for " << engine_name(GetParam()) << ", runs on " << engine_name(file.engine())
            << ", O_DIRECT " << (file.direct() ? "on" : "refused") << " in " << dir.path() << "\n";
  RecordProperty("engine", engine_name(file.engine()));
  RecordProperty("direct", file.direct() ? "true" : "false");
}

INSTANTIATE_TEST_SUITE_P(Nvme, NvmeFileTest, ::testing::Values(Engine::io_uring, Engine::threads),
                         [](const ::testing::TestParamInfo<Engine>& info) { return engine_name(info.param); });

TEST(NvmeFile, MissingDirectoryIsAnErrorNamingIt) {
  TempDir dir;
  std::filesystem::path missing = dir / "no-such-dir";
  std::string msg = error_of([&] { NvmeFile file(missing, 1 * MiB); });
  EXPECT_CONTAINS(msg, missing.string());
  EXPECT_CONTAINS(msg, "memory.nvme_dir");
}

TEST(NvmeFile, UnwritableDirectoryIsAnErrorNamingIt) {
  TempDir dir;
  std::filesystem::path readonly = dir / "readonly";
  std::filesystem::create_directory(readonly);
  std::filesystem::permissions(readonly, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  // Root writes through permission bits; sysfs refuses new files to everyone.
  if (::access(readonly.c_str(), W_OK) == 0) readonly = "/sys";
  ASSERT_TRUE(std::filesystem::is_directory(readonly));
  std::string msg = error_of([&] { NvmeFile file(readonly, 1 * MiB); });
  EXPECT_CONTAINS(msg, readonly.string());
}

TEST(NvmeFile, OverBudgetIsAnErrorNamingTheDirectory) {
  TempDir dir;
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  ctx.tier(Tier::nvme).set_budget(1 * MiB);
  std::string msg = error_of([&] { NvmeFile file(dir.path(), 1 * MiB + 1); });
  EXPECT_CONTAINS(msg, dir.path().string());
  EXPECT_CONTAINS(msg, "out of nvme memory");
  EXPECT_EQ(ctx.tier(Tier::nvme).used(), 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

TEST(NvmeFileDeathTest, MisalignedOrOutOfRangeRequestsAreChecks) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  TempDir dir;
  auto request = [&](uint64_t shift, uint64_t bytes, uint64_t offset) {
    NvmeFile file(dir.path(), 1 * MiB);
    IoBuffer b(1 * MiB);
    file.wait(file.read(static_cast<char*>(b.data()) + shift, bytes, offset));
  };
  EXPECT_DEATH(request(512, 4096, 0), "buffer .* is not aligned to 4096 bytes");
  EXPECT_DEATH(request(0, 1000, 0), "read of 1000 bytes at offset 0: both must be multiples of 4096");
  EXPECT_DEATH(request(0, 4096, 512), "read of 4096 bytes at offset 512: both must be multiples of 4096");
  EXPECT_DEATH(request(0, 8192, 1 * MiB - 4096), "runs past the end of the 1048576-byte file");
  EXPECT_DEATH(request(0, 4096, 2 * MiB), "runs past the end");
}

TEST(IoBuffer, IsAlignedAndAccountedOnTheHostTier) {
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  Allocator& host = ctx.tier(Tier::host);
  {
    IoBuffer a(5000);
    EXPECT_EQ(a.bytes(), 2 * kIoAlign);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kIoAlign, 0u);
    EXPECT_EQ(host.used(), 2 * kIoAlign);

    IoBuffer b(std::move(a));
    EXPECT_EQ(a.data(), nullptr);
    EXPECT_EQ(a.bytes(), 0u);
    EXPECT_EQ(b.bytes(), 2 * kIoAlign);
    EXPECT_EQ(host.used(), 2 * kIoAlign);

    IoBuffer c(kIoAlign);
    EXPECT_EQ(host.used(), 3 * kIoAlign);
    c = std::move(b);  // c's own page goes back
    EXPECT_EQ(c.bytes(), 2 * kIoAlign);
    EXPECT_EQ(host.used(), 2 * kIoAlign);

    IoBuffer empty(0);
    EXPECT_EQ(empty.data(), nullptr);
    EXPECT_EQ(host.used(), 2 * kIoAlign);
  }
  EXPECT_EQ(host.used(), 0u);
}

TEST(IoBuffer, OverBudgetIsAnError) {
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  ctx.tier(Tier::host).set_budget(64 * KiB);
  EXPECT_CONTAINS(error_of([] { IoBuffer b(64 * KiB + 1); }), "out of host memory");
  EXPECT_EQ(ctx.tier(Tier::host).used(), 0u);
}

TEST(DiskThroughput, MeasuresBothDirectionsOfASixteenMiBFile) {
  TempDir dir;
  DiskThroughput t = measure_sequential_throughput(dir.path(), 16 * MiB);
  EXPECT_TRUE(std::isfinite(t.write_bytes_per_s) && t.write_bytes_per_s > 0.0) << t.write_bytes_per_s;
  EXPECT_TRUE(std::isfinite(t.read_bytes_per_s) && t.read_bytes_per_s > 0.0) << t.read_bytes_per_s;
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
  std::cout << "[ NVMe     ] " << dir.path() << ": sequential write " << format_bytes(t.write_bytes_per_s)
            << "/s, read " << format_bytes(t.read_bytes_per_s) << "/s (1 MiB O_DIRECT requests, one at a time)\n";
  RecordProperty("write_bytes_per_s", std::to_string(t.write_bytes_per_s));
  RecordProperty("read_bytes_per_s", std::to_string(t.read_bytes_per_s));
}

TEST(DiskThroughput, MissingDirectoryIsAnErrorNamingIt) {
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { measure_sequential_throughput(dir / "missing", 1 * MiB); }),
                  (dir / "missing").string());
}

}  // namespace
}  // namespace loom
