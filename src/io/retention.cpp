#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cstdio>

#include "loom/io.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

std::optional<int64_t> parse_digits(std::string_view s) {
  int64_t v = 0;
  if (s.empty() || s.find_first_not_of("0123456789") != std::string_view::npos) return std::nullopt;
  auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// A leftover .tmp-<name>-<pid> of an interrupted commit whose writer is gone.
bool is_stale_temp(const fs::directory_entry& entry, std::chrono::seconds stale_after) {
  std::string name = entry.path().filename().string();
  auto pid = parse_digits(std::string_view(name).substr(name.rfind('-') + 1));
  if (pid && *pid == ::getpid()) return false;
  if (pid && *pid > 0 && *pid <= INT32_MAX && (::kill(static_cast<pid_t>(*pid), 0) == 0 || errno == EPERM)) return false;
  std::error_code ec;
  auto modified = entry.last_write_time(ec);
  return !ec && fs::file_time_type::clock::now() - modified > stale_after;
}

void remove_tree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw Error(str("cannot remove '", p.string(), "': ", ec.message()));
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  LOOM_CHECK(step >= 0, "negative checkpoint step ", step);
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::vector<CheckpointEntry> list_checkpoints(const fs::path& root) {
  std::vector<CheckpointEntry> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (fs::directory_iterator it(root, ec), end; it != end; it.increment(ec)) {
    if (ec) break;
    std::string name = it->path().filename().string();
    if (!name.starts_with("step_") || !it->is_directory()) continue;
    if (auto step = parse_digits(std::string_view(name).substr(5))) out.push_back({*step, it->path()});
  }
  if (ec) throw Error(str("cannot list checkpoint directory '", root.string(), "': ", ec.message()));
  std::sort(out.begin(), out.end(), [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return out;
}

void write_latest(const fs::path& root, std::string_view dir_name) {
  LOOM_CHECK(!dir_name.empty() && dir_name.find('/') == std::string_view::npos, "bad checkpoint name '", dir_name, "'");
  write_file_atomic(root / kLatestFile, str(dir_name, "\n"));
}

std::optional<fs::path> read_latest(const fs::path& root) {
  fs::path file = root / kLatestFile;
  std::error_code ec;
  if (!fs::exists(file, ec)) return std::nullopt;
  std::string name = read_file(file);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  if (name.empty() || name == "." || name == ".." || name.find_first_of("/\n\r") != std::string::npos)
    throw Error(str("'", file.string(), "' holds '", name,
                    "', not a checkpoint directory name; delete it or write the name of a step_ directory into it"));
  return root / name;
}

std::vector<fs::path> apply_retention(const fs::path& root, int64_t keep_last, std::chrono::seconds stale_after) {
  std::vector<fs::path> removed;
  std::vector<CheckpointEntry> checkpoints = list_checkpoints(root);
  if (keep_last > 0 && checkpoints.size() > static_cast<size_t>(keep_last)) {
    std::optional<fs::path> latest = read_latest(root);
    std::string latest_name = latest ? latest->filename().string() : "";
    // The newest is always among the kept ones.
    for (size_t i = 0; i + static_cast<size_t>(keep_last) < checkpoints.size(); ++i) {
      const fs::path& p = checkpoints[i].path;
      if (p.filename() == latest_name) continue;
      remove_tree(p);
      removed.push_back(p);
    }
  }
  std::vector<fs::path> stale;
  std::error_code ec;
  for (fs::directory_iterator it(root, ec), end; it != end; it.increment(ec)) {
    if (ec) break;
    if (it->path().filename().string().starts_with(".tmp-") && is_stale_temp(*it, stale_after))
      stale.push_back(it->path());
  }
  for (const fs::path& p : stale) {
    remove_tree(p);
    removed.push_back(p);
  }
  return removed;
}

}  // namespace loom
