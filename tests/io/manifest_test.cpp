#include <gtest/gtest.h>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

std::string xxh3_hex(std::string_view bytes) {
  FileHasher h(Checksum::xxh3_128);
  h.update(bytes.data(), bytes.size());
  return h.hex_digest();
}

// A checkpoint-like directory: a nested file, a top-level one, a manifest.
fs::path make_checkpoint(const TempDir& root) {
  fs::path dir = root / "step_00000010";
  root.write("step_00000010/model.safetensors", std::string(1000, 'w'));
  root.write("step_00000010/optim/rank_0.safetensors", "moments");
  write_manifest(dir, {{"step", 10}, {"config", {{"model", {{"n_layer", 2}}}}}});
  return dir;
}

TEST(Manifest, RecordsSizeAndDigestOfEveryFileAndTheCallersFields) {
  TempDir root;
  fs::path dir = make_checkpoint(root);
  Manifest m = read_manifest(dir);
  EXPECT_EQ(m.fields["step"], 10);
  EXPECT_EQ(m.fields["config"]["model"]["n_layer"], 2);
  EXPECT_FALSE(m.fields.contains("files"));
  ASSERT_EQ(m.files.size(), 2u);
  EXPECT_EQ(m.files.at("model.safetensors"), (FileDigest{1000, Checksum::xxh3_128, xxh3_hex(std::string(1000, 'w'))}));
  EXPECT_EQ(m.files.at("optim/rank_0.safetensors"), (FileDigest{7, Checksum::xxh3_128, xxh3_hex("moments")}));
  Manifest verified = verify_checkpoint_dir(dir);
  EXPECT_EQ(verified.files, m.files);

  // Rewriting covers new files but never lists the manifest itself.
  root.write("step_00000010/extra.txt", "x");
  EXPECT_EQ(write_manifest(dir, {{"step", 10}}).files.size(), 3u);
}

TEST(Manifest, MissingFileIsNamed) {
  TempDir root;
  fs::path dir = make_checkpoint(root);
  fs::remove(dir / "optim/rank_0.safetensors");
  std::string msg = error_of([&] { verify_checkpoint_dir(dir); });
  EXPECT_CONTAINS(msg, dir.string());
  EXPECT_CONTAINS(msg, "missing 'optim/rank_0.safetensors'");
}

TEST(Manifest, WrongSizeIsNamed) {
  TempDir root;
  fs::path dir = make_checkpoint(root);
  root.write("step_00000010/model.safetensors", std::string(999, 'w'));
  std::string msg = error_of([&] { verify_checkpoint_dir(dir, /*checksums=*/false); });
  EXPECT_CONTAINS(msg, "'model.safetensors' is 999 bytes but the manifest says 1000");
}

TEST(Manifest, WrongChecksumIsNamedAndSkippedWhenOnlySizesAreChecked) {
  TempDir root;
  fs::path dir = make_checkpoint(root);
  std::string flipped(1000, 'w');
  flipped[500] = 'v';
  root.write("step_00000010/model.safetensors", flipped);
  std::string msg = error_of([&] { verify_checkpoint_dir(dir); });
  EXPECT_CONTAINS(msg, dir.string());
  EXPECT_CONTAINS(msg, str("'model.safetensors' has xxh3_128 ", xxh3_hex(flipped), " but the manifest says ",
                           xxh3_hex(std::string(1000, 'w'))));
  verify_checkpoint_dir(dir, /*checksums=*/false);
}

// Checkpoints written before XXH3 list SHA-256 digests; they still verify,
// and a corrupt file under one is still refused.
TEST(Manifest, SHA256EntriesOfEarlierCheckpointsVerify) {
  TempDir root;
  const fs::path dir = root / "step_00000010";
  root.write("step_00000010/model.safetensors", std::string(1000, 'w'));
  write_manifest(dir, {{"step", 10}},
                 {{"model.safetensors", FileDigest{1000, Checksum::sha256, sha256_hex(std::string(1000, 'w'))}}});
  EXPECT_CONTAINS(read_file(dir / kManifestFile), "\"sha256\"");
  EXPECT_EQ(verify_checkpoint_dir(dir).files.at("model.safetensors").checksum, Checksum::sha256);
  std::string flipped(1000, 'w');
  flipped[7] = 'v';
  root.write("step_00000010/model.safetensors", flipped);
  EXPECT_CONTAINS(error_of([&] { verify_checkpoint_dir(dir); }),
                  str("'model.safetensors' has sha256 ", sha256_hex(flipped), " but the manifest says"));
}

TEST(Manifest, MissingOrCorruptManifestIsNamed) {
  TempDir root;
  fs::path dir = make_checkpoint(root);
  std::string good = read_file(dir / kManifestFile);

  fs::remove(dir / kManifestFile);
  std::string msg = error_of([&] { verify_checkpoint_dir(dir); });
  EXPECT_CONTAINS(msg, str("checkpoint directory '", dir.string(), "' has no manifest.json"));

  root.write("step_00000010/manifest.json", good.substr(0, good.size() / 2));
  EXPECT_CONTAINS(error_of([&] { verify_checkpoint_dir(dir); }), "manifest.json of checkpoint '" + dir.string() + "' is corrupt");

  root.write("step_00000010/manifest.json", R"({"step": 1})");
  EXPECT_CONTAINS(error_of([&] { read_manifest(dir); }), "no \"files\" object");

  root.write("step_00000010/manifest.json", R"({"files": {"../../etc/passwd": {"sha256": "00", "bytes": 1}}})");
  EXPECT_CONTAINS(error_of([&] { read_manifest(dir); }), "'../../etc/passwd' is not a plain relative path");

  root.write("step_00000010/manifest.json", R"({"files": {"a": {"sha256": "xyz", "bytes": 1}}})");
  EXPECT_CONTAINS(error_of([&] { read_manifest(dir); }), "entry of 'a'");

  EXPECT_CONTAINS(error_of([&] { verify_checkpoint_dir(root / "step_00000099"); }), "does not exist");
}

}  // namespace
}  // namespace loom
