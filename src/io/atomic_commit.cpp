#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "io/posix_file.h"
#include "loom/io.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

// <parent>/<name> with a trailing '/' ignored. "..", "." and "/" have no name
// of their own: committing to them would replace some ancestor directory.
fs::path normalized(const fs::path& p) {
  fs::path n = p;
  if (!n.empty() && n.filename().empty()) n = n.parent_path();
  if (n.empty() || n.filename().empty() || n.filename() == "." || n.filename() == "..")
    throw Error(str("cannot write '", p.string(), "' atomically: the path needs a final name, not '",
                    n.filename().string(), "'"));
  return n.lexically_normal();
}

std::string temp_name(const fs::path& final_path) {
  return str(".tmp-", final_path.filename().string(), "-", ::getpid());
}

void create_dirs(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) io_detail::throw_io_error("create directory", dir, ec.value());
}

void fsync_tree(const fs::path& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; it != end; it.increment(ec)) {
    if (ec) break;
    if (it->is_regular_file() || it->is_directory()) io_detail::fsync_path(it->path());
  }
  if (ec) io_detail::throw_io_error("list", dir, ec.value());
  io_detail::fsync_path(dir);
}

}  // namespace

AtomicDirWriter::AtomicDirWriter(fs::path final_dir) : final_dir_(normalized(final_dir)) {
  fs::path parent = final_dir_.has_parent_path() ? final_dir_.parent_path() : fs::path(".");
  create_dirs(parent);
  temp_dir_ = parent / temp_name(final_dir_);
  // A leftover of a crashed process that had our pid.
  std::error_code ec;
  fs::remove_all(temp_dir_, ec);
  if (::mkdir(temp_dir_.c_str(), 0755) < 0) io_detail::throw_io_error("create directory", temp_dir_, errno);
}

AtomicDirWriter::~AtomicDirWriter() {
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(temp_dir_, ec);
  }
}

fs::path AtomicDirWriter::path(std::string_view relative) const {
  fs::path rel = fs::path(relative).lexically_normal();
  LOOM_CHECK(!rel.empty() && rel.is_relative() && *rel.begin() != "..", "path '", relative,
             "' escapes the directory being written");
  fs::path p = temp_dir_ / rel;
  create_dirs(p.parent_path());
  return p;
}

void AtomicDirWriter::write_file(std::string_view relative, std::string_view bytes) const {
  fs::path p = path(relative);
  io_detail::Fd fd = io_detail::open_file(p, O_WRONLY | O_CREAT | O_TRUNC, "create");
  io_detail::write_all(fd.get(), p, bytes.data(), bytes.size());
  io_detail::close_fd(fd, p);
}

void AtomicDirWriter::commit() {
  LOOM_CHECK(!committed_, "directory ", final_dir_.string(), " committed twice");
  fsync_tree(temp_dir_);
  fs::path parent = temp_dir_.parent_path();
  bool replaced = false;
  if (::rename(temp_dir_.c_str(), final_dir_.c_str()) < 0) {
    int err = errno;
    if (err != ENOTEMPTY && err != EEXIST) io_detail::throw_io_error(str("rename '", temp_dir_.string(), "' to"), final_dir_, err);
    // An existing directory: swap the two in one step so a reader sees the old
    // or the new one, never neither.
    if (::renameat2(AT_FDCWD, temp_dir_.c_str(), AT_FDCWD, final_dir_.c_str(), RENAME_EXCHANGE) < 0)
      io_detail::throw_io_error(str("replace '", final_dir_.string(), "' with"), temp_dir_, errno);
    replaced = true;
  }
  committed_ = true;
  io_detail::fsync_path(parent);
  if (replaced) {
    // The old contents now sit under the temporary name.
    std::error_code ec;
    fs::remove_all(temp_dir_, ec);
    if (ec) io_detail::throw_io_error("remove the replaced directory", temp_dir_, ec.value());
  }
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  fs::path target = normalized(path);
  fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  fs::path temp = dir / temp_name(target);
  try {
    io_detail::Fd fd = io_detail::open_file(temp, O_WRONLY | O_CREAT | O_TRUNC, "create");
    io_detail::write_all(fd.get(), temp, bytes.data(), bytes.size());
    io_detail::fsync_fd(fd.get(), temp);
    io_detail::close_fd(fd, temp);
    if (::rename(temp.c_str(), target.c_str()) < 0) io_detail::throw_io_error(str("rename '", temp.string(), "' to"), target, errno);
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  io_detail::fsync_path(dir);
}

std::string read_file(const fs::path& path) {
  io_detail::Fd fd = io_detail::open_file(path, O_RDONLY, "read");
  struct stat st;
  if (::fstat(fd.get(), &st) < 0) io_detail::throw_io_error("stat", path, errno);
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  io_detail::pread_all(fd.get(), path, bytes.data(), bytes.size(), 0);
  return bytes;
}

}  // namespace loom
