#include <chrono>
#include <vector>

#include "loom/parallel.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Every receiving virtual stage has its own activation and gradient tag, so
// two ranks that exchange several chunks' tensors (and the same rank, whose
// last chunk feeds its first when there is one stage) never confuse them;
// within a tag, messages match in posting order, which both sides keep in
// micro-batch order.
int activation_tag(int virtual_stage) { return 2 * virtual_stage; }
int gradient_tag(int virtual_stage) { return 2 * virtual_stage + 1; }

// An asynchronous send and the tensor it reads, kept alive until it completes.
struct PendingSend {
  Work work;
  Tensor tensor;
};

}  // namespace

// Deadlock freedom: every send is asynchronous, so a rank blocks only in the
// receive an action needs, and waits there for an action that precedes it in
// its neighbour's order. Every schedule's orders are consistent (the
// simulation in pipeline_schedule_test runs them to completion), so the
// receives always complete. forward_only keeps the schedule's forwards in
// their order; leaving actions out only removes waits.
PipelineTiming run_pipeline(Communicator& pipeline, PipelineSchedule schedule, int micro_batches, int chunks,
                            PipelineStageWork& work, bool forward_only) {
  const int stages = pipeline.size(), stage = pipeline.rank();
  const int virtual_stages = stages * chunks;
  LOOM_CHECK(gradient_tag(virtual_stages - 1) <= kMaxTag, "a pipeline of ", virtual_stages,
             " virtual stages needs more point-to-point tags than ", kMaxTag);
  const int previous = (stage + stages - 1) % stages, next = (stage + 1) % stages;

  std::vector<PipelineAction> actions = pipeline_actions(schedule, stages, stage, micro_batches, chunks);
  if (forward_only)
    std::erase_if(actions, [](const PipelineAction& a) { return a.kind != PipelineAction::Kind::forward; });

  // The shape of each (chunk, micro-batch) output sent on: its gradient comes
  // back in the same shape.
  std::vector<Shape> output_shapes(static_cast<size_t>(chunks) * static_cast<size_t>(micro_batches));
  std::vector<PendingSend> sends;
  PipelineTiming timing;
  const Clock::time_point start = Clock::now();

  auto receive = [&](const Shape& shape, int src, int tag) {
    Tensor t = Tensor::empty(shape, DType::f32);
    const Clock::time_point blocked = Clock::now();
    pipeline.recv(t, src, tag);
    timing.idle_seconds += seconds_since(blocked);
    return t;
  };
  auto send = [&](Tensor t, int dst, int tag) {
    Work w = pipeline.send_async(t, dst, tag);
    sends.push_back({std::move(w), std::move(t)});
  };
  // Frees the tensors of delivered sends (wait() rethrows a failed one).
  auto release_delivered = [&] {
    std::erase_if(sends, [](PendingSend& s) {
      if (!s.work.done()) return false;
      s.work.wait();
      return true;
    });
  };

  for (const PipelineAction& action : actions) {
    release_delivered();
    const int c = action.chunk, mb = action.micro_batch;
    const int virtual_stage = c * stages + stage;
    const bool first = virtual_stage == 0, last = virtual_stage == virtual_stages - 1;
    Shape& output_shape =
        output_shapes[static_cast<size_t>(c) * static_cast<size_t>(micro_batches) + static_cast<size_t>(mb)];
    if (action.kind == PipelineAction::Kind::forward) {
      Tensor input = first ? Tensor() : receive(work.activation_shape(c, mb), previous, activation_tag(virtual_stage));
      Tensor output = work.forward(c, mb, input);
      if (last) continue;
      LOOM_CHECK(output.defined() && output.dtype() == DType::f32, "pipeline forward of chunk ", c, " micro-batch ", mb,
                 " returned no f32 activation to send on");
      output_shape = output.shape();
      send(std::move(output), next, activation_tag(virtual_stage + 1));
    } else {
      Tensor grad_output = last ? Tensor() : receive(output_shape, next, gradient_tag(virtual_stage));
      Tensor grad_input = work.backward(c, mb, grad_output);
      if (first) continue;
      LOOM_CHECK(grad_input.defined() && grad_input.dtype() == DType::f32, "pipeline backward of chunk ", c,
                 " micro-batch ", mb, " returned no f32 input gradient to send back");
      send(std::move(grad_input), previous, gradient_tag(virtual_stage - 1));
    }
  }

  // Waiting for a neighbour to take the last tensors is idle time too.
  const Clock::time_point blocked = Clock::now();
  for (PendingSend& s : sends) s.work.wait();
  timing.idle_seconds += seconds_since(blocked);
  timing.step_seconds = seconds_since(start);
  return timing;
}

}  // namespace loom
