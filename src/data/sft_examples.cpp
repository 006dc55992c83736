#include "data/sft_examples.h"

#include <nlohmann/json.hpp>

#include "data/file_io.h"

namespace loom::data {

namespace {

constexpr std::string_view kForms =
    "each line must be one JSON object, {\"prompt\": \"...\", \"response\": \"...\"} or "
    "{\"messages\": [{\"role\": \"user\", \"content\": \"...\"}, {\"role\": \"assistant\", \"content\": \"...\"}]}";

// The string field `key` of `j`; `what` names it in messages.
std::string string_field(const nlohmann::json& j, const char* key, const std::string& where, std::string_view what) {
  if (!j.contains(key)) throw Error(str(where, " has no \"", key, "\"", what, "; ", kForms));
  const nlohmann::json& v = j.at(key);
  if (!v.is_string())
    throw Error(str(where, ": \"", key, "\"", what, " is ", v.type_name(), ", not a string; ", kForms));
  return v.get<std::string>();
}

std::vector<SftSegment> chat_segments(const nlohmann::json& messages, const std::string& where) {
  if (!messages.is_array() || messages.empty())
    throw Error(str(where, ": \"messages\" must be a non-empty array of {\"role\", \"content\"} objects; ", kForms));
  std::vector<SftSegment> segments;
  bool any_response = false;
  for (size_t i = 0; i < messages.size(); ++i) {
    const nlohmann::json& m = messages[i];
    const std::string what = str(" of message ", i);
    if (!m.is_object()) throw Error(str(where, ": message ", i, " is ", m.type_name(), ", not an object; ", kForms));
    const std::string role = string_field(m, "role", where, what);
    if (role != "system" && role != "user" && role != "assistant")
      throw Error(str(where, ": message ", i, " has role \"", role,
                      "\"; use \"system\", \"user\" or \"assistant\" (the assistant's turns are the responses)"));
    SftSegment s{string_field(m, "content", where, what), role == "assistant"};
    if (s.response && s.text.empty())
      throw Error(str(where, ": assistant message ", i, " is empty; give it the response text or drop the line"));
    any_response |= s.response;
    segments.push_back(std::move(s));
  }
  if (!any_response)
    throw Error(str(where, " has no assistant message, so nothing to learn; add the response as "
                           "{\"role\": \"assistant\", \"content\": \"...\"} or drop the line"));
  return segments;
}

std::vector<SftSegment> prompt_response_segments(const nlohmann::json& j, const std::string& where) {
  std::string prompt = string_field(j, "prompt", where, "");
  std::string response = string_field(j, "response", where, "");
  if (response.empty()) throw Error(str(where, ": \"response\" is empty; give the response text or drop the line"));
  return {{std::move(prompt), false}, {std::move(response), true}};
}

}  // namespace

std::vector<SftExample> read_sft_examples(const std::filesystem::path& path) {
  const std::string text = read_file(path, "fine-tuning data");
  std::vector<SftExample> examples;
  int64_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    const std::string where = str("fine-tuning data ", path, " line ", line_no);
    if (line.find_first_not_of(" \t") == std::string_view::npos)
      throw Error(str(where, " is empty; remove blank lines (", kForms, ")"));
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& e) {
      throw Error(str(where, " is not JSON (", e.what(), "); ", kForms));
    }
    if (!j.is_object()) throw Error(str(where, " is a JSON ", j.type_name(), ", not an object; ", kForms));
    SftExample ex;
    ex.file = path;
    ex.line = line_no;
    ex.segments = j.contains("messages") ? chat_segments(j.at("messages"), where) : prompt_response_segments(j, where);
    examples.push_back(std::move(ex));
  }
  if (examples.empty()) throw Error(str("fine-tuning data ", path, " holds no examples; ", kForms));
  return examples;
}

PackedExamples pack_sft_examples(std::span<const SftExample> examples, const Tokenizer& tok, int seq_len,
                                 std::optional<int32_t> bos, int32_t eos) {
  LOOM_CHECK(seq_len > 0, "rows of ", seq_len, " tokens");
  PackedExamples out;
  const size_t T = static_cast<size_t>(seq_len);
  auto fill_row = [&] {
    while (out.tokens.size() % T != 0) {
      out.tokens.push_back(eos);
      out.mask.push_back(0);
    }
  };
  std::vector<int32_t> ids;
  std::vector<uint8_t> mask;
  for (const SftExample& ex : examples) {
    ids.clear();
    mask.clear();
    if (bos) {
      ids.push_back(*bos);
      mask.push_back(0);
    }
    for (const SftSegment& s : ex.segments) {
      const std::vector<int32_t> piece = tok.encode(s.text);
      // A tokenizer that does not reproduce the text would teach other text.
      if (tok.decode(piece) != s.text)
        throw Error(str("prepare: tokenizer ", tok.path(), " does not reproduce the text of ", ex.file, " line ",
                        ex.line, "; use a tokenizer without normalization (byte fallback or byte-level BPE)"));
      ids.insert(ids.end(), piece.begin(), piece.end());
      mask.insert(mask.end(), piece.size(), s.response ? 1 : 0);
      if (s.response) {
        ids.push_back(eos);
        mask.push_back(1);
        out.chars += count_utf8_chars(s.text);
        out.bytes += static_cast<int64_t>(s.text.size());
      }
    }
    if (!ids.empty()) mask[0] = 0;
    if (ids.size() > T) {
      ids.resize(T);
      mask.resize(T);
      ++out.truncated;
    }
    if (out.tokens.size() % T + ids.size() > T) fill_row();
    out.tokens.insert(out.tokens.end(), ids.begin(), ids.end());
    out.mask.insert(out.mask.end(), mask.begin(), mask.end());
    ++out.examples;
  }
  fill_row();
  // The last window's final target.
  out.tokens.push_back(eos);
  out.mask.push_back(0);
  for (uint8_t m : out.mask) out.targets += m;
  return out;
}

}  // namespace loom::data
