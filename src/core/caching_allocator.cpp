#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdlib>
#include <iterator>
#include <map>
#include <mutex>
#include <unordered_map>

#include "loom/core.h"
#include "core/size_class.h"

namespace loom {

namespace {

class HostMemoryResource final : public MemoryResource {
 public:
  void* allocate(size_t bytes) override { return std::aligned_alloc(kMemoryAlignment, bytes); }
  void deallocate(void* p, size_t) override { std::free(p); }
  const char* name() const override { return "host"; }
};

}  // namespace

MemoryResource& host_memory_resource() {
  static HostMemoryResource resource;
  return resource;
}

struct Allocator::Cache {
  std::mutex mu;
  std::unordered_map<void*, size_t> live;      // block in use -> its size
  std::map<size_t, std::vector<void*>> free;   // size -> cached blocks
  size_t free_bytes = 0;
  // Bytes in blocks of the resource: in use, cached, or being allocated.
  size_t held = 0;
};

namespace {

void raise(std::atomic<size_t>& peak, size_t bytes) {
  size_t p = peak.load();
  while (bytes > p && !peak.compare_exchange_weak(p, bytes)) {
  }
}

}  // namespace

Allocator::Allocator(Tier tier, size_t budget, MemoryResource& resource)
    : tier_(tier), cache_(std::make_unique<Cache>()), resource_(&resource), budget_(budget) {}

Allocator::~Allocator() { empty_cache(); }

void Allocator::check_budget(size_t bytes) const {
  const size_t used = used_.load(), budget = budget_.load();
  if (bytes > budget || used > budget - bytes) {
    throw Error(str("out of ", tier_name(tier_), " memory: asked for ", format_bytes(static_cast<double>(bytes)),
                    " with ", format_bytes(static_cast<double>(used)), " in use of a ",
                    format_bytes(static_cast<double>(budget)), " budget",
                    current_rank() >= 0 ? str(" on rank ", current_rank()) : std::string(), "; raise memory.",
                    tier_name(tier_), "_budget or offload more"));
  }
}

// Takes cached blocks, largest first, out of the cache until `room` more
// bytes fit under the budget or the cache is empty (kUnlimited: all of them);
// the caller frees them outside the lock.
std::vector<Allocator::Block> Allocator::trim_locked(size_t room) {
  std::vector<Block> out;
  Cache& c = *cache_;
  const size_t budget = budget_.load();
  const auto fits = [&] { return room <= budget && reserved_.load() <= budget - room; };
  while (!fits() && !c.free.empty()) {
    auto it = std::prev(c.free.end());
    out.push_back({it->second.back(), it->first});
    it->second.pop_back();
    c.free_bytes -= it->first;
    c.held -= it->first;
    reserved_ -= it->first;
    if (it->second.empty()) c.free.erase(it);
  }
  system_frees_ += out.size();
  return out;
}

void Allocator::free_blocks(MemoryResource& resource, const std::vector<Block>& blocks) {
  for (const Block& b : blocks) resource.deallocate(b.p, b.bytes);
}

void* Allocator::allocate(size_t bytes) {
  Cache& c = *cache_;
  size_t block = detail::size_class(bytes);
  std::vector<Block> evicted;
  MemoryResource* resource = nullptr;
  {
    std::lock_guard lock(c.mu);
    check_budget(bytes);
    used_ += bytes;
    raise(peak_, used_.load());
    auto it = c.free.find(block);
    if (it != c.free.end()) {
      void* p = it->second.back();
      it->second.pop_back();
      if (it->second.empty()) c.free.erase(it);
      c.free_bytes -= block;
      c.live.emplace(p, block);
      return p;
    }
    evicted = trim_locked(block);
    // With the cache empty, only the rounding of the blocks in use can still
    // stand between the request and the budget: a block of the exact size
    // keeps real memory as close to the budget as the alignment allows.
    if (block > budget_.load() - std::min(budget_.load(), reserved_.load()))
      block = detail::round_up_bytes(std::max<size_t>(bytes, 1), kMemoryAlignment);
    c.held += block;
    reserved_ += block;
    raise(peak_reserved_, reserved_.load());
    resource = resource_.load();
  }
  free_blocks(*resource, evicted);
  void* p = resource->allocate(block);
  std::lock_guard lock(c.mu);
  if (p == nullptr) {
    c.held -= block;
    reserved_ -= block;
    used_ -= bytes;
    throw Error(str("the ", resource->name(), " memory resource refused ", format_bytes(static_cast<double>(block)),
                    " for the ", tier_name(tier_), " tier"));
  }
  LOOM_CHECK(reinterpret_cast<uintptr_t>(p) % kMemoryAlignment == 0, "the ", resource->name(),
             " memory resource returned ", p, ", not aligned to ", kMemoryAlignment, " bytes");
  ++system_allocations_;
  c.live.emplace(p, block);
  return p;
}

void Allocator::cache_block_locked(void* p, size_t bytes) {
  Cache& c = *cache_;
  auto it = c.live.find(p);
  LOOM_CHECK(it != c.live.end(), "freeing ", p, " into the ", tier_name(tier_), " tier, which did not allocate it");
  const size_t block = it->second;
  LOOM_CHECK(bytes <= block, "freeing ", bytes, " bytes at ", p, " into the ", tier_name(tier_),
             " tier, whose block holds ", block);
  c.live.erase(it);
  c.free[block].push_back(p);
  c.free_bytes += block;
}

void Allocator::deallocate(void* p, size_t bytes) {
  std::lock_guard lock(cache_->mu);
  LOOM_CHECK(used_.load() >= bytes, "freeing more ", tier_name(tier_), " bytes than are in use");
  cache_block_locked(p, bytes);
  used_ -= bytes;
}

void Allocator::free_memory(void* p, size_t bytes) {
  std::lock_guard lock(cache_->mu);
  cache_block_locked(p, bytes);
  // The release() that came first took the bytes out of reserved() as it
  // does reserve()d ones; the block is held again, now in the cache.
  reserved_ += bytes;
}

void Allocator::reserve(size_t bytes) {
  std::vector<Block> evicted;
  MemoryResource* resource = nullptr;
  {
    std::lock_guard lock(cache_->mu);
    check_budget(bytes);
    evicted = trim_locked(bytes);
    used_ += bytes;
    reserved_ += bytes;
    raise(peak_, used_.load());
    raise(peak_reserved_, reserved_.load());
    resource = resource_.load();
  }
  free_blocks(*resource, evicted);
}

void Allocator::release(size_t bytes) {
  std::lock_guard lock(cache_->mu);
  LOOM_CHECK(used_.load() >= bytes, "released more ", tier_name(tier_), " bytes than reserved");
  used_ -= bytes;
  reserved_ -= bytes;
}

void Allocator::empty_cache() {
  std::vector<Block> evicted;
  MemoryResource* resource = nullptr;
  {
    std::lock_guard lock(cache_->mu);
    evicted = trim_locked(kUnlimited);
    resource = resource_.load();
  }
  free_blocks(*resource, evicted);
}

void Allocator::set_resource(MemoryResource& resource) {
  std::vector<Block> evicted;
  MemoryResource* previous = nullptr;
  {
    std::lock_guard lock(cache_->mu);
    LOOM_CHECK(cache_->held == cache_->free_bytes, "switching the ", tier_name(tier_), " tier to the ",
               resource.name(), " memory resource while ", cache_->held - cache_->free_bytes,
               " bytes of blocks are in use");
    evicted = trim_locked(kUnlimited);
    previous = resource_.exchange(&resource);
  }
  free_blocks(*previous, evicted);
}

void Allocator::set_budget(size_t bytes) {
  std::vector<Block> evicted;
  MemoryResource* resource = nullptr;
  {
    std::lock_guard lock(cache_->mu);
    if (bytes < used_.load())
      throw Error(str("cannot set the ", tier_name(tier_), " budget to ", format_bytes(static_cast<double>(bytes)),
                      ": ", format_bytes(static_cast<double>(used_.load())), " are already in use"));
    budget_.store(bytes);
    evicted = trim_locked(0);
    resource = resource_.load();
  }
  free_blocks(*resource, evicted);
}

void Allocator::reset_peak() {
  std::lock_guard lock(cache_->mu);
  peak_.store(used_.load());
  peak_reserved_.store(reserved_.load());
}

void Allocator::raise_peak(size_t bytes) { raise(peak_, bytes); }

}  // namespace loom
