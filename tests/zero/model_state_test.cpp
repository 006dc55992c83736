// Model-state bytes per rank and communication volume per step, held to the
// ZeRO paper's formulas, for a model of about 10.6M parameters.
#include <gtest/gtest.h>

#include "loom/planner.h"
#include "zero_test_util.h"

namespace loom {
namespace {

using testing::ten_million;

using testing::random_tokens;


struct Measured {
  std::vector<double> state_bytes;  // per rank, after a step
  std::vector<double> sent;         // collective elements per rank in one step
};

Measured measure(int ranks, int stage, DType precision) {
  Measured m;
  m.state_bytes.assign(static_cast<size_t>(ranks), 0.0);
  m.sent.assign(static_cast<size_t>(ranks), 0.0);
  run_local(ranks, [&](Communicator& world) {
    Allocator& device = MemoryContext::current().tier(Tier::device);
    const size_t before = device.used();
    TrainOptions opts;
    opts.zero.stage = stage;
    opts.zero.precision = precision;
    Trainer trainer(ten_million(), opts, &world);
    const std::vector<int32_t> data = random_tokens(int64_t(ranks) * 8 + 1, 2048, 5);
    const auto micro_batch = [&] {
      return MicroBatch{data.data() + world.rank() * 8, data.data() + world.rank() * 8 + 1, {1, 8}, world.rank()};
    };
    MicroBatch mb = micro_batch();
    trainer.step({&mb, 1});  // learns the stage-3 acquisition order
    const auto volume = [&] {
      const CommStats s = world.stats();
      return s.all_reduce.elements + s.reduce_scatter.elements + s.all_gather.elements;
    };
    const double sent_before = volume();
    trainer.step({&mb, 1});
    const size_t r = static_cast<size_t>(world.rank());
    m.sent[r] = volume() - sent_before;
    // Everything a step allocates beyond the model state is freed by its end.
    m.state_bytes[r] = static_cast<double>(device.used() - before);
  });
  return m;
}

struct Case {
  int ranks, stage;
  DType precision;
};

class ModelState : public ::testing::TestWithParam<Case> {};

TEST_P(ModelState, BytesPerRankFollowTheZeroFormulaAndVolumeTheRingModel) {
  const Case c = GetParam();
  const double psi = static_cast<double>(ten_million().num_params());
  ASSERT_GE(psi, 10e6);
  const Measured m = measure(c.ranks, c.stage, c.precision);
  const double expected = zero_model_state_bytes(c.stage, c.precision, psi, c.ranks);
  // Per step each rank sends (n-1)/n of each reduce-scatter and all-gather
  // (ring model), an all-reduce being both: about 2 psi (n-1)/n elements for
  // stages 0-2 and 3 psi (n-1)/n for stage 3, whose parameters are gathered
  // for the forward and again for the backward.
  const double ring = (c.ranks - 1.0) / c.ranks;
  const double volume = (c.stage == 3 ? 3.0 : 2.0) * psi * ring;
  for (int r = 0; r < c.ranks; ++r) {
    EXPECT_NEAR(m.state_bytes[static_cast<size_t>(r)] / expected, 1.0, 0.05)
        << "rank " << r << ": " << format_bytes(m.state_bytes[static_cast<size_t>(r)]) << ", formula "
        << format_bytes(expected);
    EXPECT_NEAR(m.sent[static_cast<size_t>(r)] / volume, 1.0, 0.05)
        << "rank " << r << ": " << m.sent[static_cast<size_t>(r)] << " elements, expected " << volume;
  }
}

std::vector<Case> cases() {
  std::vector<Case> v;
  for (DType p : {DType::f32, DType::bf16, DType::f16})
    for (int n : {2, 4})
      for (int stage : {0, 1, 2, 3}) v.push_back({n, stage, p});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Layouts, ModelState, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) {
                           return std::string(dtype_name(i.param.precision)) + "_dp" + std::to_string(i.param.ranks) +
                                  "_stage" + std::to_string(i.param.stage);
                         });

}  // namespace
}  // namespace loom
