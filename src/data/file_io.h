// Reading the data subsystem's inputs with messages that say what the file is.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>

namespace loom::data {

// The whole file. `what` says what it is for the message ("tokenizer model",
// "input text"): "tokenizer model 'x' does not exist" tells the user more than
// the bare errno.
std::string read_file(const std::filesystem::path& path, std::string_view what);

}  // namespace loom::data
