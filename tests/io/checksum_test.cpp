#include <gtest/gtest.h>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

std::string hex_of(Checksum c, std::string_view bytes) {
  FileHasher h(c);
  h.update(bytes.data(), bytes.size());
  return h.hex_digest();
}

// Reference digests printed by the Python xxhash package
// (xxhash.xxh3_128_hexdigest), in the canonical form xxhsum prints.
TEST(Checksum, Xxh3MatchesTheReferenceImplementation) {
  EXPECT_EQ(hex_of(Checksum::xxh3_128, ""), "99aa06d3014798d86001c324468d497f");
  EXPECT_EQ(hex_of(Checksum::xxh3_128, "abc"), "06b05ab6733a618578af5f94892f3950");
  EXPECT_EQ(hex_of(Checksum::xxh3_128, std::string(1000000, 'a')), "a545df8e384a9579b1fd6fae5285c4eb");
  EXPECT_EQ(hex_of(Checksum::sha256, "abc"), sha256_hex("abc"));
}

TEST(Checksum, IncrementalUpdatesInAnyChunkingMatchOneShot) {
  std::string message;
  for (int i = 0; i < 1000; ++i) message += static_cast<char>(i * 7 + 3);
  EXPECT_EQ(hex_of(Checksum::xxh3_128, message), "6bcc7eff62da44c26c4f14bd97bd9e82");
  for (Checksum c : {Checksum::xxh3_128, Checksum::sha256}) {
    const std::string expected = hex_of(c, message);
    for (size_t chunk : {1, 3, 63, 64, 65, 200, 240, 1000}) {
      FileHasher h(c);
      for (size_t pos = 0; pos < message.size(); pos += chunk)
        h.update(message.data() + pos, std::min(chunk, message.size() - pos));
      EXPECT_EQ(h.hex_digest(), expected) << checksum_name(c) << " in chunks of " << chunk;
    }
  }
}

TEST(Checksum, FileChecksumStreamsTheFile) {
  TempDir dir;
  std::string content(3 * 1024 * 1024 + 17, 'a');  // spans several read chunks
  for (size_t i = 0; i < content.size(); i += 4097) content[i] = 'b';
  const auto path = dir.write("blob", content);
  for (Checksum c : {Checksum::xxh3_128, Checksum::sha256}) EXPECT_EQ(checksum_file(path, c), hex_of(c, content));
  EXPECT_CONTAINS(error_of([&] { checksum_file(dir / "missing", Checksum::xxh3_128); }),
                  (dir / "missing").string());
}

TEST(Checksum, DigestJsonRoundTripsAndRefusesMalformedEntries) {
  const FileDigest xxh{1000, Checksum::xxh3_128, hex_of(Checksum::xxh3_128, "x")};
  const FileDigest sha{7, Checksum::sha256, sha256_hex("x")};
  for (const FileDigest& d : {xxh, sha}) {
    const nlohmann::json j = digest_json(d);
    EXPECT_TRUE(j.contains(checksum_name(d.checksum))) << j.dump();
    EXPECT_EQ(parse_digest_json(j), d) << j.dump();
  }
  const std::string h32 = xxh.hex;
  for (const char* bad : {R"({"bytes": 1})", R"({"md5": "00", "bytes": 1})", R"({"xxh3_128": "00", "bytes": 1})",
                          R"([1, 2])"})
    EXPECT_FALSE(parse_digest_json(nlohmann::json::parse(bad)).has_value()) << bad;
  // The length of the other algorithm's digest, upper case, a negative size,
  // or a second checksum are refused too.
  EXPECT_FALSE(parse_digest_json({{"sha256", h32}, {"bytes", 1}}).has_value());
  std::string upper = h32;
  for (char& ch : upper) ch = static_cast<char>(std::toupper(ch));
  EXPECT_FALSE(parse_digest_json({{"xxh3_128", upper}, {"bytes", 1}}).has_value());
  EXPECT_FALSE(parse_digest_json({{"xxh3_128", h32}, {"bytes", -1}}).has_value());
  EXPECT_FALSE(parse_digest_json({{"xxh3_128", h32}, {"sha256", sha.hex}, {"bytes", 1}}).has_value());
}

}  // namespace
}  // namespace loom
