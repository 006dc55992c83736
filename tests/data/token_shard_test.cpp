#include <gtest/gtest.h>

#include <cstring>

#include "data/data_test_util.h"
#include "loom/data.h"

namespace loom {
namespace {

using testing::error_of;
using testing::expect_mentions;
using testing::TempDir;

// A shard laid out the way llm.c's data_common.py writes it with numpy:
// np.zeros(256, int32) with magic, version and count, .tobytes(), then the
// tokens' .tobytes() as uint16 (GPT-2) or uint32 (LLaMA-3), little-endian.
std::string llmc_shard_bytes(int32_t magic, int32_t version, const std::vector<uint32_t>& tokens, int width) {
  std::string bytes(1024 + tokens.size() * width, '\0');
  auto put = [&](size_t at, uint32_t v, int n) {
    for (int b = 0; b < n; ++b) bytes[at + b] = static_cast<char>((v >> (8 * b)) & 0xFF);
  };
  put(0, static_cast<uint32_t>(magic), 4);
  put(4, static_cast<uint32_t>(version), 4);
  put(8, static_cast<uint32_t>(tokens.size()), 4);
  for (size_t i = 0; i < tokens.size(); ++i) put(1024 + i * width, tokens[i], width);
  return bytes;
}

std::vector<int32_t> read_all(const TokenShard& shard) {
  std::vector<int32_t> out(shard.size());
  shard.read(0, out);
  return out;
}

TEST(TokenShard, ReadsShardsWrittenByLlmcUnchanged) {
  TempDir dir;
  const std::vector<uint32_t> gpt2 = {50256, 464, 0, 65535, 13, 198};
  testing::write_bytes(dir / "gpt2.bin", llmc_shard_bytes(20240520, 1, gpt2, 2));
  TokenShard a(dir / "gpt2.bin");
  EXPECT_EQ(a.size(), 6);
  EXPECT_EQ(a.token_bytes(), 2);
  EXPECT_EQ(read_all(a), std::vector<int32_t>(gpt2.begin(), gpt2.end()));
  EXPECT_EQ(a.max_token_id(), 65535);

  const std::vector<uint32_t> llama3 = {128000, 9906, 1917, 128001};
  testing::write_bytes(dir / "llama3.bin", llmc_shard_bytes(20240801, 7, llama3, 4));
  TokenShard b(dir / "llama3.bin");
  EXPECT_EQ(b.token_bytes(), 4);
  EXPECT_EQ(read_all(b), std::vector<int32_t>(llama3.begin(), llama3.end()));
  EXPECT_EQ(b.token(2), 1917);
}

TEST(TokenShard, WritesLlmcsGpt2LayoutByteForByte) {
  TempDir dir;
  const std::vector<int32_t> tokens = {50256, 464, 0, 65535, 13, 198};
  write_token_shard(dir / "s.bin", tokens, 65536);
  EXPECT_EQ(testing::read_bytes(dir / "s.bin"),
            llmc_shard_bytes(20240520, 1, std::vector<uint32_t>(tokens.begin(), tokens.end()), 2));
}

TEST(TokenShard, WideVocabulariesUseVersionTwo) {
  TempDir dir;
  const std::vector<int32_t> tokens = {70000, 1, 99999, 65536};
  write_token_shard(dir / "w.bin", tokens, 100000);
  EXPECT_EQ(testing::read_bytes(dir / "w.bin"),
            llmc_shard_bytes(20240520, 2, std::vector<uint32_t>(tokens.begin(), tokens.end()), 4));
  TokenShard shard(dir / "w.bin");
  EXPECT_EQ(read_all(shard), tokens);
  EXPECT_EQ(shard.max_token_id(), 99999);
}

TEST(TokenShard, RoundTripsLargeAndEmptyShards) {
  TempDir dir;
  std::vector<int32_t> tokens(100000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>((i * 7919) % 2048);
  write_token_shard(dir / "big.bin", tokens, 2048);
  TokenShard big(dir / "big.bin");
  EXPECT_EQ(read_all(big), tokens);
  std::vector<int32_t> middle(10);
  big.read(5000, middle);
  EXPECT_EQ(middle, std::vector<int32_t>(tokens.begin() + 5000, tokens.begin() + 5010));

  write_token_shard(dir / "empty.bin", {}, 2048);
  TokenShard empty(dir / "empty.bin");
  EXPECT_EQ(empty.size(), 0);
  EXPECT_EQ(empty.max_token_id(), -1);
}

TEST(TokenShard, WritingReplacesAtomicallyAndLeavesNoTemporaries) {
  TempDir dir;
  write_token_shard(dir / "s.bin", std::vector<int32_t>{1, 2, 3}, 10);
  write_token_shard(dir / "s.bin", std::vector<int32_t>{4, 5}, 10);
  EXPECT_EQ(read_all(TokenShard(dir / "s.bin")), (std::vector<int32_t>{4, 5}));
  int files = 0;
  for ([[maybe_unused]] const auto& entry : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1);
}

TEST(TokenShard, WriterRejectsTokensOutsideTheVocabulary) {
  TempDir dir;
  expect_mentions(error_of([&] {
                    write_token_shard(dir / "s.bin", std::vector<int32_t>{1, 2, 10, 3}, 10);
                  }),
                  {"s.bin", "token 2 is 10", "[0, 10)"});
  expect_mentions(error_of([&] { write_token_shard(dir / "s.bin", std::vector<int32_t>{-4}, 10); }), {"token 0 is -4"});
  expect_mentions(error_of([&] { write_token_shard(dir / "no/such/dir/s.bin", std::vector<int32_t>{1}, 10); }),
                  {"no/such/dir/s.bin"});
  EXPECT_FALSE(std::filesystem::exists(dir / "s.bin"));
}

TEST(TokenShard, CorruptFilesAreErrorsNamingFileAndProblem) {
  TempDir dir;
  const std::vector<uint32_t> tokens = {1, 2, 3, 4};
  auto open_error = [&](const std::string& name, const std::string& bytes) {
    testing::write_bytes(dir / name, bytes);
    return error_of([&] { TokenShard shard(dir / name); });
  };
  expect_mentions(open_error("magic.bin", llmc_shard_bytes(12345, 1, tokens, 2)), {"magic.bin", "bad magic 12345"});
  expect_mentions(open_error("version.bin", llmc_shard_bytes(20240520, 3, tokens, 2)),
                  {"version.bin", "unknown version 3"});
  std::string full = llmc_shard_bytes(20240520, 1, tokens, 2);
  expect_mentions(open_error("truncated.bin", full.substr(0, full.size() - 3)),
                  {"truncated.bin", "truncated", "4 tokens", "expected 1032 bytes, got 1029"});
  expect_mentions(open_error("long.bin", full + "xx"), {"long.bin", "expected 1032 bytes, got 1034"});
  expect_mentions(open_error("header.bin", full.substr(0, 100)), {"header.bin", "100 bytes", "1024-byte header"});
  expect_mentions(open_error("negative.bin", llmc_shard_bytes(20240520, 1, {}, 2).replace(8, 4, "\xFF\xFF\xFF\xFF")),
                  {"negative.bin", "negative"});
  expect_mentions(error_of([&] { TokenShard shard(dir / "missing.bin"); }), {"missing.bin", "does not exist"});
  expect_mentions(error_of([&] { TokenShard shard(dir.path()); }), {"not a regular file"});
}

TEST(TokenShard, MovesKeepTheMapping) {
  TempDir dir;
  write_token_shard(dir / "a.bin", std::vector<int32_t>{7, 8, 9}, 10);
  write_token_shard(dir / "b.bin", std::vector<int32_t>{1}, 10);
  TokenShard a(dir / "a.bin");
  TokenShard moved(std::move(a));
  EXPECT_EQ(moved.token(2), 9);
  TokenShard b(dir / "b.bin");
  b = std::move(moved);
  EXPECT_EQ(b.size(), 3);
  EXPECT_EQ(b.token(0), 7);
  EXPECT_EQ(b.path(), dir / "a.bin");
}

}  // namespace
}  // namespace loom
