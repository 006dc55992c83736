// The Hugging Face fixtures of tests/fixtures/hf (tests/fixtures/README.md),
// and broken copies of them.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "loom/io.h"
#include "test_util.h"

namespace loom::testing {

inline std::filesystem::path hf_fixture(const std::string& name) {
  return std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/hf" / name;
}

// One tensor of a safetensors file, as stored.
struct Raw {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<Raw> load_all(const std::filesystem::path& file) {
  const SafetensorsReader r(file);
  std::vector<Raw> out;
  for (const SafetensorsReader::Entry& e : r.entries()) {
    out.push_back({e.name, e.dtype, e.shape, std::vector<uint8_t>(e.bytes)});
    r.read(e.name, out.back().bytes.data(), e.bytes);
  }
  return out;
}

inline void save_all(const std::filesystem::path& file, const std::vector<Raw>& tensors) {
  std::vector<SafetensorsTensor> list;
  for (const Raw& t : tensors) list.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  write_safetensors(file, list, {{"format", "pt"}});
}

// A copy of fixture `name` in `dir` whose model.safetensors `edit` rewrites.
template <typename Edit>
std::filesystem::path edited_copy(const TempDir& dir, const std::string& name, Edit edit) {
  const std::filesystem::path out = dir / name;
  std::filesystem::copy(hf_fixture(name), out, std::filesystem::copy_options::recursive);
  std::vector<Raw> tensors = load_all(out / "model.safetensors");
  edit(tensors);
  save_all(out / "model.safetensors", tensors);
  return out;
}

}  // namespace loom::testing
