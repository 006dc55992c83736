#include <gtest/gtest.h>

#include <numeric>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

std::string xxh3_hex(const void* data, size_t bytes) {
  FileHasher h(Checksum::xxh3_128);
  h.update(data, bytes);
  return h.hex_digest();
}

// A file of three tensors, "a" (3 MiB, so reads span several blocks), an
// empty "e" and "b", written in uneven parts; their digests by name.
struct TestFile {
  fs::path path;
  std::vector<float> a, b;
  std::map<std::string, std::string, std::less<>> digests;
};

TestFile write_test_file(const TempDir& dir) {
  TestFile f;
  f.path = dir / "t.safetensors";
  f.a.resize(3 << 18);
  f.b.resize(1000);
  std::iota(f.a.begin(), f.a.end(), 0.5f);
  std::iota(f.b.begin(), f.b.end(), -7.0f);
  const int64_t na = static_cast<int64_t>(f.a.size()), nb = static_cast<int64_t>(f.b.size());
  SafetensorsWriter w(f.path, {{"a", DType::f32, {na}}, {"e", DType::f32, {0}}, {"b", DType::f32, {nb}}});
  w.write_part("a", f.a.data(), 1000 * 4);
  w.write_part("a", f.a.data() + 1000, (f.a.size() - 1000) * 4);
  w.write_part("b", f.b.data(), 4 * 4);
  w.write_part("b", f.b.data() + 4, (f.b.size() - 4) * 4);
  w.finish();
  const std::vector<std::string>& d = w.tensor_digests();
  EXPECT_EQ(d, (std::vector<std::string>{xxh3_hex(f.a.data(), f.a.size() * 4), xxh3_hex(nullptr, 0),
                                         xxh3_hex(f.b.data(), f.b.size() * 4)}));
  f.digests = {{"a", d.at(0)}, {"e", d.at(1)}, {"b", d.at(2)}};
  return f;
}

TEST(TensorVerifier, ReadsInAnyOrderVerifyAndReturnTheBytes) {
  TempDir dir;
  const TestFile f = write_test_file(dir);
  const SafetensorsReader reader(f.path);
  TensorVerifier v(reader, f.digests);
  // "a" front to back in uneven reads, "b" from its middle, then its start.
  std::vector<float> a(f.a.size()), b(f.b.size());
  for (size_t at = 0; at < a.size();) {
    const size_t n = std::min<size_t>(a.size() - at, 300001);
    v.read_range("a", at * 4, a.data() + at, n * 4);
    at += n;
  }
  v.read_range("b", 500 * 4, b.data() + 500, 500 * 4);
  v.read_range("b", 0, b.data(), 500 * 4);
  v.finish();
  EXPECT_EQ(a, f.a);
  EXPECT_EQ(b, f.b);
}

TEST(TensorVerifier, ACorruptTensorIsRefusedByNameEvenWhenReadInPart) {
  TempDir dir;
  const TestFile f = write_test_file(dir);
  const uint64_t b_at = SafetensorsReader(f.path).entry("b").offset;
  testing::flip_bit(f.path, static_cast<std::streamoff>(b_at + 600 * 4));
  const SafetensorsReader reader(f.path);
  {
    // Read through the corrupt byte: refused once the tensor is hashed whole.
    TensorVerifier v(reader, f.digests);
    std::vector<float> b(f.b.size());
    const std::string error = error_of([&] { v.read_range("b", 0, b.data(), b.size() * 4); });
    EXPECT_CONTAINS(error, f.path.string());
    EXPECT_CONTAINS(error, "tensor 'b' has xxh3_128");
    EXPECT_CONTAINS(error, "corrupt");
  }
  {
    // Only bytes before it: finish() hashes the rest and refuses the tensor.
    TensorVerifier v(reader, f.digests);
    std::vector<float> a(f.a.size()), b(100);
    v.read_range("a", 0, a.data(), a.size() * 4);
    v.read_range("b", 0, b.data(), b.size() * 4);
    EXPECT_CONTAINS(error_of([&] { v.finish(); }), "tensor 'b' has xxh3_128");
  }
  {
    // A tensor never read is never hashed: "a" alone loads.
    TensorVerifier v(reader, f.digests);
    std::vector<float> a(f.a.size());
    v.read_range("a", 0, a.data(), a.size() * 4);
    v.finish();
    EXPECT_EQ(a, f.a);
  }
}

TEST(TensorVerifier, DigestsMustNameExactlyTheFilesTensors) {
  TempDir dir;
  const TestFile f = write_test_file(dir);
  const SafetensorsReader reader(f.path);
  auto missing = f.digests;
  missing.erase("b");
  EXPECT_CONTAINS(error_of([&] { TensorVerifier(reader, missing); }), "tensor 'b' that its manifest gives no checksum");
  auto extra = f.digests;
  extra["c"] = f.digests.at("a");
  EXPECT_CONTAINS(error_of([&] { TensorVerifier(reader, extra); }), "lacks tensor 'c'");
}

}  // namespace
}  // namespace loom
