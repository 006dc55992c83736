#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <sstream>

#include <toml++/toml.h>

#include "config/messages.h"
#include "loom/config.h"

namespace loom {

namespace {

const char* toml_kind(toml::node_type t) {
  switch (t) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "value";
  }
}

std::string toml_quote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    unsigned char u = static_cast<unsigned char>(c);
    if (c == '"') out += "\\\"";
    else if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (u < 0x20 || u == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", u);
      out += buf;
    } else {
      out += c;
    }
  }
  return out + "\"";
}

std::string toml_value(const ConfigValue& v) {
  if (auto* s = std::get_if<std::string>(&v)) return toml_quote(*s);
  return format_config_value(v);
}

struct TomlWalker {
  Config& config;
  const ConfigSchema& schema;
  std::string_view source;

  std::string where(const toml::node& node) const { return str(source, ":", node.source().begin.line); }

  void walk(const toml::table& table, const std::string& prefix) {
    for (const auto& [k, node] : table) {
      std::string name = prefix.empty() ? std::string(k.str()) : str(prefix, ".", k.str());
      const ConfigKey* key = schema.find(name);
      if (auto* sub = node.as_table()) {
        if (key) throw config_messages::ill_typed(*key, where(node), "a table");
        if (!schema.has_section(name)) throw config_messages::unknown_key(schema, name, where(node));
        walk(*sub, name);
        continue;
      }
      if (!key) {
        if (schema.has_section(name))
          throw Error(str(where(node), ": '", name, "' is a section ([", name, "]), not a key"));
        throw config_messages::unknown_key(schema, name, where(node));
      }
      config.set(name, value_of(*key, node), where(node));
    }
  }

  ConfigValue value_of(const ConfigKey& key, const toml::node& node) const {
    if (auto* v = node.as_integer()) return v->get();
    if (auto* v = node.as_floating_point()) return v->get();
    if (auto* v = node.as_boolean()) return v->get();
    if (auto* v = node.as_string()) return v->get();
    throw config_messages::ill_typed(key, where(node), str("a TOML ", toml_kind(node.type())));
  }
};

}  // namespace

void Config::load_toml_string(std::string_view text, std::string_view source) {
  toml::table root;
  try {
    root = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw Error(str("TOML syntax error in ", source, ":", e.source().begin.line, ":", e.source().begin.column, ": ",
                    e.description()));
  }
  TomlWalker{*this, *schema_, source}.walk(root, "");
}

void Config::load_toml(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw Error(str("config file '", path.string(), "' does not exist (working directory: ",
                    std::filesystem::current_path(ec).string(), ")"));
  if (std::filesystem::is_directory(path, ec))
    throw Error(str("config file '", path.string(), "' is a directory; pass a .toml file"));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(str("cannot open config file '", path.string(), "': ", std::strerror(errno)));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error(str("cannot read config file '", path.string(), "': ", std::strerror(errno)));
  load_toml_string(text.str(), path.string());
}

std::string Config::to_toml() const {
  // TOML wants top-level keys before the first [section].
  std::vector<std::string> sections{""};
  auto section_of = [](const std::string& name) {
    size_t dot = name.rfind('.');
    return dot == std::string::npos ? std::string() : name.substr(0, dot);
  };
  for (const ConfigKey& k : schema_->keys()) {
    std::string s = section_of(k.name);
    if (std::find(sections.begin(), sections.end(), s) == sections.end()) sections.push_back(s);
  }
  std::string out;
  for (const std::string& section : sections) {
    if (!section.empty()) out += str(out.empty() ? "" : "\n", "[", section, "]\n");
    for (const ConfigKey& k : schema_->keys()) {
      if (section_of(k.name) != section) continue;
      std::string leaf = section.empty() ? k.name : k.name.substr(section.size() + 1);
      out += str("# ", k.doc, "\n", leaf, " = ", toml_value(value(k.name)), "\n");
    }
  }
  return out;
}

}  // namespace loom
