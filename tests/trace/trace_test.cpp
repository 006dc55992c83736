#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "loom/core.h"
#include "loom/trace.h"

namespace loom {
namespace {

void busy(std::chrono::microseconds d) { std::this_thread::sleep_for(d); }

// One traced step: a compute span holding a communication span, a gap, then
// an optimizer span.
TraceRecorder record_one_step() {
  TraceRecorder rec;
  {
    TraceStep step(&rec, 2);
    busy(std::chrono::microseconds(300));
    {
      TraceScope compute(TraceCategory::compute, "h.0", " forward");
      busy(std::chrono::microseconds(200));
      TraceScope comm(TraceCategory::communication, "all_reduce", 2);
      busy(std::chrono::microseconds(200));
    }
    busy(std::chrono::microseconds(300));
    TraceScope opt(TraceCategory::optimizer, "update");
    busy(std::chrono::microseconds(200));
  }
  return rec;
}

TEST(Trace, SpansNestInsideTheirStep) {
  const TraceRecorder rec = record_one_step();
  const auto& s = rec.spans();
  ASSERT_EQ(s.size(), 4u);
  EXPECT_EQ(s[0].name, "step 2");
  EXPECT_EQ(s[1].name, "h.0 forward");
  EXPECT_EQ(s[2].name, "all_reduce (2)");
  EXPECT_EQ(s[3].name, "update");
  EXPECT_EQ(s[0].depth, 0);
  EXPECT_EQ(s[1].depth, 1);
  EXPECT_EQ(s[2].depth, 2);
  EXPECT_EQ(s[3].depth, 1);
  for (size_t i = 1; i < s.size(); ++i) {
    EXPECT_GE(s[i].begin_ns, s[0].begin_ns);
    EXPECT_LE(s[i].end_ns, s[0].end_ns);
  }
  EXPECT_GE(s[2].begin_ns, s[1].begin_ns);
  EXPECT_LE(s[2].end_ns, s[1].end_ns);
  EXPECT_GE(s[3].begin_ns, s[1].end_ns);
}

TEST(Trace, DisabledTracerRecordsNothing) {
  TraceRecorder rec;
  {
    // No traced step: scopes see no recorder.
    TraceScope compute(TraceCategory::compute, "h.0", " forward");
    TraceStep untraced(nullptr, 1);
    TraceScope comm(TraceCategory::communication, "all_reduce", 2);
  }
  EXPECT_TRUE(rec.spans().empty());
  // After a traced step the thread records nothing more.
  rec = record_one_step();
  const size_t n = rec.spans().size();
  { TraceScope after(TraceCategory::compute, "late"); }
  EXPECT_EQ(rec.spans().size(), n);
}

TEST(Trace, ChromeJsonTilesEachStepWithIdle) {
  const TraceRecorder r0 = record_one_step();
  const TraceRecorder r1 = record_one_step();
  const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json({r0.spans(), r1.spans()}));
  EXPECT_EQ(trace.at("displayTimeUnit"), "ms");
  const nlohmann::json& events = trace.at("traceEvents");
  for (int pid : {0, 1}) {
    bool named = false;
    double step_ts = -1, step_dur = 0, children = 0, idle = 0;
    for (const nlohmann::json& e : events) {
      if (e.at("pid") != pid) continue;
      if (e.at("ph") == "M" && e.at("name") == "process_name") {
        EXPECT_EQ(e.at("args").at("name"), str("rank ", pid));
        named = true;
      }
      if (e.at("ph") != "X") continue;
      for (const char* key : {"name", "cat", "ts", "dur", "tid"}) EXPECT_TRUE(e.contains(key)) << key;
      if (e.at("cat") == "step") {
        step_ts = e.at("ts").get<double>();
        step_dur = e.at("dur").get<double>();
      }
      if (e.at("args").at("depth") == 1) {
        children += e.at("dur").get<double>();
        if (e.at("cat") == "idle") idle += e.at("dur").get<double>();
        EXPECT_GE(e.at("ts").get<double>(), step_ts);
      }
    }
    EXPECT_TRUE(named);
    ASSERT_GT(step_dur, 0);
    EXPECT_NEAR(children, step_dur, 1e-6 * step_dur);
    // The two gaps (before the compute span and before the update) are idle.
    EXPECT_GE(idle, 500.0);
  }
}

TEST(Trace, StepsParse) {
  const TraceSteps range = TraceSteps::parse("2-4").value();
  EXPECT_EQ(range.first, 2);
  EXPECT_EQ(range.last, 4);
  EXPECT_FALSE(range.contains(1));
  EXPECT_TRUE(range.contains(4));
  EXPECT_FALSE(range.contains(5));
  const TraceSteps one = TraceSteps::parse("3").value();
  EXPECT_TRUE(one.contains(3));
  EXPECT_FALSE(one.contains(4));
  for (const char* bad : {"", "x", "0", "4-2", "2-", "-3", "2-4-6", "1.5"})
    EXPECT_FALSE(TraceSteps::parse(bad).has_value()) << bad;
}

}  // namespace
}  // namespace loom
