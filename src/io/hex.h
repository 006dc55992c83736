// Digests as lowercase hex, the form manifests and xxhsum/sha256sum print.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace loom::io_detail {

inline std::string lower_hex(const uint8_t* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    out += kHex[bytes[i] >> 4];
    out += kHex[bytes[i] & 15];
  }
  return out;
}

}  // namespace loom::io_detail
