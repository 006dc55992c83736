// Helpers for the data tests: scratch directories, files, corpus slices and
// checks on error messages.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <sstream>
#include <string>

#include "loom/data.h"
#include "test_util.h"

namespace loom::testing {

inline void write_bytes(const std::filesystem::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// `bytes` of the embedded corpus starting at `offset`, cut back to a line end.
inline std::string shakespeare(size_t offset, size_t bytes) {
  static const std::string corpus = read_bytes(std::filesystem::path(LOOM_SOURCE_DIR) / "data/tinyshakespeare.txt");
  std::string slice = corpus.substr(offset, bytes);
  return slice.substr(0, slice.rfind('\n') + 1);
}

inline void expect_mentions(const std::string& message, std::initializer_list<std::string> parts) {
  for (const auto& p : parts)
    EXPECT_NE(message.find(p), std::string::npos) << "'" << p << "' missing from: " << message;
}

}  // namespace loom::testing
