#include <limits>

#include <nlohmann/json.hpp>

#include "config/messages.h"
#include "loom/config.h"

namespace loom {

namespace {

constexpr std::string_view kJsonSource = "JSON config";

void read_object(Config& config, const nlohmann::json& object, const std::string& prefix) {
  const ConfigSchema& schema = config.schema();
  for (const auto& [k, v] : object.items()) {
    std::string name = prefix.empty() ? k : str(prefix, ".", k);
    const ConfigKey* key = schema.find(name);
    if (v.is_object()) {
      if (key) throw config_messages::ill_typed(*key, kJsonSource, "an object");
      if (!schema.has_section(name)) throw config_messages::unknown_key(schema, name, kJsonSource);
      read_object(config, v, name);
      continue;
    }
    if (!key) throw config_messages::unknown_key(schema, name, kJsonSource);
    ConfigValue value;
    if (v.is_number_integer() && !v.is_number_unsigned()) value = v.get<int64_t>();
    else if (v.is_number_unsigned() && v.get<uint64_t>() <= uint64_t(std::numeric_limits<int64_t>::max()))
      value = static_cast<int64_t>(v.get<uint64_t>());
    else if (v.is_number_float()) value = v.get<double>();
    else if (v.is_boolean()) value = v.get<bool>();
    else if (v.is_string()) value = v.get<std::string>();
    else throw config_messages::ill_typed(*key, kJsonSource, str("JSON ", v.dump()));
    config.set(name, std::move(value), std::string(kJsonSource));
  }
}

}  // namespace

nlohmann::json Config::to_json() const {
  nlohmann::json root = nlohmann::json::object();
  for (const ConfigKey& k : schema_->keys()) {
    nlohmann::json* node = &root;
    size_t start = 0;
    for (size_t dot = k.name.find('.'); dot != std::string::npos; dot = k.name.find('.', start)) {
      node = &(*node)[k.name.substr(start, dot - start)];
      start = dot + 1;
    }
    std::visit([&](const auto& x) { (*node)[k.name.substr(start)] = x; }, value(k.name));
  }
  return root;
}

Config Config::from_json(const ConfigSchema& schema, const nlohmann::json& j) {
  if (!j.is_object()) throw Error(str(kJsonSource, " must be an object of sections, found ", j.type_name()));
  Config config(schema);
  read_object(config, j, "");
  return config;
}

}  // namespace loom
