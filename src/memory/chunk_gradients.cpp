#include <algorithm>

#include "loom/device.h"
#include "memory/chunk_manager_impl.h"
#include "zero/working_precision.h"

namespace loom {

Tensor ChunkManager::Impl::grad(int id) {
  const ParamSpec& p = layout.param(id);
  const int c = chunks.chunk_of_param(id);
  ChunkState& s = cs[static_cast<size_t>(c)];
  TensorState& st = states[static_cast<size_t>(id)];
  LOOM_CHECK(st != TensorState::ready_for_reduce, "gradient of ", p.name, " written after its group ",
             layout.group_name(p.group), " was reported ready");
  st = TensorState::hold_after_backward;
  if (s.reduced.defined()) {
    // The last micro-batch's reduction still reads this chunk's gradient:
    // it ends before the next accumulation starts.
    in_flight.erase(std::find(in_flight.begin(), in_flight.end(), c));
    retire(c);
  }
  if (!s.grad.defined()) s.grad = Tensor::zeros({chunks.chunk_numel()}, DType::f32, Tier::device);
  return s.grad.flat(chunks.position(c, p.offset), p.numel()).view(p.shape);
}

void ChunkManager::Impl::zero_grads() {
  for (ChunkState& s : cs) {
    LOOM_CHECK(!s.grad.defined() && !s.write_pending, "a step started with gradients of the last one pending");
    s.sum_squares = 0.0;
    s.non_finite = 0;
    if (s.grad_shard.defined()) s.grad_shard.zero_();
  }
  final_micro_batch = true;
}

void ChunkManager::Impl::set_final_micro_batch(bool final) {
  LOOM_CHECK(final || !reuse, "gradient accumulation over several micro-batches with a manager built for one "
                              "(MemoryOptions::micro_batches = 1): the gradients would overwrite the parameters");
  final_micro_batch = final;
}

void ChunkManager::Impl::group_ready(int group) {
  for (int id : group_params[static_cast<size_t>(group)]) {
    TensorState& st = states[static_cast<size_t>(id)];
    LOOM_CHECK(st != TensorState::ready_for_reduce, "group ", layout.group_name(group), " reported ready twice");
    st = TensorState::ready_for_reduce;
    const int c = chunks.chunk_of_param(id);
    if (--cs[static_cast<size_t>(c)].not_ready == 0) reduce(c);
  }
  if (tracing) trace(group);
}

void ChunkManager::Impl::reduce(int c) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  const Chunk& ch = chunks.chunk(c);
  s.not_ready = ch.end_param - ch.first_param;
  if (!s.grad.defined()) s.grad = Tensor::zeros({chunks.chunk_numel()}, DType::f32, Tier::device);
  if (ranks == 1) {
    retire(c);
    return;
  }
  // Each rank receives the sum of its shard, asynchronously; at most two
  // chunks are in flight, so gradient memory stays bounded.
  s.reduced = Tensor::empty({chunks.shard_numel()}, DType::f32, Tier::device);
  s.reducing = dp->reduce_scatter_async(s.grad.raw(), s.reduced.raw(), chunks.shard_numel(), DType::f32);
  in_flight.push_back(c);
  while (in_flight.size() > 2) {
    const int oldest = in_flight.front();
    in_flight.pop_front();
    retire(oldest);
  }
}

void ChunkManager::Impl::retire(int c) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  s.reducing.wait();
  s.reducing = Work();
  // Reusing the parameters' memory waits until no group of the chunk is
  // acquired (the tied token table is read by the head's backward).
  if (reuse && s.refs > 0) {
    s.write_pending = true;
    return;
  }
  s.write_pending = false;
  write_gradient(c, (ranks == 1 ? s.grad : s.reduced).data<float>());
  s.grad = Tensor();
  s.reduced = Tensor();
  const Chunk& ch = chunks.chunk(c);
  for (int id = ch.first_param; id < ch.end_param; ++id)
    states[static_cast<size_t>(id)] = s.full.defined() ? TensorState::hold : TensorState::free;
}

void ChunkManager::Impl::write_gradient(int c, const float* shard) {
  ChunkState& s = cs[static_cast<size_t>(c)];
  const int64_t S = chunks.shard_numel(), len = chunks.owned(c, rank).numel();
  if (reuse) {
    // The gradient, rounded to the working precision, overwrites the
    // working parameters: the update reads it there and then writes the new
    // parameters from the master weights.
    Tensor rounded;
    const void* src = shard;
    if (precision != DType::f32) {
      rounded = Tensor::empty({S}, precision, Tier::device);
      ops::convert(shard, DType::f32, rounded.raw(), precision, S);
      src = rounded.raw();
    }
    s.sum_squares = ops::sum_squares(src, precision, len);
    s.non_finite = ops::count_non_finite(src, precision, len);
    store(s.param, src, Tier::device);
    s.holds_grads = true;
    return;
  }
  // Accumulation: each micro-batch's gradient is reduced in fp32 (as
  // Megatron reduces bf16 gradients) and added into the shard's fp32
  // gradient; the sum is rounded to the working precision once, after the
  // last micro-batch, so the update sees what one micro-batch of the whole
  // batch would write into the parameters' memory above.
  const Tier at_tier = s.grad_shard.tier();
  const float* src = shard;
  Tensor moved;
  if (at_tier != Tier::device) {
    moved = Tensor::empty({S}, DType::f32, at_tier);
    move(moved.raw(), shard, static_cast<size_t>(S) * 4);
    count(Tier::device, at_tier, S * 4);
    src = moved.data<float>();
  }
  float* acc = s.grad_shard.data<float>();
  ops::add_rounded(acc, DType::f32, src, S);
  if (final_micro_batch) {
    ops::round_to(acc, S, precision);
    s.sum_squares = ops::sum_squares(acc, DType::f32, len);
    s.non_finite = ops::count_non_finite(acc, DType::f32, len);
  }
}

void ChunkManager::Impl::finish() {
  while (!in_flight.empty()) {
    const int c = in_flight.front();
    in_flight.pop_front();
    retire(c);
  }
  for (int c = 0; c < chunks.num_chunks(); ++c) {
    const ChunkState& s = cs[static_cast<size_t>(c)];
    LOOM_CHECK(!s.write_pending && !s.grad.defined(), "chunk ", c,
               "'s gradient is incomplete at the end of backward: some group was not reported ready");
  }
}

}  // namespace loom
