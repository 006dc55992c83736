// Message builders shared by the config readers (overrides, TOML, JSON), so an
// error reads the same whichever way the value arrived.
#pragma once

#include <string_view>

#include "loom/config.h"

namespace loom::config_messages {

// "<where>: model.n_layer expects an integer >= 1, found string \"six\""
Error ill_typed(const ConfigKey& key, std::string_view where, std::string_view found);
// "unknown key 'model.n_layers' in <where>: did you mean 'model.n_layer'?"
Error unknown_key(const ConfigSchema& schema, std::string_view name, std::string_view where);

}  // namespace loom::config_messages
