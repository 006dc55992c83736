// The pipeline's timeline from its actions: every rank runs
// pipeline_actions in order, each action as soon as the rank is free and its
// input (the previous virtual stage's activation, or the next one's
// gradient) has arrived. This is what run_pipeline does with asynchronous
// sends and receives that block in action order, so the idle time it leaves
// is the schedule's bubble for the given costs.
#include <algorithm>

#include "loom/planner.h"

namespace loom {

PipelineTimeline simulate_pipeline(PipelineSchedule schedule, int stages, int micro_batches, int chunks,
                                   const PipelineCosts& costs) {
  using Kind = PipelineAction::Kind;
  const int V = stages * chunks;
  LOOM_CHECK(static_cast<int>(costs.forward_s.size()) == V && static_cast<int>(costs.backward_s.size()) == V,
             "pipeline costs for ", costs.forward_s.size(), " virtual stages, expected ", V);
  std::vector<std::vector<PipelineAction>> actions;
  for (int s = 0; s < stages; ++s) actions.push_back(pipeline_actions(schedule, stages, s, micro_batches, chunks));
  // When each (kind, virtual stage, micro-batch) finished; negative until then.
  std::vector<double> finished(static_cast<size_t>(2 * V * micro_batches), -1.0);
  auto finish = [&](Kind kind, int virtual_stage, int mb) -> double& {
    return finished[static_cast<size_t>(((kind == Kind::forward ? 0 : 1) * V + virtual_stage) * micro_batches + mb)];
  };
  std::vector<size_t> next(static_cast<size_t>(stages), 0);
  std::vector<double> clock(static_cast<size_t>(stages), 0.0);
  PipelineTimeline timeline;
  timeline.busy_s.assign(static_cast<size_t>(stages), 0.0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < stages; ++s) {
      const auto r = static_cast<size_t>(s);
      for (; next[r] < actions[r].size(); ++next[r]) {
        const PipelineAction& a = actions[r][next[r]];
        const int vs = a.chunk * stages + s;
        // The input comes from another rank (consecutive virtual stages sit
        // on consecutive ranks) unless this is where the data or loss is.
        double ready = 0.0;
        bool received = false;
        if (a.kind == Kind::forward && vs > 0) {
          ready = finish(Kind::forward, vs - 1, a.micro_batch);
          received = true;
        }
        if (a.kind == Kind::backward) {
          received = vs < V - 1;
          ready = received ? finish(Kind::backward, vs + 1, a.micro_batch) : finish(Kind::forward, vs, a.micro_batch);
        }
        if (ready < 0) break;
        if (received && stages > 1) ready += costs.transfer_s;
        const double duration = (a.kind == Kind::forward ? costs.forward_s : costs.backward_s)[static_cast<size_t>(vs)];
        const double start = std::max(clock[r], ready);
        clock[r] = start + duration;
        timeline.busy_s[r] += duration;
        timeline.spans.push_back({s, a, start, clock[r]});
        finish(a.kind, vs, a.micro_batch) = clock[r];
        progress = true;
      }
    }
  }
  timeline.completed = true;
  for (int s = 0; s < stages; ++s)
    timeline.completed = timeline.completed && next[static_cast<size_t>(s)] == actions[static_cast<size_t>(s)].size();
  timeline.makespan_s = *std::max_element(clock.begin(), clock.end());
  return timeline;
}

}  // namespace loom
