#include <algorithm>

#include "data/file_io.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {

namespace {

// The concatenated inputs and where each one starts, to name the file and
// offset of a problem found in the corpus.
struct Corpus {
  std::string text;
  std::vector<std::pair<size_t, std::filesystem::path>> starts;

  std::string locate(size_t offset) const {
    auto it =
        std::upper_bound(starts.begin(), starts.end(), offset, [](size_t off, const auto& s) { return off < s.first; });
    if (it == starts.begin()) return str("corpus byte ", offset);
    --it;
    return str(it->second, " byte ", offset - it->first);
  }
};

void validate(const PrepareOptions& o) {
  if (o.inputs.empty()) throw Error("prepare: no input text files given");
  if (o.out_dir.empty()) throw Error("prepare: no output directory given");
  if (!(o.val_fraction > 0.0 && o.val_fraction < 1.0))
    throw Error(str("prepare: val_fraction must lie in (0, 1), got ", o.val_fraction));
  if (o.seq_len <= 0) throw Error(str("prepare: seq_len must be positive, got ", o.seq_len));
  if (o.vocab_size < 0)
    throw Error(str("prepare: vocab_size must be positive (or 0 for the default), got ", o.vocab_size));
  std::error_code ec;
  if (std::filesystem::exists(o.out_dir, ec) && !std::filesystem::is_directory(o.out_dir, ec))
    throw Error(str("prepare: output ", o.out_dir, " exists and is not a directory"));
}

Corpus read_inputs(const std::vector<std::filesystem::path>& inputs) {
  Corpus corpus;
  for (const auto& path : inputs) {
    std::string text = data::read_file(path, "input text");
    if (auto off = invalid_utf8_offset(text))
      throw Error(str("input text ", path, " is not valid UTF-8 at byte offset ", *off,
                      "; convert it first (e.g. iconv -t UTF-8)"));
    // A file without a final newline would run its last line into the next file's first.
    if (!corpus.text.empty() && corpus.text.back() != '\n') corpus.text += '\n';
    corpus.starts.emplace_back(corpus.text.size(), std::filesystem::absolute(path));
    corpus.text += text;
  }
  if (corpus.text.empty()) throw Error(str("prepare: the input files hold no text"));
  return corpus;
}

// The first line start at or after (1 - val_fraction) of the bytes, or the
// next character boundary when no line starts between there and the end.
size_t split_point(std::string_view text, double val_fraction) {
  size_t cut = static_cast<size_t>(static_cast<double>(text.size()) * (1.0 - val_fraction));
  if (cut == 0 || text[cut - 1] == '\n') return cut;
  size_t eol = text.find('\n', cut);
  if (eol != std::string_view::npos && eol + 1 < text.size()) return eol + 1;
  while (cut < text.size() && (static_cast<uint8_t>(text[cut]) & 0xC0) == 0x80) ++cut;
  return cut;
}

// `unit` is "tokens", or "bytes" for the check before tokenizing.
void check_split_size(std::string_view name, int64_t count, std::string_view unit, const PrepareOptions& o) {
  if (count < static_cast<int64_t>(o.seq_len) + 1)
    throw Error(str("prepare: the ", name, " split holds ", count, " ", unit, ", fewer than the seq_len + 1 = ",
                    o.seq_len + 1, " tokens one sequence needs (val_fraction ", o.val_fraction, "); give more text, ",
                    name == "val" ? "raise val_fraction" : "lower val_fraction", " or lower seq_len"));
}

}  // namespace

DatasetInfo prepare_dataset(const PrepareOptions& opts) {
  validate(opts);
  Corpus corpus = read_inputs(opts.inputs);
  const size_t split = split_point(corpus.text, opts.val_fraction);
  const std::string_view train_text = std::string_view(corpus.text).substr(0, split);
  const std::string_view val_text = std::string_view(corpus.text).substr(split);
  if (val_text.empty() || train_text.empty())
    throw Error(str("prepare: the ", train_text.empty() ? "train" : "val", " split of ", corpus.text.size(),
                    " bytes at val_fraction ", opts.val_fraction, " is empty; give more text or change val_fraction"));
  // A token covers at least one byte: too few bytes is too few tokens, found
  // before anything is trained or written.
  check_split_size("train", static_cast<int64_t>(train_text.size()), "bytes", opts);
  check_split_size("val", static_cast<int64_t>(val_text.size()), "bytes", opts);

  std::optional<Tokenizer> reused;
  std::filesystem::path reused_path;  // the file, when opts.tokenizer is a directory
  std::string reused_bytes;
  bool reused_hf_json = false;
  if (!opts.tokenizer.empty()) {
    reused = Tokenizer::load(opts.tokenizer);
    reused_path = reused->path();
    reused_hf_json = reused->is_hf_json();
    reused_bytes = data::read_file(reused_path, "tokenizer");
    if (opts.vocab_size != 0 && opts.vocab_size != reused->vocab_size())
      throw Error(str("prepare: tokenizer ", opts.tokenizer, " has a vocabulary of ", reused->vocab_size(),
                      " tokens but vocab_size ", opts.vocab_size,
                      " was requested; drop vocab_size to use the tokenizer's, or omit the tokenizer to train one"));
  }

  std::error_code ec;
  std::filesystem::create_directories(opts.out_dir, ec);
  if (ec) throw Error(str("prepare: cannot create output directory ", opts.out_dir, ": ", ec.message()));
  DatasetInfo info;
  info.dir = std::filesystem::absolute(opts.out_dir);
  info.tokenizer = info.dir / (reused_hf_json ? "tokenizer.json" : "tokenizer.model");
  // The directory's files are about to change: a previous description goes
  // first, so a failure below never leaves one describing files it no longer matches.
  std::filesystem::remove(info.dir / "dataset.json", ec);
  if (ec) throw Error(str("prepare: cannot remove the previous ", info.dir / "dataset.json", ": ", ec.message()));
  Tokenizer tok =
      reused
          ? std::move(*reused)
          : Tokenizer::train(train_text, info.tokenizer,
                             {.vocab_size = opts.vocab_size ? opts.vocab_size : kDefaultVocabSize, .seed = opts.seed});

  std::vector<int32_t> train_ids = tok.encode(train_text);
  std::vector<int32_t> val_ids = tok.encode(val_text);
  check_split_size("train", static_cast<int64_t>(train_ids.size()), "tokens", opts);
  check_split_size("val", static_cast<int64_t>(val_ids.size()), "tokens", opts);
  // A tokenizer that does not reproduce the text would train the model on
  // something else than the corpus; loom's own always does, a reused one may not.
  for (auto [ids, text, base] : {std::tuple{&train_ids, train_text, size_t{0}}, {&val_ids, val_text, split}}) {
    std::string back = tok.decode(*ids);
    if (back != text) {
      auto diff = std::mismatch(back.begin(), back.end(), text.begin(), text.end());
      size_t off = base + static_cast<size_t>(diff.second - text.begin());
      throw Error(str("prepare: tokenizer ", tok.path(), " does not reproduce the text at ", corpus.locate(off),
                      "; use a tokenizer trained by `loom prepare` (byte fallback, identity normalization)"));
    }
  }

  if (!reused_path.empty() && !std::filesystem::equivalent(reused_path, info.tokenizer, ec)) {
    write_file_atomic(info.tokenizer, reused_bytes);
    // A tokenizer.json's bos/eos come from the tokenizer_config.json beside it.
    const std::filesystem::path config = reused_path.parent_path() / "tokenizer_config.json";
    if (reused_hf_json && std::filesystem::is_regular_file(config, ec))
      write_file_atomic(info.dir / "tokenizer_config.json", read_file(config));
  }
  for (const auto& [start, path] : corpus.starts) info.sources.push_back(path.string());
  info.val_fraction = opts.val_fraction;
  info.vocab_size = tok.vocab_size();
  info.tokenizer_sha256 = sha256_file(info.tokenizer);
  info.train = {info.dir / "train.bin", static_cast<int64_t>(train_ids.size()), count_utf8_chars(train_text),
                static_cast<int64_t>(train_text.size())};
  info.val = {info.dir / "val.bin", static_cast<int64_t>(val_ids.size()), count_utf8_chars(val_text),
              static_cast<int64_t>(val_text.size())};
  write_token_shard(info.train.file, train_ids, info.vocab_size);
  write_token_shard(info.val.file, val_ids, info.vocab_size);
  info.write();
  return info;
}

}  // namespace loom
