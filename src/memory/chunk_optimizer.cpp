#include <algorithm>
#include <deque>

#include "memory/chunk_manager_impl.h"

namespace loom {

GradientCheck ChunkManager::Impl::check_gradients() {
  GradientCheck local;
  for (const ChunkState& s : cs) {
    local.sum_squares += s.sum_squares;
    local.non_finite += s.non_finite;
  }
  if (!dp) return local;
  // Every rank decides from the same reduced figures, so all skip or all
  // step together.
  double both[2] = {local.sum_squares, static_cast<double>(local.non_finite)};
  dp->all_reduce(both, 2, DType::f64, ReduceOp::sum);
  return {both[0], static_cast<int64_t>(both[1])};
}

void ChunkManager::Impl::publish(int c, const float* master, Tier on) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  const int64_t S = chunks.shard_numel(), len = chunks.owned(c, rank).numel();
  s.holds_grads = false;
  if (s.param.tier == on) {
    convert(master, DType::f32, s.param.mem.raw(), precision, len);
    return;
  }
  // The padding past the real elements is zero in every payload.
  Tensor rounded = Tensor::zeros({S}, precision, on);
  convert(master, DType::f32, rounded.raw(), precision, len);
  store(s.param, rounded.raw(), on);
}

void ChunkManager::Impl::step(float lr, float grad_scale) {
  adamw.begin_step(lr, grad_scale);
  const int n = chunks.num_chunks();
  const int64_t S = chunks.shard_numel();
  // Optimizer state on NVMe is read a chunk ahead of the update and written
  // behind it, so the disk works while the CPU updates.
  struct Ahead {
    int chunk;
    IoBuffer buffer;
    uint64_t ticket;
  };
  // The kernel writes into these buffers: if the update throws, the reads
  // end before the buffers are freed.
  struct AheadReads : std::deque<Ahead> {
    NvmeFile* file = nullptr;
    ~AheadReads() {
      for (const Ahead& a : *this) {
        try {
          file->wait(a.ticket);
        } catch (const Error&) {
        }
      }
    }
  } ahead;
  ahead.file = nvme.get();
  int next_read = 0;
  const auto read_ahead = [&] {
    for (; next_read < n && ahead.size() < 2; ++next_read) {
      const ChunkState& s = cs[static_cast<size_t>(next_read)];
      if (s.optim.tier != Tier::nvme || chunks.owned(next_read, rank).numel() == 0) continue;
      wait_writes(s.optim.slot);
      IoBuffer b(static_cast<size_t>(s.optim.bytes));
      const uint64_t ticket = nvme->read(b.data(), b.bytes(), *s.optim.slot);
      count(Tier::nvme, Tier::host, s.optim.bytes);
      ahead.push_back({next_read, std::move(b), ticket});
    }
  };
  Tensor grads[kNumTiers], staged[kNumTiers];  // fp32 gradients and working-precision staging per tier
  const auto scratch = [&](Tensor* per_tier, Tier t, DType dt) -> Tensor& {
    Tensor& x = per_tier[static_cast<int>(t)];
    if (!x.defined()) x = Tensor::empty({S}, dt, t);
    return x;
  };
  for (int c = 0; c < n; ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    const FlatRange r = chunks.owned(c, rank);
    if (r.numel() == 0) {
      // A shard of padding alone: the (zero) gradient written over it is
      // already what the parameters' padding holds.
      s.holds_grads = false;
      continue;
    }
    read_ahead();
    // The update runs where the optimizer state lives: on the device, or on
    // the host (the CPU AdamW) for host and NVMe state.
    const Tier on = s.optim.tier == Tier::device ? Tier::device : Tier::host;
    IoBuffer state;
    float* o = nullptr;
    if (s.optim.tier == Tier::nvme) {
      LOOM_CHECK(!ahead.empty() && ahead.front().chunk == c, "NVMe reads out of order at chunk ", c);
      nvme->wait(ahead.front().ticket);
      state = std::move(ahead.front().buffer);
      ahead.pop_front();
      o = static_cast<float*>(state.data());
    } else {
      o = s.optim.mem.data<float>();
    }
    // The gradient in fp32 where the update runs: from the parameters'
    // memory (reused) or from the shard's own gradient.
    float* g = scratch(grads, on, DType::f32).data<float>();
    if (reuse) {
      const void* src = nullptr;
      if (s.param.tier == on) {
        src = s.param.mem.raw();
      } else {
        Tensor& stage = scratch(staged, on, precision);
        load(s.param, stage.raw(), on);
        src = stage.raw();
      }
      convert(src, precision, g, DType::f32, r.numel());
    } else {
      LOOM_CHECK(s.grad_shard.tier() == on, "chunk ", c, "'s gradient shard is not where its update runs");
      convert(s.grad_shard.raw(), DType::f32, g, DType::f32, r.numel());
    }
    adamw.update(r, o, g, o + S, o + 2 * S);
    publish(c, o, on);
    if (s.optim.tier == Tier::nvme) write_behind(s.optim, std::move(state));
    // An update streamed from NVMe may outlast the watchdog's timeout as a
    // whole; each chunk is progress.
    report_progress();
  }
  // Gathered copies of the old parameters are stale (a chunk computing on
  // its own payload was updated in place).
  for (int c = 0; c < n; ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(s.refs == 0, "parameters updated while chunk ", c, " is acquired");
    if (!s.aliased) drop(c);
  }
  end_update();
}

void ChunkManager::Impl::end_update() {
  // The warm-up step is over once its update is applied (or skipped).
  if (++steps_seen == 1 && opts.policy == MemoryPolicy::automatic) place_after_warm_up();
}

void ChunkManager::Impl::restore_parameters() {
  Tensor state = Tensor::empty({3 * chunks.shard_numel()}, DType::f32, Tier::host);
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    if (!s.holds_grads) continue;
    load(s.optim, state.raw(), Tier::host);
    publish(c, state.data<float>(), Tier::host);
  }
  end_update();
}

void ChunkManager::Impl::gather_chunks(int kinds, const std::function<void(int c, float* shard)>& shard,
                                       const std::function<void(FlatRange range, const float* whole, int64_t stride)>& visit) {
  const int64_t S = chunks.shard_numel(), C = chunks.chunk_numel();
  // Host staging for one chunk at a time: this rank's shard of each kind,
  // and the whole chunk of each once gathered.
  Tensor state = Tensor::empty({kinds * S}, DType::f32, Tier::host);
  Tensor whole = ranks > 1 ? Tensor::empty({kinds * C}, DType::f32, Tier::host) : Tensor();
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    const Chunk& ch = chunks.chunk(c);
    shard(c, state.data<float>());
    const float* values = state.data<float>();
    int64_t stride = S;
    if (ranks > 1) {
      for (int k = 0; k < kinds; ++k)
        dp->all_gather(state.data<float>() + k * S, whole.data<float>() + k * C, S, DType::f32);
      values = whole.data<float>();
      stride = C;
    }
    visit({ch.begin, ch.end}, values, stride);
  }
}

void ChunkManager::Impl::visit_state(const StateVisitor& visit) {
  gather_chunks(
      3, [&](int c, float* shard) { load(cs[static_cast<size_t>(c)].optim, shard, Tier::host); },
      [&](FlatRange range, const float* kinds, int64_t stride) {
        visit(range, kinds, kinds + stride, kinds + 2 * stride);
      });
}

void ChunkManager::Impl::visit_gradients(const std::function<void(FlatRange range, const float* grads)>& visit) {
  const int64_t S = chunks.shard_numel();
  Tensor staged = Tensor::empty({S}, precision, Tier::host);
  gather_chunks(
      1,
      [&](int c, float* shard) {
        // Where the update reads it: the parameters' memory (reused) or the
        // shard's own gradient.
        const ChunkState& s = cs[static_cast<size_t>(c)];
        if (!reuse) {
          convert(s.grad_shard.raw(), DType::f32, shard, DType::f32, S);  // the fp32 accumulation
          return;
        }
        load(s.param, staged.raw(), Tier::host);
        convert(staged.raw(), precision, shard, DType::f32, S);
      },
      [&](FlatRange range, const float* grads, int64_t) { visit(range, grads); });
}

std::vector<FlatRange> ChunkManager::Impl::owned_ranges() const {
  std::vector<FlatRange> ranges;
  for (int c = 0; c < chunks.num_chunks(); ++c)
    if (const FlatRange r = chunks.owned(c, rank); r.numel() > 0) ranges.push_back(r);
  return ranges;
}

void ChunkManager::Impl::visit_owned_state(const StateVisitor& visit) {
  const int64_t S = chunks.shard_numel();
  Tensor staged = Tensor::empty({3 * S}, DType::f32, Tier::host);
  const float* s = staged.data<float>();
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    const FlatRange r = chunks.owned(c, rank);
    if (r.numel() == 0) continue;
    load(cs[static_cast<size_t>(c)].optim, staged.raw(), Tier::host);
    visit(r, s, s + S, s + 2 * S);
  }
}

void ChunkManager::Impl::load_state(const StateFiller& fill, bool owned_only) {
  const int64_t S = chunks.shard_numel();
  Tensor whole = owned_only ? Tensor() : Tensor::empty({3 * chunks.chunk_numel()}, DType::f32, Tier::host);
  Tensor state = Tensor::empty({3 * S}, DType::f32, Tier::host);
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(s.refs == 0, "state loaded while chunk ", c, " is acquired");
    if (!s.aliased) drop(c);
    // This rank's elements of each kind; the padding is zero.
    const FlatRange r = chunks.owned(c, rank);
    state.zero_();
    float* own = state.data<float>();
    if (owned_only) {
      if (r.numel() > 0) fill(r, own, own + S, own + 2 * S);
    } else {
      const Chunk& ch = chunks.chunk(c);
      const int64_t n = ch.numel();
      float* w = whole.data<float>();
      fill({ch.begin, ch.end}, w, w + n, w + 2 * n);
      for (int k = 0; k < 3; ++k) std::copy_n(w + k * n + (r.begin - ch.begin), r.numel(), own + k * S);
    }
    store(s.optim, state.raw(), Tier::host);
    publish(c, state.data<float>(), Tier::host);
  }
}

}  // namespace loom
