#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <array>
#include <cstdio>
#include <type_traits>
#include <unordered_map>

#include "data/file_io.h"
#include "data/tokenizer_backend.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom {

static_assert(std::is_same_v<int32_t, int>, "sentencepiece ids are int; loom's token ids are int32_t");

namespace {

// sentencepiece's whitespace marker U+2581. Text that contains it literally is
// encoded as its three byte pieces, which decode to the marker itself, not to a
// space; that is what makes every UTF-8 string round-trip.
constexpr std::string_view kSpaceMarker = "\xE2\x96\x81";

// Longer lines are fed to the trainer in pieces: sentencepiece drops training
// sentences above its max_sentence_length instead of using them.
constexpr size_t kMaxTrainingSentenceBytes = 8192;

// The training text as sentencepiece sentences: its lines without the '\n'
// (a user-defined symbol, so no piece ever spans a line break, exactly as in
// encoding), long lines cut at a space or a character boundary.
class LineIterator : public sentencepiece::SentenceIterator {
 public:
  explicit LineIterator(std::string_view text) : rest_(text) { Next(); }
  bool done() const override { return done_; }
  const std::string& value() const override { return current_; }
  sentencepiece::util::Status status() const override { return {}; }
  void Next() override {
    while (!rest_.empty()) {
      size_t eol = rest_.find('\n');
      size_t line_len = eol == std::string_view::npos ? rest_.size() : eol;
      size_t take = std::min(line_len, kMaxTrainingSentenceBytes);
      if (take < line_len) {
        size_t space = rest_.substr(0, take).rfind(' ');
        if (space != std::string_view::npos && space > 0) take = space;
        while (take > 0 && (static_cast<uint8_t>(rest_[take]) & 0xC0) == 0x80) --take;
      }
      std::string_view piece = rest_.substr(0, take);
      bool line_ends = take == line_len;
      rest_.remove_prefix(take + (line_ends && eol != std::string_view::npos ? 1 : 0));
      if (!piece.empty()) {
        current_.assign(piece);
        return;
      }
    }
    done_ = true;
  }

 private:
  std::string_view rest_;
  std::string current_;
  bool done_ = false;
};

void check_utf8(std::string_view text, std::string_view what) {
  if (auto off = invalid_utf8_offset(text))
    throw Error(str(what, " is not valid UTF-8 at byte offset ", *off, "; convert it to UTF-8 first"));
}

void check_id(const data::TokenizerBackend& impl, int32_t id, std::string_view where) {
  const int vocab = impl.vocab_size();
  if (id < 0 || id >= vocab)
    throw Error(str("token id ", id, where, " is outside the vocabulary [0, ", vocab, ") of tokenizer ", impl.path()));
  if (impl.is_hole(id))
    throw Error(str("token id ", id, where, " names no token of tokenizer ", impl.path(),
                    " (its ids leave a gap there)"));
}

}  // namespace

namespace data {
namespace {

class SentencePieceBackend final : public TokenizerBackend {
 public:
  SentencePieceBackend(std::filesystem::path path, std::string_view serialized) : TokenizerBackend(std::move(path)) {
    auto status = sp_.LoadFromSerializedProto(serialized);
    if (!status.ok() || sp_.GetPieceSize() <= 0)
      throw Error(str("tokenizer model ", this->path(), " is not a sentencepiece model (", status.ToString(),
                      "); point to the tokenizer.model that `loom prepare` wrote, or a Hugging Face tokenizer.json"));
    byte_of_id_.assign(sp_.GetPieceSize(), -1);
    for (int id = 0; id < sp_.GetPieceSize(); ++id) {
      if (!sp_.IsByte(id)) continue;
      // Byte pieces are spelled <0xNN>.
      byte_of_id_[id] = static_cast<int16_t>(std::stoi(sp_.IdToPiece(id).substr(3, 2), nullptr, 16));
    }
    for (int k = 0; k < 3; ++k) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<uint8_t>(kSpaceMarker[k]));
      int id = sp_.PieceToId(name);
      marker_bytes_[k] = id != sp_.unk_id() && sp_.IsByte(id) ? id : -1;
    }
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    const bool escape = marker_bytes_[0] >= 0;
    std::vector<int32_t> out;
    std::vector<int> ids;
    while (true) {
      size_t marker = escape ? text.find(kSpaceMarker) : std::string_view::npos;
      std::string_view segment = text.substr(0, marker);
      if (!segment.empty()) {
        auto status = sp_.Encode(segment, &ids);
        LOOM_CHECK(status.ok(), "sentencepiece encode failed: ", status.ToString());
        out.insert(out.end(), ids.begin(), ids.end());
      }
      if (marker == std::string_view::npos) break;
      out.insert(out.end(), marker_bytes_.begin(), marker_bytes_.end());
      text.remove_prefix(marker + kSpaceMarker.size());
    }
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    LOOM_CHECK(status.ok(), "sentencepiece decode failed: ", status.ToString());
    return text;
  }

  std::string decode_piece(int32_t id) const override {
    // sentencepiece turns a lone byte of a multi-byte character into U+FFFD;
    // the raw byte is what a stream of pieces needs.
    if (byte_of_id_[id] >= 0) return std::string(1, static_cast<char>(byte_of_id_[id]));
    return decode(std::span<const int32_t>(&id, 1));
  }

  int vocab_size() const override { return sp_.GetPieceSize(); }
  std::optional<int32_t> bos_id() const override { return optional_id(sp_.bos_id()); }
  std::optional<int32_t> eos_id() const override { return optional_id(sp_.eos_id()); }
  bool is_hf_json() const override { return false; }

 private:
  static std::optional<int32_t> optional_id(int id) { return id >= 0 ? std::optional<int32_t>(id) : std::nullopt; }

  sentencepiece::SentencePieceProcessor sp_;
  std::array<int32_t, 3> marker_bytes_{-1, -1, -1};  // byte pieces of U+2581, -1 without byte fallback
  std::vector<int16_t> byte_of_id_;                  // per id: the byte of a byte piece, else -1
};

// A tokenizer.json names itself by its extension or, renamed, by being a JSON
// object: a sentencepiece model is a protobuf, whose first byte is a field tag
// and never '{'.
bool is_json_tokenizer(const std::filesystem::path& path, std::string_view bytes) {
  return path.extension() == ".json" || bytes.starts_with('{');
}

std::unique_ptr<const TokenizerBackend> load_backend(const std::filesystem::path& path) {
  std::string bytes = read_file(path, "tokenizer");
  if (is_json_tokenizer(path, bytes)) return load_hf_tokenizer(path, bytes);
  return std::make_unique<SentencePieceBackend>(path, bytes);
}

}  // namespace
}  // namespace data

Tokenizer::Tokenizer(std::unique_ptr<const data::TokenizerBackend> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::train(std::string_view text, const std::filesystem::path& model_path,
                           const TokenizerTrainOptions& opts) {
  if (opts.vocab_size <= 0) throw Error(str("tokenizer vocab_size must be positive, got ", opts.vocab_size));
  if (text.empty()) throw Error(str("cannot train tokenizer ", model_path, " on empty text"));
  check_utf8(text, "tokenizer training text");

  // Identity normalization and no whitespace clean-up keep the text exactly;
  // '\n' is a symbol of its own; byte fallback covers characters outside the
  // vocabulary; digits are single tokens so numbers tokenize uniformly; one
  // thread and every sentence (no sampling) make training deterministic.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", "bpe"},
      {"vocab_size", std::to_string(opts.vocab_size)},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"allow_whitespace_only_pieces", "true"},
      {"split_digits", "true"},
      {"byte_fallback", "true"},
      {"character_coverage", "1.0"},
      {"user_defined_symbols", "\n"},
      {"max_sentence_length", std::to_string(kMaxTrainingSentenceBytes)},
      {"input_sentence_size", "0"},
      {"num_threads", "1"},
      {"minloglevel", "2"},
  };
  sentencepiece::SetRandomGeneratorSeed(opts.seed);
  LineIterator lines(text);
  std::string serialized;
  auto status = sentencepiece::SentencePieceTrainer::Train(args, &lines, &serialized);
  if (!status.ok()) {
    // sentencepiece prefixes its reason with the failed source check.
    std::string reason = status.message();
    if (size_t end = reason.find("] "); reason.starts_with("./src/") && end != std::string::npos)
      reason.erase(0, end + 2);
    throw Error(str("training a ", opts.vocab_size, "-token BPE tokenizer for ", model_path, " failed: ", reason,
                    " Choose a vocab_size this text supports."));
  }
  write_file_atomic(model_path, serialized);
  return Tokenizer(std::make_unique<data::SentencePieceBackend>(model_path, serialized));
}

Tokenizer Tokenizer::train_file(const std::filesystem::path& text_path, const std::filesystem::path& model_path,
                                const TokenizerTrainOptions& opts) {
  std::string text = data::read_file(text_path, "tokenizer training text");
  check_utf8(text, str("tokenizer training text ", text_path));
  return train(text, model_path, opts);
}

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::is_directory(path, ec)) return Tokenizer(data::load_backend(path));
  for (const char* name : {"tokenizer.json", "tokenizer.model"})
    if (std::filesystem::exists(path / name, ec)) return Tokenizer(data::load_backend(path / name));
  throw Error(str("tokenizer ", path,
                  " is a directory without a tokenizer.json or tokenizer.model; point to the tokenizer file"));
}

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  check_utf8(text, "text to encode");
  return impl_->encode(text);
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  for (size_t i = 0; i < ids.size(); ++i) check_id(*impl_, ids[i], str(" at position ", i));
  return impl_->decode(ids);
}

std::string Tokenizer::decode_piece(int32_t id) const {
  check_id(*impl_, id, "");
  return impl_->decode_piece(id);
}

int Tokenizer::vocab_size() const { return impl_->vocab_size(); }
std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos_id(); }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos_id(); }
const std::filesystem::path& Tokenizer::path() const { return impl_->path(); }
bool Tokenizer::is_hf_json() const { return impl_->is_hf_json(); }

}  // namespace loom
