#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>

#include "io/posix_file.h"
#include "loom/config.h"
#include "loom/io.h"

namespace loom {

namespace {

// The reference implementation's limit; a larger "header" is a corrupt length.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

bool is_count(const nlohmann::ordered_json& v) {
  return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
}

}  // namespace

SafetensorsReader::SafetensorsReader(std::filesystem::path path) : path_(std::move(path)) {
  stream_fds_.fill(-1);
  auto fail = [&](const std::string& problem) { return Error(str("safetensors file '", path_.string(), "': ", problem)); };

  io_detail::Fd fd = io_detail::open_file(path_, O_RDONLY, "open safetensors file");
  struct stat st;
  if (::fstat(fd.get(), &st) < 0) io_detail::throw_io_error("stat", path_, errno);
  if (!S_ISREG(st.st_mode)) throw fail("not a regular file");
  const uint64_t file_size = static_cast<uint64_t>(st.st_size);
  if (file_size < 8) throw fail(str("is ", file_size, " bytes, too short for the 8-byte header length (truncated?)"));

  uint8_t length_bytes[8];
  io_detail::pread_all(fd.get(), path_, length_bytes, 8, 0);
  uint64_t header_bytes = 0;
  for (int i = 0; i < 8; ++i) header_bytes |= uint64_t(length_bytes[i]) << (8 * i);
  if (header_bytes > file_size - 8)
    throw fail(str("header length ", header_bytes, " runs past the end of the file (", file_size,
                   " bytes): truncated, or not a safetensors file"));
  if (header_bytes > kMaxHeaderBytes)
    throw fail(str("header length ", header_bytes, " is over the 100 MiB limit: not a safetensors file"));

  std::string text(header_bytes, '\0');
  io_detail::pread_all(fd.get(), path_, text.data(), text.size(), 8);
  nlohmann::ordered_json header;
  try {
    header = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw fail(str("header is not valid JSON: ", e.what()));
  }
  if (!header.is_object()) throw fail(str("header is a JSON ", header.type_name(), ", not an object"));

  const uint64_t data_start = 8 + header_bytes;
  const uint64_t data_size = file_size - data_start;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw fail("__metadata__ is not an object");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) throw fail(str("__metadata__ value of '", k, "' is not a string"));
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    auto bad = [&](const std::string& problem) { return fail(str("tensor '", name, "': ", problem)); };
    if (!info.is_object()) throw bad("entry is not an object");
    if (!info.contains("dtype") || !info["dtype"].is_string()) throw bad("missing string \"dtype\"");
    if (!info.contains("shape") || !info["shape"].is_array()) throw bad("missing array \"shape\"");
    if (!info.contains("data_offsets") || !info["data_offsets"].is_array() || info["data_offsets"].size() != 2 ||
        !is_count(info["data_offsets"][0]) || !is_count(info["data_offsets"][1]))
      throw bad("\"data_offsets\" is not [begin, end] with non-negative integers");

    Entry e;
    e.name = name;
    try {
      e.dtype = parse_safetensors_dtype(info["dtype"].get<std::string>());
    } catch (const Error& err) {
      throw bad(err.what());
    }
    uint64_t elements = 1;
    for (const auto& d : info["shape"]) {
      if (!is_count(d)) throw bad(str("shape ", info["shape"].dump(), " has a dimension that is not a non-negative integer"));
      uint64_t dim = d.get<uint64_t>();
      if (dim > uint64_t(INT64_MAX) || __builtin_mul_overflow(elements, dim, &elements))
        throw bad(str("shape ", info["shape"].dump(), " overflows 64 bits"));
      e.shape.push_back(static_cast<int64_t>(dim));
    }
    uint64_t begin = info["data_offsets"][0].get<uint64_t>();
    uint64_t end = info["data_offsets"][1].get<uint64_t>();
    if (begin > end) throw bad(str("data_offsets [", begin, ", ", end, "] end before they begin"));
    if (end > data_size)
      throw bad(str("data_offsets [", begin, ", ", end, "] run past the ", data_size,
                    "-byte data section (truncated file?)"));
    uint64_t expected;
    if (__builtin_mul_overflow(elements, uint64_t(dtype_size(e.dtype)), &expected) || expected != end - begin)
      throw bad(str(safetensors_dtype_name(e.dtype), " ", shape_str(e.shape), " needs ", elements, " x ",
                    dtype_size(e.dtype), " bytes but data_offsets [", begin, ", ", end, "] hold ", end - begin));
    e.offset = data_start + begin;
    e.bytes = end - begin;
    entries_.push_back(std::move(e));
  }

  // The spans must tile the data section: sorted by offset, each starts where
  // the previous ended and the last ends at the end of the file.
  std::sort(entries_.begin(), entries_.end(),
            [](const Entry& a, const Entry& b) { return std::tie(a.offset, a.bytes) < std::tie(b.offset, b.bytes); });
  uint64_t position = data_start;
  for (const Entry& e : entries_) {
    if (e.offset != position)
      throw fail(str("tensor '", e.name, "' starts at data byte ", e.offset - data_start, " but the previous tensor ends at ",
                     position - data_start, e.offset < position ? " (overlap)" : " (gap)"));
    position = e.offset + e.bytes;
  }
  if (position != file_size)
    throw fail(str(file_size - position, " bytes after the last tensor are not covered by any tensor"));

  for (size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].name, i);
  fd_ = fd.release();
  stream_fds_[0] = fd_;
}

SafetensorsReader::~SafetensorsReader() {
  for (int fd : stream_fds_)
    if (fd >= 0) ::close(fd);
}

int SafetensorsReader::stream_fd(int stream) const {
  LOOM_CHECK(stream >= 0 && stream < kMaxStreams, "read stream ", stream, " of ", path_.string());
  const std::lock_guard lock(streams_mu_);
  int& fd = stream_fds_[static_cast<size_t>(stream)];
  if (fd < 0) {
    // The same file as the first descriptor's, or an error: the path may
    // since name another file.
    io_detail::Fd opened = io_detail::open_file(path_, O_RDONLY, "open safetensors file");
    struct stat first, again;
    if (::fstat(fd_, &first) < 0 || ::fstat(opened.get(), &again) < 0)
      io_detail::throw_io_error("stat", path_, errno);
    if (first.st_dev != again.st_dev || first.st_ino != again.st_ino)
      throw Error(str("safetensors file '", path_.string(), "' was replaced while it was being read; read it again"));
    fd = opened.release();
  }
  return fd;
}

bool SafetensorsReader::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

const SafetensorsReader::Entry& SafetensorsReader::entry(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::vector<std::string> names;
    for (const Entry& e : entries_) names.push_back(e.name);
    std::string hint;
    if (auto m = did_you_mean(name, names)) hint = str("; did you mean '", *m, "'?");
    throw Error(str("safetensors file '", path_.string(), "' has no tensor '", name, "' (it has ", entries_.size(),
                    " tensors)", hint));
  }
  return entries_[it->second];
}

void SafetensorsReader::read_range(std::string_view name, uint64_t byte_offset, void* dst, size_t bytes,
                                   int stream) const {
  const Entry& e = entry(name);
  LOOM_CHECK(byte_offset <= e.bytes && bytes <= e.bytes - byte_offset, "read of bytes [", byte_offset, ", ",
             byte_offset + bytes, ") of '", name, "' (", e.bytes, " bytes) in ", path_.string());
  io_detail::pread_all(stream_fd(stream), path_, dst, bytes, e.offset + byte_offset);
}

void SafetensorsReader::read(std::string_view name, void* dst, size_t bytes) const {
  const Entry& e = entry(name);
  LOOM_CHECK(bytes == e.bytes, "tensor '", name, "' in ", path_.string(), " is ", e.bytes, " bytes, not ", bytes);
  read_range(name, 0, dst, bytes);
}

Tensor SafetensorsReader::load(std::string_view name, Tier tier) const {
  const Entry& e = entry(name);
  Tensor t = Tensor::empty(e.shape, e.dtype, tier);
  read(name, t.raw(), t.nbytes());
  return t;
}

}  // namespace loom
