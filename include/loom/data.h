// loom data: tokenizers (sentencepiece, Hugging Face tokenizer.json), llm.c token shards, `prepare` (text ->
// tokenizer + train/val shards + dataset.json) and the sharded, resumable loader.
// docs/data.md describes the file formats and the loader's semantics.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core.h"

namespace loom {

// ---------------------------------------------------------------------------
// Text
// ---------------------------------------------------------------------------

// Byte offset of the first byte that does not start a well-formed UTF-8
// sequence (overlong forms, surrogates, code points above U+10FFFF and
// truncated sequences are all invalid), or nullopt for valid text.
std::optional<size_t> invalid_utf8_offset(std::string_view text);

// Unicode code points in valid UTF-8 text: the "characters" that per-character
// loss is measured in, so a byte-level and a BPE model compare on one scale.
int64_t count_utf8_chars(std::string_view text);

// ---------------------------------------------------------------------------
// Tokenizer
// ---------------------------------------------------------------------------

// The recommended vocabulary for small corpora such as tinyshakespeare: 2.5
// characters per token on held-out text, while the embedding and the logits
// stay a modest part of a small model's compute and every token is seen often
// in 1 MB of text. Per character, 1024 and 4096 did no better at equal
// compute (docs/data.md has the measurements).
constexpr int kDefaultVocabSize = 2048;

struct TokenizerTrainOptions {
  int vocab_size = kDefaultVocabSize;
  // Seeds sentencepiece's random generator, so training is deterministic.
  uint32_t seed = 1234;
};

namespace data {
class TokenizerBackend;  // src/data/tokenizer_backend.h
}

// A tokenizer from one of two file formats:
// - a sentencepiece model (tokenizer.model): loom's own, trained by `train`, a
//   byte-fallback BPE that reproduces its input exactly: decode(encode(text)) ==
//   text for every valid UTF-8 string, including newlines (a token of their
//   own), runs of spaces, tabs and any code point;
// - a Hugging Face tokenizer.json with a byte-level BPE model (GPT-2, LLaMA-3
//   and their fine-tunes), giving exactly the ids of Hugging Face `tokenizers`'
//   encode(text, add_special_tokens=False): added and special tokens written in
//   the text become their ids, and no post-processor runs (no BOS is prepended).
//   Byte-level BPE reproduces any text too, except the spaces an added token
//   with lstrip/rstrip removes.
// Immutable after construction, so encode/decode may be called concurrently.
class Tokenizer {
 public:
  // Trains a sentencepiece model on `text` (valid UTF-8) and writes it to
  // `model_path` atomically. Deterministic: the same text and options give the
  // same bytes.
  static Tokenizer train(std::string_view text, const std::filesystem::path& model_path,
                         const TokenizerTrainOptions& opts = {});
  // The same, reading the text from `text_path`.
  static Tokenizer train_file(const std::filesystem::path& text_path, const std::filesystem::path& model_path,
                              const TokenizerTrainOptions& opts = {});
  // A file is read as tokenizer.json when its name ends in .json or its first
  // byte is '{', else as a sentencepiece model; a directory (a Hugging Face
  // checkpoint, a `prepare` output) by its tokenizer.json, else its
  // tokenizer.model. bos_id/eos_id of a tokenizer.json come from the
  // bos_token/eos_token of a tokenizer_config.json beside it, when there is one.
  // Throws Error naming the path when it is missing or unreadable, and the path
  // and the key when the file is not a tokenizer loom reads.
  static Tokenizer load(const std::filesystem::path& path);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Throws Error giving the byte offset of invalid UTF-8.
  std::vector<int32_t> encode(std::string_view text) const;
  // Throws Error naming an id outside [0, vocab_size()) or one no token has.
  // Special tokens are decoded to their text.
  std::string decode(std::span<const int32_t> ids) const;
  // The bytes of one token, for printing tokens as they are generated: byte
  // tokens give their raw byte (a character may span several tokens, so the
  // concatenation, not each piece, is UTF-8), sentencepiece control tokens
  // give "". Concatenating decode_piece over ids equals decode(ids).
  std::string decode_piece(int32_t id) const;

  // One more than the largest id (a tokenizer.json's added tokens included).
  int vocab_size() const;
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  // The file read (a directory given to `load` resolved to its file).
  const std::filesystem::path& path() const;
  // Whether this is a Hugging Face tokenizer.json (else a sentencepiece model).
  bool is_hf_json() const;

 private:
  explicit Tokenizer(std::unique_ptr<const data::TokenizerBackend> impl);
  std::unique_ptr<const data::TokenizerBackend> impl_;
};

// ---------------------------------------------------------------------------
// Token shards (llm.c's .bin format)
// ---------------------------------------------------------------------------
//
// A header of 256 little-endian int32: [0] magic, [1] version, [2] token count,
// the rest zero; then `count` little-endian tokens. Versions of magic 20240520:
//   1  uint16 tokens (llm.c's GPT-2 shards, byte for byte)
//   2  uint32 tokens (loom's extension for vocabularies above 65536)
// llm.c's own uint32 shards (magic 20240801, version 7, written by its LLaMA-3
// tooling) are read as well, so every shard llm.c writes loads unchanged.

constexpr int32_t kShardMagic = 20240520;
constexpr int32_t kShardVersionU16 = 1;
constexpr int32_t kShardVersionU32 = 2;
constexpr int32_t kLlmcU32ShardMagic = 20240801;
constexpr int32_t kLlmcU32ShardVersion = 7;
constexpr int kShardHeaderInts = 256;
constexpr size_t kShardHeaderBytes = kShardHeaderInts * sizeof(int32_t);

// Writes `tokens` atomically (temp file, fsync, rename): readers never see a
// half-written shard. Version 1 when vocab_size <= 65536, else version 2.
// Throws Error naming the first token outside [0, vocab_size).
void write_token_shard(const std::filesystem::path& path, std::span<const int32_t> tokens, int vocab_size);

// A read-only, memory-mapped shard, validated on open: magic, version and the
// header's count against the file size (Error naming the file and the problem).
class TokenShard {
 public:
  explicit TokenShard(const std::filesystem::path& path);
  TokenShard(TokenShard&&) noexcept;
  TokenShard& operator=(TokenShard&&) noexcept;
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;
  ~TokenShard();

  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return count_; }
  int token_bytes() const { return token_bytes_; }
  int32_t token(int64_t i) const;
  // out[j] = token(start + j); the range must lie within the shard.
  void read(int64_t start, std::span<int32_t> out) const;
  // Scans the shard (-1 when empty), so a trainer can hold the data against its
  // model's vocabulary before training.
  int64_t max_token_id() const;

 private:
  std::filesystem::path path_;
  const uint8_t* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t count_ = 0;
  int token_bytes_ = 2;
};

// ---------------------------------------------------------------------------
// Loss masks (loom's, beside a fine-tuning dataset's token shards)
// ---------------------------------------------------------------------------
//
// Which tokens of a shard are loss targets. A header of 256 little-endian
// int32: [0] kMaskMagic, [1] kMaskVersion, [2] token count N (the shard's),
// [3] the row length T the examples were packed for (the training seq_len),
// the rest zero; then ceil(N / 8) bytes, bit i (byte i / 8, bit i % 8 from the
// least significant) set when token i is a target. The token shard itself
// stays in llm.c's format.

constexpr int32_t kMaskMagic = 20261124;
constexpr int32_t kMaskVersion = 1;

// Writes mask[i] != 0 as bit i, atomically.
void write_loss_mask(const std::filesystem::path& path, std::span<const uint8_t> mask, int seq_len);

// A mask read whole into memory (one bit per token) and validated: magic,
// version, sizes (Error naming the file and the problem).
class LossMask {
 public:
  explicit LossMask(const std::filesystem::path& path);
  const std::filesystem::path& path() const { return path_; }
  int64_t size() const { return count_; }
  int seq_len() const { return seq_len_; }
  bool is_target(int64_t i) const;
  // targets[j] = -1 where token start + j is not a target; the range must lie
  // within the mask.
  void apply(int64_t start, std::span<int32_t> targets) const;

 private:
  std::filesystem::path path_;
  std::vector<uint8_t> bits_;
  int64_t count_ = 0;
  int seq_len_ = 0;
};

// ---------------------------------------------------------------------------
// prepare: text -> tokenizer + train/val shards + dataset.json
// ---------------------------------------------------------------------------

struct SplitInfo {
  std::filesystem::path file;  // absolute once read; relative to the dataset in JSON
  int64_t tokens = 0;
  int64_t chars = 0;  // Unicode code points (of the responses, for fine-tuning data)
  int64_t bytes = 0;  // UTF-8 bytes (likewise)
  // Fine-tuning data only: the loss mask beside `file`, the tokens it marks
  // as targets, the examples packed and how many of them were truncated.
  std::filesystem::path mask{};
  int64_t targets = 0;
  int64_t examples = 0;
  int64_t truncated = 0;
  // loss per character = loss per target token / chars_per_token(): every
  // token is a target of plain text, only the marked ones of fine-tuning data.
  double chars_per_token() const {
    const int64_t n = mask.empty() ? tokens : targets;
    return n > 0 ? static_cast<double>(chars) / static_cast<double>(n) : 0.0;
  }
  // The loss masks for a loader: this split's, or none for text.
  std::vector<std::filesystem::path> masks() const {
    if (mask.empty()) return {};
    return {mask};
  }
};

// text: pretraining on every token; sft: supervised fine-tuning, the loss on
// the response tokens only (a loss mask per split).
enum class DatasetMode { text, sft };

// What `prepare` wrote, from <dir>/dataset.json.
struct DatasetInfo {
  std::filesystem::path dir;
  std::vector<std::string> sources;  // the input files, in order
  // The SHA-256 of each source's bytes, so that a run naming other text is
  // refused (loom train, data.text); empty for a dataset prepared before
  // they were recorded.
  std::vector<std::string> sources_sha256;
  double val_fraction = 0.0;
  int vocab_size = 0;
  std::filesystem::path tokenizer;  // absolute once read
  // Recorded so a dataset is never decoded with a tokenizer other than the one
  // that encoded it.
  std::string tokenizer_sha256;
  DatasetMode mode = DatasetMode::text;
  // sft: the row length the examples were packed for, which training's seq_len must equal.
  int seq_len = 0;
  SplitInfo train, val;

  // Throws Error naming the file when it is missing, not JSON or lacks a key,
  // and naming a mask file the description lists that does not exist.
  static DatasetInfo read(const std::filesystem::path& dir);
  // Writes <dir>/dataset.json atomically.
  void write() const;
};

struct PrepareOptions {
  // UTF-8 text, concatenated in order; with `sft`, JSONL files of examples.
  std::vector<std::filesystem::path> inputs{};
  std::filesystem::path out_dir{};
  // Train a new tokenizer on the train split (empty), or reuse this model file.
  std::filesystem::path tokenizer{};
  // 0: kDefaultVocabSize when training, the model's own when reusing; when
  // reusing, any other value must equal the model's.
  int vocab_size = 0;
  // The validation split is the end of the corpus from the first line start at
  // or after (1 - val_fraction) of its bytes (from that byte itself when no
  // line starts between there and the end): deterministic.
  double val_fraction = 0.1;
  // Each split must hold at least seq_len + 1 tokens (one training sequence).
  int seq_len = 256;
  uint32_t seed = 1234;  // tokenizer training
  // Supervised fine-tuning (docs/data.md): each input line is an example,
  // {"prompt": ..., "response": ...} or {"messages": [{"role", "content"}]};
  // examples are packed into rows of seq_len tokens with a loss mask on the
  // responses. Needs `tokenizer`; val is the last val_fraction of the examples.
  bool sft = false;
  // sft: the id ending each response; default the tokenizer's eos_id.
  std::optional<int32_t> eos{};
};

// Checks options, inputs (readable, UTF-8; with `sft` every JSONL line),
// split sizes and a reused tokenizer's vocabulary before writing anything;
// then writes
// <out>/tokenizer.model, tokenizes, checks the token counts and the round trip,
// and writes train.bin, val.bin (with `sft` train.mask.bin and val.mask.bin)
// and, last, so that its presence marks a complete dataset, dataset.json.
DatasetInfo prepare_dataset(const PrepareOptions& opts);

// ---------------------------------------------------------------------------
// Training loader
// ---------------------------------------------------------------------------
//
// The shards are cut into windows of T + 1 tokens (inputs are the first T,
// targets the last T) that never straddle two shards. Each epoch visits every
// window once in an order that is a pure function of (seed, epoch, index), and
// with shuffling each shard's windows start at an offset in [0, T) drawn per
// (seed, epoch, shard), so epochs see different cuts of the text. Step k of an
// epoch is the global batch of G windows at order positions [k*G, (k+1)*G);
// dp rank r takes [r*G/D, (r+1)*G/D) of it in micro-batches of B. The global
// batch is thus the same whatever D is; the last (windows mod G) positions of
// an epoch's order are skipped so every step is full.

struct LoaderOptions {
  std::vector<std::filesystem::path> shards{};
  // One loss mask per shard (fine-tuning data), or none: targets of tokens
  // the mask leaves out are -1. Packed rows are whole windows, so with masks
  // every epoch's windows start at multiples of T (the order still shuffles)
  // and T must be the masks' row length.
  std::vector<std::filesystem::path> masks{};
  int seq_len = 0;       // T
  int micro_batch = 0;   // B: sequences per rank per next()
  int global_batch = 0;  // G: sequences per optimizer step over all dp ranks,
                         // a multiple of B * dp_size (the rest is accumulation)
  int dp_rank = 0;
  int dp_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
};

// Where a loader is: plain data for checkpoints. Saved between steps (micro ==
// 0) it is the same on every rank, and restores under another dp_size.
struct LoaderState {
  int64_t epoch = 0;
  int64_t step = 0;   // global batch within the epoch
  int64_t micro = 0;  // micro-batches of this rank's slice already served
  bool operator==(const LoaderState&) const = default;
};
void to_json(nlohmann::json& j, const LoaderState& s);
void from_json(const nlohmann::json& j, LoaderState& s);

class TokenLoader {
 public:
  // Opens and validates every shard; throws Error naming a shard shorter than
  // T + 1 tokens, or the counts when the shards hold fewer than G windows.
  explicit TokenLoader(const LoaderOptions& opts);

  // Fills B*T inputs and targets (row-major [B, T]) with the next micro-batch
  // and returns the position of its first sequence within the global batch, for
  // layout-independent dropout masks.
  int64_t next(std::span<int32_t> inputs, std::span<int32_t> targets);

  LoaderState state() const { return state_; }
  // Throws Error when the state lies outside this loader's epoch.
  void restore(const LoaderState& state);

  int64_t windows_per_epoch() const { return windows_per_epoch_; }
  int64_t steps_per_epoch() const { return windows_per_epoch_ / opts_.global_batch; }
  int micro_batches_per_step() const { return opts_.global_batch / (opts_.dp_size * opts_.micro_batch); }
  // Throws Error naming the first shard holding a token >= vocab_size, with its
  // largest id and the vocabulary.
  void check_vocab(int vocab_size) const;
  const std::vector<TokenShard>& shards() const { return shards_; }

 private:
  bool offsets() const { return opts_.shuffle && opts_.masks.empty(); }

  LoaderOptions opts_;
  std::vector<TokenShard> shards_;
  std::vector<LossMask> masks_;
  std::vector<int64_t> first_window_;  // per shard, prefix sums of windows
  int64_t windows_per_epoch_ = 0;
  LoaderState state_;
};

// ---------------------------------------------------------------------------
// Evaluation loader
// ---------------------------------------------------------------------------
//
// Every non-overlapping window [i*T, i*T + T + 1) of every shard, in order, no
// shuffling. Dp rank r evaluates windows [r*W/D, (r+1)*W/D) of the W windows;
// every rank runs the same number of batches (a collective per batch stays
// matched), padding short ones with input 0 and target -1, which the
// cross-entropy kernel ignores. With loss masks (one per shard, as
// LoaderOptions::masks) the targets they leave out are -1 too.

class EvalLoader {
 public:
  EvalLoader(const std::vector<std::filesystem::path>& shards, int seq_len, int micro_batch, int dp_rank = 0,
             int dp_size = 1, const std::vector<std::filesystem::path>& masks = {});

  // Fills the next B*T inputs and targets and returns how many rows are real
  // (possibly 0 on a rank with fewer windows); nullopt once every batch has
  // been served, after which `reset` starts over.
  std::optional<int> next(std::span<int32_t> inputs, std::span<int32_t> targets);
  void reset() { batch_ = 0; }

  int64_t total_windows() const { return first_window_.back(); }
  int64_t rank_windows() const { return end_ - begin_; }
  int64_t batches() const { return batches_; }
  // The target positions the whole split's evaluation covers (all ranks),
  // those a loss mask leaves out included.
  int64_t target_tokens() const { return total_windows() * seq_len_; }
  void check_vocab(int vocab_size) const;

 private:
  std::vector<TokenShard> shards_;
  std::vector<LossMask> masks_;
  std::vector<int64_t> first_window_;
  int seq_len_;
  int micro_batch_;
  int64_t begin_ = 0, end_ = 0, batches_ = 0, batch_ = 0;
};

}  // namespace loom
