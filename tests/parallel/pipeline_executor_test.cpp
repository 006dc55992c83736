#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "loom/device.h"
#include "loom/parallel.h"
#include "test_util.h"

namespace loom {
namespace {

using Kind = PipelineAction::Kind;

constexpr PipelineSchedule kSchedules[] = {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b,
                                           PipelineSchedule::interleaved_1f1b};

int chunks_of(PipelineSchedule schedule) { return schedule == PipelineSchedule::interleaved_1f1b ? 2 : 1; }

// A deadlock fails the test instead of hanging it.
CommOptions short_timeout() {
  CommOptions options;
  options.timeout = std::chrono::seconds(20);
  return options;
}

// Virtual stage k computes y = a_k x + b_k elementwise. Virtual stage 0 makes
// x from the micro-batch index; the loss is the sum of the last stage's y.
// Micro-batches alternate between two shapes, so a tensor received in the
// shape of another micro-batch fails.
double slope(int k) { return 1.0 + 0.125 * (k + 1); }
double offset(int k) { return 0.5 - 0.25 * k; }
Shape micro_batch_shape(int mb) { return {1 + mb % 2, 3}; }
double first_input(int mb, int64_t i) { return 0.5 * (mb + 1) + 0.25 * static_cast<double>(i); }

class AffineStages : public PipelineStageWork {
 public:
  AffineStages(int stages, int stage, int chunks)
      : grad_a(static_cast<size_t>(chunks), 0.0f),
        grad_b(static_cast<size_t>(chunks), 0.0f),
        stages_(stages),
        stage_(stage),
        last_(stages * chunks - 1) {}

  Shape activation_shape(int, int micro_batch) const override { return micro_batch_shape(micro_batch); }

  // Host code on device tensors, so each body is a HostSection: it must see
  // the fill and the received activations complete.
  Tensor forward(int chunk, int micro_batch, const Tensor& input) override {
    HostSection host;
    log.push_back({Kind::forward, chunk, micro_batch});
    const int k = chunk * stages_ + stage_;
    Tensor x;
    if (k == 0) {
      EXPECT_FALSE(input.defined());
      x = Tensor::empty(micro_batch_shape(micro_batch));
      for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = static_cast<float>(first_input(micro_batch, i));
    } else {
      EXPECT_EQ(input.shape(), micro_batch_shape(micro_batch)) << "virtual stage " << k;
      x = input;
    }
    inputs_[{chunk, micro_batch}] = x;
    Tensor y = Tensor::empty(x.shape());
    const float a = static_cast<float>(slope(k)), b = static_cast<float>(offset(k));
    for (int64_t i = 0; i < x.numel(); ++i) y.data<float>()[i] = a * x.data<float>()[i] + b;
    if (k != last_) return y;
    for (int64_t i = 0; i < y.numel(); ++i) loss += y.data<float>()[i];
    return Tensor();
  }

  Tensor backward(int chunk, int micro_batch, const Tensor& grad_output) override {
    HostSection host;
    log.push_back({Kind::backward, chunk, micro_batch});
    const int k = chunk * stages_ + stage_;
    const Tensor x = inputs_.at({chunk, micro_batch});
    inputs_.erase({chunk, micro_batch});
    Tensor dy;
    if (k == last_) {
      EXPECT_FALSE(grad_output.defined());
      dy = Tensor::empty(x.shape());
      dy.fill_(1.0f);
    } else {
      EXPECT_EQ(grad_output.shape(), x.shape()) << "virtual stage " << k;
      dy = grad_output;
    }
    Tensor dx = Tensor::empty(x.shape());
    const float a = static_cast<float>(slope(k));
    for (int64_t i = 0; i < x.numel(); ++i) {
      grad_a[static_cast<size_t>(chunk)] += dy.data<float>()[i] * x.data<float>()[i];
      grad_b[static_cast<size_t>(chunk)] += dy.data<float>()[i];
      dx.data<float>()[i] = a * dy.data<float>()[i];
    }
    return dx;
  }

  std::vector<PipelineAction> log;
  std::vector<float> grad_a, grad_b;  // per chunk, summed over the micro-batches
  float loss = 0.0f;

 private:
  int stages_, stage_, last_;
  std::map<std::pair<int, int>, Tensor> inputs_;
};

struct RankResult {
  std::vector<PipelineAction> log;
  std::vector<float> grad_a, grad_b;
  float loss = 0.0f;
};

std::vector<RankResult> run_affine(PipelineSchedule schedule, int stages, int micro_batches, bool forward_only) {
  std::vector<RankResult> results(static_cast<size_t>(stages));
  run_local(
      stages,
      [&](Communicator& pipeline) {
        AffineStages work(stages, pipeline.rank(), chunks_of(schedule));
        run_pipeline(pipeline, schedule, micro_batches, chunks_of(schedule), work, forward_only);
        results[static_cast<size_t>(pipeline.rank())] = {work.log, work.grad_a, work.grad_b, work.loss};
      },
      short_timeout());
  return results;
}

// The closed form over the micro-batches, in double: virtual stage k sees
// x_k = a_{k-1} x_{k-1} + b_{k-1} and its output's gradient is the product of
// the later slopes, so dL/da_k = sum dy_k x_k and dL/db_k = sum dy_k.
struct Expected {
  double grad_a = 0.0, grad_b = 0.0, loss = 0.0;
};

Expected closed_form(int virtual_stages, int micro_batches, int k) {
  double dy = 1.0;
  for (int j = k + 1; j < virtual_stages; ++j) dy *= slope(j);
  Expected e;
  for (int mb = 0; mb < micro_batches; ++mb)
    for (int64_t i = 0; i < shape_numel(micro_batch_shape(mb)); ++i) {
      double x = first_input(mb, i);
      for (int j = 0; j < k; ++j) x = slope(j) * x + offset(j);
      e.grad_a += dy * x;
      e.grad_b += dy;
      double y = x;
      for (int j = k; j < virtual_stages; ++j) y = slope(j) * y + offset(j);
      e.loss += y;
    }
  return e;
}

void expect_close(float got, double expected, const std::string& what) {
  EXPECT_NEAR(got, expected, 1e-5 * std::max(1.0, std::fabs(expected))) << what;
}

TEST(RunPipeline, GradientsMatchTheClosedFormOnEverySchedule) {
  for (PipelineSchedule schedule : kSchedules)
    for (int stages : {2, 4})
      for (int micro_batches : {stages, 2 * stages, 3 * stages}) {
        const int chunks = chunks_of(schedule);
        const std::string layout =
            str(pipeline_schedule_name(schedule), " stages ", stages, " micro-batches ", micro_batches);
        const std::vector<RankResult> results = run_affine(schedule, stages, micro_batches, false);
        for (int s = 0; s < stages; ++s) {
          const RankResult& r = results[static_cast<size_t>(s)];
          EXPECT_EQ(r.log, pipeline_actions(schedule, stages, s, micro_batches, chunks)) << layout << " rank " << s;
          for (int c = 0; c < chunks; ++c) {
            const int k = c * stages + s;
            const Expected e = closed_form(stages * chunks, micro_batches, k);
            const std::string where = str(layout, " virtual stage ", k);
            expect_close(r.grad_a[static_cast<size_t>(c)], e.grad_a, "d/da " + where);
            expect_close(r.grad_b[static_cast<size_t>(c)], e.grad_b, "d/db " + where);
          }
        }
        expect_close(results.back().loss, closed_form(stages * chunks, micro_batches, 0).loss, "loss " + layout);

        const std::vector<RankResult> again = run_affine(schedule, stages, micro_batches, false);
        for (size_t s = 0; s < results.size(); ++s) {
          EXPECT_TRUE(testing::bit_equal(results[s].grad_a, again[s].grad_a)) << layout << " rank " << s;
          EXPECT_TRUE(testing::bit_equal(results[s].grad_b, again[s].grad_b)) << layout << " rank " << s;
        }
      }
}

TEST(RunPipeline, ForwardOnlyRunsTheSchedulesForwardsAndNoBackward) {
  for (PipelineSchedule schedule : kSchedules) {
    const int stages = 4, micro_batches = 8, chunks = chunks_of(schedule);
    const std::vector<RankResult> results = run_affine(schedule, stages, micro_batches, true);
    for (int s = 0; s < stages; ++s) {
      std::vector<PipelineAction> forwards = pipeline_actions(schedule, stages, s, micro_batches, chunks);
      std::erase_if(forwards, [](const PipelineAction& a) { return a.kind == Kind::backward; });
      const RankResult& r = results[static_cast<size_t>(s)];
      EXPECT_EQ(r.log, forwards) << pipeline_schedule_name(schedule) << " rank " << s;
      for (float g : r.grad_a) EXPECT_EQ(g, 0.0f);
    }
    expect_close(results.back().loss, closed_form(stages * chunks, micro_batches, 0).loss,
                 str("loss ", pipeline_schedule_name(schedule)));
  }
}

// Compute that takes wall time but no CPU, so ranks as threads on a shared
// two-core machine keep the timing of ranks on their own devices.
class SleepingStages : public PipelineStageWork {
 public:
  SleepingStages(int stages, int stage, int chunks, std::chrono::microseconds forward_time)
      : stages_(stages), stage_(stage), last_(stages * chunks - 1), forward_time_(forward_time) {}

  Shape activation_shape(int, int) const override { return {1}; }
  Tensor forward(int chunk, int, const Tensor&) override {
    std::this_thread::sleep_for(forward_time_);
    return chunk * stages_ + stage_ == last_ ? Tensor() : Tensor::zeros({1});
  }
  Tensor backward(int, int, const Tensor&) override {
    std::this_thread::sleep_for(2 * forward_time_);
    return Tensor::zeros({1});
  }

 private:
  int stages_, stage_, last_;
  std::chrono::microseconds forward_time_;
};

struct MeasuredBubble {
  double first_step = 0.0;  // mean over the ranks
  double steady = 0.0;      // mean over the ranks and the later steps
};

// Consecutive steps, as a training loop runs them. The first step alone shows
// less than the bubble: a rank that finishes early (stage s, s backwards
// before the first stage) spends the rest of the pipeline's step idle in the
// next step's first receive, which only later steps measure.
MeasuredBubble measure_bubble(PipelineSchedule schedule, int stages, int micro_batches, int chunks,
                              std::chrono::microseconds forward_time) {
  constexpr int kSteps = 3;
  std::vector<std::vector<double>> fractions(static_cast<size_t>(stages));
  run_local(
      stages,
      [&](Communicator& pipeline) {
        SleepingStages work(stages, pipeline.rank(), chunks, forward_time);
        for (int step = 0; step < kSteps; ++step)
          fractions[static_cast<size_t>(pipeline.rank())].push_back(
              run_pipeline(pipeline, schedule, micro_batches, chunks, work).bubble_fraction());
      },
      short_timeout());
  MeasuredBubble m;
  for (const std::vector<double>& rank : fractions) {
    m.first_step += rank[0] / stages;
    for (int step = 1; step < kSteps; ++step) m.steady += rank[static_cast<size_t>(step)] / (stages * (kSteps - 1));
  }
  return m;
}

TEST(RunPipeline, MeasuredBubbleIsTheTextbookFraction) {
  const int p = 4, m = 8;
  // Long enough that a late wake-up on a loaded machine (ctest runs other
  // suites alongside) is a few percent of a unit of work, not a fifth.
  const std::chrono::microseconds forward(40000);
  const double textbook = static_cast<double>(p - 1) / (m + p - 1);
  const double interleaved_textbook = static_cast<double>(p - 1) / (2 * m + p - 1);
  const MeasuredBubble gpipe = measure_bubble(PipelineSchedule::gpipe, p, m, 1, forward);
  const MeasuredBubble one_f_one_b = measure_bubble(PipelineSchedule::one_f_one_b, p, m, 1, forward);
  const MeasuredBubble interleaved = measure_bubble(PipelineSchedule::interleaved_1f1b, p, m, 2, forward / 2);
  std::printf("pipeline bubble, p=%d m=%d, forward %lld ms backward %lld ms per stage, mean over ranks:\n", p, m,
              static_cast<long long>(forward.count() / 1000), static_cast<long long>(2 * forward.count() / 1000));
  std::printf("  gpipe             %.3f (first step %.3f), textbook %.3f\n", gpipe.steady, gpipe.first_step, textbook);
  std::printf("  1f1b              %.3f (first step %.3f), textbook %.3f\n", one_f_one_b.steady, one_f_one_b.first_step,
              textbook);
  std::printf("  interleaved_1f1b  %.3f (first step %.3f), textbook %.3f (2 chunks)\n", interleaved.steady,
              interleaved.first_step, interleaved_textbook);
  EXPECT_NEAR(one_f_one_b.steady / textbook, 1.0, 0.2);
  EXPECT_NEAR(gpipe.steady / textbook, 1.0, 0.2);
  EXPECT_LT(interleaved.steady, one_f_one_b.steady);
}

}  // namespace
}  // namespace loom
