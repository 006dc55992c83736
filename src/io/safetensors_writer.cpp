#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <set>

#include "io/posix_file.h"
#include "loom/io.h"

namespace loom {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; so is loom's memory");

SafetensorsWriter::SafetensorsWriter(std::filesystem::path path, std::vector<SafetensorsSpec> specs,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), specs_(std::move(specs)), tensor_hasher_(std::make_unique<FileHasher>()) {
  // The header lists __metadata__ first and the tensors in data order, as the
  // reference implementation does.
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string_view> names;
  uint64_t offset = 0;
  for (const SafetensorsSpec& s : specs_) {
    LOOM_CHECK(s.name != "__metadata__" && !s.name.empty(), "bad safetensors tensor name '", s.name, "'");
    LOOM_CHECK(names.insert(s.name).second, "tensor '", s.name, "' declared twice for ", path_.string());
    for (int64_t d : s.shape) LOOM_CHECK(d >= 0, "negative dimension in ", s.name, " ", shape_str(s.shape));
    header[s.name] = {{"dtype", safetensors_dtype_name(s.dtype)},
                      {"shape", s.shape},
                      {"data_offsets", {offset, offset + s.bytes()}}};
    offset += s.bytes();
  }
  std::string text = header.dump();
  // Padding to a multiple of 8 keeps the data section 8-byte aligned for mmap readers.
  text.append((8 - text.size() % 8) % 8, ' ');
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(uint64_t(text.size()) >> (8 * i));

  io_detail::Fd fd = io_detail::open_file(path_, O_WRONLY | O_CREAT | O_TRUNC, "create");
  struct stat st;
  regular_file_ = ::fstat(fd.get(), &st) == 0 && S_ISREG(st.st_mode);
  try {
    io_detail::write_all(fd.get(), path_, length, sizeof length);
    io_detail::write_all(fd.get(), path_, text.data(), text.size());
    hasher_.update(length, sizeof length);
    hasher_.update(text);
    bytes_ = sizeof length + text.size();
  } catch (...) {
    // No destructor runs for a constructor that throws.
    if (regular_file_) ::unlink(path_.c_str());
    throw;
  }
  fd_ = fd.release();
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_ && regular_file_) ::unlink(path_.c_str());
}

void SafetensorsWriter::next_tensor() {
  tensor_digests_.push_back(tensor_hasher_->hex_digest());
  tensor_hasher_ = std::make_unique<FileHasher>();
  ++current_;
  current_written_ = 0;
}

void SafetensorsWriter::advance_to(std::string_view name) {
  if (current_ < specs_.size() && current_written_ == specs_[current_].bytes() && specs_[current_].name != name)
    next_tensor();
  // Zero-byte tensors need no write; step over them towards `name`.
  while (current_ < specs_.size() && specs_[current_].name != name && specs_[current_].bytes() == 0) next_tensor();
  LOOM_CHECK(current_ < specs_.size() && specs_[current_].name == name, "safetensors write of '", name, "' to ",
             path_.string(), " out of the declared order (expected '",
             current_ < specs_.size() ? specs_[current_].name : std::string("<end>"), "')");
}

void SafetensorsWriter::write_part(std::string_view name, const void* data, size_t bytes) {
  LOOM_CHECK(!finished_, "write to finished safetensors file ", path_.string());
  advance_to(name);
  LOOM_CHECK(current_written_ + bytes <= specs_[current_].bytes(), "tensor '", name, "' is ",
             specs_[current_].bytes(), " bytes; ", current_written_ + bytes, " written to ", path_.string());
  // In blocks small enough to stay in cache between the write's copy and the
  // two hashes: the bytes come from memory once, not three times.
  constexpr size_t kBlock = size_t(256) << 10;
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kBlock, bytes - done);
    io_detail::write_all(fd_, path_, p + done, n);
    hasher_.update(p + done, n);
    tensor_hasher_->update(p + done, n);
    done += n;
  }
  bytes_ += bytes;
  current_written_ += bytes;
}

void SafetensorsWriter::write(std::string_view name, const void* data) {
  advance_to(name);
  LOOM_CHECK(current_written_ == 0, "tensor '", name, "' was already partly written to ", path_.string());
  write_part(name, data, specs_[current_].bytes());
}

void SafetensorsWriter::finish() {
  LOOM_CHECK(!finished_, "safetensors file ", path_.string(), " finished twice");
  if (current_ < specs_.size() && current_written_ == specs_[current_].bytes()) next_tensor();
  while (current_ < specs_.size() && specs_[current_].bytes() == 0) next_tensor();
  LOOM_CHECK(current_ == specs_.size(), "safetensors file ", path_.string(), " finished before tensor '",
             specs_[current_].name, "' was written");
  io_detail::Fd fd(fd_);
  fd_ = -1;
  io_detail::fsync_fd(fd.get(), path_);
  io_detail::close_fd(fd, path_);
  finished_ = true;
  digest_ = FileDigest{bytes_, hasher_.checksum(), hasher_.hex_digest()};
}

const FileDigest& SafetensorsWriter::digest() const {
  LOOM_CHECK(finished_, "digest of safetensors file ", path_.string(), " asked before finish()");
  return digest_;
}

const std::vector<std::string>& SafetensorsWriter::tensor_digests() const {
  LOOM_CHECK(finished_, "tensor digests of safetensors file ", path_.string(), " asked before finish()");
  return tensor_digests_;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsSpec> specs;
  for (const SafetensorsTensor& t : tensors) specs.push_back({t.name, t.dtype, t.shape});
  SafetensorsWriter writer(path, std::move(specs), metadata);
  for (const SafetensorsTensor& t : tensors) writer.write(t.name, t.data);
  writer.finish();
}

}  // namespace loom
