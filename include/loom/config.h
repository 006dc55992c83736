// loom config: a typed schema of dotted keys ("model.n_layer") and the values
// of one run, loaded from TOML, overridden from the command line, and stored
// as JSON in checkpoints and manifests. Every value is checked against the
// schema when it is set, so a run fails on bad input before it allocates.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "loom/core.h"

namespace loom {

enum class ConfigType : uint8_t {
  integer,  // int64_t
  real,     // double; TOML/JSON integers are accepted and widened
  boolean,  // bool
  string,   // std::string
  choice,   // std::string, one of the key's choices
  bytes,    // std::string such as "2GiB" or "unlimited", checked by parse_bytes
};
const char* config_type_name(ConfigType t);

using ConfigValue = std::variant<int64_t, double, bool, std::string>;

// How a value prints in messages and overrides: 6, 0.0003, true, "bf16".
std::string format_config_value(const ConfigValue& v);

struct ConfigKey {
  std::string name;  // "section.key"; a key without a dot is top level
  ConfigType type;
  ConfigValue default_value;
  std::string doc;                   // one line
  std::vector<std::string> choices;  // choice keys only
  // Inclusive bounds; integer keys hold int64_t, real keys double.
  std::optional<ConfigValue> min;
  std::optional<ConfigValue> max;

  // "integer in [1, 96]", "one of fp32, bf16, fp16", ...
  std::string describe_type() const;
};

// The keys a program accepts, in registration order (the order of to_toml()).
class ConfigSchema {
 public:
  ConfigSchema& add_int(std::string name, int64_t def, std::string doc, std::optional<int64_t> min = {},
                        std::optional<int64_t> max = {});
  ConfigSchema& add_float(std::string name, double def, std::string doc, std::optional<double> min = {},
                          std::optional<double> max = {});
  ConfigSchema& add_bool(std::string name, bool def, std::string doc);
  ConfigSchema& add_string(std::string name, std::string def, std::string doc);
  ConfigSchema& add_choice(std::string name, std::string def, std::vector<std::string> choices, std::string doc);
  ConfigSchema& add_bytes(std::string name, std::string def, std::string doc);

  const std::vector<ConfigKey>& keys() const { return keys_; }
  const ConfigKey* find(std::string_view name) const;
  // Whether `name` is a section: a proper dotted prefix of some key ("model").
  bool has_section(std::string_view name) const;
  // The closest registered key name to a misspelt one, if any is close.
  std::optional<std::string> suggest(std::string_view name) const;
  // " (did you mean 'model.n_layer'?)" style suffix for messages, or a list of
  // the known sections when nothing is close.
  std::string unknown_key_hint(std::string_view name) const;

 private:
  ConfigSchema& add(ConfigKey key);
  std::vector<ConfigKey> keys_;
};

// The candidate closest to `word` by edit distance, if within a distance that
// still reads as a typo (about a third of the word). Used for every
// "did you mean" in loom.
std::optional<std::string> did_you_mean(std::string_view word, const std::vector<std::string>& candidates);

// Parses "2GiB", "512MiB", "1.5GiB", "64KB", "1000", "unlimited" (= kUnlimited).
// Binary units KiB..TiB, decimal units KB..TB, B or none for bytes; throws
// Error naming the text and the accepted forms.
size_t parse_bytes(std::string_view text);

// The values of one run. Each value remembers where it came from (default,
// file:line, override, JSON) so cross-field errors can point at it.
class Config {
 public:
  // Every key at its default. The schema must outlive the Config (loom_schema() does).
  explicit Config(const ConfigSchema& schema);

  const ConfigSchema& schema() const { return *schema_; }

  // Merges a TOML file over the current values. Throws Error naming the path
  // for a missing/unreadable file, line:column for syntax errors, and
  // path:line for unknown keys, ill-typed and out-of-range values.
  void load_toml(const std::filesystem::path& path);
  // The same for TOML text; `source` names it in messages.
  void load_toml_string(std::string_view text, std::string_view source);

  // "model.n_layer=6": the value is parsed as the key's type ("6", "3e-4",
  // "true", "bf16", "2GiB").
  void set_override(std::string_view assignment);
  // Sets a typed value (int64_t for integer keys, double for real keys, ...),
  // checked like any other; `source` is recorded for messages.
  void set(std::string_view key, ConfigValue value, std::string source = "set()");

  // T is int64_t, double, bool or std::string and must match the key's type
  // (std::string for choice and bytes keys). Unknown keys and type mismatches
  // are programming errors (LOOM_CHECK).
  template <typename T>
  T get(std::string_view key) const;
  // A bytes key through parse_bytes.
  size_t get_bytes(std::string_view key) const;

  const ConfigValue& value(std::string_view key) const;
  // "default", "configs/x.toml:12", "override 'model.n_layer=6'", "JSON config".
  const std::string& source(std::string_view key) const;
  bool is_default(std::string_view key) const;

  // Every key, sections in registration order, each key with its doc as a comment.
  std::string to_toml() const;
  // {"model": {"n_layer": 6, ...}, "precision": "fp32", ...}: every key.
  nlohmann::json to_json() const;
  // Reads what to_json wrote (a subset of keys is fine: the rest keep their
  // defaults); unknown keys and ill-typed values throw Error.
  static Config from_json(const ConfigSchema& schema, const nlohmann::json& j);

 private:
  struct Slot {
    ConfigValue value;
    std::string source;
  };
  const ConfigKey& key_or_check(std::string_view key) const;
  void assign(const ConfigKey& key, ConfigValue value, std::string source);

  const ConfigSchema* schema_;
  std::map<std::string, Slot, std::less<>> values_;
};

// A cross-field validation failure, formatted as
//   "train.batch_size = 12 (configs/x.toml:5): must be a multiple of
//    train.micro_batch_size * parallel.dp = 8; fix: set train.batch_size to 16"
// so every such message names the field, its value and origin, the rule and
// what to change.
class ConfigError : public Error {
 public:
  ConfigError(const Config& config, std::string_view key, std::string_view constraint, std::string_view fix);
};

// loom's own keys (see src/config/loom_schema.cpp); defaults describe the
// default main job, a small GPT on tinyshakespeare.
const ConfigSchema& loom_schema();


}  // namespace loom
