#include <fcntl.h>
#include <unistd.h>

#include <vector>

// xxHash's functions inlined here, compiled for this CPU as the rest of loom
// is (-march=native): its AVX-512 path hashes about 2.5x as fast as the
// shared library's SSE2 build, and a load hashes every byte it reads.
// GCC 12 warns, wrongly, that the AVX-512 intrinsics inlined from it read an
// uninitialized variable (the intrinsics' own undefined-vector idiom); the
// warning is reported where they are inlined, anywhere in this file.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "io/hex.h"
#include "io/posix_file.h"
#include "loom/io.h"

namespace loom {

struct FileHasher::Algorithm {
  virtual ~Algorithm() = default;
  virtual void update(const void* data, size_t bytes) = 0;
  virtual std::string hex_digest() = 0;
};

namespace {

class Xxh3Algorithm final : public FileHasher::Algorithm {
 public:
  Xxh3Algorithm() : state_(XXH3_createState()) {
    LOOM_CHECK(state_ != nullptr, "XXH3_createState failed");
    LOOM_CHECK(XXH3_128bits_reset(state_) == XXH_OK, "XXH3_128bits_reset failed");
  }
  ~Xxh3Algorithm() override { XXH3_freeState(state_); }
  void update(const void* data, size_t bytes) override {
    LOOM_CHECK(XXH3_128bits_update(state_, data, bytes) == XXH_OK, "XXH3_128bits_update failed");
  }
  std::string hex_digest() override {
    // The canonical (big-endian) form, as xxhsum prints it.
    XXH128_canonical_t canonical;
    XXH128_canonicalFromHash(&canonical, XXH3_128bits_digest(state_));
    return io_detail::lower_hex(canonical.digest, sizeof(canonical.digest));
  }

 private:
  XXH3_state_t* state_;
};

class Sha256Algorithm final : public FileHasher::Algorithm {
 public:
  void update(const void* data, size_t bytes) override { sha_.update(data, bytes); }
  std::string hex_digest() override { return sha_.hex_digest(); }

 private:
  Sha256 sha_;
};

template <typename A>
std::unique_ptr<FileHasher::Algorithm> make_algorithm() {
  return std::make_unique<A>();
}

struct ChecksumInfo {
  Checksum checksum;
  const char* name;
  size_t hex_digits;
  std::unique_ptr<FileHasher::Algorithm> (*make)();
};
constexpr ChecksumInfo kChecksums[] = {{Checksum::xxh3_128, "xxh3_128", 32, make_algorithm<Xxh3Algorithm>},
                                       {Checksum::sha256, "sha256", 64, make_algorithm<Sha256Algorithm>}};

const ChecksumInfo& info_of(Checksum c) {
  for (const ChecksumInfo& info : kChecksums)
    if (info.checksum == c) return info;
  LOOM_CHECK(false, "unknown checksum ", static_cast<int>(c));
  return kChecksums[0];
}

bool is_lower_hex(const std::string& s) { return s.find_first_not_of("0123456789abcdef") == std::string::npos; }

}  // namespace

const char* checksum_name(Checksum c) { return info_of(c).name; }

std::optional<Checksum> parse_checksum_name(std::string_view name) {
  for (const ChecksumInfo& info : kChecksums)
    if (name == info.name) return info.checksum;
  return std::nullopt;
}

FileHasher::FileHasher(Checksum c) : checksum_(c), algorithm_(info_of(c).make()) {}

FileHasher::~FileHasher() = default;

void FileHasher::update(const void* data, size_t bytes) {
  LOOM_CHECK(algorithm_ != nullptr, "FileHasher::update after hex_digest");
  algorithm_->update(data, bytes);
}

std::string FileHasher::hex_digest() {
  LOOM_CHECK(algorithm_ != nullptr, "FileHasher::hex_digest called twice");
  std::string hex = algorithm_->hex_digest();
  algorithm_.reset();
  return hex;
}

std::string checksum_file(const std::filesystem::path& path, Checksum c) {
  io_detail::Fd fd = io_detail::open_file(path, O_RDONLY, "read");
  FileHasher h(c);
  std::vector<uint8_t> chunk(size_t(1) << 20);
  for (;;) {
    ssize_t n = ::read(fd.get(), chunk.data(), chunk.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) io_detail::throw_io_error("read", path, errno);
    if (n == 0) break;
    h.update(chunk.data(), static_cast<size_t>(n));
  }
  return h.hex_digest();
}

std::string sha256_file(const std::filesystem::path& path) { return checksum_file(path, Checksum::sha256); }

nlohmann::json digest_json(const FileDigest& digest) {
  return {{checksum_name(digest.checksum), digest.hex}, {"bytes", digest.bytes}};
}

std::optional<FileDigest> parse_digest_json(const nlohmann::json& entry) {
  if (!entry.is_object() || entry.size() != 2 || !entry.contains("bytes") || !entry.at("bytes").is_number_unsigned())
    return std::nullopt;
  for (const auto& [key, value] : entry.items()) {
    if (key == "bytes") continue;
    const std::optional<Checksum> c = parse_checksum_name(key);
    if (!c || !value.is_string()) return std::nullopt;
    const std::string hex = value.get<std::string>();
    if (hex.size() != info_of(*c).hex_digits || !is_lower_hex(hex)) return std::nullopt;
    return FileDigest{entry.at("bytes").get<uint64_t>(), *c, hex};
  }
  return std::nullopt;
}

}  // namespace loom
