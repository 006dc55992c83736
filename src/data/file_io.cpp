#include "data/file_io.h"

#include "loom/io.h"

namespace loom::data {

std::string read_file(const std::filesystem::path& path, std::string_view what) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) throw Error(str(what, " ", path, " does not exist"));
  if (std::filesystem::is_directory(path, ec)) throw Error(str(what, " ", path, " is a directory, not a file"));
  try {
    return loom::read_file(path);
  } catch (const Error& e) {
    throw Error(str("cannot read ", what, ": ", e.what()));
  }
}

}  // namespace loom::data
