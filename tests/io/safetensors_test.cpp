#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "test_util.h"
#include "loom/io.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A file with the given header text (unpadded, as given) and data section.
fs::path raw_file(const TempDir& dir, const std::string& header, const std::string& data,
                  const std::string& name = "raw.safetensors") {
  return dir.write(name, le64(header.size()) + header + data);
}

std::string floats(std::initializer_list<float> values) {
  std::string s(values.size() * 4, '\0');
  std::memcpy(s.data(), std::data(values), s.size());
  return s;
}

TEST(Safetensors, RoundTripsEveryDtypeShapeAndMetadata) {
  TempDir dir;
  std::vector<float> f32 = {1.5f, -2.0f, 3.25f, 0.0f, 1e-30f, 7.0f};
  std::vector<uint16_t> bf16 = {0x3f80, 0xc000, 0x7fc0};
  std::vector<uint16_t> f16 = {0x3c00, 0xbc00};
  std::vector<int32_t> i32 = {1, -2, 2147483647};
  std::vector<int64_t> i64 = {-9000000000LL};
  std::vector<uint8_t> u8 = {0, 255, 7, 9};
  std::vector<int8_t> i8 = {-127, 127, 0};
  float scalar = 42.0f;
  std::vector<SafetensorsTensor> tensors = {
      {"w.f32", DType::f32, {2, 3}, f32.data()},  {"w.bf16", DType::bf16, {3}, bf16.data()},
      {"w.f16", DType::f16, {1, 2}, f16.data()},  {"ids", DType::i32, {3}, i32.data()},
      {"count", DType::i64, {1}, i64.data()},     {"mask", DType::u8, {2, 2}, u8.data()},
      {"scalar", DType::f32, {}, &scalar},        {"empty", DType::f32, {0, 4}, nullptr},
      {"q", DType::i8, {3}, i8.data()},
  };
  auto path = dir / "all.safetensors";
  write_safetensors(path, tensors, {{"format", "pt"}, {"step", "10"}});

  SafetensorsReader r(path);
  ASSERT_EQ(r.entries().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = r.entries()[i];
    EXPECT_EQ(e.name, tensors[i].name) << "data order is the declared order";
    EXPECT_EQ(e.dtype, tensors[i].dtype);
    EXPECT_EQ(e.shape, tensors[i].shape);
    std::string bytes(e.bytes, '\0');
    r.read(e.name, bytes.data(), bytes.size());
    if (e.bytes) {
      EXPECT_EQ(std::memcmp(bytes.data(), tensors[i].data, e.bytes), 0) << e.name;
    }
  }
  EXPECT_EQ(r.entry("scalar").bytes, 4u);
  EXPECT_EQ(r.entry("empty").bytes, 0u);
  EXPECT_EQ(r.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "10"}}));

  // Header: __metadata__ first, padded with spaces so data starts 8-byte aligned.
  std::string file = read_file(path);
  uint64_t n = 0;
  std::memcpy(&n, file.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(file.substr(8, 15), "{\"__metadata__\"");
  EXPECT_EQ(file.find_last_not_of(' ', 8 + n - 1), file.rfind('}', 8 + n - 1)) << "only spaces follow the JSON";
}

TEST(Safetensors, LoadsIntoAccountedTensorsAndReadsRanges) {
  TempDir dir;
  std::vector<float> w = {0, 1, 2, 3, 4, 5, 6, 7};
  auto path = dir / "w.safetensors";
  write_safetensors(path, {{"w", DType::f32, {2, 4}, w.data()}});
  SafetensorsReader r(path);
  MemoryContext ctx;
  MemoryContext::Install install(ctx);
  Tensor t = r.load("w", Tier::host);
  EXPECT_EQ(t.shape(), (Shape{2, 4}));
  EXPECT_EQ(ctx.tier(Tier::host).used(), 32u);
  EXPECT_EQ(t.data<float>()[5], 5.0f);
  float row[4];
  r.read_range("w", 16, row, sizeof row);  // second row
  EXPECT_EQ(row[0], 4.0f);
  EXPECT_EQ(row[3], 7.0f);
}

TEST(Safetensors, StreamingWriterTakesTensorsInPieces) {
  TempDir dir;
  std::vector<float> a(1000), b = {9, 8, 7};
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  auto path = dir / "stream.safetensors";
  {
    SafetensorsWriter w(path, {{"a", DType::f32, {10, 100}}, {"none", DType::f32, {0}}, {"b", DType::f32, {3}}});
    for (int piece = 0; piece < 10; ++piece) w.write_part("a", a.data() + 100 * piece, 400);
    w.write("b", b.data());
    w.finish();
  }
  SafetensorsReader r(path);
  std::vector<float> back(1000);
  r.read("a", back.data(), 4000);
  EXPECT_EQ(back, a);
  EXPECT_EQ(r.entry("b").offset, r.entry("a").offset + 4000);
}

TEST(Safetensors, WriterDigestsTensorsLargerThanItsHashingBlock) {
  TempDir dir;
  // 3 MiB and a bit: the writer hashes in blocks, in pieces of any size.
  std::vector<float> a((3 << 18) + 5), b(7, 2.5f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 977);
  auto path = dir / "big.safetensors";
  SafetensorsWriter w(path, {{"a", DType::f32, {int64_t(a.size())}}, {"b", DType::f32, {7}}});
  w.write_part("a", a.data(), 4 * 1000);
  w.write_part("a", a.data() + 1000, 4 * (a.size() - 1000));
  w.write("b", b.data());
  w.finish();
  EXPECT_EQ(w.digest().hex, checksum_file(path, Checksum::xxh3_128));
  EXPECT_EQ(w.digest().bytes, fs::file_size(path));
  FileHasher ha, hb;
  ha.update(a.data(), 4 * a.size());
  hb.update(b.data(), 4 * b.size());
  EXPECT_EQ(w.tensor_digests(), (std::vector<std::string>{ha.hex_digest(), hb.hex_digest()}));
}

TEST(Safetensors, ReadStreamsInterleaveOverOneFile) {
  TempDir dir;
  std::vector<float> a(64), b(64);
  for (size_t i = 0; i < a.size(); ++i) {
    a[i] = static_cast<float>(i);
    b[i] = -static_cast<float>(i);
  }
  auto path = dir / "two.safetensors";
  write_safetensors(path, {{"a", DType::f32, {64}, a.data()}, {"b", DType::f32, {64}, b.data()}});
  const SafetensorsReader r(path);
  std::vector<float> ra(64), rb(64);
  for (size_t at = 0; at < 64; at += 16) {
    r.read_range("a", 4 * at, ra.data() + at, 64, /*stream=*/0);
    r.read_range("b", 4 * at, rb.data() + at, 64, /*stream=*/SafetensorsReader::kMaxStreams - 1);
  }
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
}

TEST(Safetensors, AStreamOpenedAfterTheFileWasReplacedIsAnError) {
  TempDir dir;
  std::vector<float> a(4, 1.0f), other(4, 2.0f);
  auto path = dir / "a.safetensors";
  write_safetensors(path, {{"a", DType::f32, {4}, a.data()}});
  const SafetensorsReader r(path);
  write_safetensors(dir / "other.safetensors", {{"a", DType::f32, {4}, other.data()}});
  fs::rename(dir / "other.safetensors", path);
  std::vector<float> back(4);
  r.read_range("a", 0, back.data(), 16);  // the first stream still reads the file it opened
  EXPECT_EQ(back, a);
  const std::string e = error_of([&] { r.read_range("a", 0, back.data(), 16, 1); });
  EXPECT_NE(e.find("was replaced while it was being read"), std::string::npos) << e;
}

TEST(Safetensors, UnfinishedWriterRemovesItsFile) {
  TempDir dir;
  auto path = dir / "partial.safetensors";
  std::vector<float> a(4);
  {
    SafetensorsWriter w(path, {{"a", DType::f32, {4}}, {"b", DType::f32, {4}}});
    w.write("a", a.data());
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST(SafetensorsDeathTest, WritesOutOfDeclaredOrderAreABug) {
  TempDir dir;
  std::vector<float> a(4);
  EXPECT_DEATH(
      {
        SafetensorsWriter w(dir / "x.safetensors", {{"a", DType::f32, {4}}, {"b", DType::f32, {4}}});
        w.write("b", a.data());
      },
      "out of the declared order");
  EXPECT_DEATH(
      {
        SafetensorsWriter w(dir / "y.safetensors", {{"a", DType::f32, {4}}});
        w.finish();
      },
      "finished before tensor 'a'");
}

// What the reference implementation writes for
//   save_file({"weight": [[1, 2], [3, 4]], "bias": [0.5, -1]}, metadata={"format": "pt"})
// compact JSON, __metadata__ first, tensors sorted by name, space padding.
TEST(Safetensors, ReadsTheReferenceLibraryLayout) {
  TempDir dir;
  std::string header =
      R"({"__metadata__":{"format":"pt"},"bias":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
      R"("weight":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  auto path = raw_file(dir, header, floats({0.5f, -1.0f, 1, 2, 3, 4}));
  SafetensorsReader r(path);
  EXPECT_EQ(r.metadata().at("format"), "pt");
  float w[4];
  r.read("weight", w, sizeof w);
  EXPECT_EQ(w[3], 4.0f);
  EXPECT_EQ(r.entry("weight").shape, (Shape{2, 2}));
}

TEST(Safetensors, ReadsUnpaddedHeadersWithoutMetadataInAnyKeyOrder) {
  TempDir dir;
  auto path = raw_file(
      dir, R"({"b":{"shape":[1],"data_offsets":[4,8],"dtype":"I32"},"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}})",
      std::string("\x01\0\0\0\x02\0\0\0", 8));
  SafetensorsReader r(path);
  EXPECT_TRUE(r.metadata().empty());
  ASSERT_EQ(r.entries().size(), 2u);
  EXPECT_EQ(r.entries()[0].name, "a");  // data order
  int32_t b = 0;
  r.read("b", &b, 4);
  EXPECT_EQ(b, 2);
}

TEST(Safetensors, ReadsThePythonFixture) {
  SafetensorsReader r(fs::path(LOOM_SOURCE_DIR) / "tests/fixtures/gpt_tiny.safetensors");
  ASSERT_FALSE(r.entries().empty());
  const auto& wte = r.entry("param.wte.weight");
  EXPECT_EQ(wte.dtype, DType::f32);
  EXPECT_EQ(wte.shape.size(), 2u);
  std::vector<float> values(wte.bytes / 4);
  r.read(wte.name, values.data(), wte.bytes);
  EXPECT_TRUE(std::any_of(values.begin(), values.end(), [](float v) { return v != 0.0f; }));
}

TEST(Safetensors, MissingTensorSuggestsTheClosestName) {
  TempDir dir;
  float x = 1;
  auto path = dir / "m.safetensors";
  write_safetensors(path, {{"h.0.attn.weight", DType::f32, {1}, &x}});
  SafetensorsReader r(path);
  EXPECT_FALSE(r.contains("h.0.attn.wieght"));
  std::string msg = error_of([&] { r.entry("h.0.attn.wieght"); });
  EXPECT_CONTAINS(msg, path.string());
  EXPECT_CONTAINS(msg, "did you mean 'h.0.attn.weight'?");
}

// Every malformed file is an Error naming the file and the problem.
class SafetensorsCorrupt : public ::testing::Test {
 protected:
  std::string open_error(const fs::path& path) {
    std::string msg = error_of([&] { SafetensorsReader r(path); });
    EXPECT_CONTAINS(msg, path.string());
    return msg;
  }
  fs::path valid_file() {
    std::vector<float> a = {1, 2, 3, 4};
    auto path = dir_ / "valid.safetensors";
    write_safetensors(path, {{"a", DType::f32, {4}, a.data()}});
    return path;
  }
  TempDir dir_;
};

TEST_F(SafetensorsCorrupt, TruncatedFiles) {
  std::string good = read_file(valid_file());
  EXPECT_CONTAINS(open_error(dir_.write("t1.safetensors", good.substr(0, good.size() - 1))), "run past the");
  EXPECT_CONTAINS(open_error(dir_.write("t2.safetensors", good.substr(0, 20))), "runs past the end of the file");
  EXPECT_CONTAINS(open_error(dir_.write("t3.safetensors", good.substr(0, 5))), "too short");
  EXPECT_CONTAINS(open_error(dir_.write("t4.safetensors", "")), "too short");
}

TEST_F(SafetensorsCorrupt, BadHeaders) {
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32",)", "")), "header is not valid JSON");
  EXPECT_CONTAINS(open_error(raw_file(dir_, "[1, 2]", "")), "header is a JSON array, not an object");
  EXPECT_CONTAINS(open_error(dir_.write("huge.safetensors", le64(1ull << 40) + "{}")), "runs past the end");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"__metadata__":{"step":10}})", "")),
                  "__metadata__ value of 'step' is not a string");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[1]}})", "xxxx")),
                  "tensor 'a': \"data_offsets\" is not [begin, end]");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", "12345678")),
                  "unsupported safetensors dtype 'F64'");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", "1234")),
                  "not a non-negative integer");
}

TEST_F(SafetensorsCorrupt, OffsetsAndSizes) {
  const std::string data(16, 'x');
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", data)),
                  "tensor 'a': data_offsets [0, 32] run past the 16-byte data section");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data)),
                  "F32 [3] needs 3 x 4 bytes but data_offsets [0, 16] hold 16");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", data)),
                  "end before they begin");
  EXPECT_CONTAINS(open_error(raw_file(dir_,
                                      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                      data)),
                  "(overlap)");
  EXPECT_CONTAINS(open_error(raw_file(dir_,
                                      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                      R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                      data)),
                  "(gap)");
  EXPECT_CONTAINS(open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data)),
                  "8 bytes after the last tensor are not covered");
  EXPECT_CONTAINS(
      open_error(raw_file(dir_, R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,4]}})", "1234")),
      "overflows 64 bits");
}

TEST(Safetensors, UnreadablePathsNameThePath) {
  TempDir dir;
  EXPECT_CONTAINS(error_of([&] { SafetensorsReader r(dir / "nope.safetensors"); }), "nope.safetensors");
  EXPECT_CONTAINS(error_of([&] { SafetensorsReader r(dir.path()); }), dir.path().string());
  EXPECT_CONTAINS(error_of([&] { write_safetensors(dir / "no/such/dir/x.safetensors", {}); }), "no/such/dir");
}

}  // namespace
}  // namespace loom
