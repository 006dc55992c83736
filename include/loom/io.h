// loom io: the file primitives checkpoints are built from. Checksums, the
// safetensors format (read lazily, written streaming), atomic directory and
// file commits that survive crashes and full disks, checkpoint manifests with
// per-file checksums, and retention of step_NNNNNNNN directories.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

struct evp_md_ctx_st;  // OpenSSL's EVP_MD_CTX (Sha256), kept out of this header

#include "loom/core.h"

namespace loom {

// ---------------------------------------------------------------------------
// SHA-256 (FIPS 180-4), computed by OpenSSL (which uses the CPU's SHA
// instructions where it has them)
// ---------------------------------------------------------------------------

class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  void update(const void* data, size_t bytes);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // The digest; the object is spent afterwards (LOOM_CHECK on reuse).
  std::array<uint8_t, 32> finish();
  // finish() as 64 lowercase hex digits.
  std::string hex_digest();

 private:
  ::evp_md_ctx_st* ctx_;
  bool finished_ = false;
};

std::string sha256_hex(std::string_view bytes);
// Streams the file in chunks; throws Error naming the path if it cannot be read.
std::string sha256_file(const std::filesystem::path& path);

// ---------------------------------------------------------------------------
// File checksums
// ---------------------------------------------------------------------------
// A manifest names each file's checksum by its algorithm. loom writes XXH3-128
// (xxHash): it hashes at memory speed, so verifying a checkpoint costs little
// beside reading it, where SHA-256 took several times as long as the read.
// SHA-256 entries, which earlier versions wrote, still verify.
enum class Checksum { xxh3_128, sha256 };

// The manifest key, "xxh3_128" or "sha256"; the inverse returns nullopt for
// any other key.
const char* checksum_name(Checksum c);
std::optional<Checksum> parse_checksum_name(std::string_view name);

// A checksum computed over bytes that arrive in pieces.
class FileHasher {
 public:
  explicit FileHasher(Checksum c = Checksum::xxh3_128);
  ~FileHasher();
  FileHasher(const FileHasher&) = delete;
  FileHasher& operator=(const FileHasher&) = delete;

  Checksum checksum() const { return checksum_; }
  void update(const void* data, size_t bytes);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // The digest as lowercase hex; the hasher is spent afterwards.
  std::string hex_digest();

  struct Algorithm;  // one per Checksum (src/io/checksum.cpp)

 private:
  Checksum checksum_;
  std::unique_ptr<Algorithm> algorithm_;
};

// Streams the file in chunks; throws Error naming the path if it cannot be read.
std::string checksum_file(const std::filesystem::path& path, Checksum c);

// ---------------------------------------------------------------------------
// safetensors
// ---------------------------------------------------------------------------
// Layout (docs/checkpoints.md): 8-byte little-endian header length N, N bytes
// of JSON header {"name": {"dtype", "shape", "data_offsets": [begin, end]},
// "__metadata__": {str: str}}, then the data section; offsets are relative to
// the data section and tile it exactly.

// "F32", "BF16", "F16", "I32", "I64", "U8", "I8".
const char* safetensors_dtype_name(DType dt);
// The inverse; throws Error for other tags (F64, BOOL, ...) naming what loom reads.
DType parse_safetensors_dtype(std::string_view tag);

// A file's size and checksum (manifests, checkpoints).
struct FileDigest {
  uint64_t bytes = 0;
  Checksum checksum = Checksum::xxh3_128;
  std::string hex;  // lowercase
  bool operator==(const FileDigest&) const = default;
};

// As a manifest lists it: {"<checksum name>": "<hex>", "bytes": <count>}.
nlohmann::json digest_json(const FileDigest& digest);
// The inverse; nullopt unless `entry` is exactly that, with a known checksum
// and a digest of its length.
std::optional<FileDigest> parse_digest_json(const nlohmann::json& entry);

struct SafetensorsSpec {
  std::string name;
  DType dtype;
  Shape shape;
  size_t bytes() const { return static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype); }
};

// Writes a safetensors file whose tensors are declared up front (the header
// needs every offset) and whose bytes then arrive one tensor, or one piece of a
// tensor, at a time, so a checkpoint never needs a second copy of its state in
// memory. Tensors are stored in the declared order. A writer destroyed before
// finish() removes its partial file.
class SafetensorsWriter {
 public:
  // Creates `path` (truncating) and writes the header. Names must be unique
  // and not "__metadata__".
  SafetensorsWriter(std::filesystem::path path, std::vector<SafetensorsSpec> specs,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // All of tensor `name`'s bytes; it must be the next unwritten tensor.
  void write(std::string_view name, const void* data);
  // The next `bytes` bytes of tensor `name`: the tensor being written, or the
  // next one once the current one is complete. Lets a sharded tensor be
  // written piece by piece.
  void write_part(std::string_view name, const void* data, size_t bytes);
  // Checks every declared byte arrived, fsyncs and closes. Throws Error otherwise.
  void finish();
  // After finish(): the file's size and checksum, hashed as the bytes were
  // written (a sharded checkpoint's rank never reads its file back).
  const FileDigest& digest() const;
  // After finish(): each tensor's XXH3-128 (hex), in the declared order, so
  // that a reader of some tensors verifies only those (TensorVerifier).
  const std::vector<std::string>& tensor_digests() const;

 private:
  void advance_to(std::string_view name);
  // Moves on to the next declared tensor, keeping the finished one's digest.
  void next_tensor();
  std::filesystem::path path_;
  std::vector<SafetensorsSpec> specs_;
  int fd_ = -1;
  bool regular_file_ = true;    // only a regular file is removed on failure, never a device
  size_t current_ = 0;          // index of the tensor being written
  size_t current_written_ = 0;  // bytes of it written so far
  bool finished_ = false;
  FileHasher hasher_;
  std::unique_ptr<FileHasher> tensor_hasher_;  // of the tensor being written
  std::vector<std::string> tensor_digests_;
  uint64_t bytes_ = 0;  // written so far, header included
  FileDigest digest_;
};

struct SafetensorsTensor {
  std::string name;
  DType dtype;
  Shape shape;
  const void* data;
};
// One call for tensors that are all in memory.
void write_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsTensor>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Opens and validates a safetensors file: header length against file size,
// JSON well-formed, every entry's dtype known, shape * dtype size equal to its
// byte span, spans in bounds and tiling the data section without gaps or
// overlaps. Every failure is an Error naming the file and the problem. Tensor
// bytes are read on demand with pread (thread-safe), so opening a large file
// costs only its header.
class SafetensorsReader {
 public:
  struct Entry {
    std::string name;
    DType dtype;
    Shape shape;
    uint64_t offset;  // absolute file offset of the first byte
    uint64_t bytes;
  };

  explicit SafetensorsReader(std::filesystem::path path);
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // In header order.
  const std::vector<Entry>& entries() const { return entries_; }
  bool contains(std::string_view name) const;
  // Throws Error naming the file and the closest tensor name.
  const Entry& entry(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Reads that go front to back through the file, one after another. The
  // kernel reads ahead of one such stream per open file; reads of several
  // tensors that interleave (a checkpoint load takes a block of a
  // parameter's values, then of both its moments, then the next block) look
  // random to it, and every read would wait for the device. Each stream
  // beyond the first reads through its own descriptor of the file, opened at
  // its first read, so the kernel follows each stream on its own.
  static constexpr int kMaxStreams = 4;

  // All of tensor `name` into `dst`, which holds exactly `bytes` bytes.
  void read(std::string_view name, void* dst, size_t bytes) const;
  // Bytes [byte_offset, byte_offset + bytes) of tensor `name` (a shard's
  // slice), as part of read stream `stream` (0 to kMaxStreams - 1).
  void read_range(std::string_view name, uint64_t byte_offset, void* dst, size_t bytes, int stream = 0) const;
  // A new tensor from the calling thread's MemoryContext holding `name`.
  Tensor load(std::string_view name, Tier tier = Tier::host) const;

 private:
  // Stream `stream`'s descriptor, opening it at its first use.
  int stream_fd(int stream) const;

  std::filesystem::path path_;
  int fd_ = -1;  // stream 0
  mutable std::mutex streams_mu_;
  mutable std::array<int, kMaxStreams> stream_fds_;  // [0] is fd_; -1 until opened
  std::vector<Entry> entries_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
};

// Reads byte ranges of a safetensors file's tensors, verifying each tensor it
// reads against its XXH3-128 (SafetensorsWriter::tensor_digests) as the bytes
// arrive: a read that continues where the tensor's hashing stands is hashed
// in place, while its bytes are still in cache, so reading a tensor front to
// back costs one pass; a read further on first hashes the bytes skipped; a
// tensor read only in part is hashed to its end by finish(). Throws Error
// naming the file and the tensor when a digest does not match.
class TensorVerifier {
 public:
  // `digests`: tensor name -> XXH3-128 hex, for every tensor of `reader`.
  TensorVerifier(const SafetensorsReader& reader, std::map<std::string, std::string, std::less<>> digests);
  ~TensorVerifier();
  TensorVerifier(const TensorVerifier&) = delete;
  TensorVerifier& operator=(const TensorVerifier&) = delete;

  // SafetensorsReader::read_range, verified.
  void read_range(std::string_view name, uint64_t byte_offset, void* dst, size_t bytes, int stream = 0);
  // Verifies every tensor read so far to its end.
  void finish();

 private:
  struct Tensor;  // one tensor's hashing: its digest, hasher and how far it got
  Tensor& tensor(std::string_view name);
  // Hashes the tensor's bytes from where its hashing stands up to `end`.
  void hash_up_to(Tensor& t, uint64_t end, int stream);
  void check_if_complete(Tensor& t);

  const SafetensorsReader& reader_;
  std::map<std::string, std::unique_ptr<Tensor>, std::less<>> tensors_;
};

// ---------------------------------------------------------------------------
// Atomic commits
// ---------------------------------------------------------------------------

// Builds a directory under a temporary name and publishes it whole:
// files go to <parent>/.tmp-<name>-<pid>; commit() fsyncs every file and
// directory in it, renames it to <parent>/<name> and fsyncs the parent. If the
// object dies uncommitted (an exception, a full disk) the temporary directory
// is removed and whatever was at <parent>/<name> is untouched. Committing over
// an existing directory swaps the two atomically (renameat2 RENAME_EXCHANGE)
// and then removes the old one.
class AtomicDirWriter {
 public:
  explicit AtomicDirWriter(std::filesystem::path final_dir);
  ~AtomicDirWriter();
  AtomicDirWriter(const AtomicDirWriter&) = delete;
  AtomicDirWriter& operator=(const AtomicDirWriter&) = delete;

  const std::filesystem::path& final_dir() const { return final_dir_; }
  const std::filesystem::path& temp_dir() const { return temp_dir_; }
  // temp_dir()/relative, creating its parent directories; for writers of
  // their own (SafetensorsWriter, write_manifest).
  std::filesystem::path path(std::string_view relative) const;
  // Writes a whole file into the directory.
  void write_file(std::string_view relative, std::string_view bytes) const;
  void commit();

 private:
  std::filesystem::path final_dir_;
  std::filesystem::path temp_dir_;
  bool committed_ = false;
};

// Replaces `path` with `bytes` atomically (temp file in the same directory,
// fsync, rename, fsync the directory): for small pointer files like `latest`.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// Reads a whole file; Error naming the path if it cannot.
std::string read_file(const std::filesystem::path& path);

// ---------------------------------------------------------------------------
// Checkpoint manifests
// ---------------------------------------------------------------------------

inline constexpr const char* kManifestFile = "manifest.json";

// manifest.json of a checkpoint directory: any fields the trainer records
// (step, config, layout, ...) plus "files": {relative path: digest_json}.
struct Manifest {
  nlohmann::json fields = nlohmann::json::object();
  std::map<std::string, FileDigest> files;
};

// Digests every regular file under `dir` (recursively, paths relative with
// '/'), except manifest.json, and writes dir/manifest.json with `fields`.
// Returns what it wrote.
Manifest write_manifest(const std::filesystem::path& dir, const nlohmann::json& fields);
// The same with digests the writers took as they wrote (SafetensorsWriter::
// digest): `files` must list every file under `dir` but manifest.json; none
// is read back.
Manifest write_manifest(const std::filesystem::path& dir, const nlohmann::json& fields,
                        std::map<std::string, FileDigest> files);
// Throws Error naming the directory if manifest.json is missing or corrupt.
Manifest read_manifest(const std::filesystem::path& dir);
// Checks that every file the manifest lists exists with its size and (unless
// `checksums` is false) its checksum. Throws Error naming the directory and the
// exact file that is missing, has the wrong size or the wrong checksum.
Manifest verify_checkpoint_dir(const std::filesystem::path& dir, bool checksums = true);
// The same for one file `rel` of the manifest (a sharded checkpoint's rank
// checks the files it reads).
void verify_checkpoint_file(const std::filesystem::path& dir, const std::string& rel, const FileDigest& digest,
                            bool checksum = true);

// ---------------------------------------------------------------------------
// Retention
// ---------------------------------------------------------------------------

inline constexpr const char* kLatestFile = "latest";

// "step_00000010": zero-padded to 8 digits so names sort like steps.
std::string checkpoint_dir_name(int64_t step);

struct CheckpointEntry {
  int64_t step;
  std::filesystem::path path;
};
// Directories of `root` named step_<digits>, ascending by step. Anything else
// (latest, .tmp-* leftovers, other files) is ignored.
std::vector<CheckpointEntry> list_checkpoints(const std::filesystem::path& root);

// root/latest names the newest complete checkpoint directory.
void write_latest(const std::filesystem::path& root, std::string_view dir_name);
// The directory root/latest names, or nullopt when there is no `latest`.
// Throws Error if it holds anything but a plain directory name.
std::optional<std::filesystem::path> read_latest(const std::filesystem::path& root);

// Deletes all but the newest `keep_last` checkpoints (keep_last 0 keeps all),
// never the newest one nor the one `latest` points to. Also removes stale
// .tmp-* leftovers of interrupted commits: those whose pid is no longer a live
// process on this host and that have not been modified for `stale_after` (the
// age guard protects writers on other hosts of a shared filesystem). Returns
// the paths removed.
std::vector<std::filesystem::path> apply_retention(const std::filesystem::path& root, int64_t keep_last,
                                                   std::chrono::seconds stale_after = std::chrono::hours(1));

}  // namespace loom
