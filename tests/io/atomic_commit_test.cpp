#include <gtest/gtest.h>
#include <sys/mount.h>

#include <cerrno>
#include <cstring>
#include <fstream>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

std::vector<std::string> names_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

TEST(AtomicDirWriter, CommitPublishesTheWholeDirectory) {
  TempDir root;
  fs::path final_dir = root / "step_00000010";
  {
    AtomicDirWriter w(final_dir);
    EXPECT_EQ(w.temp_dir().filename().string(), str(".tmp-step_00000010-", ::getpid()));
    w.write_file("model.bin", "weights");
    w.write_file("optim/rank0.bin", "moments");
    EXPECT_FALSE(fs::exists(final_dir)) << "nothing is visible before commit";
    w.commit();
  }
  EXPECT_EQ(read_file(final_dir / "model.bin"), "weights");
  EXPECT_EQ(read_file(final_dir / "optim/rank0.bin"), "moments");
  EXPECT_EQ(names_in(root.path()), std::vector<std::string>{"step_00000010"});
}

TEST(AtomicDirWriter, ExceptionMidWriteLeavesThePreviousDirectoryIntact) {
  TempDir root;
  fs::path final_dir = root / "step_00000010";
  {
    AtomicDirWriter w(final_dir);
    w.write_file("model.bin", "old weights");
    w.commit();
  }
  std::vector<float> big(1024, 1.0f);
  try {
    AtomicDirWriter w(final_dir);
    SafetensorsWriter st(w.path("model.safetensors"), {{"a", DType::f32, {1024}}, {"b", DType::f32, {1024}}});
    st.write("a", big.data());
    throw std::runtime_error("simulated crash between tensors");
  } catch (const std::runtime_error&) {
  }
  EXPECT_EQ(read_file(final_dir / "model.bin"), "old weights");
  EXPECT_EQ(names_in(final_dir), std::vector<std::string>{"model.bin"});
  EXPECT_EQ(names_in(root.path()), std::vector<std::string>{"step_00000010"}) << "no temporary directory is left";
}

TEST(AtomicDirWriter, CommitOverAnExistingDirectoryReplacesIt) {
  TempDir root;
  fs::path final_dir = root / "export";
  {
    AtomicDirWriter w(final_dir);
    w.write_file("a", "1");
    w.write_file("stale", "only in the old one");
    w.commit();
  }
  {
    AtomicDirWriter w(final_dir / "");  // a trailing slash names the same directory
    w.write_file("a", "2");
    w.commit();
  }
  EXPECT_EQ(names_in(final_dir), std::vector<std::string>{"a"});
  EXPECT_EQ(read_file(final_dir / "a"), "2");
  EXPECT_EQ(names_in(root.path()), std::vector<std::string>{"export"});
}

TEST(AtomicDirWriter, CreatesMissingParentsAndRejectsEscapingPaths) {
  TempDir root;
  AtomicDirWriter w(root / "runs/a/step_00000001");
  w.write_file("x", "y");
  w.commit();
  EXPECT_TRUE(fs::exists(root / "runs/a/step_00000001/x"));
  EXPECT_CONTAINS(error_of([&] { AtomicDirWriter bad(root / ".."); }), "needs a final name");
  EXPECT_CONTAINS(error_of([&] { AtomicDirWriter bad(root / "."); }), "needs a final name");
  EXPECT_CONTAINS(error_of([&] { AtomicDirWriter bad("/"); }), "needs a final name");
  EXPECT_CONTAINS(error_of([&] { write_file_atomic(root / "..", "x"); }), "needs a final name");
}

TEST(AtomicDirWriterDeathTest, PathsOutsideTheDirectoryAreABug) {
  TempDir root;
  AtomicDirWriter w(root / "d");
  EXPECT_DEATH(w.path("../outside"), "escapes the directory");
}

TEST(WriteFileAtomic, ReplacesContentAndLeavesNoTemporaryFile) {
  TempDir root;
  write_file_atomic(root / "latest", "step_00000001\n");
  write_file_atomic(root / "latest", "step_00000002\n");
  EXPECT_EQ(read_file(root / "latest"), "step_00000002\n");
  EXPECT_EQ(names_in(root.path()), std::vector<std::string>{"latest"});
  std::string msg = error_of([&] { write_file_atomic(root / "missing/latest", "x"); });
  EXPECT_CONTAINS(msg, (root / "missing").string());
  EXPECT_CONTAINS(error_of([&] { read_file(root / "nope"); }), (root / "nope").string());
}

// A small tmpfs is a real full disk. Mounting needs CAP_SYS_ADMIN (root on
// loom's development and CI machines); without it the test is skipped.
class TmpfsMount {
 public:
  TmpfsMount(const fs::path& where, size_t bytes) : where_(where) {
    fs::create_directories(where);
    if (::mount("tmpfs", where.c_str(), "tmpfs", 0, str("size=", bytes).c_str()) == 0)
      mounted_ = true;
    else
      error_ = std::strerror(errno);
  }
  ~TmpfsMount() {
    if (mounted_) ::umount2(where_.c_str(), MNT_DETACH);
  }
  bool mounted() const { return mounted_; }
  const std::string& error() const { return error_; }

 private:
  fs::path where_;
  bool mounted_ = false;
  std::string error_;
};

TEST(AtomicDirWriter, FullDiskIsAnErrorAndKeepsThePreviousCheckpoint) {
  TempDir root;
  fs::path disk = root / "disk";
  TmpfsMount mount(disk, 256 * 1024);
  if (!mount.mounted()) GTEST_SKIP() << "cannot mount a tmpfs to fill: " << mount.error();

  std::vector<float> small(4096, 1.0f);  // 16 KiB
  {
    AtomicDirWriter w(disk / "step_00000001");
    write_safetensors(w.path("model.safetensors"), {{"w", DType::f32, {4096}, small.data()}});
    write_manifest(w.temp_dir(), {{"step", 1}});
    w.commit();
  }
  write_latest(disk, "step_00000001");

  std::vector<float> big(128 * 1024, 2.0f);  // 512 KiB: more than the disk holds
  std::string msg = error_of([&] {
    AtomicDirWriter w(disk / "step_00000002");
    write_safetensors(w.path("model.safetensors"), {{"w", DType::f32, {128 * 1024}, big.data()}});
    w.commit();
  });
  EXPECT_CONTAINS(msg, "disk full");
  EXPECT_CONTAINS(msg, (disk / ".tmp-step_00000002-").string());
  EXPECT_CONTAINS(msg, "model.safetensors");

  EXPECT_EQ(names_in(disk), (std::vector<std::string>{"latest", "step_00000001"}));
  verify_checkpoint_dir(disk / "step_00000001");
  EXPECT_EQ(read_latest(disk), disk / "step_00000001");

  // The pointer file on a full disk: an Error, and the old pointer survives.
  std::ofstream(disk / "filler", std::ios::binary) << std::string(512 * 1024, 'x');
  EXPECT_CONTAINS(error_of([&] { write_latest(disk, "step_00000002"); }), "disk full");
  EXPECT_EQ(read_latest(disk), disk / "step_00000001");
  EXPECT_EQ(names_in(disk), (std::vector<std::string>{"filler", "latest", "step_00000001"}));
}

}  // namespace
}  // namespace loom
