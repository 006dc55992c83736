// The file formats behind loom::Tokenizer. Tokenizer checks its arguments
// (valid UTF-8, ids within the vocabulary) before calling a backend.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

class TokenizerBackend {
 public:
  explicit TokenizerBackend(std::filesystem::path path) : path_(std::move(path)) {}
  virtual ~TokenizerBackend() = default;

  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual std::string decode_piece(int32_t id) const = 0;
  virtual int vocab_size() const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  virtual bool is_hf_json() const = 0;
  // An id in [0, vocab_size()) that no token has (only a tokenizer.json can
  // leave holes), so decoding it is an error rather than an empty string.
  virtual bool is_hole(int32_t /*id*/) const { return false; }

  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

// A Hugging Face tokenizer.json (`json_text`, read from `path`) with a
// byte-level BPE model; hf_tokenizer.cpp lists what it supports.
std::unique_ptr<const TokenizerBackend> load_hf_tokenizer(const std::filesystem::path& path,
                                                          std::string_view json_text);

}  // namespace loom::data
