#include <algorithm>
#include <cmath>

#include "data/file_io.h"
#include "data/sft_examples.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {

namespace {

// The concatenated inputs and where each one starts, to name the file and
// offset of a problem found in the corpus.
struct Corpus {
  std::string text;
  std::vector<std::pair<size_t, std::filesystem::path>> starts;
  std::vector<std::string> sha256;  // of each input's bytes

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
    corpus.sha256.push_back(sha256_hex(text));
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

// A tokenizer given to prepare, to be copied into the dataset.
struct ReusedTokenizer {
  std::optional<Tokenizer> tok;
  std::filesystem::path path;  // the file, when opts.tokenizer is a directory
  std::string bytes;
  bool hf_json = false;
};

ReusedTokenizer load_reused(const PrepareOptions& opts) {
  ReusedTokenizer r;
  if (opts.tokenizer.empty()) return r;
  r.tok = Tokenizer::load(opts.tokenizer);
  r.path = r.tok->path();
  r.hf_json = r.tok->is_hf_json();
  r.bytes = data::read_file(r.path, "tokenizer");
  if (opts.vocab_size != 0 && opts.vocab_size != r.tok->vocab_size())
    throw Error(str("prepare: tokenizer ", opts.tokenizer, " has a vocabulary of ", r.tok->vocab_size(),
                    " tokens but vocab_size ", opts.vocab_size,
                    " was requested; drop vocab_size to use the tokenizer's, or omit the tokenizer to train one"));
  return r;
}

// Creates the output directory and removes a previous description: the
// directory's files are about to change, so a failure after this never leaves
// one describing files it no longer matches.
DatasetInfo begin_output(const PrepareOptions& opts, bool hf_json) {
  std::error_code ec;
  std::filesystem::create_directories(opts.out_dir, ec);
  if (ec) throw Error(str("prepare: cannot create output directory ", opts.out_dir, ": ", ec.message()));
  DatasetInfo info;
  info.dir = std::filesystem::absolute(opts.out_dir);
  info.tokenizer = info.dir / (hf_json ? "tokenizer.json" : "tokenizer.model");
  std::filesystem::remove(info.dir / "dataset.json", ec);
  if (ec) throw Error(str("prepare: cannot remove the previous ", info.dir / "dataset.json", ": ", ec.message()));
  return info;
}

void copy_reused(const ReusedTokenizer& r, const DatasetInfo& info) {
  std::error_code ec;
  if (r.path.empty() || std::filesystem::equivalent(r.path, info.tokenizer, ec)) return;
  write_file_atomic(info.tokenizer, r.bytes);
  // A tokenizer.json's bos/eos come from the tokenizer_config.json beside it.
  const std::filesystem::path config = r.path.parent_path() / "tokenizer_config.json";
  if (r.hf_json && std::filesystem::is_regular_file(config, ec))
    write_file_atomic(info.dir / "tokenizer_config.json", read_file(config));
}

DatasetInfo prepare_sft(const PrepareOptions& opts) {
  if (opts.tokenizer.empty())
    throw Error("prepare --sft: no tokenizer given; fine-tuning data is encoded with the model's tokenizer: pass "
                "--tokenizer (a checkpoint directory, tokenizer.json or tokenizer.model)");
  std::vector<data::SftExample> examples;
  for (const auto& path : opts.inputs) {
    std::vector<data::SftExample> more = data::read_sft_examples(path);
    examples.insert(examples.end(), std::make_move_iterator(more.begin()), std::make_move_iterator(more.end()));
  }
  const int64_t n = static_cast<int64_t>(examples.size());
  const int64_t n_val = std::max<int64_t>(1, std::llround(static_cast<double>(n) * opts.val_fraction));
  if (n_val >= n)
    throw Error(str("prepare: ", n, " fine-tuning examples at val_fraction ", opts.val_fraction,
                    " leave no training examples (", n_val, " for validation); give more examples or lower "
                    "val_fraction"));

  ReusedTokenizer reused = load_reused(opts);
  const Tokenizer& tok = *reused.tok;
  const std::optional<int32_t> eos = opts.eos ? opts.eos : tok.eos_id();
  if (!eos)
    throw Error(str("prepare --sft: tokenizer ", tok.path(),
                    " names no end-of-sequence token, which ends every response; pass --eos ID, or give the "
                    "tokenizer.json a tokenizer_config.json with \"eos_token\""));
  if (*eos < 0 || *eos >= tok.vocab_size())
    throw Error(str("prepare --sft: eos id ", *eos, " is outside the vocabulary [0, ", tok.vocab_size(), ") of ",
                    tok.path()));
  const std::span<const data::SftExample> all(examples);
  const data::PackedExamples train = data::pack_sft_examples(all.first(static_cast<size_t>(n - n_val)), tok,
                                                             opts.seq_len, tok.bos_id(), *eos);
  const data::PackedExamples val =
      data::pack_sft_examples(all.last(static_cast<size_t>(n_val)), tok, opts.seq_len, tok.bos_id(), *eos);

  DatasetInfo info = begin_output(opts, reused.hf_json);
  copy_reused(reused, info);
  for (const auto& path : opts.inputs) {
    info.sources.push_back(std::filesystem::absolute(path).string());
    info.sources_sha256.push_back(sha256_file(path));
  }
  info.mode = DatasetMode::sft;
  info.seq_len = opts.seq_len;
  info.val_fraction = opts.val_fraction;
  info.vocab_size = tok.vocab_size();
  info.tokenizer_sha256 = sha256_file(info.tokenizer);
  for (auto [split, packed, name] : {std::tuple{&info.train, &train, "train"}, {&info.val, &val, "val"}}) {
    *split = {.file = info.dir / str(name, ".bin"),
              .tokens = static_cast<int64_t>(packed->tokens.size()),
              .chars = packed->chars,
              .bytes = packed->bytes,
              .mask = info.dir / str(name, ".mask.bin"),
              .targets = packed->targets,
              .examples = packed->examples,
              .truncated = packed->truncated};
    write_token_shard(split->file, packed->tokens, info.vocab_size);
    write_loss_mask(split->mask, packed->mask, opts.seq_len);
  }
  info.write();
  return info;
}

}  // namespace

DatasetInfo prepare_dataset(const PrepareOptions& opts) {
  validate(opts);
  if (opts.sft) return prepare_sft(opts);
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

  ReusedTokenizer reused = load_reused(opts);
  DatasetInfo info = begin_output(opts, reused.hf_json);
  Tokenizer tok =
      reused.tok
          ? std::move(*reused.tok)
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

  copy_reused(reused, info);
  for (const auto& [start, path] : corpus.starts) info.sources.push_back(path.string());
  info.sources_sha256 = corpus.sha256;
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
