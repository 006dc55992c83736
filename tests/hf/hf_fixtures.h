// The Hugging Face fixtures of tests/fixtures/hf (tests/fixtures/README.md).
#pragma once

#include <filesystem>
#include <string>

namespace loom::testing {

inline std::filesystem::path hf_fixture(const std::string& name) {
  return std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/hf" / name;
}

}  // namespace loom::testing
