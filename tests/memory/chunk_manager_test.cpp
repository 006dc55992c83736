// The chunk manager's bookkeeping driven by hand: tensor states through a
// forward and a backward, reduction only once a chunk's tensors are all
// ready, and the checks that keep a chunk from being used while it holds
// gradients.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "loom/device.h"
#include "loom/memory.h"
#include "test_util.h"

namespace loom {
namespace {

// Two groups whose three parameters share one chunk of 4096 elements.
struct TwoGroups {
  TwoGroups() {
    const int a = layout.add_group("a");
    a0 = layout.add("a0", {1000}, ParamInit::normal_(0.02f), true, a);
    a1 = layout.add("a1", {1000}, ParamInit::constant(1.0f), false, a);
    const int b = layout.add_group("b");
    b0 = layout.add("b0", {1000}, ParamInit::normal_(0.02f), true, b);
    opts.policy = MemoryPolicy::fixed;
    opts.chunk_bytes = 4096 * 4;
  }
  ParamLayout layout;
  int a0 = 0, a1 = 0, b0 = 0;
  MemoryOptions opts;
};

TEST(ChunkManager, TensorStatesFollowTheStepAndAChunkReducesOnceAllItsTensorsAreReady) {
  TwoGroups m;
  for (double offload : {0.0, 1.0}) {
    m.opts.offload_param_frac = offload;
    ChunkManager mgr(m.layout, m.opts, DType::f32, nullptr, AdamWConfig{}, 7, 0);
    ChunkParamStore ps(mgr);
    ChunkGradStore gs(mgr);
    ASSERT_EQ(mgr.chunks().num_chunks(), 1);
    const auto state = [&](int id) { return mgr.state(id); };
    EXPECT_EQ(state(m.a0), TensorState::free);

    ps.begin_step();
    gs.zero();
    ps.acquire(0);
    EXPECT_EQ(state(m.a0), TensorState::compute);
    EXPECT_EQ(state(m.b0), TensorState::hold) << "gathered with its chunk, not in use";
    ops::synchronize();  // the host reads the chunk: its move must have run
    const float before = ps.param(m.a1).data<float>()[0];
    EXPECT_EQ(before, 1.0f);
    ps.release(0);
    // Computed on in place, the chunk stays; a staged copy is dropped.
    const TensorState released = offload == 0.0 ? TensorState::hold : TensorState::free;
    EXPECT_EQ(state(m.a0), released);

    // Backward: b's group, then a's.
    ps.acquire(1);
    gs.grad(m.b0).fill_(0.5f);
    EXPECT_EQ(state(m.b0), TensorState::hold_after_backward);
    ps.release(1);
    gs.group_ready(1);
    EXPECT_EQ(state(m.b0), TensorState::ready_for_reduce) << "a's tensors are not ready: no reduction yet";
    ps.acquire(0);
    gs.grad(m.a0).fill_(0.25f);
    gs.grad(m.a1).fill_(1.0f);
    ps.release(0);
    gs.group_ready(0);
    // The chunk was reduced: its tensors are back to hold or free.
    EXPECT_EQ(state(m.a0), released);
    EXPECT_EQ(state(m.b0), released);
    gs.finish();
    ps.end_step();

    // The gradient now sits in the parameters' memory until the update.
    EXPECT_DEATH(ps.acquire(0), "holds gradients");
    const GradientCheck check = mgr.check_gradients();
    EXPECT_DOUBLE_EQ(check.sum_squares, 1000 * (0.5 * 0.5 + 0.25 * 0.25 + 1.0));
    EXPECT_EQ(check.non_finite, 0);
    mgr.step(0.1f, 1.0f);
    ps.acquire(0);
    ops::synchronize();
    EXPECT_LT(ps.param(m.a1).data<float>()[0], before) << "a positive gradient lowers the parameter";
    ps.release(0);
    EXPECT_EQ(mgr.steps(), 1);
  }
}

// Acquiring an offloaded chunk only enqueues its move on the copy stream, and
// the compute stream's later kernels wait for it: with the copy stream held
// back, acquire returns, a kernel reading the parameter stays pending, and
// both finish with the right values once the copy stream runs.
TEST(ChunkManager, AcquireMovesTheChunkOnTheCopyStreamAndComputeWaitsForIt) {
  testing::with_cpu_stream_mode(CpuStreamMode::async, [] {
    TwoGroups m;
    m.opts.offload_param_frac = 1.0;
    ChunkManager mgr(m.layout, m.opts, DType::f32, nullptr, AdamWConfig{}, 7, 0);
    ChunkParamStore ps(mgr);
    ASSERT_EQ(mgr.placement().param.at(0), Tier::host);

    std::atomic<bool> open{false};
    copy_stream().enqueue([&] {
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
      while (!open && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    });
    ps.acquire(0);
    EXPECT_FALSE(open) << "acquire waited for the copy stream";
    Tensor read = Tensor::empty({1000});
    ops::copy(read.raw(), ps.param(m.a1).raw(), read.nbytes());
    const Event read_done = Event::record(current_stream());
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    EXPECT_FALSE(read_done.query()) << "a kernel ran before the chunk's move";
    open = true;
    const Tensor got = read.clone(Tier::host);
    for (int64_t i = 0; i < got.numel(); ++i) ASSERT_EQ(got.data<float>()[i], 1.0f) << i;
    ps.release(0);
  });
}

TEST(ChunkManager, GradientsAfterTheGroupIsReadyAndUnbalancedReleasesAreChecks) {
  TwoGroups m;
  ChunkManager mgr(m.layout, m.opts, DType::f32, nullptr, AdamWConfig{}, 7, 0);
  ChunkParamStore ps(mgr);
  ChunkGradStore gs(mgr);
  gs.zero();
  gs.grad(m.a0);
  gs.group_ready(0);
  EXPECT_DEATH(gs.grad(m.a1), "written after its group a was reported ready");
  EXPECT_DEATH(gs.group_ready(0), "reported ready twice");
  EXPECT_DEATH(ps.release(1), "not acquired");
  EXPECT_DEATH(ps.param(m.b0), "is not acquired");
  EXPECT_DEATH(gs.set_reduce(false), "gradient accumulation over several micro-batches");
}

TEST(ChunkManager, ReportsWhereTheBytesLive) {
  TwoGroups m;
  m.opts.offload_optim_frac = 1.0;
  m.opts.chunk_bytes = 4096 * 2;  // in the working precision
  ChunkManager mgr(m.layout, m.opts, DType::bf16, nullptr, AdamWConfig{}, 7, 0);
  const MemoryReport r = mgr.report();
  EXPECT_EQ(r.num_chunks, 1);
  EXPECT_EQ(r.chunk_numel, 4096);
  EXPECT_EQ(r.model_state[Tier::device], 4096 * 2) << "bf16 parameters";
  EXPECT_EQ(r.model_state[Tier::host], 4096 * 12) << "fp32 master weights, m and v";
  EXPECT_EQ(r.model_state[Tier::nvme], 0);
  EXPECT_CONTAINS(describe(r), "host");
}

// Sixteen micro-batches under bf16: 1, then 15 times 2^-9 per element. A bf16
// accumulator rounds 1 + 2^-9 back to 1 each time; the gradient shard adds
// them in fp32 and rounds the sum once, after the last micro-batch, and the
// sum of squares the update checks shows which happened.
TEST(ChunkManager, SixteenBf16MicroBatchesAccumulateInFp32) {
  constexpr int kMicroBatches = 16;
  const auto contribution = [](int mb) { return mb == 0 ? 1.0f : 0x1p-9f; };
  const auto bf16 = [](float x) {
    round_to(&x, 1, DType::bf16);
    return x;
  };
  float fp32 = 0.0f, per_micro_batch = 0.0f;
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    fp32 += contribution(mb);
    per_micro_batch = bf16(per_micro_batch + contribution(mb));
  }
  TwoGroups m;
  m.opts.micro_batches = kMicroBatches;
  m.opts.chunk_bytes = 4096 * 2;
  ChunkManager mgr(m.layout, m.opts, DType::bf16, nullptr, AdamWConfig{}, 7, 0);
  ChunkParamStore ps(mgr);
  ChunkGradStore gs(mgr);
  ps.begin_step();
  gs.zero();
  for (int mb = 0; mb < kMicroBatches; ++mb) {
    gs.set_reduce(mb + 1 == kMicroBatches);
    ps.acquire(1);
    gs.grad(m.b0).fill_(contribution(mb));
    ps.release(1);
    gs.group_ready(1);
    ps.acquire(0);
    gs.grad(m.a0).fill_(contribution(mb));
    gs.grad(m.a1).fill_(contribution(mb));
    ps.release(0);
    gs.group_ready(0);
  }
  gs.finish();
  ps.end_step();
  const double rounded_once = bf16(fp32), old = per_micro_batch;
  const GradientCheck check = mgr.check_gradients();
  EXPECT_EQ(check.non_finite, 0);
  EXPECT_EQ(check.sum_squares, 3000 * rounded_once * rounded_once);
  // One bf16 rounding from the fp32 sum; a bf16 accumulator is further off.
  EXPECT_LE(std::fabs(rounded_once - fp32) / fp32, 0x1p-8);
  EXPECT_GT(std::fabs(old - fp32) / fp32, 0x1p-8);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// auto with room for two of four chunks: the cache follows Belady's rule on
// the recorded order a b c d d c b a (a forward and a backward).
TEST(ChunkManager, AutoEvictsTheChunkWhoseNextUseIsFurthest) {
  ParamLayout layout;
  for (const char* name : {"a", "b", "c", "d"}) {
    const int g = layout.add_group(name);
    layout.add(str(name, ".w"), {2048}, ParamInit::normal_(0.02f), true, g);
  }
  MemoryOptions opts;
  opts.policy = MemoryPolicy::automatic;
  opts.chunk_bytes = 2048 * 4;
  opts.prefetch = 0;  // only the accesses themselves move chunks
  MemoryContext context;
  MemoryContext::Install install(context);
  ChunkManager mgr(layout, opts, DType::f32, nullptr, AdamWConfig{}, 7, 0);
  ChunkParamStore ps(mgr);
  ChunkGradStore gs(mgr);
  ASSERT_EQ(mgr.chunks().num_chunks(), 4);
  const auto run_step = [&] {
    ps.begin_step();
    gs.zero();
    for (int g = 0; g < 4; ++g) {
      ps.acquire(g);
      ps.release(g);
    }
    for (int g = 4; g-- > 0;) {
      ps.acquire(g);
      gs.grad(g).fill_(0.01f);
      ps.release(g);
      gs.group_ready(g);
    }
    gs.finish();
    ps.end_step();
  };
  run_step();  // the traced warm-up, everything on the host
  // Room for two chunks' parameters once the traced peak and the working
  // set are set aside (place_after_warm_up's arithmetic).
  const int64_t P = 2048 * 4;
  ChunkPlacement staged = mgr.placement();
  const int64_t working = memory_needs(mgr.chunks(), staged, DType::f32, opts).device_working;
  const int64_t traced = mgr.report().traced_non_model;
  ASSERT_GE(traced, 0);
  context.tier(Tier::device).set_budget(static_cast<size_t>(traced + working + 2 * P + P / 2));
  mgr.step(1e-3f, 1.0f);

  const TierTraffic before = mgr.report().traffic;
  run_step();
  // a, b cached; c evicts a (used last), d evicts b, b evicts d (next used
  // after c and b), a evicts c: a and b end on the device.
  EXPECT_EQ(mgr.placement().param, (std::vector<Tier>{Tier::device, Tier::device, Tier::host, Tier::host}));
  const TierTraffic after = mgr.report().traffic;
  EXPECT_EQ(after.at(Tier::host, Tier::device) - before.at(Tier::host, Tier::device), 6 * P);
  EXPECT_EQ(after.at(Tier::device, Tier::host) - before.at(Tier::device, Tier::host), 4 * P);
}

}  // namespace
}  // namespace loom
