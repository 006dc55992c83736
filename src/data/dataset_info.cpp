#include <nlohmann/json.hpp>

#include "data/file_io.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {

namespace {

constexpr std::string_view kFileName = "dataset.json";
constexpr std::string_view kFormat = "loom.dataset";
constexpr int kFormatVersion = 1;

nlohmann::json split_json(const SplitInfo& s) {
  nlohmann::json j = {{"file", s.file.filename().string()},
                      {"tokens", s.tokens},
                      {"chars", s.chars},
                      {"bytes", s.bytes},
                      {"chars_per_token", s.chars_per_token()}};
  if (!s.mask.empty()) {
    j["mask"] = s.mask.filename().string();
    j["targets"] = s.targets;
    j["examples"] = s.examples;
    j["truncated"] = s.truncated;
  }
  return j;
}

SplitInfo split_from_json(const nlohmann::json& j, const std::filesystem::path& dir, DatasetMode mode) {
  SplitInfo s;
  s.file = dir / j.at("file").get<std::string>();
  s.tokens = j.at("tokens").get<int64_t>();
  s.chars = j.at("chars").get<int64_t>();
  s.bytes = j.at("bytes").get<int64_t>();
  if (mode == DatasetMode::sft) {
    s.mask = dir / j.at("mask").get<std::string>();
    s.targets = j.at("targets").get<int64_t>();
    s.examples = j.at("examples").get<int64_t>();
    s.truncated = j.at("truncated").get<int64_t>();
  }
  return s;
}

}  // namespace

DatasetInfo DatasetInfo::read(const std::filesystem::path& dir_or_file) {
  const bool is_file = dir_or_file.filename() == kFileName;
  const std::filesystem::path file = is_file ? dir_or_file : dir_or_file / kFileName;
  std::string text = data::read_file(file, "dataset description");
  DatasetInfo info;
  info.dir = std::filesystem::absolute(file).parent_path();
  try {
    auto j = nlohmann::json::parse(text);
    if (j.at("format").get<std::string>() != kFormat || j.at("format_version").get<int>() != kFormatVersion)
      throw Error(
          str(file, " is not a ", kFormat, " version ", kFormatVersion, " description; run `loom prepare` again"));
    info.sources = j.at("sources").get<std::vector<std::string>>();
    // Descriptions from before the hashes were recorded have none: such a
    // dataset is used as it is.
    info.sources_sha256 = j.value("sources_sha256", std::vector<std::string>{});
    info.val_fraction = j.at("val_fraction").get<double>();
    info.vocab_size = j.at("vocab_size").get<int>();
    info.tokenizer = info.dir / j.at("tokenizer").at("file").get<std::string>();
    info.tokenizer_sha256 = j.at("tokenizer").at("sha256").get<std::string>();
    // Descriptions from before fine-tuning data are plain text.
    const std::string mode = j.value("mode", "text");
    if (mode != "text" && mode != "sft")
      throw Error(str("dataset description ", file, " has mode \"", mode,
                      "\" (known: \"text\", \"sft\"); run `loom prepare` again"));
    info.mode = mode == "sft" ? DatasetMode::sft : DatasetMode::text;
    if (info.mode == DatasetMode::sft) info.seq_len = j.at("seq_len").get<int>();
    info.train = split_from_json(j.at("train"), info.dir, info.mode);
    info.val = split_from_json(j.at("val"), info.dir, info.mode);
  } catch (const nlohmann::json::exception& e) {
    throw Error(str("dataset description ", file, " is malformed (", e.what(), "); run `loom prepare` again"));
  }
  std::error_code ec;
  for (const SplitInfo* split : {&info.train, &info.val})
    if (!split->mask.empty() && !std::filesystem::exists(split->mask, ec))
      throw Error(str("loss mask ", split->mask, " listed by ", file,
                      " does not exist; the fine-tuning dataset is incomplete: run `loom prepare --sft` again"));
  return info;
}

void DatasetInfo::write() const {
  nlohmann::json j = {{"format", kFormat},
                      {"format_version", kFormatVersion},
                      {"sources", sources},
                      {"sources_sha256", sources_sha256},
                      {"val_fraction", val_fraction},
                      {"vocab_size", vocab_size},
                      {"tokenizer", {{"file", tokenizer.filename().string()}, {"sha256", tokenizer_sha256}}},
                      {"train", split_json(train)},
                      {"val", split_json(val)}};
  if (mode == DatasetMode::sft) {
    j["mode"] = "sft";
    j["seq_len"] = seq_len;
  }
  write_file_atomic(dir / kFileName, j.dump(2) + "\n");
}

}  // namespace loom
