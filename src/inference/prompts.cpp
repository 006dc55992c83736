// Prompts files in, results files out (loom generate --prompts).
#include <fstream>

#include <nlohmann/json.hpp>

#include "loom/inference.h"

namespace loom {

namespace {

constexpr const char* kFields = "prompt, max_tokens, temperature, top_p, top_k, seed";

template <typename T>
T field(const nlohmann::json& v, const std::string& where, const char* name) {
  try {
    return v.get<T>();
  } catch (const nlohmann::json::exception&) {
    throw Error(str(where, ": field '", name, "' is ", v.dump(), ", not a ",
                    std::is_same_v<T, std::string> ? "string" : "number"));
  }
}

PromptSpec parse_object(const std::string& line, const std::string& where, const PromptSpec& defaults) {
  nlohmann::json obj;
  try {
    obj = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    throw Error(str(where, ": not a JSON object (", e.what(), ")"));
  }
  if (!obj.is_object()) throw Error(str(where, ": not a JSON object but ", obj.dump()));
  PromptSpec p = defaults;
  bool has_prompt = false;
  for (const auto& [key, v] : obj.items()) {
    if (key == "prompt") {
      p.prompt = field<std::string>(v, where, "prompt");
      has_prompt = true;
    } else if (key == "max_tokens") {
      p.max_tokens = field<int64_t>(v, where, "max_tokens");
      if (p.max_tokens < 0) throw Error(str(where, ": max_tokens = ", p.max_tokens, " is negative"));
    } else if (key == "temperature") {
      p.sample.temperature = field<float>(v, where, "temperature");
    } else if (key == "top_p") {
      p.sample.top_p = field<float>(v, where, "top_p");
    } else if (key == "top_k") {
      p.sample.top_k = field<int64_t>(v, where, "top_k");
    } else if (key == "seed") {
      p.sample.seed = field<uint64_t>(v, where, "seed");
    } else {
      throw Error(str(where, ": unknown field '", key, "' (the fields are ", kFields, ")"));
    }
  }
  if (!has_prompt) throw Error(str(where, ": no \"prompt\" field"));
  return p;
}

}  // namespace

std::vector<PromptSpec> read_prompts(const std::filesystem::path& path, const PromptSpec& defaults) {
  std::ifstream in(path);
  if (!in) throw Error(str("cannot read the prompts file '", path.string(), "'"));
  std::vector<PromptSpec> prompts;
  std::optional<bool> jsonl;  // decided by the first non-empty line
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    if (!jsonl) jsonl = line[line.find_first_not_of(" \t")] == '{';
    if (*jsonl) {
      prompts.push_back(parse_object(line, str(path.string(), " line ", number), defaults));
    } else {
      prompts.push_back(defaults);
      prompts.back().prompt = line;
    }
  }
  if (prompts.empty()) throw Error(str("the prompts file '", path.string(), "' has no prompts"));
  return prompts;
}

std::string result_json_line(int64_t index, const std::string& prompt, const GenerationResult& result) {
  const nlohmann::json j{{"index", index},
                         {"prompt", prompt},
                         {"text", result.text},
                         {"tokens", result.tokens.size()},
                         {"finish_reason", finish_reason_name(result.finish)}};
  // Generated text may cut a UTF-8 character at max_tokens: replace, not throw.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace loom
