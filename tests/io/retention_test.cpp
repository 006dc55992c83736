#include <gtest/gtest.h>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

// Above the largest pid_max Linux allows (2^22), so never a live process.
constexpr int kDeadPid = 4194305;

std::vector<int64_t> steps_in(const fs::path& root) {
  std::vector<int64_t> steps;
  for (const CheckpointEntry& c : list_checkpoints(root)) steps.push_back(c.step);
  return steps;
}

void make_checkpoints(const TempDir& root, std::initializer_list<int64_t> steps) {
  for (int64_t s : steps) root.write(checkpoint_dir_name(s) + "/model.safetensors", "w");
}

TEST(Retention, NamesSortLikeSteps) {
  EXPECT_EQ(checkpoint_dir_name(10), "step_00000010");
  EXPECT_EQ(checkpoint_dir_name(123456789), "step_123456789");
}

TEST(Retention, ListsOnlyStepDirectoriesInStepOrder) {
  TempDir root;
  make_checkpoints(root, {10, 2, 123456789});
  root.write("step_00000005", "a file, not a checkpoint");
  root.write("step_abc/x", "");
  root.write(str(".tmp-step_00000011-", kDeadPid, "/x"), "");
  write_latest(root.path(), "step_00000010");
  EXPECT_EQ(steps_in(root.path()), (std::vector<int64_t>{2, 10, 123456789}));
  EXPECT_TRUE(list_checkpoints(root / "does-not-exist").empty());
}

TEST(Retention, KeepsTheNewestAndTheOneLatestPointsTo) {
  TempDir root;
  make_checkpoints(root, {1, 2, 3, 4, 5});
  write_latest(root.path(), checkpoint_dir_name(2));
  auto removed = apply_retention(root.path(), 2);
  EXPECT_EQ(steps_in(root.path()), (std::vector<int64_t>{2, 4, 5}));
  EXPECT_EQ(removed, (std::vector<fs::path>{root / "step_00000001", root / "step_00000003"}));

  write_latest(root.path(), checkpoint_dir_name(5));
  apply_retention(root.path(), 1);
  EXPECT_EQ(steps_in(root.path()), (std::vector<int64_t>{5}));
}

TEST(Retention, KeepLastZeroKeepsEverything) {
  TempDir root;
  make_checkpoints(root, {1, 2, 3});
  EXPECT_TRUE(apply_retention(root.path(), 0).empty());
  EXPECT_EQ(steps_in(root.path()), (std::vector<int64_t>{1, 2, 3}));
}

TEST(Retention, RemovesOnlyStaleTemporaryDirectories) {
  TempDir root;
  make_checkpoints(root, {1});
  auto old = fs::file_time_type::clock::now() - std::chrono::hours(2);
  std::string dead_old = str(".tmp-step_00000002-", kDeadPid);
  std::string dead_recent = str(".tmp-step_00000003-", kDeadPid);
  std::string ours_old = str(".tmp-step_00000004-", ::getpid());
  std::string live_old = ".tmp-step_00000005-1";  // pid 1 is always alive
  std::string dead_file = str(".tmp-latest-", kDeadPid);
  for (const std::string& name : {dead_old, dead_recent, ours_old, live_old}) root.write(name + "/x", "partial");
  root.write(dead_file, "step_00000002\n");
  for (const std::string& name : {dead_old, ours_old, live_old, dead_file}) fs::last_write_time(root / name, old);

  auto removed = apply_retention(root.path(), 5);
  std::sort(removed.begin(), removed.end());
  EXPECT_EQ(removed, (std::vector<fs::path>{root / dead_file, root / dead_old}));
  EXPECT_TRUE(fs::exists(root / dead_recent));
  EXPECT_TRUE(fs::exists(root / ours_old));
  EXPECT_TRUE(fs::exists(root / live_old));
  EXPECT_EQ(steps_in(root.path()), (std::vector<int64_t>{1}));
}

TEST(Retention, LatestPointer) {
  TempDir root;
  EXPECT_EQ(read_latest(root.path()), std::nullopt);
  write_latest(root.path(), "step_00000007");
  EXPECT_EQ(read_file(root / kLatestFile), "step_00000007\n");
  EXPECT_EQ(read_latest(root.path()), root / "step_00000007");
  root.write(kLatestFile, "../elsewhere\n");
  std::string msg = error_of([&] { read_latest(root.path()); });
  EXPECT_CONTAINS(msg, (root / kLatestFile).string());
  EXPECT_CONTAINS(msg, "not a checkpoint directory name");
}

}  // namespace
}  // namespace loom
