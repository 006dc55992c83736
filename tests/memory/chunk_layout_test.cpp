#include <gtest/gtest.h>

#include <limits>

#include "loom/memory.h"
#include "loom/nn.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::error_of;
using testing::TempDir;

constexpr int64_t A = kChunkShardAlign;

// Groups and 1-D parameters of the given sizes, named p<id>.
ParamLayout make_layout(const std::vector<std::vector<int64_t>>& groups) {
  ParamLayout layout;
  int id = 0;
  for (const std::vector<int64_t>& sizes : groups) {
    const int g = layout.add_group(str("g", layout.num_groups()));
    for (int64_t n : sizes) layout.add(str("p", id++), {n}, ParamInit::constant(0.0f), true, g);
  }
  return layout;
}

GPTConfig small_config() {
  return {.n_layer = 2, .n_head = 2, .n_embd = 32, .vocab_size = 37, .block_size = 12, .lora = {}};
}

// The packing invariants: consecutive chunks of whole parameters in layout
// order, each parameter in the chunk it is mapped to, and every chunk but the
// first opened by a parameter that did not fit in the previous one.
void expect_greedy_packing(const ChunkLayout& cl) {
  const ParamLayout& layout = cl.params();
  int64_t flat = 0;
  int next_param = 0;
  for (int c = 0; c < cl.num_chunks(); ++c) {
    const Chunk& ch = cl.chunk(c);
    EXPECT_EQ(ch.first_param, next_param) << "chunk " << c;
    EXPECT_LT(ch.first_param, ch.end_param) << "chunk " << c;
    EXPECT_EQ(ch.begin, flat) << "chunk " << c;
    EXPECT_LE(ch.numel(), cl.chunk_numel()) << "chunk " << c;
    for (int p = ch.first_param; p < ch.end_param; ++p) {
      EXPECT_EQ(cl.chunk_of_param(p), c);
      EXPECT_EQ(layout.param(p).offset, flat);
      flat += layout.param(p).numel();
    }
    EXPECT_EQ(ch.end, flat) << "chunk " << c;
    if (c > 0) {
      EXPECT_GT(cl.chunk(c - 1).numel() + layout.param(ch.first_param).numel(), cl.chunk_numel());
    }
    next_param = ch.end_param;
  }
  EXPECT_EQ(next_param, static_cast<int>(layout.params().size()));
  EXPECT_EQ(flat, layout.numel());
  EXPECT_EQ(cl.wasted_numel(), cl.num_chunks() * cl.chunk_numel() - layout.numel());
}

// Every group's chunks are exactly those of its parameters, in order.
void expect_group_chunks(const ChunkLayout& cl) {
  const ParamLayout& layout = cl.params();
  for (int g = 0; g < layout.num_groups(); ++g) {
    std::vector<int> expected;
    for (size_t p = 0; p < layout.params().size(); ++p)
      if (layout.params()[p].group == g) {
        const int c = cl.chunk_of_param(static_cast<int>(p));
        if (expected.empty() || expected.back() != c) expected.push_back(c);
      }
    EXPECT_EQ(cl.chunks_of_group(g), expected) << "group " << g;
  }
}

// Rank r's part of every chunk is shard r clipped to the real elements, and
// the ranks together hold each element of the flat space exactly once.
void expect_owned_covers_once(const ChunkLayout& cl) {
  std::vector<int> holders(static_cast<size_t>(cl.params().numel()), 0);
  const int64_t s = cl.shard_numel();
  EXPECT_EQ(s * cl.ranks(), cl.chunk_numel());
  EXPECT_EQ(s % kChunkShardAlign, 0);
  for (int c = 0; c < cl.num_chunks(); ++c) {
    const Chunk& ch = cl.chunk(c);
    for (int r = 0; r < cl.ranks(); ++r) {
      const FlatRange o = cl.owned(c, r);
      EXPECT_EQ(o.begin, std::min(ch.begin + r * s, ch.end)) << "chunk " << c << " rank " << r;
      EXPECT_EQ(o.end, std::min(ch.begin + (r + 1) * s, ch.end)) << "chunk " << c << " rank " << r;
      EXPECT_GE(o.numel(), 0);
      EXPECT_EQ(cl.position(c, o.begin), std::min(r * s, ch.numel()));
      for (int64_t i = o.begin; i < o.end; ++i) ++holders[static_cast<size_t>(i)];
    }
  }
  for (size_t i = 0; i < holders.size(); ++i) ASSERT_EQ(holders[i], 1) << "flat element " << i;
}

TEST(ChunkLayout, PacksWholeParametersGreedilyInLayoutOrder) {
  // g0: 3A + 2A fill chunk 0; 4A does not fit in its last A, so g1 opens
  // chunk 1 and spans into chunk 2, which also holds g2.
  const ParamLayout layout = make_layout({{3 * A, 2 * A}, {4 * A, A, 2 * A}, {A + 5}});
  const ChunkLayout cl(layout, 6 * A, 1);
  ASSERT_EQ(cl.num_chunks(), 3);
  EXPECT_EQ(cl.chunk_numel(), 6 * A);
  EXPECT_EQ(cl.shard_numel(), 6 * A);
  EXPECT_EQ(cl.chunk(0).first_param, 0);
  EXPECT_EQ(cl.chunk(0).end_param, 2);
  EXPECT_EQ(cl.chunk(0).begin, 0);
  EXPECT_EQ(cl.chunk(0).end, 5 * A);
  EXPECT_EQ(cl.chunk(1).first_param, 2);
  EXPECT_EQ(cl.chunk(1).end_param, 4);
  EXPECT_EQ(cl.chunk(1).begin, 5 * A);
  EXPECT_EQ(cl.chunk(1).end, 10 * A);
  EXPECT_EQ(cl.chunk(2).first_param, 4);
  EXPECT_EQ(cl.chunk(2).end_param, 6);
  EXPECT_EQ(cl.chunk(2).begin, 10 * A);
  EXPECT_EQ(cl.chunk(2).end, 13 * A + 5);
  EXPECT_EQ(cl.chunk(2).numel(), 3 * A + 5);
  EXPECT_EQ(cl.chunk_of_param(3), 1);
  EXPECT_EQ(cl.chunk_of_param(4), 2);
  EXPECT_EQ(cl.chunks_of_group(0), std::vector<int>({0}));
  EXPECT_EQ(cl.chunks_of_group(1), std::vector<int>({1, 2}));
  EXPECT_EQ(cl.chunks_of_group(2), std::vector<int>({2}));
  EXPECT_EQ(cl.position(2, 12 * A), 2 * A);
  EXPECT_EQ(cl.wasted_numel(), 18 * A - (13 * A + 5));
  EXPECT_EQ(&cl.params(), &layout);
  expect_greedy_packing(cl);
  expect_group_chunks(cl);
}

TEST(ChunkLayout, AParameterThatFillsTheRestStaysInTheChunk) {
  const ParamLayout layout = make_layout({{A, 3 * A}, {4 * A}});
  const ChunkLayout cl(layout, 4 * A, 1);
  ASSERT_EQ(cl.num_chunks(), 2);
  EXPECT_EQ(cl.chunk(0).end_param, 2);
  EXPECT_EQ(cl.chunk(1).numel(), 4 * A);
  EXPECT_EQ(cl.wasted_numel(), 0);
}

TEST(ChunkLayout, OwnedShardsHoldTheRealElementsOnce) {
  const ParamLayout layout = make_layout({{3 * A, 2 * A}, {4 * A, A, 2 * A}, {A + 5}, {7 * A + 3, 11}});
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(str("ranks ", ranks));
    const ChunkLayout cl(layout, 8 * A, ranks);
    EXPECT_EQ(cl.ranks(), ranks);
    EXPECT_EQ(cl.shard_numel(), 8 * A / ranks);
    expect_greedy_packing(cl);
    expect_owned_covers_once(cl);
  }
  // Chunk 2 holds only the A + 5 parameter (the 7A + 3 one does not fit
  // after it): with four 2A shards, rank 0 holds all of it and the other
  // shards are all padding, empty ranges at the chunk's end.
  const ChunkLayout four(layout, 8 * A, 4);
  ASSERT_EQ(four.num_chunks(), 4);
  EXPECT_EQ(four.chunk(3).numel(), 7 * A + 14);
  EXPECT_EQ(four.owned(3, 3).numel(), A + 14);
  const Chunk& c2 = four.chunk(2);
  EXPECT_EQ(c2.numel(), A + 5);
  EXPECT_EQ(four.owned(2, 0).begin, c2.begin);
  EXPECT_EQ(four.owned(2, 0).end, c2.end);
  for (int r = 1; r < 4; ++r) {
    EXPECT_EQ(four.owned(2, r).begin, c2.end) << r;
    EXPECT_EQ(four.owned(2, r).numel(), 0) << r;
  }
}

TEST(ChunkLayout, PacksARealModelsLayout) {
  const GPT model(small_config());
  const ParamLayout& layout = model.layout();
  for (int ranks : {1, 2, 4}) {
    SCOPED_TRACE(str("ranks ", ranks));
    const ChunkLayout cl(layout, 4 * A, ranks);
    EXPECT_GT(cl.num_chunks(), 2);
    expect_greedy_packing(cl);
    expect_group_chunks(cl);
    expect_owned_covers_once(cl);
  }
}

TEST(ChunkLayout, AnEmptyLayoutHasNoChunks) {
  ParamLayout layout;
  layout.add_group("empty");
  const ChunkLayout cl(layout, A, 1);
  EXPECT_EQ(cl.num_chunks(), 0);
  EXPECT_EQ(cl.wasted_numel(), 0);
  EXPECT_TRUE(cl.chunks_of_group(0).empty());
}

TEST(ChunkLayout, RejectsOversizedParametersAndUnalignedCapacities) {
  const ParamLayout layout = make_layout({{A, 5 * A + 1}});
  std::string m = error_of([&] { ChunkLayout(layout, 4 * A, 1); });
  EXPECT_CONTAINS(m, "memory.chunk_bytes");
  EXPECT_CONTAINS(m, "p1");
  EXPECT_CONTAINS(m, str(5 * A + 1));
  EXPECT_CONTAINS(m, str(4 * A));
  EXPECT_CONTAINS(m, str("at least ", 6 * A));

  m = error_of([&] { ChunkLayout(layout, 6 * A + 1000, 1); });
  EXPECT_CONTAINS(m, "memory.chunk_bytes");
  EXPECT_CONTAINS(m, str(6 * A + 1000));
  EXPECT_CONTAINS(m, str("multiple of ", A));
  // A multiple of the alignment but not of ranks * alignment.
  m = error_of([&] { ChunkLayout(layout, 6 * A, 4); });
  EXPECT_CONTAINS(m, str("multiple of ", 4 * A));
  m = error_of([&] { ChunkLayout(layout, 0, 1); });
  EXPECT_CONTAINS(m, "memory.chunk_bytes");
  m = error_of([&] { ChunkLayout(layout, 8 * A, 0); });
  EXPECT_CONTAINS(m, "0 data-parallel ranks");
}

// The waste of every candidate, built as a ChunkLayout.
ChunkSearch brute_force(const ParamLayout& layout, int ranks, int64_t max_numel) {
  const int64_t step = ranks * A;
  int64_t largest = 0;
  for (const ParamSpec& p : layout.params()) largest = std::max(largest, p.numel());
  const int64_t smallest = (largest + step - 1) / step * step;
  ChunkSearch best;
  best.wasted_numel = std::numeric_limits<int64_t>::max();
  for (int64_t capacity = smallest; capacity <= std::max(max_numel, smallest); capacity += step) {
    const ChunkLayout cl(layout, capacity, ranks);
    ++best.candidates;
    if (cl.wasted_numel() < best.wasted_numel) best = {capacity, cl.wasted_numel(), best.candidates};
  }
  return best;
}

TEST(ChunkSearch, FindsTheCapacityThatWastesLeast) {
  const ParamLayout layout = make_layout({{3 * A + 7, 2 * A}, {5 * A - 3, A, 2 * A + 1}, {A + 5, 6 * A}, {9}});
  for (int ranks : {1, 2, 4}) {
    for (int64_t max_numel : {int64_t{0}, 12 * A, 40 * A + 100}) {
      SCOPED_TRACE(str("ranks ", ranks, " max_numel ", max_numel));
      const ChunkSearch found = search_chunk_numel(layout, ranks, max_numel);
      const ChunkSearch expected = brute_force(layout, ranks, max_numel);
      EXPECT_EQ(found.chunk_numel, expected.chunk_numel);
      EXPECT_EQ(found.wasted_numel, expected.wasted_numel);
      EXPECT_EQ(found.candidates, expected.candidates);
    }
  }
  // The search is not trivially the smallest or the largest candidate here.
  const ChunkSearch found = search_chunk_numel(layout, 1, 40 * A);
  EXPECT_GT(found.chunk_numel, 6 * A);
  EXPECT_LT(found.chunk_numel, 40 * A);
  EXPECT_EQ(found.candidates, 35);

  const GPT model(small_config());
  const ChunkSearch gpt = search_chunk_numel(model.layout(), 2, 16 * A);
  const ChunkSearch gpt_expected = brute_force(model.layout(), 2, 16 * A);
  EXPECT_EQ(gpt.chunk_numel, gpt_expected.chunk_numel);
  EXPECT_EQ(gpt.wasted_numel, gpt_expected.wasted_numel);
  EXPECT_EQ(gpt.candidates, gpt_expected.candidates);
  EXPECT_GT(gpt.candidates, 1);
}

TEST(ChunkSearch, TiesGoToTheSmallerCapacity) {
  // 2A and 4A both waste nothing; 3A wastes 2A.
  const ParamLayout layout = make_layout({{2 * A, 2 * A}});
  const ChunkSearch s = search_chunk_numel(layout, 1, 4 * A);
  EXPECT_EQ(s.chunk_numel, 2 * A);
  EXPECT_EQ(s.wasted_numel, 0);
  EXPECT_EQ(s.candidates, 3);
}

TEST(ChunkSearch, AMaximumBelowTheLargestParameterGivesTheSmallestCapacity) {
  const ParamLayout layout = make_layout({{3 * A + 1, 10}});
  ChunkSearch s = search_chunk_numel(layout, 1, A);
  EXPECT_EQ(s.chunk_numel, 4 * A);
  EXPECT_EQ(s.candidates, 1);
  EXPECT_EQ(s.wasted_numel, 4 * A - (3 * A + 11));
  s = search_chunk_numel(layout, 2, 5 * A);  // rounds down to 4A, the smallest at step 2A
  EXPECT_EQ(s.chunk_numel, 4 * A);
  EXPECT_EQ(s.candidates, 1);
}

TEST(ChunkSearch, RejectsNoRanksAndAnEmptyLayout) {
  const ParamLayout layout = make_layout({{A}});
  EXPECT_CONTAINS(error_of([&] { search_chunk_numel(layout, 0, 8 * A); }), "got 0");
  ParamLayout empty;
  EXPECT_CONTAINS(error_of([&] { search_chunk_numel(empty, 1, 8 * A); }), "no");
}

TEST(MemoryOptions, PolicyAndStateNames) {
  for (MemoryPolicy p : {MemoryPolicy::none, MemoryPolicy::fixed, MemoryPolicy::automatic})
    EXPECT_EQ(parse_memory_policy(memory_policy_name(p)), p);
  EXPECT_STREQ(memory_policy_name(MemoryPolicy::fixed), "static");
  EXPECT_STREQ(memory_policy_name(MemoryPolicy::automatic), "auto");
  const std::string m = error_of([] { parse_memory_policy("gemini"); });
  EXPECT_CONTAINS(m, "memory.policy = \"gemini\"");
  for (const char* name : {"\"none\"", "\"static\"", "\"auto\""}) EXPECT_CONTAINS(m, name);
  EXPECT_STREQ(tensor_state_name(TensorState::free), "free");
  EXPECT_STREQ(tensor_state_name(TensorState::compute), "compute");
  EXPECT_STREQ(tensor_state_name(TensorState::hold), "hold");
  EXPECT_STREQ(tensor_state_name(TensorState::hold_after_backward), "hold_after_backward");
  EXPECT_STREQ(tensor_state_name(TensorState::ready_for_reduce), "ready_for_reduce");
}

TEST(MemoryOptions, ValidateNamesTheField) {
  TempDir dir;
  MemoryOptions ok;
  ok.policy = MemoryPolicy::fixed;
  ok.offload_param_frac = 0.5;
  ok.offload_optim_frac = 1.0;
  ok.nvme_dir = dir.path();
  EXPECT_NO_THROW(validate(ok));
  EXPECT_NO_THROW(validate(MemoryOptions{}));

  auto message = [&](auto change) {
    MemoryOptions o = ok;
    change(o);
    return error_of([&] { validate(o); });
  };
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.offload_param_frac = 1.5; }), "memory.offload_param_frac = 1.5");
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.offload_optim_frac = -0.25; }), "memory.offload_optim_frac = -0.25");
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.offload_optim_frac = std::numeric_limits<double>::quiet_NaN(); }),
                  "memory.offload_optim_frac");
  const std::string not_static = message([](MemoryOptions& o) { o.policy = MemoryPolicy::automatic; });
  EXPECT_CONTAINS(not_static, "memory.offload_param_frac");
  EXPECT_CONTAINS(not_static, "the fractions only apply to memory.policy = \"static\"");
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.chunk_bytes = -1; }), "memory.chunk_bytes = -1");
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.prefetch = -2; }), "memory.prefetch = -2");
  EXPECT_CONTAINS(message([](MemoryOptions& o) { o.micro_batches = 0; }), "micro_batches = 0");
  const std::filesystem::path missing = dir / "missing";
  EXPECT_CONTAINS(message([&](MemoryOptions& o) { o.nvme_dir = missing; }),
                  str("memory.nvme_dir = ", missing, " does not exist or is not a directory"));
  const std::filesystem::path file = dir.write("file", "x");
  EXPECT_CONTAINS(message([&](MemoryOptions& o) { o.nvme_dir = file; }), "is not a directory");
}

TEST(MemoryReport, DescribeShowsEveryTierAndTheTraffic) {
  constexpr int64_t MiB = int64_t{1} << 20;
  MemoryReport r;
  r.policy = MemoryPolicy::fixed;
  r.num_chunks = 12;
  r.chunk_numel = 64 * A;
  r.model_state[Tier::device] = 3 * MiB;
  r.model_state[Tier::host] = 5 * MiB;
  r.model_state[Tier::nvme] = 7 * MiB;
  r.peak[Tier::device] = 9 * MiB;
  r.peak_reserved[Tier::device] = 10 * MiB;
  r.budget[Tier::device] = 16 * MiB;
  r.budget[Tier::host] = -1;
  r.budget[Tier::nvme] = -1;
  r.traffic.at(Tier::host, Tier::device) = 12 * MiB;
  r.traffic.at(Tier::nvme, Tier::host) = 2 * MiB;
  r.nvme.reads = 4;
  r.nvme.bytes_read = 2 * MiB;
  r.nvme.read_seconds = 0.5;
  const std::string d = describe(r);
  EXPECT_CONTAINS(d, "static");
  EXPECT_CONTAINS(d, "12 chunks");
  EXPECT_CONTAINS(d, str(64 * A, " elements"));
  EXPECT_CONTAINS(d,
                  "device: model state 3.00 MiB, peak 9.00 MiB (6.00 MiB besides model state, 10.00 MiB reserved), "
                  "budget 16.00 MiB");
  EXPECT_CONTAINS(d, "host: model state 5.00 MiB, peak 0 B (0 B besides model state, 0 B reserved), budget unlimited");
  EXPECT_CONTAINS(d, "nvme: model state 7.00 MiB");
  EXPECT_CONTAINS(d, "host->device 12.00 MiB");
  EXPECT_CONTAINS(d, "nvme->host 2.00 MiB");
  EXPECT_EQ(d.find("device->host"), std::string::npos) << d;
  EXPECT_CONTAINS(d, "4 reads of 2.00 MiB at 4.00 MiB/s");
  EXPECT_EQ(d.find("writes"), std::string::npos) << d;
  r.nvme.writes = 1;
  r.nvme.bytes_written = MiB;
  EXPECT_CONTAINS(describe(r), "4 reads of 2.00 MiB at 4.00 MiB/s, 1 writes of 1.00 MiB\n");
  EXPECT_EQ(d.find("traced"), std::string::npos) << d;
  r.traced_non_model = 3 * MiB / 2;
  EXPECT_CONTAINS(describe(r), "traced device peak besides model state: 1.50 MiB");
  // Without a policy only the allocators' figures are known.
  r.policy = MemoryPolicy::none;
  EXPECT_EQ(describe(r),
            "memory (policy none): device peak 9.00 MiB (10.00 MiB reserved) of 16.00 MiB, host peak 0 B (0 B "
            "reserved) of unlimited, nvme peak 0 B of unlimited\n");
}

}  // namespace
}  // namespace loom
