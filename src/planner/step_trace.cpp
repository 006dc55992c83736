// The predicted step as a timeline (`loom plan --trace`): the pieces the time
// model sums (StepPieces), placed where the step runs them and named as a
// measured trace names the same work (TraceScope's call sites: the modules'
// "<group> forward" / "<group> backward", the collectives' "<op> (<n>)", the
// pipeline's receives, the optimizer's two spans, the chunk manager's moves
// between tiers), so that a predicted and a measured trace open side by side.
#include <algorithm>
#include <cmath>
#include <map>
#include <tuple>

#include "loom/planner.h"

namespace loom {

namespace {

using Kind = PipelineAction::Kind;

// One rank's spans with their times in seconds from the step's start; each
// boundary is one double, shared by the spans that meet there, so that they
// meet in ticks too.
struct Span {
  std::string name;
  TraceCategory category;
  double begin_s, end_s;
  int depth;
};

std::string collective_span_name(const PredictedCollective& c) { return str(collective_name(c.op), " (", c.group, ")"); }

// A module's span from `begin` to `end`, with its collectives inside in the
// order it issues them and its compute spread evenly around them (the model
// prices a module's compute as a whole, not what runs between its
// collectives).
void add_module(std::vector<Span>& out, const PredictedModule& m, const char* pass, double begin, double end) {
  out.push_back({str(m.name, pass), TraceCategory::compute, begin, end, 1});
  const double gap = m.compute_s / static_cast<double>(m.collectives.size() + 1);
  double t = begin;
  for (const PredictedCollective& c : m.collectives) {
    t += gap;
    const double from = std::min(t, end);
    t += c.seconds;
    out.push_back({collective_span_name(c), TraceCategory::communication, from, std::min(t, end), 2});
  }
}

// One pipeline action's modules, back to back from `begin`, the last ending
// at `end` (the action's length is their sum).
void add_action(std::vector<Span>& out, const std::vector<PredictedModule>& modules, Kind kind, double begin,
                double end) {
  const char* pass = kind == Kind::forward ? " forward" : " backward";
  double t = begin;
  for (size_t i = 0; i < modules.size(); ++i) {
    const PredictedModule& m = modules[i];
    const double next = i + 1 == modules.size() ? end : std::min(end, t + m.compute_s + m.communication_s);
    add_module(out, m, pass, t, next);
    t = next;
  }
}

// A phase's exposed moves between tiers from `t` on, which they advance:
// the model sums a phase's moves rather than placing each, so they show
// where the phase ends, one span per resource that any time is exposed on.
void add_moves(std::vector<Span>& out, const TransferSeconds& moves, double& t) {
  for (const auto& [name, seconds] : {std::pair{"chunk move", moves.copy_s}, std::pair{"nvme read", moves.disk_s}}) {
    if (seconds <= 0.0) continue;
    out.push_back({name, TraceCategory::transfer, t, t + seconds, 1});
    t += seconds;
  }
}

// A pipeline action as a rank runs it: when, and how long.
struct Placed {
  PipelineAction action;
  double start_s, end_s;
};

// The order a rank without a pipeline runs its micro-batches in: the
// Trainer's loop (each micro-batch's forward, then its backward), or, with
// a model-parallel mesh, run_pipeline's order for one stage.
std::vector<PipelineAction> single_stage_order(const Layout& layout, int micro_batches) {
  if (layout.tp > 1)
    return pipeline_actions(layout.schedule, 1, 0, micro_batches, static_cast<int>(layout.virtual_stages));
  std::vector<PipelineAction> order;
  for (int mb = 0; mb < micro_batches; ++mb) {
    order.push_back({Kind::forward, 0, mb});
    order.push_back({Kind::backward, 0, mb});
  }
  return order;
}

}  // namespace

PredictedTrace predict_step_trace(const LayoutProblem& problem, const Layout& layout,
                                  const StepMemoryOptions& options, const MachineRates& rates) {
  PredictedTrace trace;
  StepPieces pieces;
  trace.prediction = predict_step_time(problem, layout, options, rates, &pieces);
  const StepTimePrediction& p = trace.prediction;
  const int pp = static_cast<int>(layout.pp);
  const int micro_batches = static_cast<int>(problem.global_batch / (layout.dp * layout.micro_batch));
  LOOM_CHECK(pp == 1 || !pieces.pass_gather, "ZeRO-3's gathers with a pipeline of ", pp, " stages");

  std::vector<std::vector<Span>> stages(static_cast<size_t>(pp));
  for (int stage = 0; stage < pp; ++stage) {
    std::vector<Span>& out = stages[static_cast<size_t>(stage)];
    double t = 0.0;
    if (pieces.step_gather) {
      const double end = pieces.step_gather->seconds;
      out.push_back({collective_span_name(*pieces.step_gather), TraceCategory::communication, t, end, 1});
      t = end;
    }
    const double pipeline_start = t;

    // The rank's actions where the simulation puts them; without a pipeline,
    // one after the other in the order the rank runs them, each after its
    // ZeRO-3 gather.
    std::vector<Placed> placed;
    for (const PipelineTimeline::Span& s : p.pipeline.spans)
      if (s.rank == stage) placed.push_back({s.action, pipeline_start + s.start_s, pipeline_start + s.end_s});
    double pipeline_end = pipeline_start + p.pipeline.makespan_s;
    if (pp == 1) {
      std::map<std::tuple<int, int, int>, double> length;
      for (const Placed& a : placed)
        length[{static_cast<int>(a.action.kind), a.action.chunk, a.action.micro_batch}] = a.end_s - a.start_s;
      placed.clear();
      for (const PipelineAction& a : single_stage_order(layout, micro_batches)) {
        if (pieces.pass_gather) t += pieces.pass_gather->seconds;
        const double end = t + length.at({static_cast<int>(a.kind), a.chunk, a.micro_batch});
        placed.push_back({a, t, end});
        t = end;
      }
      pipeline_end = t;
    }

    // A wait before an action is for its input: the neighbour's work, then
    // the message in flight for the transfer's last seconds.
    double free_at = pipeline_start;
    for (const Placed& a : placed) {
      if (pieces.pass_gather)
        out.push_back({collective_span_name(*pieces.pass_gather), TraceCategory::communication, free_at, a.start_s, 1});
      else if (a.start_s > free_at)
        out.push_back({str("recv (", pp, ")"), TraceCategory::communication,
                       std::max(free_at, a.start_s - pieces.transfer_s), a.start_s, 1});
      const int virtual_stage = a.action.chunk * pp + stage;
      add_action(out,
                 (a.action.kind == Kind::forward ? pieces.forward : pieces.backward)[static_cast<size_t>(virtual_stage)],
                 a.action.kind, a.start_s, a.end_s);
      free_at = a.end_s;
    }

    // Every rank goes on from the makespan: the gradient reductions and the
    // optimizer's norm wait for the slowest stage.
    t = pipeline_end;
    add_moves(out, pieces.model_moves, t);
    for (const PredictedCollective& c : pieces.after_pipeline) {
      const double end = t + c.seconds;
      out.push_back({collective_span_name(c), TraceCategory::communication, t, end, 1});
      t = end;
    }
    const double checked = t + pieces.gradient_check_s;
    out.push_back({"gradient check", TraceCategory::optimizer, t, checked, 1});
    t = checked;
    add_moves(out, pieces.update_moves, t);
    out.push_back({"clip and update", TraceCategory::optimizer, t, std::max(t, p.step_s), 1});
  }

  // Ticks of 1e-15 of the step: far below any piece the model prices.
  const double ticks_per_s = p.step_s > 0.0 ? 1e15 / p.step_s : 1e9;
  trace.ticks_per_us = ticks_per_s / 1e6;
  const auto tick = [&](double seconds) { return static_cast<int64_t>(std::llround(seconds * ticks_per_s)); };
  const int64_t step_end = tick(p.step_s);
  std::vector<std::vector<TraceSpan>> by_stage(static_cast<size_t>(pp));
  for (int stage = 0; stage < pp; ++stage) {
    std::vector<TraceSpan>& out = by_stage[static_cast<size_t>(stage)];
    out.push_back({"step 1", TraceCategory::step, 0, step_end, 0});
    for (const Span& s : stages[static_cast<size_t>(stage)])
      out.push_back({s.name, s.category, std::min(tick(s.begin_s), step_end), std::min(tick(s.end_s), step_end),
                     s.depth});
  }
  const int64_t world = layout.dp * layout.tp * layout.pp;
  const int64_t per_stage = layout.dp * layout.tp;
  for (int64_t r = 0; r < world; ++r) trace.ranks.push_back(by_stage[static_cast<size_t>(r / per_stage)]);
  return trace;
}

}  // namespace loom
