#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "loom/parallel.h"
#include "loom/planner.h"
#include "test_util.h"

namespace loom {
namespace {

using Kind = PipelineAction::Kind;

struct ScheduleCase {
  PipelineSchedule schedule;
  int stages;
  int micro_batches;
  int chunks;
};

std::string describe(const ScheduleCase& l) {
  return str(pipeline_schedule_name(l.schedule), " stages ", l.stages, " micro-batches ", l.micro_batches, " chunks ",
             l.chunks);
}

// Every layout the schedules must handle, including the edge cases of a
// single stage, a single micro-batch and fewer micro-batches than stages.
std::vector<ScheduleCase> layouts() {
  std::vector<ScheduleCase> all;
  for (int stages : {1, 2, 3, 4, 8})
    for (int m = 1; m <= 3 * stages; ++m) {
      all.push_back({PipelineSchedule::gpipe, stages, m, 1});
      all.push_back({PipelineSchedule::one_f_one_b, stages, m, 1});
    }
  for (int stages : {2, 3, 4, 8})
    for (int chunks : {2, 3, 4})
      for (int m = stages; m <= 4 * stages; m += stages)
        all.push_back({PipelineSchedule::interleaved_1f1b, stages, m, chunks});
  return all;
}

// "F0 F1 B0 ..." (chunk 0) or "F1.0 ..." (chunk.micro-batch) for messages.
std::string format(const std::vector<PipelineAction>& actions) {
  std::string text;
  for (const PipelineAction& a : actions)
    text += str(text.empty() ? "" : " ", a.kind == Kind::forward ? "F" : "B", a.chunk == 0 ? "" : str(a.chunk, "."),
                a.micro_batch);
  return text;
}

std::vector<PipelineAction> parse(const std::string& text) {
  std::vector<PipelineAction> actions;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find(' ', begin), text.size());
    const std::string item = text.substr(begin + 1, end - begin - 1);
    const size_t dot = item.find('.');
    const Kind kind = text[begin] == 'F' ? Kind::forward : Kind::backward;
    if (dot == std::string::npos)
      actions.push_back({kind, 0, std::stoi(item)});
    else
      actions.push_back({kind, std::stoi(item.substr(0, dot)), std::stoi(item.substr(dot + 1))});
    begin = end + 1;
  }
  return actions;
}

TEST(PipelineSchedule, NamesRoundTripAndUnknownNamesListTheKnownOnes) {
  for (PipelineSchedule s :
       {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved_1f1b})
    EXPECT_EQ(parse_pipeline_schedule(pipeline_schedule_name(s)), s);
  EXPECT_STREQ(pipeline_schedule_name(PipelineSchedule::one_f_one_b), "1f1b");
  const std::string m = testing::error_of([] { parse_pipeline_schedule("pipedream"); });
  EXPECT_CONTAINS(m, "unknown pipeline schedule 'pipedream'");
  EXPECT_CONTAINS(m, "gpipe, 1f1b or interleaved_1f1b");
}

TEST(PipelineSchedule, EveryUnitRunsOnceForwardsBeforeBackwardsInMicroBatchOrder) {
  for (const ScheduleCase& l : layouts())
    for (int stage = 0; stage < l.stages; ++stage) {
      const std::vector<PipelineAction> actions =
          pipeline_actions(l.schedule, l.stages, stage, l.micro_batches, l.chunks);
      const std::string where = str(describe(l), " stage ", stage, ": ", format(actions));
      ASSERT_EQ(actions.size(), 2u * static_cast<size_t>(l.chunks * l.micro_batches)) << where;
      // next[kind][chunk]: the micro-batch whose action of that kind is due next.
      std::vector<std::vector<int>> next(2, std::vector<int>(static_cast<size_t>(l.chunks), 0));
      std::vector<std::vector<bool>> forwarded(static_cast<size_t>(l.chunks),
                                               std::vector<bool>(static_cast<size_t>(l.micro_batches), false));
      for (const PipelineAction& a : actions) {
        ASSERT_TRUE(a.chunk >= 0 && a.chunk < l.chunks) << where;
        int& due = next[a.kind == Kind::forward ? 0 : 1][static_cast<size_t>(a.chunk)];
        ASSERT_EQ(a.micro_batch, due) << where;
        ++due;
        std::vector<bool>::reference seen = forwarded[static_cast<size_t>(a.chunk)][static_cast<size_t>(a.micro_batch)];
        if (a.kind == Kind::forward)
          seen = true;
        else
          ASSERT_TRUE(seen) << "backward before its forward: " << where;
      }
      for (const std::vector<int>& per_kind : next)
        for (int count : per_kind) EXPECT_EQ(count, l.micro_batches) << where;
    }
}

TEST(PipelineSchedule, OneFOneBKeepsAtMostStagesMinusStageMicroBatchesInFlight) {
  for (const ScheduleCase& l : layouts()) {
    if (l.schedule != PipelineSchedule::one_f_one_b) continue;
    for (int stage = 0; stage < l.stages; ++stage) {
      int in_flight = 0, most = 0;
      for (const PipelineAction& a : pipeline_actions(l.schedule, l.stages, stage, l.micro_batches, 1)) {
        in_flight += a.kind == Kind::forward ? 1 : -1;
        most = std::max(most, in_flight);
      }
      EXPECT_EQ(most, std::min(l.stages - stage, l.micro_batches)) << describe(l) << " stage " << stage;
    }
  }
}

TEST(PipelineSchedule, ExactOrders) {
  EXPECT_EQ(format(pipeline_actions(PipelineSchedule::gpipe, 4, 2, 3, 1)), "F0 F1 F2 B0 B1 B2");
  // Warm-up of stages - 1 forwards, five forward-backward pairs, three backwards.
  const std::vector<PipelineAction> first = pipeline_actions(PipelineSchedule::one_f_one_b, 4, 0, 8, 1);
  EXPECT_EQ(first, parse("F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7")) << format(first);
  EXPECT_EQ(format(pipeline_actions(PipelineSchedule::one_f_one_b, 4, 3, 3, 1)), "F0 B0 F1 B1 F2 B2");
  // Megatron's interleaving, 2 ranks, 2 chunks, 4 micro-batches: rank 0 warms
  // up with 2 * (2 - 0 - 1) + (2 - 1) * 2 = 4 forwards, rank 1 with 2.
  const std::vector<PipelineAction> rank0 = pipeline_actions(PipelineSchedule::interleaved_1f1b, 2, 0, 4, 2);
  EXPECT_EQ(rank0, parse("F0 F1 F1.0 F1.1 F2 B1.0 F3 B1.1 F1.2 B0 F1.3 B1 B1.2 B1.3 B2 B3")) << format(rank0);
  const std::vector<PipelineAction> rank1 = pipeline_actions(PipelineSchedule::interleaved_1f1b, 2, 1, 4, 2);
  EXPECT_EQ(rank1, parse("F0 F1 F1.0 B1.0 F1.1 B1.1 F2 B0 F3 B1 F1.2 B1.2 F1.3 B1.3 B2 B3")) << format(rank1);
  // A single group of micro-batches (micro-batches == stages) warms up with
  // every forward, as Megatron does.
  const std::vector<PipelineAction> single = pipeline_actions(PipelineSchedule::interleaved_1f1b, 2, 1, 2, 2);
  EXPECT_EQ(single, parse("F0 F1 F1.0 F1.1 B1.0 B1.1 B0 B1")) << format(single);
}

// The planner's simulate_pipeline runs every rank's actions in order as soon
// as each action's input exists: what run_pipeline does with asynchronous
// sends and receives that block in action order.
PipelineTimeline simulate(const ScheduleCase& l, double forward_time, double backward_time) {
  const size_t V = static_cast<size_t>(l.stages * l.chunks);
  return simulate_pipeline(l.schedule, l.stages, l.micro_batches, l.chunks,
                           PipelineCosts{std::vector<double>(V, forward_time), std::vector<double>(V, backward_time)});
}

// With forward time 1 and backward time 2 per chunk, every rank of every
// layout finishes, and each rank idles for exactly the textbook bubble of the
// step: (p-1)/(m+p-1) for gpipe and 1f1b, where every rank waits p - 1
// forwards before its first and p - 1 backwards after its last; and for
// interleaving with v chunks (p-1)/(v m + p - 1), since a rank waits for p - 1
// chunk forwards and backwards, each 1/v of a stage's.
TEST(PipelineSchedule, SimulatedStepsFinishWithTheTextbookBubble) {
  for (const ScheduleCase& l : layouts()) {
    const PipelineTimeline sim = simulate(l, 1, 2);
    ASSERT_TRUE(sim.completed) << "deadlock: " << describe(l);
    const int64_t p = l.stages, m = l.micro_batches, v = l.chunks;
    const int64_t steps = l.schedule == PipelineSchedule::interleaved_1f1b ? v * m + p - 1 : m + p - 1;
    for (int s = 0; s < l.stages; ++s) {
      // Whole numbers of time units: exact in doubles.
      const double idle = sim.makespan_s - sim.busy_s[static_cast<size_t>(s)];
      // idle / makespan == (p - 1) / steps, exactly.
      EXPECT_EQ(idle * static_cast<double>(steps), sim.makespan_s * static_cast<double>(p - 1))
          << describe(l) << " stage " << s << ": idle " << idle << " of " << sim.makespan_s;
    }
  }
  // The same work per rank (2 chunks at half the time each) idles less when
  // interleaved: 3/19 of the step against 3/11.
  const PipelineTimeline plain = simulate({PipelineSchedule::one_f_one_b, 4, 8, 1}, 2, 4);
  const PipelineTimeline interleaved = simulate({PipelineSchedule::interleaved_1f1b, 4, 8, 2}, 1, 2);
  EXPECT_EQ(plain.busy_s[0], interleaved.busy_s[0]);
  EXPECT_EQ(plain.makespan_s, 66);
  EXPECT_EQ(interleaved.makespan_s, 57);
}

}  // namespace
}  // namespace loom

namespace loom {
namespace {

// Forward-only evaluation of an interleaved model runs gpipe over its chunks:
// every forward of chunk 0, then of chunk 1; the backwards in reverse.
TEST(PipelineSchedule, GpipeOverSeveralChunksRunsThemInOrder) {
  using K = PipelineAction::Kind;
  const std::vector<PipelineAction> expected = {{K::forward, 0, 0},  {K::forward, 0, 1},  {K::forward, 1, 0},
                                                {K::forward, 1, 1},  {K::backward, 1, 0}, {K::backward, 1, 1},
                                                {K::backward, 0, 0}, {K::backward, 0, 1}};
  EXPECT_EQ(pipeline_actions(PipelineSchedule::gpipe, 2, 1, 2, 2), expected);
}

}  // namespace
}  // namespace loom
