#include <algorithm>
#include <climits>

#include "loom/device.h"
#include "loom/trace.h"
#include "memory/chunk_manager_impl.h"
#include "zero/working_precision.h"

namespace loom {

using zero_detail::at;

namespace {

// What each tier of the calling thread's context can still take.
TierBytes available_budgets() {
  TierBytes b;
  for (int t = 0; t < kNumTiers; ++t) {
    const Allocator& a = MemoryContext::current().tier(static_cast<Tier>(t));
    const size_t budget = a.budget();
    b.bytes[static_cast<size_t>(t)] =
        budget == kUnlimited ? INT64_MAX : static_cast<int64_t>(budget - std::min(budget, a.used()));
  }
  return b;
}

// A host buffer a copy-stream move reads from lives until the move has run.
void free_after_copy(IoBuffer buffer) {
  copy_stream().enqueue([held = std::make_shared<IoBuffer>(std::move(buffer))] {});
}

}  // namespace

ChunkManager::Impl::Impl(const ParamLayout& layout_, const MemoryOptions& opts_, DType precision_, Communicator* dp_,
                         const AdamWConfig& adamw_cfg, uint64_t seed, int64_t device_activations)
    : layout(layout_),
      opts(opts_),
      precision(precision_),
      w(static_cast<int64_t>(dtype_size(precision_))),
      dp(dp_),
      ranks(dp_ ? dp_->size() : 1),
      rank(dp_ ? dp_->rank() : 0),
      plan(plan_memory(layout_, opts_, precision_, ranks, device_activations, available_budgets())),
      chunks(layout_, plan.search.chunk_numel, ranks),
      cs(static_cast<size_t>(chunks.num_chunks())),
      states(layout_.params().size(), TensorState::free),
      group_params(static_cast<size_t>(layout_.num_groups())),
      group_refs(static_cast<size_t>(layout_.num_groups()), 0),
      group_compute(static_cast<size_t>(layout_.num_groups())),
      adamw(layout_, adamw_cfg, {}),
      reuse(opts_.micro_batches == 1),
      traced_per_group(static_cast<size_t>(layout_.num_groups()), -1) {
  for (int id = 0; id < static_cast<int>(layout.params().size()); ++id)
    group_params[static_cast<size_t>(layout.param(id).group)].push_back(id);
  initialize(seed);
}

ChunkManager::Impl::~Impl() {
  // Collectives and NVMe requests write into the chunks' buffers: they end
  // before the buffers are freed. A failed one already failed the step.
  for (ChunkState& s : cs) {
    for (Work* w : {&s.gathering, &s.reducing}) {
      try {
        w->wait();
      } catch (const Error&) {
      }
    }
  }
  try {
    if (nvme) nvme->wait_all();
  } catch (const Error&) {
  }
}

void ChunkManager::Impl::initialize(uint64_t seed) {
  const HostSection host;
  const int64_t S = chunks.shard_numel();
  // NVMe slots for the payloads placed there; they keep them for the run.
  uint64_t file_bytes = 0;
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    s.param = {plan.placement.param[static_cast<size_t>(c)], Tensor(), precision, S * w, std::nullopt};
    s.optim = {plan.placement.optim[static_cast<size_t>(c)], Tensor(), DType::f32, optim_payload_bytes(S), std::nullopt};
    for (Payload* p : {&s.param, &s.optim}) {
      if (p->tier != Tier::nvme) continue;
      p->slot = file_bytes;
      file_bytes += static_cast<uint64_t>(round_up(p->bytes, int64_t(kIoAlign)));
    }
    s.not_ready = chunks.chunk(c).end_param - chunks.chunk(c).first_param;
  }
  if (file_bytes > 0)
    nvme = std::make_unique<NvmeFile>(opts.nvme_dir, file_bytes,
                                      opts.nvme_io_uring ? NvmeFile::Engine::io_uring : NvmeFile::Engine::threads);
  // Each element's initial value depends only on (seed, name, index): a
  // shard initializes its own elements. The master weights start as those
  // values and the working parameters as their rounding, as under ZeRO.
  Tensor values = Tensor::empty({3 * S}, DType::f32, Tier::host);
  Tensor working = Tensor::empty({S}, precision, Tier::host);
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    const FlatRange r = chunks.owned(c, rank);
    values.zero_();
    working.zero_();
    if (r.numel() > 0) layout.initialize(values.data<float>(), r.begin, r.numel(), seed);
    convert(values.raw(), DType::f32, working.raw(), precision, S);
    for (Payload* p : {&s.param, &s.optim})
      p->mem = payload_memory(*p, p->tier);
    store(s.param, working.raw(), Tier::host);
    store(s.optim, values.raw(), Tier::host);
    if (!reuse)
      s.grad_shard = Tensor::zeros({S}, DType::f32, s.optim.tier == Tier::device ? Tier::device : Tier::host);
  }
  wait_writes(std::nullopt);
  traffic = {};  // placing the initial values is not traffic of training
}

void ChunkManager::Impl::count(Tier from, Tier to, int64_t bytes) {
  if (from != to) traffic.at(from, to) += bytes;
}

Event ChunkManager::Impl::move_async(void* dst, const void* src, size_t bytes) {
  TraceScope trace(TraceCategory::transfer, "chunk move");
  const Stream copy = copy_stream();
  Event::record(current_stream()).wait(copy);
  const StreamGuard on_copy(copy);
  ops::copy(dst, src, bytes);
  return Event::record(copy);
}

void ChunkManager::Impl::move(void* dst, const void* src, size_t bytes) {
  move_async(dst, src, bytes).wait(current_stream());
}

IoBuffer ChunkManager::Impl::read_now(const Payload& p) {
  LOOM_CHECK(p.slot.has_value(), "a payload on NVMe without a slot");
  wait_writes(p.slot);
  IoBuffer b(static_cast<size_t>(p.bytes));
  TraceScope trace(TraceCategory::transfer, "nvme read");
  nvme->wait(nvme->read(b.data(), b.bytes(), *p.slot));
  count(Tier::nvme, Tier::host, p.bytes);
  return b;
}

void ChunkManager::Impl::write_behind(const Payload& p, IoBuffer buffer) {
  LOOM_CHECK(p.slot.has_value(), "a payload on NVMe without a slot");
  wait_writes(p.slot);
  const uint64_t ticket = nvme->write(buffer.data(), buffer.bytes(), *p.slot);
  count(Tier::host, Tier::nvme, p.bytes);
  writes.push_back({std::move(buffer), ticket, *p.slot});
  // One write stays in flight behind the computation (memory_needs counts
  // its buffer).
  while (writes.size() > 1) {
    nvme->wait(writes.front().ticket);
    writes.pop_front();
  }
}

void ChunkManager::Impl::wait_writes(std::optional<uint64_t> slot) {
  for (auto it = writes.begin(); it != writes.end();) {
    if (slot && it->slot != *slot) {
      ++it;
      continue;
    }
    nvme->wait(it->ticket);
    it = writes.erase(it);
  }
}

Event ChunkManager::Impl::load_async(const Payload& p, void* dst, Tier to) {
  if (p.tier == Tier::nvme) {
    IoBuffer b = read_now(p);
    const Event done = move_async(dst, b.data(), static_cast<size_t>(p.bytes));
    free_after_copy(std::move(b));
    count(Tier::host, to, p.bytes);
    return done;
  }
  count(p.tier, to, p.bytes);
  return move_async(dst, p.mem.raw(), static_cast<size_t>(p.bytes));
}

void ChunkManager::Impl::load(const Payload& p, void* dst, Tier to) { load_async(p, dst, to).wait(current_stream()); }

void ChunkManager::Impl::store(Payload& p, const void* src, Tier from) {
  if (p.tier == Tier::nvme) {
    IoBuffer b(static_cast<size_t>(p.bytes));
    // The NVMe engine reads the buffer from the host: the move must be done.
    move_async(b.data(), src, static_cast<size_t>(p.bytes)).synchronize();
    count(from, Tier::host, p.bytes);
    write_behind(p, std::move(b));
    return;
  }
  if (p.mem.raw() != src) move(p.mem.raw(), src, static_cast<size_t>(p.bytes));
  count(from, p.tier, p.bytes);
}

Tensor ChunkManager::Impl::payload_memory(const Payload& p, Tier tier) const {
  if (tier == Tier::nvme) return Tensor();
  return Tensor::empty({p.bytes / static_cast<int64_t>(dtype_size(p.dtype))}, p.dtype, tier);
}

void ChunkManager::Impl::migrate(Payload& p, Tier to) {
  if (p.tier == to) return;
  LOOM_CHECK(to != Tier::nvme || p.slot.has_value(), "payloads move to NVMe only into the slot they started in");
  Payload moved = p;
  moved.tier = to;
  moved.mem = payload_memory(p, to);
  if (p.tier == Tier::nvme)
    load(p, moved.mem.raw(), to);
  else
    store(moved, p.mem.raw(), p.tier);
  p = std::move(moved);
}

ChunkPlacement ChunkManager::Impl::placement() const {
  ChunkPlacement out;
  for (const ChunkState& s : cs) {
    out.param.push_back(s.param.tier);
    out.optim.push_back(s.optim.tier);
  }
  return out;
}

// ---------------------------------------------------------------------------
// Access
// ---------------------------------------------------------------------------

void ChunkManager::Impl::materialize(int c, bool wait) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  if (s.full.defined()) {
    if (wait) s.gathering.wait();
    return;
  }
  if (opts.policy == MemoryPolicy::automatic && !tracing && s.param.tier == Tier::host) cache(c);
  const int64_t S = chunks.shard_numel();
  if (ranks == 1) {
    if (s.param.tier == Tier::device) {
      s.full = s.param.mem;
      s.aliased = true;
      return;
    }
    if (s.param.tier == Tier::nvme) {
      // Read ahead into host memory; the copy to the device waits for use.
      if (!s.read_ticket) {
        wait_writes(s.param.slot);
        s.read_buffer = IoBuffer(static_cast<size_t>(s.param.bytes));
        s.read_ticket = nvme->read(s.read_buffer.data(), s.read_buffer.bytes(), *s.param.slot);
        count(Tier::nvme, Tier::host, s.param.bytes);
      }
      if (!wait) return;
      nvme->wait(*s.read_ticket);
      s.read_ticket.reset();
      s.full = Tensor::empty({S}, precision, Tier::device);
      s.copied = move_async(s.full.raw(), s.read_buffer.data(), static_cast<size_t>(s.param.bytes));
      free_after_copy(std::move(s.read_buffer));
      count(Tier::host, Tier::device, s.param.bytes);
      return;
    }
    // A prefetch only starts the move: acquire makes the compute stream wait.
    s.full = Tensor::empty({S}, precision, Tier::device);
    s.copied = load_async(s.param, s.full.raw(), Tier::device);
    return;
  }
  // Several ranks: this rank's shard on the device, then the all-gather
  // (the communicator waits for the rank's streams when it issues it).
  const void* shard = s.param.mem.raw();
  if (s.param.tier != Tier::device) {
    s.staged = Tensor::empty({S}, precision, Tier::device);
    s.copied = load_async(s.param, s.staged.raw(), Tier::device);
    shard = s.staged.raw();
  }
  s.full = Tensor::empty({chunks.chunk_numel()}, precision, Tier::device);
  s.gathering = dp->all_gather_async(shard, s.full.raw(), S, precision);
  if (wait) s.gathering.wait();
}

void ChunkManager::Impl::drop(int c) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  LOOM_CHECK(s.refs == 0, "chunk ", c, " dropped while a group using it is acquired");
  s.gathering.wait();
  s.gathering = Work();
  // Freeing is ordered on the compute stream, which must not free memory the
  // copy stream may still be writing.
  s.copied.wait(current_stream());
  s.copied = Event();
  s.full = Tensor();
  s.staged = Tensor();
  s.aliased = false;
  if (s.read_ticket) nvme->wait(*s.read_ticket);
  s.read_ticket.reset();
  s.read_buffer = IoBuffer();
  const Chunk& ch = chunks.chunk(c);
  for (int id = ch.first_param; id < ch.end_param; ++id) {
    TensorState& st = states[static_cast<size_t>(id)];
    LOOM_CHECK(st != TensorState::compute, "parameter ", layout.param(id).name, " dropped while in compute");
    if (st == TensorState::hold) st = TensorState::free;
  }
}

bool ChunkManager::Impl::wanted_soon(int c) const {
  if (!in_step || recording) return false;
  const size_t end = std::min(order.size(), cursor + static_cast<size_t>(opts.prefetch) + 1);
  for (size_t i = cursor; i < end; ++i)
    if (order[i] == c) return true;
  return false;
}

size_t ChunkManager::Impl::next_use(int c) const {
  for (size_t i = cursor; i < order.size(); ++i)
    if (order[i] == c) return i - cursor;
  for (size_t i = 0; i < std::min(cursor, order.size()); ++i)
    if (order[i] == c) return order.size() - cursor + i;
  return SIZE_MAX;
}

bool ChunkManager::Impl::cache(int c) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  const int64_t bytes = s.param.bytes;
  // Belady's rule: while there is no room, evict the resident chunk used
  // furthest in the future, unless c itself is used later than all of them
  // (then c is only staged for this use).
  while (cache_used + bytes > cache_capacity) {
    int victim = -1;
    size_t furthest = next_use(c);
    for (int d = 0; d < chunks.num_chunks(); ++d) {
      const ChunkState& r = cs[static_cast<size_t>(d)];
      if (d == c || r.param.tier != Tier::device || r.refs > 0 || r.write_pending) continue;
      const size_t u = next_use(d);
      if (u > furthest) {
        furthest = u;
        victim = d;
      }
    }
    if (victim < 0) return false;
    drop(victim);
    migrate(cs[static_cast<size_t>(victim)].param, Tier::host);
    cache_used -= cs[static_cast<size_t>(victim)].param.bytes;
  }
  migrate(s.param, Tier::device);
  cache_used += bytes;
  return true;
}

void ChunkManager::Impl::acquire(int group) {
  const std::vector<int>& list = chunks.chunks_of_group(group);
  for (int c : list) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(!s.holds_grads, "group ", layout.group_name(group),
               " acquired between backward and the optimizer step, while its chunk holds gradients");
    if (in_step) {
      if (recording) {
        recorded.push_back(c);
      } else if (cursor < order.size() && order[cursor] == c) {
        ++cursor;
      } else {
        // A new order: stop prefetching and learn it again next step.
        order.clear();
        cursor = 0;
      }
    }
    materialize(c, true);
    s.copied.wait(current_stream());
    ++s.refs;
    const Chunk& ch = chunks.chunk(c);
    for (int id = ch.first_param; id < ch.end_param; ++id)
      if (states[static_cast<size_t>(id)] == TensorState::free) states[static_cast<size_t>(id)] = TensorState::hold;
  }
  for (int id : group_params[static_cast<size_t>(group)]) {
    TensorState& st = states[static_cast<size_t>(id)];
    if (st != TensorState::hold_after_backward) st = TensorState::compute;
  }
  if (group_refs[static_cast<size_t>(group)]++ == 0 && precision != DType::f32) {
    // Kernels compute in fp32: the group's parameters converted once.
    const auto [begin, end] = layout.group_range(group);
    Tensor compute = Tensor::empty({end - begin});
    for (int id : group_params[static_cast<size_t>(group)]) {
      const ParamSpec& p = layout.param(id);
      const int c = chunks.chunk_of_param(id);
      ops::convert(at(cs[static_cast<size_t>(c)].full.raw(), precision, chunks.position(c, p.offset)), precision,
                   compute.data<float>() + (p.offset - begin), DType::f32, p.numel());
    }
    group_compute[static_cast<size_t>(group)] = std::move(compute);
  }
  if (in_step && !recording)
    for (size_t i = cursor; i < std::min(order.size(), cursor + static_cast<size_t>(opts.prefetch)); ++i)
      materialize(order[i], false);
  if (tracing) trace(group);
}

void ChunkManager::Impl::release(int group) {
  int& refs = group_refs[static_cast<size_t>(group)];
  LOOM_CHECK(refs > 0, "release of group ", layout.group_name(group), " which is not acquired");
  if (--refs == 0) {
    group_compute[static_cast<size_t>(group)] = Tensor();
    for (int id : group_params[static_cast<size_t>(group)]) {
      TensorState& st = states[static_cast<size_t>(id)];
      if (st == TensorState::compute) st = TensorState::hold;
    }
  }
  for (int c : chunks.chunks_of_group(group)) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(s.refs > 0, "chunk ", c, " released more often than acquired");
    if (--s.refs > 0) continue;
    if (s.write_pending) retire(c);
    if (!s.aliased && !wanted_soon(c)) drop(c);
  }
  if (tracing) trace(group);
}

Tensor ChunkManager::Impl::param(int id) const {
  const ParamSpec& p = layout.param(id);
  if (precision == DType::f32) {
    const int c = chunks.chunk_of_param(id);
    const ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(s.refs > 0 && s.full.defined(), "parameter ", p.name, " used while its group ",
               layout.group_name(p.group), " is not acquired");
    return s.full.flat(chunks.position(c, p.offset), p.numel()).view(p.shape);
  }
  const Tensor& compute = group_compute[static_cast<size_t>(p.group)];
  LOOM_CHECK(compute.defined(), "parameter ", p.name, " used while its group ", layout.group_name(p.group),
             " is not acquired");
  return compute.flat(p.offset - layout.group_range(p.group).first, p.numel()).view(p.shape);
}

void ChunkManager::Impl::begin_step() {
  in_step = true;
  cursor = 0;
  recording = order.empty();
  recorded.clear();
  if (opts.policy == MemoryPolicy::automatic && steps_seen == 0) {
    // The warm-up step is traced: everything the device holds at the
    // modules' boundaries besides the manager's own bytes.
    tracing = true;
    traced = 0;
    traced_device_peak = MemoryContext::current().tier(Tier::device).peak();
    MemoryContext::current().tier(Tier::device).reset_peak();
    traced_manager_bytes = manager_device_bytes();
  }
}

void ChunkManager::Impl::end_step() {
  if (recording) order = recorded;
  in_step = false;
  for (int c = 0; c < chunks.num_chunks(); ++c)
    if (cs[static_cast<size_t>(c)].refs == 0 && !cs[static_cast<size_t>(c)].aliased) drop(c);
  // The device's high-water mark, measured in intervals while tracing, is
  // whole again.
  if (tracing) MemoryContext::current().tier(Tier::device).raise_peak(traced_device_peak);
  tracing = false;
}

// ---------------------------------------------------------------------------
// The auto policy
// ---------------------------------------------------------------------------

int64_t ChunkManager::Impl::manager_device_bytes() const {
  int64_t bytes = 0;
  const auto add = [&](const Tensor& t) {
    if (t.defined() && t.tier() == Tier::device) bytes += static_cast<int64_t>(t.nbytes());
  };
  for (const ChunkState& s : cs) {
    add(s.param.mem);
    add(s.optim.mem);
    if (!s.aliased) add(s.full);
    add(s.staged);
    add(s.grad);
    add(s.reduced);
    add(s.grad_shard);
  }
  for (const Tensor& t : group_compute) add(t);
  return bytes;
}

void ChunkManager::Impl::trace(int group) {
  Allocator& device = MemoryContext::current().tier(Tier::device);
  const int64_t manager = manager_device_bytes();
  // The manager's bytes may have grown within the interval (gradient chunks
  // are created inside backward), so the smaller of the two ends is taken:
  // the non-model figure errs on the high side.
  const int64_t non_model = static_cast<int64_t>(device.peak()) - std::min(manager, traced_manager_bytes);
  traced = std::max(traced, non_model);
  traced_device_peak = std::max(traced_device_peak, device.peak());
  int64_t& g = traced_per_group[static_cast<size_t>(group)];
  g = std::max(g, non_model);
  device.reset_peak();
  traced_manager_bytes = manager;
}

void ChunkManager::Impl::place_after_warm_up() {
  const int n = chunks.num_chunks();
  const Allocator& device = MemoryContext::current().tier(Tier::device);
  const Allocator& host = MemoryContext::current().tier(Tier::host);
  const auto budget = [](const Allocator& a) {
    return a.budget() == kUnlimited ? INT64_MAX / 4 : static_cast<int64_t>(a.budget());
  };
  const int64_t P = chunks.shard_numel() * w, O = optim_payload_bytes(chunks.shard_numel());
  const int64_t grad_shard = reuse ? 0 : chunks.shard_numel() * 4;
  // The device keeps what the budget leaves after the traced non-model peak
  // and the working set of a placement that stages chunks.
  ChunkPlacement staged = placement();
  std::fill(staged.param.begin(), staged.param.end(), Tier::host);
  const MemoryNeeds working = memory_needs(chunks, staged, precision, opts);
  int64_t room = budget(device) - traced - working.device_working;
  int64_t optim_on_device = 0;
  for (const ChunkState& s : cs) optim_on_device += s.optim.tier == Tier::device ? O + grad_shard : 0;
  room -= optim_on_device;
  const int64_t params_fit = std::clamp<int64_t>(room / std::max<int64_t>(P, 1), 0, n);
  cache_capacity = params_fit * P;
  room -= cache_capacity;

  // Optimizer state: the device while there is room (only once every
  // chunk's parameters fit), then the host, keeping room for the parameters
  // the cache leaves there (one more during an eviction) and the host
  // working set, then NVMe.
  int64_t host_payloads = 0;
  for (const ChunkState& s : cs) {
    host_payloads += s.param.tier == Tier::host ? P : 0;
    host_payloads += s.optim.tier == Tier::host ? O : 0;
    host_payloads += s.grad_shard.defined() && s.grad_shard.tier() == Tier::host ? grad_shard : 0;
  }
  const int64_t host_other = static_cast<int64_t>(host.used()) - host_payloads;
  const int64_t params_on_host = params_fit < n ? (n - params_fit + 1) * P : 0;
  int64_t host_room = budget(host) - host_other - working.host_working - params_on_host;
  std::vector<Tier> optim_tier(static_cast<size_t>(n));
  for (int c = 0; c < n; ++c) {
    const ChunkState& s = cs[static_cast<size_t>(c)];
    Tier& t = optim_tier[static_cast<size_t>(c)];
    if (params_fit == n && room >= O + grad_shard) {
      t = Tier::device;
      room -= O + grad_shard;
    } else if (host_room >= O + grad_shard || !s.optim.slot) {
      t = Tier::host;
      host_room -= O + grad_shard;
    } else {
      t = Tier::nvme;
    }
  }
  // Moves that free host memory go first.
  for (Tier pass : {Tier::device, Tier::nvme, Tier::host}) {
    for (int c = 0; c < n; ++c) {
      ChunkState& s = cs[static_cast<size_t>(c)];
      const Tier t = optim_tier[static_cast<size_t>(c)];
      if (t != pass || s.optim.tier == t) continue;
      migrate(s.optim, t);
      // A gradient shard of its own lives where the update reads it.
      const Tier gt = t == Tier::device ? Tier::device : Tier::host;
      if (s.grad_shard.defined() && s.grad_shard.tier() != gt) {
        count(s.grad_shard.tier(), gt, static_cast<int64_t>(s.grad_shard.nbytes()));
        s.grad_shard = s.grad_shard.clone(gt);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Public forwarding
// ---------------------------------------------------------------------------

ChunkManager::ChunkManager(const ParamLayout& layout, const MemoryOptions& opts, DType precision, Communicator* dp,
                           const AdamWConfig& adamw, uint64_t seed, int64_t device_activations)
    : impl_(std::make_unique<Impl>(layout, opts, precision, dp, adamw, seed, device_activations)) {}

ChunkManager::~ChunkManager() = default;

const ChunkLayout& ChunkManager::chunks() const { return impl_->chunks; }
ChunkPlacement ChunkManager::placement() const { return impl_->placement(); }
TensorState ChunkManager::state(int param) const { return impl_->states.at(static_cast<size_t>(param)); }
// The optimizer, the gradient reductions and the whole-state visits run on
// the host: those entry points are HostSections. Acquire and release only
// enqueue moves (copy stream) and kernels (compute stream), so the host runs
// ahead of both and a prefetch overlaps the computation.
GradientCheck ChunkManager::check_gradients() {
  const HostSection host;
  return impl_->check_gradients();
}
void ChunkManager::step(float lr, float grad_scale) {
  const HostSection host;
  impl_->step(lr, grad_scale);
}
void ChunkManager::after_skip() {
  const HostSection host;
  impl_->restore_parameters();
}
int64_t ChunkManager::steps() const { return impl_->adamw.steps(); }
void ChunkManager::set_steps(int64_t t) { impl_->adamw.set_steps(t); }
void ChunkManager::visit_state(const StateVisitor& visit) {
  const HostSection host;
  impl_->visit_state(visit);
}
void ChunkManager::visit_gradients(const GradientVisitor& visit) {
  const HostSection host;
  impl_->visit_gradients(visit);
}
std::vector<FlatRange> ChunkManager::owned_ranges() const { return impl_->owned_ranges(); }
void ChunkManager::visit_owned_state(const StateVisitor& visit) {
  const HostSection host;
  impl_->visit_owned_state(visit);
}
void ChunkManager::load_state(const StateFiller& fill) {
  const HostSection host;
  impl_->load_state(fill, /*owned_only=*/false);
}
void ChunkManager::load_owned_state(const StateFiller& fill) {
  const HostSection host;
  impl_->load_state(fill, /*owned_only=*/true);
}

MemoryReport ChunkManager::report() const {
  const Impl& m = *impl_;
  MemoryReport r = allocator_report();
  r.policy = m.opts.policy;
  r.num_chunks = m.chunks.num_chunks();
  r.chunk_numel = m.chunks.chunk_numel();
  for (const ChunkState& s : m.cs) {
    r.model_state[s.param.tier] += s.param.bytes;
    r.model_state[s.optim.tier] += s.optim.bytes;
    if (s.grad_shard.defined()) r.model_state[s.grad_shard.tier()] += static_cast<int64_t>(s.grad_shard.nbytes());
  }
  r.traced_non_model = m.traced;
  for (int g = 0; g < m.layout.num_groups(); ++g)
    if (m.traced_per_group[static_cast<size_t>(g)] >= 0)
      r.traced_modules.emplace_back(m.layout.group_name(g), m.traced_per_group[static_cast<size_t>(g)]);
  r.traffic = m.traffic;
  if (m.nvme) r.nvme = m.nvme->stats();
  return r;
}

// ---------------------------------------------------------------------------
// The stores
// ---------------------------------------------------------------------------

ChunkParamStore::ChunkParamStore(ChunkManager& manager) : ParamStore(manager.impl_->layout), manager_(manager) {}
void ChunkParamStore::acquire(int group) {
  check_group(group);
  manager_.impl_->acquire(group);
}
void ChunkParamStore::release(int group) {
  check_group(group);
  manager_.impl_->release(group);
}
Tensor ChunkParamStore::param(int id) const { return manager_.impl_->param(id); }
void ChunkParamStore::begin_step() { manager_.impl_->begin_step(); }
void ChunkParamStore::end_step() { manager_.impl_->end_step(); }

ChunkGradStore::ChunkGradStore(ChunkManager& manager)
    : GradStore(manager.impl_->layout, NoStorage{}), manager_(manager) {}
Tensor ChunkGradStore::grad(int id) const { return manager_.impl_->grad(id); }
void ChunkGradStore::zero() {
  const HostSection host;
  manager_.impl_->zero_grads();
}
void ChunkGradStore::set_reduce(bool reduce) { manager_.impl_->set_final_micro_batch(reduce); }
void ChunkGradStore::group_ready(int group) {
  check_group(group);
  const HostSection host;
  manager_.impl_->group_ready(group);
}
void ChunkGradStore::finish() {
  const HostSection host;
  manager_.impl_->finish();
}

}  // namespace loom
