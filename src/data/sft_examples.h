// Supervised fine-tuning examples: reading JSONL files, encoding each example
// with its loss mask and packing the examples into rows (docs/data.md).
#pragma once

#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/data.h"

namespace loom::data {

// A piece of an example's text: a prompt (context only) or a response (a
// loss target, followed by EOS).
struct SftSegment {
  std::string text;
  bool response = false;
};

struct SftExample {
  std::vector<SftSegment> segments;
  std::filesystem::path file;
  int64_t line = 0;  // 1-based
};

// Every line of a JSONL file as an example; throws Error naming the file, the
// line and the fix for a line that is empty, not JSON, not an example (no
// response, no assistant turn, a field that is not a string), and for a file
// without lines.
std::vector<SftExample> read_sft_examples(const std::filesystem::path& path);

// A split's tokens and loss mask, packed into rows of seq_len tokens plus one
// final filler token, so that the loaders' windows [kT, kT + T + 1) are the
// rows (the last token of a window, its row's successor's first, is never a
// target).
struct PackedExamples {
  std::vector<int32_t> tokens;
  std::vector<uint8_t> mask;  // 1 where the token is a loss target
  int64_t examples = 0;
  int64_t truncated = 0;  // examples longer than a row, cut to seq_len tokens
  int64_t targets = 0;
  int64_t chars = 0, bytes = 0;  // of the responses
};

// Encodes each example as [bos] segments..., every response followed by
// `eos`, and packs them in order: an example that does not fit in the rest of
// the current row starts the next one, the rest filled with `eos` (not a
// target). An example's first token is never a target (nothing of its own
// precedes it). Throws Error naming the file and line of a segment the
// tokenizer does not reproduce.
PackedExamples pack_sft_examples(std::span<const SftExample> examples, const Tokenizer& tok, int seq_len,
                                 std::optional<int32_t> bos, int32_t eos);

}  // namespace loom::data
