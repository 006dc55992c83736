// loom core: errors, dtypes, memory tiers with accounted allocators, tensors,
// and the counter-based RNG that makes initialization layout-independent.
#pragma once

#include <signal.h>

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace loom {

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// A recoverable error the user can act on: bad config, I/O, timeouts, corrupt
// files, out-of-budget. The message names the value and what to do about it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Concatenates anything streamable; used to build error messages.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

// "a, b, c": names listed in a message.
std::string joined(const std::vector<std::string>& items, std::string_view separator = ", ");

// The rank of the calling thread, for messages. Ranks are threads under the
// local backend, so this is thread-local; -1 until a communicator sets it.
int current_rank();
void set_current_rank(int rank);

namespace detail {
[[noreturn]] void check_failed(const char* file, int line, const char* cond, const std::string& msg);
}  // namespace detail

// A broken invariant (a bug, not bad input): prints file:line and rank, aborts.
#define LOOM_CHECK(cond, ...)                                                          \
  do {                                                                                 \
    if (!(cond)) [[unlikely]]                                                          \
      ::loom::detail::check_failed(__FILE__, __LINE__, #cond, ::loom::str(__VA_ARGS__)); \
  } while (0)

// ---------------------------------------------------------------------------
// Termination signals
// ---------------------------------------------------------------------------

// Installs `handler` for SIGTERM and SIGINT (sigaction with `flags`, e.g.
// SA_RESTART) for this object's lifetime and restores the handlers in place
// before when it goes. The handler may only do what is async-signal-safe:
// set a flag, or kill() another process.
class ScopedTerminationHandler {
 public:
  ScopedTerminationHandler(void (*handler)(int), int flags);
  ~ScopedTerminationHandler();
  ScopedTerminationHandler(const ScopedTerminationHandler&) = delete;
  ScopedTerminationHandler& operator=(const ScopedTerminationHandler&) = delete;

 private:
  struct sigaction previous_term_ {}, previous_int_ {};
};

// ---------------------------------------------------------------------------
// Data types
// ---------------------------------------------------------------------------

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8, f64, i8 };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
// Parses "f32"/"fp32"/"float32", "bf16"/"bfloat16", "f16"/"fp16"/"float16"; throws Error otherwise.
DType parse_dtype(std::string_view name);

// Exact conversions with round-to-nearest-even; NaN stays NaN, overflow goes to Inf.
uint16_t f32_to_bf16(float x);
float bf16_to_f32(uint16_t x);
uint16_t f32_to_f16(float x);
float f16_to_f32(uint16_t x);

// Bulk conversions between any two floating dtypes (f32, bf16, f16).
void convert(const void* src, DType src_dt, void* dst, DType dst_dt, int64_t n);

// Rounds f32 values in place to what `dt` can represent (identity for f32).
void round_to(float* x, int64_t n, DType dt);

// Writes `value`, rounded to `dt`, into n elements of a floating dtype.
void fill(void* dst, DType dt, int64_t n, float value);

// ---------------------------------------------------------------------------
// Devices
// ---------------------------------------------------------------------------

// What a rank computes on. Streams, events and the kernel dispatch that run
// work on it are in device.h.
enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;

  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int index) { return {DeviceKind::cuda, index}; }
  // "cpu", "cuda:0".
  std::string name() const;
  friend bool operator==(const Device&, const Device&) = default;
};

namespace detail {
class StreamImpl;
}

// ---------------------------------------------------------------------------
// Memory tiers and accounted allocators
// ---------------------------------------------------------------------------

// Where bytes live. Without a GPU, `device` is a budgeted host arena standing in
// for GPU memory, so out-of-memory and offload are real on a CPU machine.
enum class Tier : uint8_t { device, host, nvme };
constexpr int kNumTiers = 3;
const char* tier_name(Tier t);

constexpr size_t kUnlimited = SIZE_MAX;

// Every block a tier hands out is aligned to this many bytes (a cache line,
// and what the vectorized kernels assume).
constexpr size_t kMemoryAlignment = 64;

// Where a tier gets its raw memory. Every tier defaults to host memory; a GPU
// backend gives the device tier device memory (cudaMalloc) and the host tier
// pinned memory (cudaHostAlloc) by implementing this interface, so the caching
// and the accounting stay the same on every machine. Implementations are
// thread-safe and outlive every Allocator that uses them.
class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // At least kMemoryAlignment-aligned; nullptr when the system refuses.
  virtual void* allocate(size_t bytes) = 0;
  virtual void deallocate(void* p, size_t bytes) = 0;
  virtual const char* name() const = 0;
};

// kMemoryAlignment-aligned host memory (aligned_alloc/free); stateless.
MemoryResource& host_memory_resource();

// Byte accounting for one tier with a budget and high-water marks, over a
// cache of the tier's raw memory. Every allocation of the tier goes through
// here, so memory figures are read from these counters rather than estimated.
//
// Freed blocks are kept, by size class, and handed out again: a training step
// that repeats the previous one's allocations reaches the resource for none
// of them. Two figures follow from that:
//   used()      the bytes tensors hold, exactly as requested: what the memory
//               formulas and the budget checks of the planners are about;
//   reserved()  the bytes the tier holds from its resource: blocks in use
//               (rounded up to their size class), cached free blocks, and the
//               bytes accounted with reserve().
// The budget bounds reserved() (up to the rounding of blocks in use): a
// request that would push it past the budget first returns cached blocks to
// the resource. Only a request that would push used() past the budget is an
// out-of-memory Error. Thread-safe: memory may be
// freed from any thread.
class Allocator {
 public:
  Allocator(Tier tier, size_t budget = kUnlimited, MemoryResource& resource = host_memory_resource());
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  // kMemoryAlignment-aligned memory from the cache or the resource, zero
  // bytes allowed. Throws Error naming the tier, the request and the budget
  // when the budget would be exceeded. `deallocate` takes the size requested.
  void* allocate(size_t bytes);
  void deallocate(void* p, size_t bytes);

  // Accounting without memory, for bytes that live elsewhere (NVMe files).
  void reserve(size_t bytes);
  void release(size_t bytes);
  // Returns the memory of an allocation whose bytes were already released:
  // a free in stream order (the asynchronous CPU streams) counts the bytes
  // free when the host lets go of them, as a GPU's stream-ordered allocator
  // does, and returns the memory once the stream's earlier work has run.
  // Between the two, the bytes released are in neither used() nor reserved().
  void free_memory(void* p, size_t bytes);

  // Returns every cached free block to the resource.
  void empty_cache();
  // Takes raw memory from `resource` from now on. No block may be in use; the
  // cache is emptied into the previous resource first.
  void set_resource(MemoryResource& resource);
  MemoryResource& resource() const { return *resource_.load(); }

  Tier tier() const { return tier_; }
  size_t used() const { return used_.load(); }
  size_t peak() const { return peak_.load(); }
  size_t reserved() const { return reserved_.load(); }
  size_t peak_reserved() const { return peak_reserved_.load(); }
  // Calls that reached the resource since construction: a steady state is
  // one where neither grows.
  uint64_t system_allocations() const { return system_allocations_.load(); }
  uint64_t system_frees() const { return system_frees_.load(); }
  size_t budget() const { return budget_.load(); }
  // Lowering the budget below what is in use is an Error; below what is
  // reserved empties as much of the cache as it takes.
  void set_budget(size_t bytes);
  // Both high-water marks restart from the current figures.
  void reset_peak();
  // Raises the high-water mark of used() to at least `bytes`: a peak
  // measured in intervals (reset_peak at each boundary) is put back together.
  void raise_peak(size_t bytes);

 private:
  struct Cache;
  struct Block {
    void* p;
    size_t bytes;
  };
  void check_budget(size_t bytes) const;
  void cache_block_locked(void* p, size_t bytes);
  std::vector<Block> trim_locked(size_t room);
  static void free_blocks(MemoryResource& resource, const std::vector<Block>& blocks);

  Tier tier_;
  std::unique_ptr<Cache> cache_;
  std::atomic<MemoryResource*> resource_;
  // Changed under the cache's lock (raise_peak by compare-exchange alone);
  // read without it.
  std::atomic<size_t> budget_;
  std::atomic<size_t> used_{0};
  std::atomic<size_t> peak_{0};
  std::atomic<size_t> reserved_{0};
  std::atomic<size_t> peak_reserved_{0};
  std::atomic<uint64_t> system_allocations_{0};
  std::atomic<uint64_t> system_frees_{0};
};

// The allocators of one rank, one per tier, its device and its streams. Under
// the local backend every rank thread installs its own, so budgets,
// high-water marks and streams are per rank.
class MemoryContext {
 public:
  MemoryContext();
  ~MemoryContext();
  Allocator& tier(Tier t) { return *tiers_[static_cast<int>(t)]; }

  // The device whose memory the device tier is and whose backend runs the
  // rank's kernels (the CPU unless a backend says otherwise).
  Device device() const { return device_; }

  // The rank's streams, created at first use (device.h).
  enum class StreamRole : uint8_t { compute, copy };
  const std::shared_ptr<detail::StreamImpl>& stream(StreamRole role);

  // The calling thread's context: the one installed with `Install`, or the
  // process-wide default.
  static MemoryContext& current();

  // Installs a context for the calling thread for the lifetime of this object.
  class Install {
   public:
    explicit Install(MemoryContext& ctx);
    ~Install();
    Install(const Install&) = delete;
    Install& operator=(const Install&) = delete;

   private:
    MemoryContext* previous_;
  };

 private:
  std::array<std::unique_ptr<Allocator>, kNumTiers> tiers_;
  Device device_;
  std::mutex streams_mu_;
  std::array<std::shared_ptr<detail::StreamImpl>, 2> streams_;
};

// Human-readable byte count ("1.50 GiB").
std::string format_bytes(double bytes);

// ---------------------------------------------------------------------------
// Tensor
// ---------------------------------------------------------------------------

using Shape = std::vector<int64_t>;
int64_t shape_numel(const Shape& s);
std::string shape_str(const Shape& s);

// Owned bytes from one allocator, freed into it.
class Storage {
 public:
  Storage(Allocator& alloc, size_t bytes);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Allocator& allocator() const { return alloc_; }

 private:
  Allocator& alloc_;
  size_t bytes_;
  void* data_;
  // Set when the rank's streams are asynchronous: the memory is returned in
  // the compute stream's order, after the work enqueued before the free.
  std::shared_ptr<detail::StreamImpl> stream_;
};

// A contiguous, row-major n-d array. Views share storage. Tensors describe
// memory; they never decide where parameters live (the stores do).
class Tensor {
 public:
  Tensor() = default;

  // Allocated from the calling thread's MemoryContext.
  static Tensor empty(const Shape& shape, DType dt = DType::f32, Tier tier = Tier::device);
  static Tensor zeros(const Shape& shape, DType dt = DType::f32, Tier tier = Tier::device);
  // A copy of `shape` elements of host memory (a blocking copy).
  static Tensor from_host(const void* data, const Shape& shape, DType dt, Tier tier = Tier::device);
  // A non-owning view over memory someone else keeps alive.
  static Tensor borrow(void* data, const Shape& shape, DType dt, Tier tier);

  bool defined() const { return data_ != nullptr || (storage_ && numel() == 0); }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t numel() const { return shape_numel(shape_); }
  DType dtype() const { return dtype_; }
  Tier tier() const { return tier_; }
  // The device of the device tier's memory; the CPU for host and NVMe.
  Device device() const { return device_; }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    check_element_type(sizeof(T), type_tag<T>());
    return static_cast<T*>(data_);
  }

  // Same bytes, another shape of the same element count.
  Tensor view(const Shape& shape) const;
  // Rows [start, start + len) along dimension 0.
  Tensor rows(int64_t start, int64_t len) const;
  // A 1-d view of `n` elements starting at flat element `offset`.
  Tensor flat(int64_t offset, int64_t n) const;

  void zero_();
  void fill_(float value);  // floating dtypes only
  // Copies `src` (same element count) converting dtype with RNE rounding.
  void copy_from(const Tensor& src);
  Tensor clone(Tier tier) const;

 private:
  template <typename T>
  static constexpr int type_tag();
  void check_element_type(size_t size, int tag) const;

  std::shared_ptr<Storage> storage_;
  void* data_ = nullptr;
  Shape shape_;
  DType dtype_ = DType::f32;
  Tier tier_ = Tier::device;
  Device device_;
};

template <typename T>
constexpr int Tensor::type_tag() {
  if constexpr (std::is_same_v<T, float>) return 0;
  else if constexpr (std::is_same_v<T, uint16_t>) return 1;
  else if constexpr (std::is_same_v<T, int32_t>) return 2;
  else if constexpr (std::is_same_v<T, int64_t>) return 3;
  else if constexpr (std::is_same_v<T, uint8_t>) return 4;
  else if constexpr (std::is_same_v<T, double>) return 5;
  else if constexpr (std::is_same_v<T, int8_t>) return 6;
  else return -1;
}

// ---------------------------------------------------------------------------
// Counter-based RNG (Philox4x32-10)
// ---------------------------------------------------------------------------

// Random numbers that are a pure function of (key, counter): any rank can
// produce any element of any stream without generating the ones before it.
// That is what makes initialization and dropout independent of the layout.
// Defined here, inline, so that loops drawing one number per element (dropout)
// inline the rounds and vectorize them.
struct Philox {
  static std::array<uint32_t, 4> block(uint64_t key, uint64_t counter_hi, uint64_t counter_lo) {
    // Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3").
    constexpr uint32_t kMul0 = 0xD2511F53u, kMul1 = 0xCD9E8D57u;
    constexpr uint32_t kWeyl0 = 0x9E3779B9u, kWeyl1 = 0xBB67AE85u;
    uint32_t c0 = static_cast<uint32_t>(counter_lo), c1 = static_cast<uint32_t>(counter_lo >> 32);
    uint32_t c2 = static_cast<uint32_t>(counter_hi), c3 = static_cast<uint32_t>(counter_hi >> 32);
    uint32_t k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
    for (int round = 0; round < 10; ++round) {
      uint64_t p0 = static_cast<uint64_t>(kMul0) * c0;
      uint64_t p1 = static_cast<uint64_t>(kMul1) * c2;
      uint32_t hi0 = static_cast<uint32_t>(p0 >> 32), lo0 = static_cast<uint32_t>(p0);
      uint32_t hi1 = static_cast<uint32_t>(p1 >> 32), lo1 = static_cast<uint32_t>(p1);
      c0 = hi1 ^ c1 ^ k0;
      c1 = lo1;
      c2 = hi0 ^ c3 ^ k1;
      c3 = lo0;
      k0 += kWeyl0;
      k1 += kWeyl1;
    }
    return {c0, c1, c2, c3};
  }
};

// The stream key of a named object, e.g. a parameter: mixes the seed with a
// 64-bit hash of the name.
uint64_t stream_key(uint64_t seed, std::string_view name);
// Mixes further integers into a key (e.g. step and layer for dropout).
uint64_t stream_key(uint64_t key, uint64_t a, uint64_t b);

// Element `index` of the stream `key`: uniform in [0, 1) (24 random bits) and
// standard normal.
inline float philox_uniform(uint64_t key, uint64_t index) {
  return static_cast<float>(Philox::block(key, 0, index)[0] >> 8) * (1.0f / 16777216.0f);
}
float philox_normal(uint64_t key, uint64_t index);

// out[i] = mean + std * normal(key, first + i) for i in [0, n).
void fill_normal(float* out, int64_t n, uint64_t key, uint64_t first, float mean, float std);

}  // namespace loom
