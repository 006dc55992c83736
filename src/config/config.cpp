#include <algorithm>
#include <charconv>
#include <cmath>

#include "config/messages.h"
#include "loom/config.h"

namespace loom {

namespace config_messages {

Error ill_typed(const ConfigKey& key, std::string_view where, std::string_view found) {
  std::string expected = key.describe_type();
  const char* article = expected.starts_with("one of") ? "" : std::string_view("aeiou").find(expected[0]) != std::string_view::npos ? "an " : "a ";
  return Error(str(where, ": ", key.name, " expects ", article, expected, ", found ", found));
}

Error unknown_key(const ConfigSchema& schema, std::string_view name, std::string_view where) {
  return Error(str("unknown key '", name, "' in ", where, ": ", schema.unknown_key_hint(name)));
}

}  // namespace config_messages

namespace {

std::string describe_found(const ConfigValue& v) {
  static constexpr const char* kKinds[] = {"integer", "number", "boolean", "string"};
  return str(kKinds[v.index()], ' ', format_config_value(v));
}

bool in_range(const ConfigKey& key, const ConfigValue& v) {
  if (key.type == ConfigType::integer) {
    int64_t x = std::get<int64_t>(v);
    return (!key.min || x >= std::get<int64_t>(*key.min)) && (!key.max || x <= std::get<int64_t>(*key.max));
  }
  if (key.type == ConfigType::real) {
    double x = std::get<double>(v);
    return (!key.min || x >= std::get<double>(*key.min)) && (!key.max || x <= std::get<double>(*key.max));
  }
  return true;
}

// Converts a value as found in a source to the key's type, or throws naming both.
ConfigValue coerce(const ConfigKey& key, ConfigValue found, std::string_view where) {
  auto wrong = [&] { return config_messages::ill_typed(key, where, describe_found(found)); };
  switch (key.type) {
    case ConfigType::integer:
      if (!std::holds_alternative<int64_t>(found)) throw wrong();
      return found;
    case ConfigType::real:
      if (auto* i = std::get_if<int64_t>(&found)) return static_cast<double>(*i);
      if (!std::holds_alternative<double>(found)) throw wrong();
      if (!std::isfinite(std::get<double>(found))) throw wrong();
      return found;
    case ConfigType::boolean:
      if (!std::holds_alternative<bool>(found)) throw wrong();
      return found;
    case ConfigType::string:
    case ConfigType::choice:
      if (!std::holds_alternative<std::string>(found)) throw wrong();
      return found;
    case ConfigType::bytes:
      if (auto* i = std::get_if<int64_t>(&found); i && *i >= 0) return std::to_string(*i);
      if (!std::holds_alternative<std::string>(found)) throw wrong();
      return found;
  }
  return found;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Parses override text as the key's type; text that does not parse stays a
// string so the type error shows what was written.
ConfigValue parse_override_value(const ConfigKey& key, std::string_view text) {
  const char* first = text.data();
  const char* last = text.data() + text.size();
  switch (key.type) {
    case ConfigType::integer: {
      int64_t x = 0;
      auto [end, ec] = std::from_chars(first, last, x);
      if (ec == std::errc() && end == last && !text.empty()) return x;
      break;
    }
    case ConfigType::real: {
      double x = 0;
      auto [end, ec] = std::from_chars(first, last, x);
      if (ec == std::errc() && end == last && !text.empty()) return x;
      break;
    }
    case ConfigType::boolean:
      if (text == "true") return true;
      if (text == "false") return false;
      break;
    default:
      if (text.size() >= 2 && text.front() == '"' && text.back() == '"') text = text.substr(1, text.size() - 2);
      break;
  }
  return std::string(text);
}

}  // namespace

Config::Config(const ConfigSchema& schema) : schema_(&schema) {
  for (const ConfigKey& k : schema.keys()) values_.emplace(k.name, Slot{k.default_value, "default"});
}

const ConfigKey& Config::key_or_check(std::string_view key) const {
  const ConfigKey* k = schema_->find(key);
  LOOM_CHECK(k != nullptr, "config key '", key, "' is not in the schema; ", schema_->unknown_key_hint(key));
  return *k;
}

void Config::assign(const ConfigKey& key, ConfigValue value, std::string source) {
  value = coerce(key, std::move(value), source);
  if (!in_range(key, value))
    throw Error(str(source, ": ", key.name, " = ", format_config_value(value), " is out of range: allowed ",
                    key.describe_type()));
  if (key.type == ConfigType::choice) {
    const std::string& s = std::get<std::string>(value);
    if (std::find(key.choices.begin(), key.choices.end(), s) == key.choices.end()) {
      std::string hint;
      if (auto m = did_you_mean(s, key.choices)) hint = str(" (did you mean '", *m, "'?)");
      throw Error(str(source, ": ", key.name, " = ", format_config_value(value), " is not ", key.describe_type(), hint));
    }
  }
  if (key.type == ConfigType::bytes) {
    try {
      parse_bytes(std::get<std::string>(value));
    } catch (const Error& e) {
      throw Error(str(source, ": ", key.name, ": ", e.what()));
    }
  }
  Slot& slot = values_.find(key.name)->second;
  slot.value = std::move(value);
  slot.source = std::move(source);
}

void Config::set(std::string_view key, ConfigValue value, std::string source) {
  const ConfigKey* k = schema_->find(key);
  if (!k) throw config_messages::unknown_key(*schema_, key, source);
  assign(*k, std::move(value), std::move(source));
}

void Config::set_override(std::string_view assignment) {
  std::string source = str("override '", assignment, "'");
  size_t eq = assignment.find('=');
  if (eq == std::string_view::npos || trim(assignment.substr(0, eq)).empty())
    throw Error(str(source, " is not of the form key=value (e.g. model.n_layer=6)"));
  std::string_view name = trim(assignment.substr(0, eq));
  std::string_view text = trim(assignment.substr(eq + 1));
  const ConfigKey* k = schema_->find(name);
  if (!k) throw config_messages::unknown_key(*schema_, name, source);
  assign(*k, parse_override_value(*k, text), std::move(source));
}

template <typename T>
T Config::get(std::string_view key) const {
  const ConfigValue& v = value(key);
  LOOM_CHECK(std::holds_alternative<T>(v), "config key '", key, "' is a ", config_type_name(key_or_check(key).type),
             ", read with the wrong C++ type");
  return std::get<T>(v);
}

template int64_t Config::get<int64_t>(std::string_view) const;
template double Config::get<double>(std::string_view) const;
template bool Config::get<bool>(std::string_view) const;
template std::string Config::get<std::string>(std::string_view) const;

size_t Config::get_bytes(std::string_view key) const {
  LOOM_CHECK(key_or_check(key).type == ConfigType::bytes, "config key '", key, "' is not a byte size");
  return parse_bytes(std::get<std::string>(value(key)));
}

const ConfigValue& Config::value(std::string_view key) const {
  key_or_check(key);
  return values_.find(key)->second.value;
}

const std::string& Config::source(std::string_view key) const {
  key_or_check(key);
  return values_.find(key)->second.source;
}

bool Config::is_default(std::string_view key) const { return source(key) == "default"; }

ConfigError::ConfigError(const Config& config, std::string_view key, std::string_view constraint,
                         std::string_view fix)
    : Error(str(key, " = ", format_config_value(config.value(key)), " (", config.source(key), "): ", constraint,
                "; fix: ", fix)) {}

}  // namespace loom
