// Verification of a safetensors file's tensors as they are read: the bytes
// a load needs are hashed while they are still in cache, so checking a
// checkpoint adds little to reading it (a whole-file checksum would read
// every byte twice, and the bytes a rank does not need as well).
#include <algorithm>
#include <vector>

#include "loom/io.h"

namespace loom {

struct TensorVerifier::Tensor {
  const SafetensorsReader::Entry* entry = nullptr;
  std::string expected;
  FileHasher hasher{Checksum::xxh3_128};
  uint64_t hashed = 0;  // bytes [0, hashed) of the tensor went into `hasher`
  bool verified = false;
};

TensorVerifier::TensorVerifier(const SafetensorsReader& reader,
                               std::map<std::string, std::string, std::less<>> digests)
    : reader_(reader) {
  for (const SafetensorsReader::Entry& e : reader.entries()) {
    auto it = digests.find(e.name);
    if (it == digests.end())
      throw Error(str("checkpoint file '", reader.path().string(), "' holds tensor '", e.name,
                      "' that its manifest gives no checksum for (corrupt); resume from another checkpoint"));
    auto t = std::make_unique<Tensor>();
    t->entry = &e;
    t->expected = std::move(it->second);
    tensors_.emplace(e.name, std::move(t));
    digests.erase(it);
  }
  if (!digests.empty())
    throw Error(str("checkpoint file '", reader.path().string(), "' lacks tensor '", digests.begin()->first,
                    "' that its manifest lists (corrupt); resume from another checkpoint"));
}

TensorVerifier::~TensorVerifier() = default;

TensorVerifier::Tensor& TensorVerifier::tensor(std::string_view name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) reader_.entry(name);  // throws, naming the closest tensor
  LOOM_CHECK(it != tensors_.end(), "tensor '", name, "' of ", reader_.path().string(), " has no verifier");
  return *it->second;
}

void TensorVerifier::check_if_complete(Tensor& t) {
  if (t.verified || t.hashed != t.entry->bytes) return;
  const std::string actual = t.hasher.hex_digest();
  if (actual != t.expected)
    throw Error(str("checkpoint file '", reader_.path().string(), "': tensor '", t.entry->name, "' has xxh3_128 ",
                    actual, " but the manifest says ", t.expected, " (corrupt); resume from another checkpoint"));
  t.verified = true;
}

void TensorVerifier::hash_up_to(Tensor& t, uint64_t end, int stream) {
  // Through a buffer that stays in cache: these bytes are hashed, not kept.
  std::vector<uint8_t> buffer(std::min<uint64_t>(end - std::min(end, t.hashed), uint64_t(1) << 20));
  while (t.hashed < end) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buffer.size(), end - t.hashed));
    reader_.read_range(t.entry->name, t.hashed, buffer.data(), n, stream);
    t.hasher.update(buffer.data(), n);
    t.hashed += n;
  }
  check_if_complete(t);
}

void TensorVerifier::read_range(std::string_view name, uint64_t byte_offset, void* dst, size_t bytes, int stream) {
  Tensor& t = tensor(name);
  if (!t.verified && byte_offset > t.hashed) hash_up_to(t, byte_offset, stream);
  // In blocks, each hashed straight after its read, while it is in cache.
  constexpr size_t kBlock = size_t(1) << 20;
  auto* out = static_cast<uint8_t*>(dst);
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kBlock, bytes - done);
    const uint64_t at = byte_offset + done;
    reader_.read_range(name, at, out + done, n, stream);
    // Only bytes where the hashing stands continue it; bytes before it were
    // hashed when they were first read.
    if (!t.verified && at <= t.hashed && t.hashed < at + n) {
      const uint64_t skip = t.hashed - at;
      t.hasher.update(out + done + skip, n - skip);
      t.hashed = at + n;
      check_if_complete(t);
    }
    done += n;
  }
}

void TensorVerifier::finish() {
  for (auto& [name, t] : tensors_)
    if (t->hashed > 0 && !t->verified) hash_up_to(*t, t->entry->bytes, 0);
}

}  // namespace loom
