#include <algorithm>
#include <charconv>
#include <set>

#include "loom/config.h"

namespace loom {

const char* config_type_name(ConfigType t) {
  switch (t) {
    case ConfigType::integer: return "integer";
    case ConfigType::real: return "number";
    case ConfigType::boolean: return "boolean";
    case ConfigType::string: return "string";
    case ConfigType::choice: return "choice";
    case ConfigType::bytes: return "byte size";
  }
  return "?";
}

std::string format_config_value(const ConfigValue& v) {
  struct Visitor {
    std::string operator()(int64_t x) const { return std::to_string(x); }
    std::string operator()(double x) const {
      char buf[64];
      auto res = std::to_chars(buf, buf + sizeof buf, x);
      std::string text(buf, res.ptr);
      // "6.0", not "6": a real reads as one in messages and in TOML.
      if (text.find_first_of(".en") == std::string::npos) text += ".0";
      return text;
    }
    std::string operator()(bool x) const { return x ? "true" : "false"; }
    std::string operator()(const std::string& x) const { return str('"', x, '"'); }
  };
  return std::visit(Visitor{}, v);
}

std::string ConfigKey::describe_type() const {
  switch (type) {
    case ConfigType::choice: {
      std::string s = "one of ";
      for (size_t i = 0; i < choices.size(); ++i) s += (i ? ", " : "") + choices[i];
      return s;
    }
    case ConfigType::bytes: return "byte size such as \"2GiB\", \"512MiB\" or \"unlimited\"";
    case ConfigType::integer:
    case ConfigType::real: {
      std::string s = type == ConfigType::integer ? "integer" : "number";
      if (min && max) return str(s, " in [", format_config_value(*min), ", ", format_config_value(*max), "]");
      if (min) return str(s, " >= ", format_config_value(*min));
      if (max) return str(s, " <= ", format_config_value(*max));
      return s;
    }
    case ConfigType::boolean: return "boolean (true or false)";
    case ConfigType::string: return "string";
  }
  return config_type_name(type);
}

ConfigSchema& ConfigSchema::add(ConfigKey key) {
  LOOM_CHECK(!key.name.empty() && key.name.front() != '.' && key.name.back() != '.', "bad config key name '",
             key.name, "'");
  LOOM_CHECK(find(key.name) == nullptr, "config key '", key.name, "' registered twice");
  // A key cannot also be a section ("model" and "model.n_layer"): TOML could not express both.
  for (const ConfigKey& k : keys_) {
    LOOM_CHECK(!k.name.starts_with(key.name + ".") && !key.name.starts_with(k.name + "."), "config key '",
               key.name, "' clashes with '", k.name, "'");
  }
  keys_.push_back(std::move(key));
  return *this;
}

ConfigSchema& ConfigSchema::add_int(std::string name, int64_t def, std::string doc, std::optional<int64_t> min,
                                    std::optional<int64_t> max) {
  LOOM_CHECK((!min || def >= *min) && (!max || def <= *max), "default of ", name, " out of its range");
  ConfigKey k{std::move(name), ConfigType::integer, def, std::move(doc), {}, {}, {}};
  if (min) k.min = *min;
  if (max) k.max = *max;
  return add(std::move(k));
}

ConfigSchema& ConfigSchema::add_float(std::string name, double def, std::string doc, std::optional<double> min,
                                      std::optional<double> max) {
  LOOM_CHECK((!min || def >= *min) && (!max || def <= *max), "default of ", name, " out of its range");
  ConfigKey k{std::move(name), ConfigType::real, def, std::move(doc), {}, {}, {}};
  if (min) k.min = *min;
  if (max) k.max = *max;
  return add(std::move(k));
}

ConfigSchema& ConfigSchema::add_bool(std::string name, bool def, std::string doc) {
  return add(ConfigKey{std::move(name), ConfigType::boolean, def, std::move(doc), {}, {}, {}});
}

ConfigSchema& ConfigSchema::add_string(std::string name, std::string def, std::string doc) {
  return add(ConfigKey{std::move(name), ConfigType::string, std::move(def), std::move(doc), {}, {}, {}});
}

ConfigSchema& ConfigSchema::add_choice(std::string name, std::string def, std::vector<std::string> choices,
                                       std::string doc) {
  LOOM_CHECK(std::find(choices.begin(), choices.end(), def) != choices.end(), "default of ", name,
             " is not among its choices");
  return add(ConfigKey{std::move(name), ConfigType::choice, std::move(def), std::move(doc), std::move(choices), {}, {}});
}

ConfigSchema& ConfigSchema::add_bytes(std::string name, std::string def, std::string doc) {
  parse_bytes(def);
  return add(ConfigKey{std::move(name), ConfigType::bytes, std::move(def), std::move(doc), {}, {}, {}});
}

const ConfigKey* ConfigSchema::find(std::string_view name) const {
  for (const ConfigKey& k : keys_)
    if (k.name == name) return &k;
  return nullptr;
}

bool ConfigSchema::has_section(std::string_view name) const {
  for (const ConfigKey& k : keys_)
    if (k.name.size() > name.size() && k.name.starts_with(name) && k.name[name.size()] == '.') return true;
  return false;
}

namespace {

std::string_view leaf_of(std::string_view name) {
  size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? name : name.substr(dot + 1);
}

// Optimal string alignment distance: Levenshtein plus adjacent transpositions,
// the commonest typo ("n_layre").
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

}  // namespace

std::optional<std::string> did_you_mean(std::string_view word, const std::vector<std::string>& candidates) {
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::optional<std::string> best;
  size_t best_distance = limit + 1;
  for (const std::string& c : candidates) {
    size_t dist = edit_distance(word, c);
    if (dist < best_distance) {
      best_distance = dist;
      best = c;
    }
  }
  return best;
}

std::optional<std::string> ConfigSchema::suggest(std::string_view name) const {
  // Sections are candidates too, so "[modle]" suggests "model".
  std::vector<std::string> names;
  for (const ConfigKey& k : keys_) {
    for (size_t dot = k.name.find('.'); dot != std::string::npos; dot = k.name.find('.', dot + 1)) {
      std::string section = k.name.substr(0, dot);
      if (std::find(names.begin(), names.end(), section) == names.end()) names.push_back(section);
    }
    names.push_back(k.name);
  }
  if (auto s = did_you_mean(name, names)) return s;
  // The right key in the wrong section ("train.n_layer", or "n_layer" alone).
  std::string_view leaf = leaf_of(name);
  for (const ConfigKey& k : keys_)
    if (leaf_of(k.name) == leaf) return k.name;
  return std::nullopt;
}

std::string ConfigSchema::unknown_key_hint(std::string_view name) const {
  if (auto s = suggest(name)) return str("did you mean '", *s, "'?");
  std::set<std::string> sections;
  std::vector<std::string> top_level;
  for (const ConfigKey& k : keys_) {
    size_t dot = k.name.find('.');
    if (dot == std::string::npos)
      top_level.push_back(k.name);
    else
      sections.insert(k.name.substr(0, dot));
  }
  std::string s = "known sections are";
  for (const std::string& sec : sections) s += str(" [", sec, "]");
  if (!top_level.empty()) {
    s += " and top-level keys";
    for (const std::string& k : top_level) s += " " + k;
  }
  return s;
}

}  // namespace loom
