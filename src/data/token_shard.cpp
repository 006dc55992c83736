#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <utility>

#include "loom/data.h"
#include "loom/io.h"

namespace loom {

static_assert(std::endian::native == std::endian::little, "token shards are little-endian, as is this code");

namespace {

uint32_t load_token(const uint8_t* body, int64_t i, int width) {
  if (width == 2) {
    uint16_t t;
    std::memcpy(&t, body + 2 * i, 2);
    return t;
  }
  uint32_t t;
  std::memcpy(&t, body + 4 * i, 4);
  return t;
}

}  // namespace

void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens, int vocab_size) {
  if (vocab_size <= 0)
    throw Error(str("cannot write token shard ", path, ": vocab_size must be positive, got ", vocab_size));
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    throw Error(str("cannot write token shard ", path, ": ", tokens.size(),
                    " tokens exceed the format's int32 count; split them over several shards"));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0 || tokens[i] >= vocab_size)
      throw Error(str("cannot write token shard ", path, ": token ", i, " is ", tokens[i],
                      ", outside the vocabulary [0, ", vocab_size, ")"));

  const bool narrow = vocab_size <= 65536;
  const size_t width = narrow ? 2 : 4;
  std::string bytes(kShardHeaderBytes + tokens.size() * width, '\0');
  const int32_t header[3] = {kShardMagic, narrow ? kShardVersionU16 : kShardVersionU32,
                             static_cast<int32_t>(tokens.size())};
  std::memcpy(bytes.data(), header, sizeof(header));
  char* body = bytes.data() + kShardHeaderBytes;
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (narrow) {
      uint16_t t = static_cast<uint16_t>(tokens[i]);
      std::memcpy(body + 2 * i, &t, 2);
    } else {
      uint32_t t = static_cast<uint32_t>(tokens[i]);
      std::memcpy(body + 4 * i, &t, 4);
    }
  }
  try {
    write_file_atomic(path, bytes);
  } catch (const Error& e) {
    throw Error(str("cannot write token shard ", path, ": ", e.what()));
  }
}

TokenShard::TokenShard(const std::filesystem::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw Error(str("token shard ", path, " does not exist; run `loom prepare` to create it"));
    throw Error(str("cannot open token shard ", path, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error(str("token shard ", path, " is not a regular file"));
  }
  const size_t file_bytes = static_cast<size_t>(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    throw Error(str("token shard ", path, " is truncated: ", file_bytes, " bytes, shorter than the ", kShardHeaderBytes,
                    "-byte header"));
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);  // the mapping keeps the file open
  if (map == MAP_FAILED) throw Error(str("cannot map token shard ", path, ": ", std::strerror(map_errno)));
  map_ = static_cast<const uint8_t*>(map);
  map_bytes_ = file_bytes;

  // From here on a throw must unmap; the destructor does not run for a
  // constructor that throws.
  auto fail = [&](const std::string& msg) {
    ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
    map_ = nullptr;
    throw Error(str("token shard ", path, " ", msg));
  };
  int32_t header[3];
  std::memcpy(header, map_, sizeof(header));
  const int32_t magic = header[0], version = header[1], count = header[2];
  if (magic == kShardMagic && version == kShardVersionU16) {
    token_bytes_ = 2;
  } else if ((magic == kShardMagic && version == kShardVersionU32) ||
             (magic == kLlmcU32ShardMagic && version == kLlmcU32ShardVersion)) {
    token_bytes_ = 4;
  } else if (magic == kShardMagic || magic == kLlmcU32ShardMagic) {
    fail(str("has unknown version ", version, " for magic ", magic, " (known: ", kShardMagic, " versions ",
             kShardVersionU16, " (uint16) and ", kShardVersionU32, " (uint32), ", kLlmcU32ShardMagic, " version ",
             kLlmcU32ShardVersion, " (uint32)); it was written by a newer or different tool"));
  } else {
    fail(str("has bad magic ", magic, " (expected ", kShardMagic, " or ", kLlmcU32ShardMagic,
             "); it is not an llm.c/loom token shard"));
  }
  if (count < 0) fail(str("is corrupt: the header's token count is negative (", count, ")"));
  const size_t expected = kShardHeaderBytes + static_cast<size_t>(count) * token_bytes_;
  if (file_bytes < expected)
    fail(str("is truncated: its header says ", count, " tokens, expected ", expected, " bytes, got ", file_bytes));
  if (file_bytes > expected)
    fail(str("has ", file_bytes - expected, " bytes after its ", count, " tokens (expected ", expected, " bytes, got ",
             file_bytes, "); it is corrupt or was appended to"));
  count_ = count;
}

TokenShard::TokenShard(TokenShard&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_bytes_(std::exchange(other.map_bytes_, 0)),
      count_(other.count_),
      token_bytes_(other.token_bytes_) {}

TokenShard& TokenShard::operator=(TokenShard&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    count_ = other.count_;
    token_bytes_ = other.token_bytes_;
  }
  return *this;
}

TokenShard::~TokenShard() {
  if (map_) ::munmap(const_cast<uint8_t*>(map_), map_bytes_);
}

int32_t TokenShard::token(int64_t i) const {
  LOOM_CHECK(i >= 0 && i < count_, "token ", i, " outside shard ", path_, " of ", count_, " tokens");
  return static_cast<int32_t>(load_token(map_ + kShardHeaderBytes, i, token_bytes_));
}

void TokenShard::read(int64_t start, std::span<int32_t> out) const {
  const int64_t n = static_cast<int64_t>(out.size());
  LOOM_CHECK(start >= 0 && start + n <= count_, "tokens [", start, ", ", start + n, ") outside shard ", path_, " of ",
             count_, " tokens");
  const uint8_t* body = map_ + kShardHeaderBytes;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(load_token(body, start + i, token_bytes_));
}

int64_t TokenShard::max_token_id() const {
  int64_t best = -1;
  const uint8_t* body = map_ + kShardHeaderBytes;
  for (int64_t i = 0; i < count_; ++i) best = std::max<int64_t>(best, load_token(body, i, token_bytes_));
  return best;
}

}  // namespace loom
