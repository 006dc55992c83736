#include <gtest/gtest.h>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

// FIPS 180-2 appendix B known answers.
TEST(Sha256, FipsKnownAnswers) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Lengths around the 55/56/64-byte padding boundaries (values from Python's hashlib).
TEST(Sha256, PaddingBoundaries) {
  EXPECT_EQ(sha256_hex(std::string(55, 'a')), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  EXPECT_EQ(sha256_hex(std::string(63, 'a')), "7d3e74a05d7db15bce4ad9ec0658ea98e3f06eeecf16b4c6fff2da457ddc2f34");
  EXPECT_EQ(sha256_hex(std::string(64, 'a')), "ffe054fe7ae0cb6dc65c3af9b61d5209f439851db43d0ba5997337df154668eb");
  EXPECT_EQ(sha256_hex(std::string(65, 'a')), "635361c48bb9eab14198e76ea8ab7f1a41685d6ad62aa9146d301d4f17eb0ae0");
  EXPECT_EQ(sha256_hex(std::string(119, 'a')), "31eba51c313a5c08226adf18d4a359cfdfd8d2e816b13f4af952f7ea6584dcfb");
  EXPECT_EQ(sha256_hex(std::string(120, 'a')), "2f3d335432c70b580af0e8e1b3674a7c020d683aa5f73aaaedfdc55af904c21c");
}

TEST(Sha256, IncrementalUpdatesInAnyChunkingMatchOneShot) {
  std::string message;
  for (int i = 0; i < 1000; ++i) message += static_cast<char>(i * 7 + 3);
  const std::string expected = sha256_hex(message);
  for (size_t chunk : {1, 3, 63, 64, 65, 200}) {
    Sha256 h;
    for (size_t pos = 0; pos < message.size(); pos += chunk) h.update(std::string_view(message).substr(pos, chunk));
    EXPECT_EQ(h.hex_digest(), expected) << "chunk " << chunk;
  }
}

TEST(Sha256, FileDigestStreamsTheFile) {
  TempDir dir;
  std::string content(3 * 1024 * 1024 + 17, 'a');  // spans several read chunks
  for (size_t i = 0; i < content.size(); i += 4097) content[i] = 'b';
  auto path = dir.write("blob", content);
  EXPECT_EQ(sha256_file(path), sha256_hex(content));
  EXPECT_CONTAINS(error_of([&] { sha256_file(dir / "missing"); }), (dir / "missing").string());
}

TEST(Sha256DeathTest, ReuseAfterFinishIsABug) {
  Sha256 h;
  h.update("abc");
  h.finish();
  EXPECT_DEATH(h.update("x"), "after finish");
}

}  // namespace
}  // namespace loom
