// A model config as a JSON object whose keys are the model.* config keys
// without "model.": the checkpoint manifest records a model this way, and a
// config's model section (Config::to_json()["model"]) reads into one.
// Internal to src/train.
#pragma once

#include <nlohmann/json.hpp>

#include "loom/nn.h"

namespace loom {

nlohmann::json model_json(const GPTConfig& c);

// `base` with the fields `j` has (other keys, such as "preset", are not
// model fields and are left alone). Throws Error naming a field of the wrong
// type or an unknown choice.
GPTConfig model_from_json(const nlohmann::json& j, GPTConfig base = {});

}  // namespace loom
