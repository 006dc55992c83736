// loom memory: chunk-based placement of model state across the device, host
// and NVMe tiers (heterogeneous memory, after Colossal-AI's Gemini and
// DeepSpeed's ZeRO-Infinity).
//
// Parameters are packed, whole and in layout order, into chunks of one fixed
// capacity. A chunk is the unit that moves between tiers, is gathered over the
// data-parallel ranks (ZeRO-3 at chunk granularity: rank r stores shard r of
// every chunk) and whose gradient is reduce-scattered. Each chunk shard has
// two payloads that a policy places on a tier:
//   param  the working parameters (working precision)
//   optim  the AdamW moments and, under bf16/f16, the fp32 master weights
// The model computes on the device tier only: a chunk whose parameters live
// elsewhere is copied (or read from NVMe) into a device buffer when its group
// is acquired, ahead of use when the order is known. The AdamW update runs
// where the optimizer state lives (the CPU kernels on host memory for the host
// and NVMe tiers), chunk by chunk, reading the next chunk while it updates
// this one. docs/memory.md gives the bytes per parameter on each tier.
#pragma once

#include <array>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "loom/comm.h"
#include "loom/optim.h"
#include "loom/store.h"
#include "loom/zero.h"

namespace loom {

// ---------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------

enum class MemoryPolicy : uint8_t {
  none,       // the stores of zero.h: everything on the device tier
  fixed,      // "static": fractions of the chunks' payloads offloaded, as configured
  automatic,  // "auto": placed from a traced warm-up step, device as a cache
};
const char* memory_policy_name(MemoryPolicy p);  // "none", "static", "auto"
// Throws Error listing the valid names.
MemoryPolicy parse_memory_policy(const std::string& name);

struct MemoryOptions {
  MemoryPolicy policy = MemoryPolicy::none;
  // static: the fraction of chunks whose parameters / optimizer state live
  // off the device (on NVMe when nvme_dir is set, else on the host).
  double offload_param_frac = 0.0;
  double offload_optim_frac = 0.0;
  std::filesystem::path nvme_dir;  // empty: no NVMe tier
  bool nvme_io_uring = true;       // false: the thread-pool pread/pwrite engine
  int64_t chunk_bytes = 0;         // capacity of a chunk in working-precision bytes; 0: searched
  int prefetch = 2;                // chunks fetched ahead of use
  // Micro-batches per step and rank (set from train.*, not a memory key).
  // With one, bf16/f16 gradients reuse the parameters' memory; with more they
  // accumulate in gradient shards of their own.
  int64_t micro_batches = 1;
};
// Throws Error naming the field (memory.*) of an option out of range.
void validate(const MemoryOptions& opts);

// ---------------------------------------------------------------------------
// Chunks
// ---------------------------------------------------------------------------

// Elements a chunk shard is a multiple of: 2048 elements are 4 KiB in bf16
// and 8 KiB in fp32, so every shard payload is aligned for O_DIRECT.
constexpr int64_t kChunkShardAlign = 2048;

// The life of one parameter tensor within a step (Gemini's TensorState). A
// chunk may move or be dropped only when none of its tensors is in compute,
// and its gradient is reduced only when all of them are ready_for_reduce.
enum class TensorState : uint8_t {
  free,                 // its chunk holds no gathered copy on this rank
  compute,              // its group is acquired: the model reads it
  hold,                 // gathered, not in use
  hold_after_backward,  // its gradient is being accumulated, the group's backward not finished
  ready_for_reduce,     // its gradient for this micro-batch is complete
};
const char* tensor_state_name(TensorState s);

struct Chunk {
  int first_param = 0, end_param = 0;  // parameters [first, end) in layout order
  int64_t begin = 0, end = 0;          // their flat range; the next chunk starts at `end`, padding is not flat
  int64_t numel() const { return end - begin; }
};

// The parameters of a layout packed into chunks of `chunk_numel` elements,
// each shard (chunk_numel / ranks elements) a multiple of kChunkShardAlign.
class ChunkLayout {
 public:
  // Throws Error when a parameter is larger than a chunk or the capacity is
  // not a multiple of ranks * kChunkShardAlign.
  ChunkLayout(const ParamLayout& layout, int64_t chunk_numel, int ranks);

  const ParamLayout& params() const { return layout_; }
  const std::vector<Chunk>& chunks() const { return chunks_; }
  int num_chunks() const { return static_cast<int>(chunks_.size()); }
  const Chunk& chunk(int c) const { return chunks_.at(static_cast<size_t>(c)); }
  int64_t chunk_numel() const { return chunk_numel_; }
  int ranks() const { return ranks_; }
  int64_t shard_numel() const { return chunk_numel_ / ranks_; }
  int chunk_of_param(int id) const { return chunk_of_param_.at(static_cast<size_t>(id)); }
  // The chunks holding parameters of group g, in order.
  const std::vector<int>& chunks_of_group(int g) const { return chunks_of_group_.at(static_cast<size_t>(g)); }
  // Position of flat element `flat` inside its chunk.
  int64_t position(int c, int64_t flat) const { return flat - chunk(c).begin; }
  // The real (not padding) elements rank r stores of chunk c: flat [begin, end).
  FlatRange owned(int c, int r) const;
  // Capacity left unused over all chunks: num_chunks * chunk_numel - numel.
  int64_t wasted_numel() const;

 private:
  const ParamLayout& layout_;
  int64_t chunk_numel_;
  int ranks_;
  std::vector<Chunk> chunks_;
  std::vector<int> chunk_of_param_;
  std::vector<std::vector<int>> chunks_of_group_;
};

// The capacity memory.chunk_bytes gives (in working-precision bytes): whole
// elements, rounded up to whole shards of kChunkShardAlign elements per rank.
int64_t chunk_capacity(int64_t chunk_bytes, DType precision, int ranks);

// Gemini's chunk size search: every capacity from the smallest that holds the
// largest parameter up to `max_numel` (at least that smallest), in steps of
// ranks * kChunkShardAlign, and the one that wastes the fewest elements; ties
// go to the smaller chunk (finer placement).
struct ChunkSearch {
  int64_t chunk_numel = 0;
  int64_t wasted_numel = 0;
  int candidates = 0;  // capacities tried
};
ChunkSearch search_chunk_numel(const ParamLayout& layout, int ranks, int64_t max_numel);

// ---------------------------------------------------------------------------
// NVMe tier
// ---------------------------------------------------------------------------

// Offsets, lengths and buffer addresses of NVMe I/O are multiples of this.
constexpr size_t kIoAlign = 4096;

// Host-tier bytes aligned to kIoAlign (the size rounded up to it), accounted
// on the calling thread's host allocator.
class IoBuffer {
 public:
  IoBuffer() = default;
  explicit IoBuffer(size_t bytes);
  ~IoBuffer();
  IoBuffer(IoBuffer&& other) noexcept;
  IoBuffer& operator=(IoBuffer&& other) noexcept;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }  // rounded up to kIoAlign

 private:
  Allocator* alloc_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

struct NvmeStats {
  int64_t reads = 0, writes = 0;
  int64_t bytes_read = 0, bytes_written = 0;
  double read_seconds = 0.0, write_seconds = 0.0;  // wall time with a request of that kind in flight
};

// A scratch file of the NVMe tier: created in a directory and unlinked at
// once, so it disappears with the process however it ends and nothing in it
// is ever read by a later run. Reads and writes are asynchronous, several in
// flight, through io_uring with O_DIRECT (liburing), or a pool of threads
// doing pread/pwrite when io_uring is unavailable or not wanted. O_DIRECT is
// dropped only where the filesystem refuses it (tmpfs). The space is
// accounted on the nvme allocator. Used by one thread (its own workers aside).
class NvmeFile {
 public:
  enum class Engine : uint8_t { io_uring, threads };
  // Throws Error naming the directory when it cannot create the file or
  // reserve `bytes` (rounded up to kIoAlign).
  NvmeFile(const std::filesystem::path& dir, uint64_t bytes, Engine engine = Engine::io_uring, int queue_depth = 8);
  ~NvmeFile();  // waits for requests in flight
  NvmeFile(const NvmeFile&) = delete;
  NvmeFile& operator=(const NvmeFile&) = delete;

  // Start a request; `buf`, `bytes` and `offset` must be multiples of
  // kIoAlign. The returned ticket is waited on with wait().
  uint64_t read(void* buf, uint64_t bytes, uint64_t offset);
  uint64_t write(const void* buf, uint64_t bytes, uint64_t offset);
  // Blocks until the request has finished; throws Error naming the
  // directory, the offset and the system's reason when it failed.
  void wait(uint64_t ticket);
  void wait_all();

  Engine engine() const;  // io_uring falls back to threads when the kernel refuses it
  bool direct() const;
  uint64_t size() const;
  const std::filesystem::path& dir() const;
  NvmeStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The directory's own sequential throughput, the baseline NVMe I/O is held
// against: `bytes` written then read back in `block`-byte O_DIRECT requests,
// one at a time, in a scratch file (removed afterwards).
struct DiskThroughput {
  double write_bytes_per_s = 0.0, read_bytes_per_s = 0.0;
};
DiskThroughput measure_sequential_throughput(const std::filesystem::path& dir, uint64_t bytes,
                                             uint64_t block = uint64_t(1) << 20);

// ---------------------------------------------------------------------------
// Placement
// ---------------------------------------------------------------------------

// Bytes per tier.
struct TierBytes {
  std::array<int64_t, kNumTiers> bytes{};
  int64_t& operator[](Tier t) { return bytes[static_cast<size_t>(t)]; }
  int64_t operator[](Tier t) const { return bytes[static_cast<size_t>(t)]; }
};

// Where each chunk's payloads live.
struct ChunkPlacement {
  std::vector<Tier> param, optim;  // per chunk
};

// What a placement of a model needs on each tier, per rank, before anything
// is allocated: the model state (the payloads where they are placed, and the
// gradient shards when gradients cannot reuse the parameters' memory) and the
// working sets the manager adds: on the device, gathered chunks, fp32 compute
// copies and gradient chunks in flight; on the host, the staging buffers of
// NVMe reads and writes. The caller adds its activation estimate.
struct MemoryNeeds {
  TierBytes model_state;
  int64_t device_working = 0;
  int64_t host_working = 0;
};
MemoryNeeds memory_needs(const ChunkLayout& chunks, const ChunkPlacement& placement, DType precision,
                         const MemoryOptions& opts);

// The static policy's placement: the last round(frac * chunks) chunks of
// each payload kind off the device, on NVMe when `nvme` is true.
ChunkPlacement static_placement(int num_chunks, double offload_param_frac, double offload_optim_frac, bool nvme);

// Checks needs against budgets: throws Error saying, for every tier that does
// not fit, how much is needed (model state, working set, activations) and the
// budget, and what to change (memory.* keys).
void check_budgets(const MemoryNeeds& needs, int64_t device_activations, const TierBytes& budgets,
                   const MemoryOptions& opts);

// What the manager will place and need, from shapes and budgets alone: the
// chunk size, the placement (for auto, the warm-up step's: every chunk off
// the device) and the needs. The ChunkManager starts with it, and
// plan_training calls it so that a run that cannot fit fails before anything
// is allocated. Throws Error (check_budgets) when the budgets cannot hold it.
// device_activations: the device bytes outside the chunks (the step's
// activations, and frozen parameters, which FrozenParams keeps there).
struct MemoryPlan {
  ChunkSearch search;
  ChunkPlacement placement;
  MemoryNeeds needs;
};
MemoryPlan plan_memory(const ParamLayout& layout, const MemoryOptions& opts, DType precision, int ranks,
                       int64_t device_activations, const TierBytes& budgets);

// ---------------------------------------------------------------------------
// The manager and its stores
// ---------------------------------------------------------------------------

// Bytes moved between tiers: moved[from][to], cumulative.
struct TierTraffic {
  std::array<std::array<int64_t, kNumTiers>, kNumTiers> moved{};
  int64_t& at(Tier from, Tier to) { return moved[static_cast<size_t>(from)][static_cast<size_t>(to)]; }
  int64_t at(Tier from, Tier to) const { return moved[static_cast<size_t>(from)][static_cast<size_t>(to)]; }
  TierTraffic& operator+=(const TierTraffic& o);
  TierTraffic& operator-=(const TierTraffic& o);
  friend TierTraffic operator-(TierTraffic a, const TierTraffic& b) { return a -= b; }
  friend bool operator==(const TierTraffic&, const TierTraffic&) = default;
};
// "host->device 12.00 MiB, nvme->host 2.00 MiB": the pairs that moved any.
std::string describe(const TierTraffic& t);

// Where the bytes of one rank live.
struct MemoryReport {
  MemoryPolicy policy = MemoryPolicy::none;
  int num_chunks = 0;
  int64_t chunk_numel = 0;
  TierBytes model_state;          // payloads and gradient shards, now
  TierBytes peak;                 // the allocators' high-water marks of bytes in use
  TierBytes peak_reserved;        // ... and of bytes held from the system (in use + cached)
  TierBytes budget;               // kUnlimited shows as -1
  int64_t traced_non_model = -1;  // auto: the warm-up step's peak device bytes besides model state
  // auto: the same per module (parameter group), at its boundaries
  std::vector<std::pair<std::string, int64_t>> traced_modules;
  TierTraffic traffic;
  NvmeStats nvme;
};
std::string describe(const MemoryReport& r);  // a few lines for the console
// The calling thread's allocators: their peaks and budgets, no policy.
MemoryReport allocator_report();

class ChunkManager;

// ParamStore over chunks: acquire(group) brings the group's chunks to the
// device (gathered over dp), release lets the manager keep or drop them.
class ChunkParamStore final : public ParamStore {
 public:
  explicit ChunkParamStore(ChunkManager& manager);
  void acquire(int group) override;
  void release(int group) override;
  Tensor param(int id) const override;
  void begin_step() override;
  void end_step() override;

 private:
  ChunkManager& manager_;
};

// GradStore over chunks: each chunk's fp32 gradient lives on the device while
// its tensors' gradients accumulate, and is reduce-scattered into the shard's
// gradient once all of them are ready_for_reduce.
class ChunkGradStore final : public GradStore {
 public:
  explicit ChunkGradStore(ChunkManager& manager);
  Tensor grad(int id) const override;
  void zero() override;
  void set_reduce(bool reduce) override;
  void group_ready(int group) override;
  void finish() override;

 private:
  ChunkManager& manager_;
};

// Owns the chunks' memory on every tier, moves payloads, gathers and reduces
// chunks and runs the AdamW update chunk by chunk. `dp` may be null (one rank).
class ChunkManager final : public OptimizerStore {
 public:
  // Validates the options, searches the chunk size (unless given), places the
  // payloads and checks the budgets of the calling thread's MemoryContext
  // (with `device_activations`, the caller's estimate of what the step holds
  // besides model state) before it allocates anything.
  ChunkManager(const ParamLayout& layout, const MemoryOptions& opts, DType precision, Communicator* dp,
               const AdamWConfig& adamw, uint64_t seed, int64_t device_activations);
  ~ChunkManager();
  ChunkManager(const ChunkManager&) = delete;
  ChunkManager& operator=(const ChunkManager&) = delete;

  const ChunkLayout& chunks() const;
  ChunkPlacement placement() const;  // where each payload is now
  TensorState state(int param) const;
  MemoryReport report() const;

  // Collective: the gradients' global sum of squares and non-finite count.
  GradientCheck check_gradients() override;
  // Collective: one AdamW update of this rank's shards with every gradient
  // multiplied by grad_scale.
  void step(float lr, float grad_scale) override;
  // After a skipped step (fp16 overflow): the working parameters, which hold
  // the gradients when they reuse their memory, are rounded again from the
  // master weights.
  void after_skip() override;
  int64_t steps() const override;
  void set_steps(int64_t t) override;

  // Collective: the whole model's fp32 weights (master weights) and moments,
  // chunk by chunk in flat order, each chunk gathered from the ranks' shards
  // into host memory valid during the call. A model larger than the host
  // streams through one chunk (checkpoints).
  void visit_state(const StateVisitor& visit) override;
  // Collective: the step's reduced gradient (fp32, still multiplied by the
  // loss scale) chunk by chunk in flat order, like visit_state; valid between
  // the gradient store's finish() and step().
  void visit_gradients(const GradientVisitor& visit) override;
  // Every rank takes its shards from `fill`, which writes the whole state of
  // each chunk's range.
  void load_state(const StateFiller& fill) override;
  // Only this rank's shard of each chunk: nothing else is asked of `fill`.
  void load_owned_state(const StateFiller& fill) override;
  // This rank's shard of each chunk (padding left out), one chunk's staged
  // on the host at a time from whichever tier holds it.
  std::vector<FlatRange> owned_ranges() const override;
  void visit_owned_state(const StateVisitor& visit) override;

 private:
  friend class ChunkParamStore;
  friend class ChunkGradStore;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
