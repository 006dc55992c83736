#include <algorithm>

#include "loom/parallel.h"

namespace loom {

namespace {

constexpr PipelineSchedule kSchedules[] = {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
                                           PipelineSchedule::interleaved_1f1b};

using Kind = PipelineAction::Kind;

// With several chunks per rank (forward-only evaluation of an interleaved
// model) the forwards run chunk by chunk and the backwards in reverse.
std::vector<PipelineAction> gpipe_actions(int micro_batches, int chunks) {
  std::vector<PipelineAction> actions;
  for (int c = 0; c < chunks; ++c)
    for (int mb = 0; mb < micro_batches; ++mb) actions.push_back({Kind::forward, c, mb});
  for (int c = chunks; c-- > 0;)
    for (int mb = 0; mb < micro_batches; ++mb) actions.push_back({Kind::backward, c, mb});
  return actions;
}

// The warm-up, steady state and cool-down every 1F1B variant shares, over
// `units` forward and backward units; forward(k) and backward(k) name the
// k-th of each.
template <typename Forward, typename Backward>
std::vector<PipelineAction> one_f_one_b_order(int units, int warmup, Forward forward, Backward backward) {
  std::vector<PipelineAction> actions;
  for (int k = 0; k < warmup; ++k) actions.push_back(forward(k));
  for (int k = 0; k < units - warmup; ++k) {
    actions.push_back(forward(warmup + k));
    actions.push_back(backward(k));
  }
  for (int k = units - warmup; k < units; ++k) actions.push_back(backward(k));
  return actions;
}

// Megatron-LM's forward_backward_pipelining_without_interleaving: stage s
// starts stages - s - 1 micro-batches ahead, so the last stage turns each
// forward around at once and no stage holds more than stages - s in flight.
std::vector<PipelineAction> one_f_one_b_actions(int stages, int stage, int micro_batches) {
  const int warmup = std::min(stages - stage - 1, micro_batches);
  return one_f_one_b_order(
      micro_batches, warmup, [](int k) { return PipelineAction{Kind::forward, 0, k}; },
      [](int k) { return PipelineAction{Kind::backward, 0, k}; });
}

// Megatron-LM's forward_backward_pipelining_with_interleaving. The
// micro-batches run in groups of `stages`: a rank runs a group through chunk
// 0, then chunk 1, ..., before the next group, and the backwards through the
// chunks in reverse. Warm-up is two forwards per downstream stage (a forward
// and the backward it enables take a round trip) plus a full pass of the
// other chunks; Megatron warms up with every forward when there is a single
// group, and so does this.
std::vector<PipelineAction> interleaved_actions(int stages, int stage, int micro_batches, int chunks) {
  const int units = micro_batches * chunks;
  const int warmup =
      micro_batches == stages ? units : std::min((stages - stage - 1) * 2 + (chunks - 1) * stages, units);
  auto micro_batch = [&](int k) { return k / (stages * chunks) * stages + k % stages; };
  auto chunk = [&](int k) { return k / stages % chunks; };
  return one_f_one_b_order(
      units, warmup, [&](int k) { return PipelineAction{Kind::forward, chunk(k), micro_batch(k)}; },
      [&](int k) { return PipelineAction{Kind::backward, chunks - 1 - chunk(k), micro_batch(k)}; });
}

}  // namespace

const char* pipeline_schedule_name(PipelineSchedule schedule) {
  switch (schedule) {
    case PipelineSchedule::gpipe: return "gpipe";
    case PipelineSchedule::one_f_one_b: return "1f1b";
    case PipelineSchedule::interleaved_1f1b: return "interleaved_1f1b";
  }
  LOOM_CHECK(false, "unknown pipeline schedule");
}

PipelineSchedule parse_pipeline_schedule(std::string_view name) {
  for (PipelineSchedule schedule : kSchedules)
    if (name == pipeline_schedule_name(schedule)) return schedule;
  throw Error(str("unknown pipeline schedule '", name, "': use gpipe, 1f1b or interleaved_1f1b"));
}

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int micro_batches,
                                             int chunks) {
  LOOM_CHECK(stages >= 1 && stage >= 0 && stage < stages, "pipeline stage ", stage, " of ", stages);
  LOOM_CHECK(micro_batches >= 1, "pipeline of ", micro_batches, " micro-batches");
  switch (schedule) {
    case PipelineSchedule::gpipe:
      LOOM_CHECK(chunks >= 1, "gpipe with ", chunks, " chunks per rank");
      return gpipe_actions(micro_batches, chunks);
    case PipelineSchedule::one_f_one_b:
      LOOM_CHECK(chunks == 1, "1f1b runs one chunk per rank, not ", chunks);
      return one_f_one_b_actions(stages, stage, micro_batches);
    case PipelineSchedule::interleaved_1f1b:
      LOOM_CHECK(chunks >= 2, "interleaved_1f1b needs at least 2 chunks per rank, not ", chunks);
      LOOM_CHECK(micro_batches % stages == 0, "interleaved_1f1b needs micro-batches (", micro_batches,
                 ") to be a multiple of the stages (", stages, ")");
      return interleaved_actions(stages, stage, micro_batches, chunks);
  }
  LOOM_CHECK(false, "unknown pipeline schedule");
}

}  // namespace loom
