#include "loom/io.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

// A manifest path must stay inside its directory.
bool is_safe_relative(const std::string& rel) {
  fs::path p(rel);
  if (rel.empty() || p.is_absolute() || p.lexically_normal() != p) return false;
  for (const fs::path& part : p)
    if (part == "..") return false;
  return true;
}

}  // namespace

Manifest write_manifest(const fs::path& dir, const nlohmann::json& fields) {
  std::map<std::string, FileDigest> files;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; it != end; it.increment(ec)) {
    if (ec) break;
    if (!it->is_regular_file() || it->is_symlink()) continue;
    std::string rel = it->path().lexically_relative(dir).generic_string();
    if (rel == kManifestFile) continue;
    files[rel] = FileDigest{it->file_size(), Checksum::xxh3_128, checksum_file(it->path(), Checksum::xxh3_128)};
  }
  if (ec) throw Error(str("cannot list checkpoint directory '", dir.string(), "': ", ec.message()));
  return write_manifest(dir, fields, std::move(files));
}

Manifest write_manifest(const fs::path& dir, const nlohmann::json& fields, std::map<std::string, FileDigest> files) {
  LOOM_CHECK(fields.is_object() && !fields.contains("files"), "manifest fields must be an object without \"files\"");
  Manifest m;
  m.fields = fields;
  m.files = std::move(files);

  nlohmann::json j = fields;
  nlohmann::json& listed = j["files"] = nlohmann::json::object();
  for (const auto& [rel, digest] : m.files) listed[rel] = digest_json(digest);
  write_file_atomic(dir / kManifestFile, j.dump(2) + "\n");
  return m;
}

Manifest read_manifest(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(str("checkpoint directory '", dir.string(), "' does not exist"));
  fs::path file = dir / kManifestFile;
  if (!fs::exists(file, ec))
    throw Error(str("checkpoint directory '", dir.string(), "' has no ", kManifestFile,
                    ": it is incomplete or not a loom checkpoint; resume from another checkpoint"));
  auto corrupt = [&](const std::string& problem) {
    return Error(str(kManifestFile, " of checkpoint '", dir.string(), "' is corrupt: ", problem,
                     "; resume from another checkpoint"));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(file));
  } catch (const nlohmann::json::exception& e) {
    throw corrupt(e.what());
  }
  if (!j.is_object()) throw corrupt("not a JSON object");
  if (!j.contains("files") || !j["files"].is_object()) throw corrupt("no \"files\" object");
  Manifest m;
  for (const auto& [rel, entry] : j["files"].items()) {
    if (!is_safe_relative(rel)) throw corrupt(str("file path '", rel, "' is not a plain relative path"));
    const std::optional<FileDigest> digest = parse_digest_json(entry);
    if (!digest)
      throw corrupt(str("entry of '", rel, "' is not {\"xxh3_128\" or \"sha256\": <hex digest>, \"bytes\": <count>}"));
    m.files[rel] = *digest;
  }
  j.erase("files");
  m.fields = std::move(j);
  return m;
}

void verify_checkpoint_file(const fs::path& dir, const std::string& rel, const FileDigest& digest, bool checksum) {
  fs::path p = dir / rel;
  std::error_code ec;
  if (!fs::is_regular_file(p, ec))
    throw Error(str("checkpoint '", dir.string(), "' is missing '", rel,
                    "' listed in its manifest; resume from another checkpoint"));
  uint64_t bytes = fs::file_size(p, ec);
  if (ec) throw Error(str("checkpoint '", dir.string(), "': cannot stat '", rel, "': ", ec.message()));
  if (bytes != digest.bytes)
    throw Error(str("checkpoint '", dir.string(), "': '", rel, "' is ", bytes, " bytes but the manifest says ",
                    digest.bytes, " (truncated or overwritten); resume from another checkpoint"));
  if (!checksum) return;
  const std::string actual = checksum_file(p, digest.checksum);
  if (actual != digest.hex)
    throw Error(str("checkpoint '", dir.string(), "': '", rel, "' has ", checksum_name(digest.checksum), " ", actual,
                    " but the manifest says ", digest.hex, " (corrupt); resume from another checkpoint"));
}

Manifest verify_checkpoint_dir(const fs::path& dir, bool checksums) {
  Manifest m = read_manifest(dir);
  for (const auto& [rel, digest] : m.files) verify_checkpoint_file(dir, rel, digest, checksums);
  return m;
}

}  // namespace loom
