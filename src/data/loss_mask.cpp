#include <bit>
#include <cstring>
#include <limits>

#include "data/file_io.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {

static_assert(std::endian::native == std::endian::little, "loss masks are little-endian, as is this code");

void write_loss_mask(const std::filesystem::path& path, std::span<const uint8_t> mask, int seq_len) {
  LOOM_CHECK(mask.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()) && seq_len > 0, "a mask of ",
             mask.size(), " tokens for rows of ", seq_len);
  std::string bytes(kShardHeaderBytes + (mask.size() + 7) / 8, '\0');
  const int32_t header[4] = {kMaskMagic, kMaskVersion, static_cast<int32_t>(mask.size()), seq_len};
  std::memcpy(bytes.data(), header, sizeof(header));
  char* body = bytes.data() + kShardHeaderBytes;
  for (size_t i = 0; i < mask.size(); ++i)
    if (mask[i]) body[i / 8] = static_cast<char>(static_cast<uint8_t>(body[i / 8]) | (1u << (i % 8)));
  try {
    write_file_atomic(path, bytes);
  } catch (const Error& e) {
    throw Error(str("cannot write loss mask ", path, ": ", e.what()));
  }
}

LossMask::LossMask(const std::filesystem::path& path) : path_(path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw Error(str("loss mask ", path,
                    " does not exist; the fine-tuning dataset is incomplete: run `loom prepare --sft` again"));
  const std::string bytes = data::read_file(path, "loss mask");
  auto fail = [&](const std::string& msg) {
    throw Error(str("loss mask ", path, " ", msg, "; run `loom prepare --sft` again"));
  };
  if (bytes.size() < kShardHeaderBytes)
    fail(str("is truncated: ", bytes.size(), " bytes, shorter than the ", kShardHeaderBytes, "-byte header"));
  int32_t header[4];
  std::memcpy(header, bytes.data(), sizeof(header));
  if (header[0] != kMaskMagic) fail(str("has bad magic ", header[0], " (expected ", kMaskMagic, ")"));
  if (header[1] != kMaskVersion) fail(str("has unknown version ", header[1], " (known: ", kMaskVersion, ")"));
  if (header[2] < 0 || header[3] <= 0)
    fail(str("is corrupt: its header gives ", header[2], " tokens in rows of ", header[3]));
  const size_t expected = kShardHeaderBytes + (static_cast<size_t>(header[2]) + 7) / 8;
  if (bytes.size() != expected)
    fail(str("holds ", bytes.size(), " bytes but its header's ", header[2], " tokens need ", expected));
  count_ = header[2];
  seq_len_ = header[3];
  bits_.assign(bytes.begin() + kShardHeaderBytes, bytes.end());
}

bool LossMask::is_target(int64_t i) const {
  LOOM_CHECK(i >= 0 && i < count_, "token ", i, " outside loss mask ", path_, " of ", count_, " tokens");
  return (bits_[static_cast<size_t>(i / 8)] >> (i % 8)) & 1;
}

void LossMask::apply(int64_t start, std::span<int32_t> targets) const {
  const int64_t n = static_cast<int64_t>(targets.size());
  LOOM_CHECK(start >= 0 && start + n <= count_, "tokens [", start, ", ", start + n, ") outside loss mask ", path_,
             " of ", count_, " tokens");
  for (int64_t j = 0; j < n; ++j)
    if (!is_target(start + j)) targets[j] = -1;
}

}  // namespace loom
