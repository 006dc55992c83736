// Hugging Face tokenizer.json with a byte-level BPE model, reproducing the ids
// of the `tokenizers` library (encode with add_special_tokens=False).
//
// Supported, as GPT-2 and LLaMA-3 files use them:
//   normalizer     null
//   pre_tokenizer  ByteLevel (add_prefix_space, use_regex: GPT-2's pattern), or a
//                  Sequence of Split (Regex or String pattern, behavior Isolated,
//                  invert false) ending in one ByteLevel
//   model          BPE: vocab, merges ("a b" or [a, b]), ignore_merges,
//                  byte_fallback, unk_token, fuse_unk (no dropout,
//                  continuing_subword_prefix or end_of_word_suffix)
//   decoder        ByteLevel
//   added_tokens   content, id, single_word, lstrip, rstrip, normalized
//   post_processor ignored: encode adds no special tokens
// Anything else is an Error naming the file and the key.
//
// The pipeline, as `tokenizers` runs it: added tokens are cut out of the text
// first (leftmost-longest literal matches; tokens with normalized=false on the
// raw text, then those with normalized=true on the pieces between), each
// remaining piece is pre-tokenized by the regexes (PCRE2 with UCP, so \p{L},
// \p{N} and \s follow Unicode as Oniguruma's do), and each pre-token's bytes,
// mapped to GPT-2's byte alphabet, are merged by rank.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "data/tokenizer_backend.h"
#include "loom/core.h"
#include "loom/data.h"
#include "loom/io.h"

namespace loom::data {
namespace {

using json = nlohmann::json;

// The ByteLevel pre-tokenizer's built-in pattern (GPT-2's).
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Far above any real vocabulary (LLaMA-3: 128,256).
constexpr int64_t kMaxTokenId = int64_t{1} << 24;

// A pre-token longer than this is not cached: long runs (whitespace, minified
// code) rarely repeat, and the cache should hold words.
constexpr size_t kMaxCachedPiece = 256;
// Entries of the per-call cache: a large corpus's distinct words stop being
// added here, so its memory stays bounded (some tens of MB).
constexpr size_t kMaxCacheEntries = size_t{1} << 18;

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the
// others for U+0100 onwards in byte order, so every token is printable text.
std::array<uint32_t, 256> byte_code_points() {
  std::array<uint32_t, 256> cp{};
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    cp[b] = printable ? b : next++;
  }
  return cp;
}

std::string utf8_of(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else if (cp < 0x800) {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    s += static_cast<char>(0xE0 | (cp >> 12));
    s += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

// The code point at `pos` of valid UTF-8 and its byte length.
std::pair<uint32_t, size_t> code_point_at(std::string_view s, size_t pos) {
  auto b = static_cast<uint8_t>(s[pos]);
  size_t len = b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
  uint32_t cp = len == 1 ? b : b & (0xFF >> (len + 1));
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<uint8_t>(s[pos + k]) & 0x3F);
  return {cp, len};
}

size_t utf8_length_at(std::string_view s, size_t pos) { return code_point_at(s, pos).second; }

// A compiled PCRE2 pattern; matching allocates its own match data, so one
// Regex serves concurrent encodes.
class Regex {
 public:
  Regex(std::string_view pattern, uint32_t options, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP | options, &err, &offset, nullptr);
    if (!code_)
      throw Error(str(where, " is not a regular expression PCRE2 accepts (", message(err), " at offset ", offset,
                      "): ", pattern));
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without JIT (an unsupported CPU) it interprets
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }

  // The matches in `s` (valid UTF-8) as [begin, end) byte ranges, as
  // Oniguruma's find_iter gives them: non-overlapping, an empty match skipped.
  template <class F>
  void for_each_match(std::string_view s, F&& f) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    size_t start = 0;
    while (start <= s.size()) {
      int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), start, PCRE2_NO_UTF_CHECK,
                           md.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) return;
      if (rc < 0) throw Error(str("pre-tokenizer regex failed on a piece of ", s.size(), " bytes: ", message(rc)));
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
      if (ov[0] == ov[1]) {
        if (ov[0] >= s.size()) return;
        start = ov[0] + utf8_length_at(s, ov[0]);
        continue;
      }
      f(ov[0], ov[1]);
      start = ov[1];
    }
  }

  // Whether the character at `pos` matches (for one-character classes, anchored).
  bool matches_at(std::string_view s, size_t pos) const {
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md(
        pcre2_match_data_create_from_pattern(code_, nullptr), &pcre2_match_data_free);
    return pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(s.data()), s.size(), pos,
                       PCRE2_NO_UTF_CHECK | PCRE2_ANCHORED, md.get(), nullptr) > 0;
  }

 private:
  static std::string message(int code) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(code, buf, sizeof(buf));
    return reinterpret_cast<const char*>(buf);
  }
  pcre2_code* code_ = nullptr;
};

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false;
};

// One step of the pre-tokenizer: split each piece by `regex` (Isolated: the
// matches and the text between them are all pieces), after prepending a space
// to a piece that lacks one when `add_prefix_space` (ByteLevel's option).
struct PreTokenizerStep {
  std::unique_ptr<Regex> regex;  // null: no split
  bool add_prefix_space = false;
};

// Reading the file, with errors that name it and the key.
class Reader {
 public:
  explicit Reader(const std::filesystem::path& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& key, const std::string& problem) const {
    throw Error(str("tokenizer.json ", path_, ": ", key, " ", problem));
  }
  const json& at(const json& obj, const std::string& key, const std::string& where) const {
    if (!obj.is_object() || !obj.contains(key)) fail(join(where, key), "is missing");
    return obj.at(key);
  }
  std::string string_at(const json& obj, const std::string& key, const std::string& where) const {
    const json& v = at(obj, key, where);
    if (!v.is_string()) fail(join(where, key), str("must be a string, not ", v.dump()));
    return v.get<std::string>();
  }
  bool flag(const json& obj, const std::string& key, const std::string& where, bool fallback = false) const {
    if (!obj.contains(key) || obj.at(key).is_null()) return fallback;
    if (!obj.at(key).is_boolean()) fail(join(where, key), str("must be true or false, not ", obj.at(key).dump()));
    return obj.at(key).get<bool>();
  }
  // Ids index a table of pieces, so a typo of a huge id must not allocate it.
  int32_t token_id(const json& id, const std::string& key) const {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= kMaxTokenId)
      fail(key, str("is ", id.dump(), "; token ids are integers in [0, ", kMaxTokenId, ")"));
    return id.get<int32_t>();
  }
  static std::string join(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

constexpr std::string_view kSupported =
    "loom reads byte-level BPE tokenizer.json files as GPT-2 and LLaMA-3 use them (model BPE, normalizer null, "
    "pre_tokenizer ByteLevel or a Sequence of Split (Isolated) and ByteLevel, decoder ByteLevel)";

class HfBpeBackend final : public TokenizerBackend {
 public:
  HfBpeBackend(const std::filesystem::path& path, std::string_view text) : TokenizerBackend(path) {
    json root;
    try {
      root = json::parse(text);
    } catch (const json::exception& e) {
      throw Error(str("tokenizer.json ", path, " is not valid JSON (", e.what(), ")"));
    }
    const std::array<uint32_t, 256> cp = byte_code_points();
    for (int b = 0; b < 256; ++b) {
      byte_char_[b] = utf8_of(cp[b]);
      char_byte_[cp[b]] = static_cast<uint8_t>(b);
    }
    Reader r(path);
    if (!root.is_object()) r.fail("the top level", str("must be a JSON object; ", kSupported));
    try {
      read_normalizer(r, root);
      read_model(r, r.at(root, "model", ""));
      read_pre_tokenizer(r, r.at(root, "pre_tokenizer", ""));
      read_decoder(r, r.at(root, "decoder", ""));
      read_added_tokens(r, root);
      read_config(path.parent_path() / "tokenizer_config.json");
    } catch (const json::exception& e) {
      throw Error(str("tokenizer.json ", path, " has an unexpected value (", e.what(), "); ", kSupported));
    }
  }

  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> out;
    Scratch scratch;
    for_each_added_split(text, /*normalized=*/false, [&](std::string_view piece, int32_t id) {
      if (id >= 0) return out.push_back(id);
      for_each_added_split(piece, /*normalized=*/true, [&](std::string_view sub, int32_t sub_id) {
        if (sub_id >= 0) return out.push_back(sub_id);
        pre_tokenize(sub, 0, [&](std::string_view word) { encode_word(word, scratch, out); });
      });
    });
    return out;
  }

  std::string decode(std::span<const int32_t> ids) const override {
    std::string text;
    for (int32_t id : ids) text += pieces_[id];
    return text;
  }
  std::string decode_piece(int32_t id) const override { return pieces_[id]; }
  int vocab_size() const override { return static_cast<int>(pieces_.size()); }
  std::optional<int32_t> bos_id() const override { return bos_; }
  std::optional<int32_t> eos_id() const override { return eos_; }
  bool is_hf_json() const override { return true; }
  bool is_hole(int32_t id) const override { return !has_token_[id]; }

 private:
  struct Merge {
    int32_t rank;
    int32_t new_id;
  };
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1 at the ends
    bool alive;
  };
  struct Candidate {
    int32_t rank, pos, new_id;
    // The lowest rank first, then the leftmost, as `tokenizers` orders merges.
    bool operator<(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  struct StringHash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
  };
  // Per encode call, so concurrent encodes share nothing mutable.
  struct Scratch {
    // Pre-token -> ids, as `tokenizers` caches words: text repeats its words.
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache;
    std::vector<Symbol> symbols;
    std::priority_queue<Candidate> queue;
    std::string mapped;
  };

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }

  void read_normalizer(const Reader& r, const json& root) {
    if (!root.contains("normalizer") || root.at("normalizer").is_null()) return;
    const json& n = root.at("normalizer");
    r.fail("normalizer", str("is ", n.contains("type") ? n.at("type").dump() : n.dump(),
                             ", which loom does not support: only null; ", kSupported));
  }

  int32_t token_id(const Reader& r, const std::string& token, const std::string& key) const {
    auto it = vocab_.find(token);
    if (it == vocab_.end()) r.fail(key, str("names \"", token, "\", which is not in model.vocab"));
    return it->second;
  }

  void read_model(const Reader& r, const json& model) {
    std::string type = r.string_at(model, "type", "model");
    if (type != "BPE") r.fail("model.type", str("is \"", type, "\"; ", kSupported));
    if (model.contains("dropout") && !model.at("dropout").is_null() && model.at("dropout").get<double>() != 0.0)
      r.fail("model.dropout", "is set; BPE dropout samples tokenizations, so loom reads only dropout null");
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
      if (model.contains(key) && !model.at(key).is_null() && !model.at(key).get<std::string>().empty())
        r.fail(str("model.", key), str("is set; ", kSupported));

    const json& vocab = r.at(model, "vocab", "model");
    if (!vocab.is_object()) r.fail("model.vocab", "must be an object of token: id");
    for (const auto& [token, id] : vocab.items()) {
      const int32_t checked = r.token_id(id, str("model.vocab[\"", token, "\"]"));
      vocab_.emplace(token, checked);
      set_piece(checked, token);
    }

    const json& merges = r.at(model, "merges", "model");
    if (!merges.is_array()) r.fail("model.merges", "must be an array");
    merges_.reserve(merges.size());
    for (size_t i = 0; i < merges.size(); ++i) {
      const json& m = merges[i];
      const std::string key = str("model.merges[", i, "]");
      std::string a, b;
      if (m.is_string()) {
        // "a b": tokens never contain a plain space (the byte alphabet maps it to Ġ).
        const std::string& s = m.get_ref<const std::string&>();
        size_t space = s.find(' ');
        if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
          r.fail(key, str("is \"", s, "\"; a merge is \"left right\" or [left, right]"));
        a = s.substr(0, space);
        b = s.substr(space + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        r.fail(key, str("is ", m.dump(), "; a merge is \"left right\" or [left, right]"));
      }
      const int32_t ia = token_id(r, a, key), ib = token_id(r, b, key), merged = token_id(r, a + b, key);
      // A repeated pair keeps its last rank, as `tokenizers` builds its map.
      merges_[pair_key(ia, ib)] = Merge{static_cast<int32_t>(i), merged};
    }

    ignore_merges_ = r.flag(model, "ignore_merges", "model");
    byte_fallback_ = r.flag(model, "byte_fallback", "model");
    fuse_unk_ = r.flag(model, "fuse_unk", "model");
    if (model.contains("unk_token") && !model.at("unk_token").is_null())
      unk_id_ = token_id(r, r.string_at(model, "unk_token", "model"), "model.unk_token");

    for (int b = 0; b < 256; ++b) {
      auto it = vocab_.find(byte_char_[b]);
      byte_id_[b] = it == vocab_.end() ? -1 : it->second;
      // `tokenizers` falls back on the bytes of the mapped character, <0xC4>
      // <0xA0> for the space's Ġ, not on the original byte.
      std::vector<int32_t> fallback;
      for (char c : byte_char_[b]) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<uint8_t>(c));
        auto f = vocab_.find(name);
        if (f == vocab_.end()) {
          fallback.clear();
          break;
        }
        fallback.push_back(f->second);
      }
      fallback_ids_[b] = std::move(fallback);
    }
  }

  void read_pre_tokenizer(const Reader& r, const json& pt) {
    if (pt.is_null()) r.fail("pre_tokenizer", str("is null; ", kSupported));
    std::string type = r.string_at(pt, "type", "pre_tokenizer");
    if (type == "ByteLevel") {
      add_byte_level(r, pt, "pre_tokenizer");
      return;
    }
    if (type != "Sequence") r.fail("pre_tokenizer.type", str("is \"", type, "\"; ", kSupported));
    const json& list = r.at(pt, "pretokenizers", "pre_tokenizer");
    if (!list.is_array() || list.empty()) r.fail("pre_tokenizer.pretokenizers", "must be a non-empty array");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = str("pre_tokenizer.pretokenizers[", i, "]");
      std::string t = r.string_at(list[i], "type", where);
      const bool last = i + 1 == list.size();
      if (t == "ByteLevel" && last) {
        add_byte_level(r, list[i], where);
      } else if (t == "Split" && !last) {
        add_split(r, list[i], where);
      } else {
        r.fail(where + ".type", str("is \"", t, "\"", t == "ByteLevel" || t == "Split" ? " at this position" : "",
                                    "; a Sequence must be Split steps followed by one ByteLevel; ", kSupported));
      }
    }
  }

  void add_byte_level(const Reader& r, const json& pt, const std::string& where) {
    PreTokenizerStep step;
    step.add_prefix_space = r.flag(pt, "add_prefix_space", where);
    if (r.flag(pt, "use_regex", where, true))
      step.regex = std::make_unique<Regex>(kGpt2Pattern, 0, "ByteLevel's GPT-2 pattern");
    steps_.push_back(std::move(step));
  }

  void add_split(const Reader& r, const json& split, const std::string& where) {
    const std::string behavior = r.string_at(split, "behavior", where);
    if (behavior != "Isolated")
      r.fail(where + ".behavior", str("is \"", behavior, "\"; loom supports Split with behavior Isolated"));
    if (r.flag(split, "invert", where)) r.fail(where + ".invert", "is true; loom supports invert false");
    const json& pattern = r.at(split, "pattern", where);
    PreTokenizerStep step;
    if (pattern.contains("Regex")) {
      step.regex = std::make_unique<Regex>(r.string_at(pattern, "Regex", where + ".pattern"), 0,
                                           str("tokenizer.json ", r.path(), ": ", where, ".pattern.Regex"));
    } else if (pattern.contains("String")) {
      step.regex = std::make_unique<Regex>(r.string_at(pattern, "String", where + ".pattern"), PCRE2_LITERAL,
                                           str("tokenizer.json ", r.path(), ": ", where, ".pattern.String"));
    } else {
      r.fail(where + ".pattern", str("is ", pattern.dump(), "; expected {\"Regex\": ...} or {\"String\": ...}"));
    }
    steps_.push_back(std::move(step));
  }

  void read_decoder(const Reader& r, const json& decoder) {
    if (decoder.is_null()) r.fail("decoder", str("is null; ", kSupported));
    std::string type = r.string_at(decoder, "type", "decoder");
    if (type != "ByteLevel") r.fail("decoder.type", str("is \"", type, "\"; ", kSupported));
  }

  void read_added_tokens(const Reader& r, const json& root) {
    if (!root.contains("added_tokens") || root.at("added_tokens").is_null()) return;
    const json& list = root.at("added_tokens");
    if (!list.is_array()) r.fail("added_tokens", "must be an array");
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string where = str("added_tokens[", i, "]");
      AddedToken t;
      t.content = r.string_at(list[i], "content", where);
      t.id = r.token_id(r.at(list[i], "id", where), where + ".id");
      if (t.content.empty()) r.fail(where + ".content", "is empty");
      if (invalid_utf8_offset(t.content)) r.fail(where + ".content", "is not valid UTF-8");
      t.single_word = r.flag(list[i], "single_word", where);
      t.lstrip = r.flag(list[i], "lstrip", where);
      t.rstrip = r.flag(list[i], "rstrip", where);
      t.normalized = r.flag(list[i], "normalized", where);
      set_piece(t.id, t.content);
      added_by_content_[t.content] = t.id;
      auto& set = t.normalized ? normalized_added_ : raw_added_;
      set.tokens.push_back(std::move(t));
    }
    for (AddedSet* set : {&raw_added_, &normalized_added_}) {
      // Longest first, so the first token that matches at a position is the
      // leftmost-longest match `tokenizers`' Aho-Corasick automaton finds.
      std::stable_sort(set->tokens.begin(), set->tokens.end(),
                       [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
      for (size_t k = 0; k < set->tokens.size(); ++k)
        set->by_first_byte[static_cast<uint8_t>(set->tokens[k].content[0])].push_back(static_cast<int>(k));
    }
  }

  // bos_token / eos_token: a string or {"content": ...}, as transformers writes them.
  void read_config(const std::filesystem::path& config_path) {
    std::error_code ec;
    if (!std::filesystem::is_regular_file(config_path, ec)) return;
    json config;
    try {
      config = json::parse(loom::read_file(config_path));
    } catch (const json::exception& e) {
      throw Error(str(config_path, " is not valid JSON (", e.what(), ")"));
    }
    auto id_of = [&](const char* key) -> std::optional<int32_t> {
      if (!config.contains(key) || config.at(key).is_null()) return std::nullopt;
      const json& v = config.at(key);
      const json& content = v.is_object() && v.contains("content") ? v.at("content") : v;
      if (!content.is_string()) throw Error(str(config_path, ": ", key, " is ", v.dump(), "; expected a token string"));
      const std::string& token = content.get_ref<const std::string&>();
      if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
      if (auto it = vocab_.find(token); it != vocab_.end()) return it->second;
      throw Error(str(config_path, ": ", key, " \"", token, "\" is not a token of ", path()));
    };
    bos_ = id_of("bos_token");
    eos_ = id_of("eos_token");
  }

  // The bytes a token decodes to, by the ByteLevel decoder's rule: a token
  // whose every character is in the byte alphabet gives those bytes, any other
  // (an added token with a space, say) its own UTF-8.
  void set_piece(int32_t id, const std::string& token) {
    if (static_cast<size_t>(id) >= pieces_.size()) {
      pieces_.resize(static_cast<size_t>(id) + 1);
      has_token_.resize(static_cast<size_t>(id) + 1, false);
    }
    has_token_[id] = true;
    std::string bytes;
    for (size_t pos = 0; pos < token.size();) {
      auto [cp, len] = code_point_at(token, pos);
      auto it = char_byte_.find(cp);
      if (it == char_byte_.end()) {
        bytes = token;
        break;
      }
      bytes += static_cast<char>(it->second);
      pos += len;
    }
    pieces_[id] = std::move(bytes);
  }

  struct AddedSet {
    std::vector<AddedToken> tokens;
    std::array<std::vector<int>, 256> by_first_byte;
  };

  // Calls f(piece, id) over `text` cut at the added tokens of one set: id is
  // the token's, or -1 for the text between. `tokenizers`' AddedVocabulary::
  // find_matches, with its single_word, lstrip and rstrip rules.
  template <class F>
  void for_each_added_split(std::string_view text, bool normalized, F&& f) const {
    const AddedSet& set = normalized ? normalized_added_ : raw_added_;
    if (set.tokens.empty()) {
      if (!text.empty()) f(text, -1);
      return;
    }
    size_t emitted = 0;  // text before this is handed out
    size_t search = 0;   // where the next match may start
    while (true) {
      auto [start, hit] = find_added(set, text, search);
      if (!hit) break;
      size_t stop = start + hit->content.size();
      search = stop;
      if (hit->single_word) {
        bool word_before = start > 0 && ends_with_word(text.substr(0, start));
        bool word_after = stop < text.size() && word_char_.matches_at(text, stop);
        if (word_before || word_after) continue;
      }
      if (hit->lstrip) start = std::max(start_of_trailing_space(text.substr(0, start)), emitted);
      if (hit->rstrip)
        while (stop < text.size() && space_char_.matches_at(text, stop)) stop += utf8_length_at(text, stop);
      if (emitted < start) f(text.substr(emitted, start - emitted), -1);
      f(text.substr(start, stop - start), hit->id);
      emitted = stop;
    }
    if (emitted < text.size()) f(text.substr(emitted), -1);
  }

  // The leftmost-longest added token at or after `from`: where and which (null for none).
  static std::pair<size_t, const AddedToken*> find_added(const AddedSet& set, std::string_view text, size_t from) {
    for (size_t pos = from; pos < text.size(); ++pos)
      for (int k : set.by_first_byte[static_cast<uint8_t>(text[pos])])
        if (text.substr(pos).starts_with(set.tokens[k].content)) return {pos, &set.tokens[k]};
    return {text.size(), nullptr};
  }

  static size_t previous_char_start(std::string_view s, size_t end) {
    size_t pos = end - 1;
    while (pos > 0 && (static_cast<uint8_t>(s[pos]) & 0xC0) == 0x80) --pos;
    return pos;
  }
  bool ends_with_word(std::string_view s) const { return word_char_.matches_at(s, previous_char_start(s, s.size())); }
  size_t start_of_trailing_space(std::string_view s) const {
    size_t start = s.size();
    while (start > 0) {
      size_t prev = previous_char_start(s, start);
      if (!space_char_.matches_at(s, prev)) break;
      start = prev;
    }
    return start;
  }

  // Runs the pre-tokenizer steps from `step` on `piece`, calling f per pre-token.
  template <class F>
  void pre_tokenize(std::string_view piece, size_t step, F&& f) const {
    if (step == steps_.size()) return f(piece);
    const PreTokenizerStep& s = steps_[step];
    if (s.add_prefix_space && !piece.starts_with(' ')) {
      // The only copy the pipeline makes: the space is not in the text.
      std::string spaced(1, ' ');
      spaced.append(piece);
      return split_step(s, spaced, step, f);
    }
    split_step(s, piece, step, f);
  }
  template <class F>
  void split_step(const PreTokenizerStep& s, std::string_view piece, size_t step, F&& f) const {
    if (!s.regex) return pre_tokenize(piece, step + 1, f);
    size_t prev = 0;
    s.regex->for_each_match(piece, [&](size_t begin, size_t end) {
      if (prev < begin) pre_tokenize(piece.substr(prev, begin - prev), step + 1, f);
      pre_tokenize(piece.substr(begin, end - begin), step + 1, f);
      prev = end;
    });
    if (prev < piece.size()) pre_tokenize(piece.substr(prev), step + 1, f);
  }

  // The ids of one pre-token (raw bytes), cached per encode call.
  void encode_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const {
    const bool cacheable = word.size() <= kMaxCachedPiece;
    if (cacheable) {
      if (auto it = scratch.cache.find(word); it != scratch.cache.end()) {
        out.insert(out.end(), it->second.begin(), it->second.end());
        return;
      }
    }
    const size_t first = out.size();
    merge_word(word, scratch, out);
    if (cacheable && scratch.cache.size() < kMaxCacheEntries)
      scratch.cache.emplace(word, std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
  }

  void merge_word(std::string_view word, Scratch& scratch, std::vector<int32_t>& out) const {
    if (ignore_merges_) {
      scratch.mapped.clear();
      for (char c : word) scratch.mapped += byte_char_[static_cast<uint8_t>(c)];
      if (auto it = vocab_.find(scratch.mapped); it != vocab_.end()) return out.push_back(it->second);
    }
    // Initial symbols: one per byte, as `tokenizers`' BPE::merge_word builds them.
    std::vector<Symbol>& sym = scratch.symbols;
    sym.clear();
    auto add = [&](int32_t id) {
      const auto n = static_cast<int32_t>(sym.size());
      sym.push_back({id, n - 1, -1, true});
      if (n > 0) sym[n - 1].next = n;
    };
    bool unk_pending = false;
    for (char c : word) {
      const auto b = static_cast<uint8_t>(c);
      if (byte_id_[b] >= 0) {
        if (unk_pending) add(unk_id_);
        unk_pending = false;
        add(byte_id_[b]);
        continue;
      }
      if (byte_fallback_ && !fallback_ids_[b].empty()) {
        for (int32_t id : fallback_ids_[b]) add(id);
        continue;
      }
      if (unk_id_ < 0) continue;  // `tokenizers` drops a character it cannot represent
      if (unk_pending && !fuse_unk_) add(unk_id_);
      unk_pending = true;
    }
    if (unk_pending) add(unk_id_);

    auto& queue = scratch.queue;
    auto push = [&](int32_t pos) {
      const Symbol& s = sym[pos];
      if (s.next < 0) return;
      if (auto it = merges_.find(pair_key(s.id, sym[s.next].id)); it != merges_.end())
        queue.push({it->second.rank, pos, it->second.new_id});
    };
    for (int32_t pos = 0; pos + 1 < static_cast<int32_t>(sym.size()); ++pos) push(pos);
    while (!queue.empty()) {
      const Candidate top = queue.top();
      queue.pop();
      Symbol& left = sym[top.pos];
      if (!left.alive || left.next < 0) continue;
      // A stale candidate: one of its symbols has merged since it was queued.
      auto it = merges_.find(pair_key(left.id, sym[left.next].id));
      if (it == merges_.end() || it->second.new_id != top.new_id) continue;
      Symbol& right = sym[left.next];
      left.id = top.new_id;
      right.alive = false;
      left.next = right.next;
      if (right.next >= 0) sym[right.next].prev = top.pos;
      if (left.prev >= 0) push(left.prev);
      push(top.pos);
    }
    for (const Symbol& s : sym)
      if (s.alive) out.push_back(s.id);
  }

  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, Merge> merges_;
  std::unordered_map<std::string, int32_t> added_by_content_;
  AddedSet raw_added_, normalized_added_;
  std::vector<PreTokenizerStep> steps_;
  std::array<std::string, 256> byte_char_;  // a byte's character in the byte alphabet, UTF-8
  std::unordered_map<uint32_t, uint8_t> char_byte_;
  std::array<int32_t, 256> byte_id_{};  // the vocab id of a byte's character, -1 if absent
  std::array<std::vector<int32_t>, 256> fallback_ids_;
  std::vector<std::string> pieces_;  // per id: the bytes it decodes to
  std::vector<bool> has_token_;
  bool ignore_merges_ = false, byte_fallback_ = false, fuse_unk_ = false;
  int32_t unk_id_ = -1;
  std::optional<int32_t> bos_, eos_;
  // The classes `tokenizers` tests with Rust's \w and \s for single_word and lstrip/rstrip.
  Regex word_char_{R"(\w)", 0, "the word-character class"};
  Regex space_char_{R"(\s)", 0, "the whitespace class"};
};

}  // namespace

std::unique_ptr<const TokenizerBackend> load_hf_tokenizer(const std::filesystem::path& path,
                                                          std::string_view json_text) {
  return std::make_unique<HfBpeBackend>(path, json_text);
}

}  // namespace loom::data
