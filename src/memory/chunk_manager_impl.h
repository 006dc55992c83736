// The ChunkManager's state, shared by the files that implement it:
// chunk_manager.cpp (payloads, placement, access), chunk_gradients.cpp
// (accumulation and reduction) and chunk_optimizer.cpp (the update and the
// whole-model state). Internal to src/memory.
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <vector>

#include "loom/device.h"
#include "loom/memory.h"
#include "memory/chunk_sizes.h"

namespace loom {

// Bytes of one chunk shard's state on some tier: a Tensor on the device or
// host tier, a slot of the scratch file on NVMe.
struct Payload {
  Tier tier = Tier::device;
  Tensor mem;  // device and host
  DType dtype = DType::f32;
  int64_t bytes = 0;  // the payload's size (a multiple of kIoAlign)
  std::optional<uint64_t> slot;  // offset in the scratch file, for payloads that started on NVMe
};

struct ChunkState {
  Payload param, optim;
  // The whole chunk (working precision) on the device while it is in use or
  // kept for a use soon. On one rank a chunk whose parameters live on the
  // device computes on them directly (full aliases param.mem).
  Tensor full;
  bool aliased = false;
  Tensor staged;   // dp > 1: the device copy of an off-device shard being gathered
  Event copied;    // the copy-stream move filling `full` (one rank) or `staged`
  Work gathering;  // the all-gather filling `full`
  // An NVMe read of the parameters started ahead of use (one rank).
  IoBuffer read_buffer;
  std::optional<uint64_t> read_ticket;
  int refs = 0;  // acquired groups using the chunk

  // Gradients of the current micro-batch.
  Tensor grad;       // device fp32, the whole chunk
  int not_ready = 0;  // tensors not yet ready_for_reduce
  Tensor reduced;    // dp > 1: this rank's shard of the reduced gradient
  Work reducing;
  bool write_pending = false;  // reduced, waiting for the chunk's release to be written
  bool holds_grads = false;    // the parameter payload holds the gradient until the update
  // Gradient accumulation (more than one micro-batch): the shard's gradient
  // in the working precision, where the update reads it.
  Tensor grad_shard;
  double sum_squares = 0.0;  // of the step's final gradient shard
  int64_t non_finite = 0;
};

struct PendingWrite {
  IoBuffer buffer;
  uint64_t ticket = 0;
  uint64_t slot = 0;
};

struct ChunkManager::Impl {
  Impl(const ParamLayout& layout, const MemoryOptions& opts, DType precision, Communicator* dp,
       const AdamWConfig& adamw, uint64_t seed, int64_t device_activations);
  ~Impl();

  // --- chunk_manager.cpp ---
  void initialize(uint64_t seed);
  void count(Tier from, Tier to, int64_t bytes);
  // Copies bytes between tiers on the copy stream, once the compute work
  // enqueued so far has run (it may have written the source or last used
  // the destination); the event marks the copy's end.
  Event move_async(void* dst, const void* src, size_t bytes);
  // The same, with the compute stream's later work waiting for the copy.
  void move(void* dst, const void* src, size_t bytes);
  // Copies a payload into `dst`, memory on tier `to`: load_async returns the
  // copy's event, load makes the compute stream wait for it.
  Event load_async(const Payload& p, void* dst, Tier to);
  void load(const Payload& p, void* dst, Tier to);
  // Copies `src`, memory on tier `from`, into a payload.
  void store(Payload& p, const void* src, Tier from);
  // Moves a payload to another tier (NVMe only back to its own slot).
  void migrate(Payload& p, Tier to);
  // A tier's memory for payload p.
  Tensor payload_memory(const Payload& p, Tier tier) const;
  ChunkPlacement placement() const;  // the payloads' tiers
  IoBuffer read_now(const Payload& p);
  void write_behind(const Payload& p, IoBuffer buffer);
  void wait_writes(std::optional<uint64_t> slot);  // nullopt: all
  // Makes chunk c's whole parameters available on the device; with
  // wait = false only starts it (prefetch).
  void materialize(int c, bool wait);
  void drop(int c);
  // Whether chunk c is among the next `prefetch` + 1 accesses of the order.
  bool wanted_soon(int c) const;
  // Steps until chunk c is accessed again (the recorded order, wrapping).
  size_t next_use(int c) const;
  // auto: makes room for chunk c's parameters on the device if the
  // furthest-used resident chunk is used later than c; true if c moved there.
  bool cache(int c);
  void acquire(int group);
  void release(int group);
  Tensor param(int id) const;
  void begin_step();
  void end_step();
  // auto: device bytes besides model state at the boundaries of the warm-up
  // step's modules, and the placement that follows from them.
  int64_t manager_device_bytes() const;
  void trace(int group);
  void place_after_warm_up();

  // --- chunk_gradients.cpp ---
  Tensor grad(int id);
  void zero_grads();
  void set_final_micro_batch(bool final);
  void group_ready(int group);
  void reduce(int c);
  void retire(int c);
  // Writes chunk c's reduced gradient shard (fp32, device) where the update
  // reads it.
  void write_gradient(int c, const float* shard);
  void finish();

  // --- chunk_optimizer.cpp ---
  GradientCheck check_gradients();
  void step(float lr, float grad_scale);
  // Rounds chunk c's master weights into its parameter payload.
  void publish(int c, const float* master, Tier on);
  void restore_parameters();
  void end_update();
  // Gathers the chunks one at a time: shard(c, out) writes `kinds` fp32
  // values per element of this rank's shard of chunk c (kinds blocks of the
  // shard size), and visit gets each chunk's whole range with each kind's
  // values `stride` apart.
  void gather_chunks(int kinds, const std::function<void(int c, float* shard)>& shard,
                     const std::function<void(FlatRange range, const float* whole, int64_t stride)>& visit);
  void visit_state(const StateVisitor& visit);
  void visit_gradients(const std::function<void(FlatRange range, const float* grads)>& visit);
  // `fill` asked for each chunk's whole range, or only for its owned shard.
  void load_state(const StateFiller& fill, bool owned_only);
  std::vector<FlatRange> owned_ranges() const;
  void visit_owned_state(const StateVisitor& visit);

  const ParamLayout& layout;
  MemoryOptions opts;
  DType precision;
  int64_t w;  // bytes per working-precision element
  Communicator* dp;
  int ranks, rank;
  MemoryPlan plan;
  ChunkLayout chunks;
  std::vector<ChunkState> cs;
  std::vector<TensorState> states;  // per parameter
  std::vector<std::vector<int>> group_params;  // parameter ids per group
  std::vector<int> group_refs;
  std::vector<Tensor> group_compute;  // bf16/f16: fp32 copies of acquired groups
  std::unique_ptr<NvmeFile> nvme;
  std::deque<PendingWrite> writes;
  AdamW adamw;  // step count and constants; the moments live in the payloads
  bool reuse;   // gradients overwrite the parameters (one micro-batch per step)
  bool final_micro_batch = true;
  std::deque<int> in_flight;  // chunks being reduce-scattered

  // The chunk access order of the last complete step (prefetch, eviction).
  std::vector<int> order, recorded;
  size_t cursor = 0;
  bool in_step = false, recording = true;
  int64_t steps_seen = 0;

  // auto policy
  int64_t cache_capacity = 0;  // device bytes for parameter payloads after warm-up
  int64_t cache_used = 0;
  bool tracing = false;
  int64_t traced = -1;
  int64_t traced_manager_bytes = 0;
  size_t traced_device_peak = 0;  // the device's high-water mark across the traced intervals
  std::vector<int64_t> traced_per_group;

  TierTraffic traffic;
};

}  // namespace loom
