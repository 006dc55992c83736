// The predicted step as a Chrome trace (predict_step_trace, `loom plan
// --trace`): parsed back from its JSON, every rank's step span is the
// predicted step time, its direct children tile it, each category's time is
// the prediction's split, and the spans are named as a measured trace names
// the same work.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "loom/planner.h"

namespace loom {
namespace {

// A machine with known figures: GEMMs at half of a 1e12 peak, copies at
// 1e11 B/s, collectives as rings over one link.
MachineRates hand_built_rates() {
  MachineRates r;
  r.description = "hand-built";
  r.peak_flops_fp32 = 1e12;
  r.peak_flops_bf16 = 4e12;
  r.gemm_efficiency = 0.5;
  r.memory_bytes_per_s = 1e11;
  r.device_memory_bytes = 1e12;
  r.ranks_per_node = 8;
  r.intra_node = {1e-5, 1e10};
  r.inter_node = {1e-5, 1e9};
  return r;
}

// True when `s` is a run of one or more decimal digits.
bool all_digits(std::string_view s) {
  return !s.empty() && s.find_first_not_of("0123456789") == std::string_view::npos;
}

// A compute span is "<module> forward|backward" with module embedding, h.<i>
// or head (std::regex is avoided: GCC 12 warns inside it under -O2 with
// sanitizers).
bool is_compute_name(std::string_view name) {
  const size_t space = name.rfind(' ');
  if (space == std::string_view::npos) return false;
  const std::string_view module = name.substr(0, space), pass = name.substr(space + 1);
  if (pass != "forward" && pass != "backward") return false;
  if (module == "embedding" || module == "head") return true;
  return module.starts_with("h.") && all_digits(module.substr(2));
}

// A collective span is "<op> (<bytes>)".
bool is_communication_name(std::string_view name) {
  const size_t open = name.find(" (");
  if (open == std::string_view::npos || !name.ends_with(')')) return false;
  const std::string_view op = name.substr(0, open);
  if (op != "all_reduce" && op != "reduce_scatter" && op != "all_gather" && op != "recv") {
    return false;
  }
  return all_digits(name.substr(open + 2, name.size() - open - 3));
}

MachineRates h100() { return load_machine_rates(LOOM_SOURCE_DIR "/hardware/h100-sxm.json"); }

LayoutProblem problem() {
  GPTConfig m;
  m.n_layer = 4;
  m.n_head = 4;
  m.n_embd = 64;
  m.vocab_size = 256;
  m.block_size = 64;
  return LayoutProblem{.model = m, .global_batch = 16, .seq_len = 64};
}

struct Event {
  std::string name, cat;
  double ts = 0, dur = 0;
  int depth = 0;
  double end() const { return ts + dur; }
};

// The trace's "X" events per pid, in file order, and each pid's name.
struct Trace {
  std::map<int, std::vector<Event>> events;
  std::map<int, std::string> names;
};

Trace parse(const std::string& json) {
  Trace t;
  const nlohmann::json j = nlohmann::json::parse(json);
  for (const nlohmann::json& e : j.at("traceEvents")) {
    const int pid = e.at("pid").get<int>();
    if (e.at("ph") == "M" && e.at("name") == "process_name") t.names[pid] = e.at("args").at("name").get<std::string>();
    if (e.at("ph") != "X") continue;
    t.events[pid].push_back({e.at("name").get<std::string>(), e.at("cat").get<std::string>(), e.at("ts").get<double>(),
                             e.at("dur").get<double>(), e.at("args").at("depth").get<int>()});
  }
  return t;
}

bool is_recv(const Event& e) { return e.name.rfind("recv (", 0) == 0; }

// Seconds per part of the prediction's split on one rank: a span's own time
// (less the spans inside it) by category, with the pipeline's receives and
// idle time as the bubble.
std::map<std::string, double> split_of(const std::vector<Event>& events) {
  std::map<std::string, double> split;
  std::vector<const Event*> open;  // the last span seen at each depth
  for (const Event& e : events) {
    open.resize(static_cast<size_t>(e.depth));
    open.push_back(&e);
    if (e.depth == 0) continue;
    const std::string part = e.cat == "idle" || is_recv(e) ? "bubble" : e.cat;
    split[part] += e.dur * 1e-6;
    const Event& parent = *open[static_cast<size_t>(e.depth - 1)];
    if (parent.depth >= 1) split[is_recv(parent) ? "bubble" : parent.cat] -= e.dur * 1e-6;
  }
  return split;
}

// Everything the trace of any layout holds to, checked on `t`, the trace
// parsed.
void check_trace(const LayoutProblem& pr, const Layout& l, const MachineRates& rates, const StepMemoryOptions& o,
                 Trace& t) {
  const PredictedTrace predicted = predict_step_trace(pr, l, o, rates);
  const StepTimePrediction p = predict_step_time(pr, l, o, rates);
  const bool offloads = l.memory_policy != MemoryPolicy::none;
  EXPECT_EQ(predicted.prediction.step_s, p.step_s);
  t = parse(predicted.json());
  const int64_t world = l.dp * l.tp * l.pp;
  EXPECT_EQ(static_cast<int64_t>(t.events.size()), world);
  EXPECT_EQ(static_cast<int64_t>(t.names.size()), world);
  const double step_us = p.step_s * 1e6, tolerance = 1e-9 * step_us;
  for (int rank = 0; rank < world; ++rank) {
    SCOPED_TRACE(testing::Message() << "rank " << rank);
    EXPECT_EQ(t.names.at(rank), "rank " + std::to_string(rank));
    const std::vector<Event>& events = t.events.at(rank);
    ASSERT_FALSE(events.empty());
    // One step span of the predicted step time, from 0.
    const Event& step = events.front();
    EXPECT_EQ(step.depth, 0);
    EXPECT_EQ(step.cat, "step");
    EXPECT_EQ(step.name, "step 1");
    EXPECT_EQ(step.ts, 0.0);
    EXPECT_NEAR(step.dur, step_us, 1e-12 * step_us);
    // Its direct children tile it, end to end.
    double at = step.ts, sum = 0;
    for (const Event& e : events) {
      EXPECT_GE(e.depth, 0);
      EXPECT_LE(e.depth, 2);
      if (e.depth == 0) {
        EXPECT_EQ(&e, &step) << "one step span";
        continue;
      }
      if (e.depth == 2) continue;
      EXPECT_NEAR(e.ts, at, tolerance) << e.name;
      at = e.end();
      sum += e.dur;
    }
    EXPECT_NEAR(at, step.end(), tolerance);
    EXPECT_NEAR(sum, step.dur, tolerance);
    // Collectives nest inside the module that issues them.
    const Event* parent = nullptr;
    for (const Event& e : events) {
      if (e.depth == 1) parent = &e;
      if (e.depth != 2) continue;
      ASSERT_NE(parent, nullptr);
      EXPECT_EQ(parent->cat, "compute") << e.name;
      EXPECT_EQ(e.cat, "communication");
      EXPECT_GE(e.ts, parent->ts - tolerance);
      EXPECT_LE(e.end(), parent->end() + tolerance);
    }
    // The measured trace's names.
    for (const Event& e : events) {
      if (e.cat == "compute") {
        EXPECT_TRUE(is_compute_name(e.name)) << e.name;
      }
      if (e.cat == "communication") {
        EXPECT_TRUE(is_communication_name(e.name)) << e.name;
      }
      if (e.cat == "optimizer") {
        EXPECT_TRUE(e.name == "gradient check" || e.name == "clip and update") << e.name;
      }
      if (!offloads) {
        EXPECT_NE(e.cat, "transfer");
      } else if (e.cat == "transfer") {
        EXPECT_TRUE(e.name == "chunk move" || e.name == "nvme read") << e.name;
      }
      EXPECT_NE(e.cat, "data");
    }
    // The optimizer ends the step (the update's exposed moves, if any,
    // between its two spans).
    std::vector<const Event*> direct;
    for (const Event& e : events)
      if (e.depth == 1 && e.cat != "transfer") direct.push_back(&e);
    ASSERT_GE(direct.size(), 2u);
    EXPECT_EQ(direct[direct.size() - 2]->name, "gradient check");
    EXPECT_EQ(direct.back()->name, "clip and update");
  }
  // The busiest pipeline stage's ranks spend the step as the prediction
  // splits it.
  const size_t busiest = static_cast<size_t>(std::max_element(p.pipeline.busy_s.begin(), p.pipeline.busy_s.end()) -
                                             p.pipeline.busy_s.begin());
  for (int64_t r = 0; r < l.dp * l.tp; ++r) {
    const int rank = static_cast<int>(static_cast<int64_t>(busiest) * l.dp * l.tp + r);
    SCOPED_TRACE(testing::Message() << "busiest stage's rank " << rank);
    std::map<std::string, double> split = split_of(t.events.at(rank));
    EXPECT_NEAR(split["compute"], p.compute_s, 1e-9 * p.step_s);
    EXPECT_NEAR(split["communication"], p.communication_s, 1e-9 * p.step_s);
    EXPECT_NEAR(split["bubble"], p.bubble_s, 1e-9 * p.step_s);
    EXPECT_NEAR(split["optimizer"], p.optimizer_s, 1e-9 * p.step_s);
    if (offloads) {
      EXPECT_NEAR(split["transfer"], p.transfer_s, 1e-9 * p.step_s);
    } else {
      EXPECT_EQ(split.count("transfer"), 0u);
    }
  }
  // Ranks of one pipeline stage play one role.
  for (int64_t rank = 0; rank < world; ++rank) {
    const int64_t first = rank / (l.dp * l.tp) * (l.dp * l.tp);
    const std::vector<Event>&a = t.events.at(static_cast<int>(rank)), &b = t.events.at(static_cast<int>(first));
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].name, b[i].name);
  }
}

Trace check_trace(const LayoutProblem& pr, const Layout& l, const MachineRates& rates,
                  const StepMemoryOptions& o = {.precision = DType::f32, .bucket_bytes = 1 << 20, .memory = {}}) {
  Trace t;
  check_trace(pr, l, rates, o, t);
  return t;
}

// The names of one rank's spans at `depth` of category `cat`, in order.
std::vector<std::string> names(const Trace& t, int rank, const std::string& cat, int depth) {
  std::vector<std::string> out;
  for (const Event& e : t.events.at(rank))
    if (e.cat == cat && e.depth == depth) out.push_back(e.name);
  return out;
}

// Each micro-batch's forward through the modules, then its backward in
// reverse (the Trainer's loop without a pipeline).
std::vector<std::string> sequential_modules(int micro_batches) {
  const std::vector<std::string> modules = {"embedding", "h.0", "h.1", "h.2", "h.3", "head"};
  std::vector<std::string> out;
  for (int mb = 0; mb < micro_batches; ++mb) {
    for (const std::string& m : modules) out.push_back(m + " forward");
    for (auto it = modules.rbegin(); it != modules.rend(); ++it) out.push_back(*it + " backward");
  }
  return out;
}

TEST(StepTrace, SingleRankRunsEachMicroBatchForwardThenBackward) {
  for (const MachineRates& rates : {hand_built_rates(), h100()}) {
    SCOPED_TRACE(rates.description);
    const Trace t = check_trace(problem(), Layout{.micro_batch = 4}, rates);
    EXPECT_EQ(names(t, 0, "compute", 1), sequential_modules(4));
    EXPECT_TRUE(names(t, 0, "communication", 1).empty());
    EXPECT_TRUE(names(t, 0, "communication", 2).empty());
    EXPECT_TRUE(names(t, 0, "idle", 1).empty());
  }
}

TEST(StepTrace, DataParallelZero1GathersFirstAndReducesAfterTheBackward) {
  for (const MachineRates& rates : {hand_built_rates(), h100()}) {
    SCOPED_TRACE(rates.description);
    const Layout l{.dp = 2, .micro_batch = 4, .zero_stage = 1};
    const Trace t = check_trace(problem(), l, rates);
    for (int rank : {0, 1}) {
      const std::vector<Event>& events = t.events.at(rank);
      EXPECT_EQ(events[1].name, "all_gather (2)");  // after the step span
      EXPECT_EQ(names(t, rank, "communication", 1),
                (std::vector<std::string>{"all_gather (2)", "reduce_scatter (2)"}));
      EXPECT_EQ(names(t, rank, "compute", 1), sequential_modules(2));
    }
    // ZeRO-0 all-reduces instead, and gathers nothing.
    const Trace plain = check_trace(problem(), Layout{.dp = 2, .micro_batch = 4}, rates);
    EXPECT_EQ(names(plain, 0, "communication", 1), std::vector<std::string>{"all_reduce (2)"});
  }
}

TEST(StepTrace, Zero3GathersBeforeEveryForwardAndBackward) {
  const Trace t = check_trace(problem(), Layout{.dp = 2, .micro_batch = 4, .zero_stage = 3}, hand_built_rates());
  std::vector<std::string> direct;
  for (const Event& e : t.events.at(0))
    if (e.depth == 1 && (e.cat == "communication" || e.name == "embedding forward" || e.name == "head backward"))
      direct.push_back(e.name);
  EXPECT_EQ(direct, (std::vector<std::string>{"all_gather (2)", "embedding forward", "all_gather (2)", "head backward",
                                              "all_gather (2)", "embedding forward", "all_gather (2)", "head backward",
                                              "reduce_scatter (2)"}));
}

TEST(StepTrace, TensorParallelCollectivesSitInsideTheirModules) {
  for (bool sp : {false, true}) {
    SCOPED_TRACE(sp ? "sequence parallel" : "tensor parallel");
    const Layout l{.tp = 2, .sequence_parallel = sp, .micro_batch = 4};
    const Trace t = check_trace(problem(), l, hand_built_rates());
    // Per block, forward and backward: two all-reduces, or with sequence
    // parallelism two all-gather and reduce-scatter pairs forward, and
    // backward each half's input gathered again before the pair. The
    // collectives `loom train` issues, as its trace shows them (trace.path).
    const std::vector<std::string> block =
        sp ? std::vector<std::string>{"all_gather (2)", "reduce_scatter (2)", "all_gather (2)", "reduce_scatter (2)"}
           : std::vector<std::string>{"all_reduce (2)", "all_reduce (2)"};
    const std::vector<std::string> block_backward =
        sp ? std::vector<std::string>{"all_gather (2)", "all_gather (2)", "reduce_scatter (2)",
                                      "all_gather (2)", "all_gather (2)", "reduce_scatter (2)"}
           : block;
    std::map<std::string, std::vector<std::string>> inside;  // module span -> its collectives (first micro-batch)
    std::string module;
    std::set<std::string> seen;
    for (const Event& e : t.events.at(1)) {
      if (e.depth == 1) module = seen.insert(e.name).second ? e.name : "";
      if (e.depth == 2 && !module.empty()) inside[module].push_back(e.name);
    }
    for (const char* m : {"h.0 forward", "h.3 forward"}) EXPECT_EQ(inside[m], block) << m;
    for (const char* m : {"h.0 backward", "h.3 backward"}) EXPECT_EQ(inside[m], block_backward) << m;
    // The embedding's rows summed (sp: scattered to the ranks' tokens, their
    // gradients gathered back); the head's input gathered (sp) and the
    // cross-entropy's two all-reduces, its input gradient summed (sp:
    // scattered).
    using Names = std::vector<std::string>;
    EXPECT_EQ(inside["embedding forward"], Names{sp ? "reduce_scatter (2)" : "all_reduce (2)"});
    EXPECT_EQ(inside["embedding backward"], sp ? Names{"all_gather (2)"} : Names{});
    EXPECT_EQ(inside["head forward"], sp ? (Names{"all_gather (2)", "all_reduce (2)", "all_reduce (2)"})
                                         : (Names{"all_reduce (2)", "all_reduce (2)"}));
    EXPECT_EQ(inside["head backward"], Names{sp ? "reduce_scatter (2)" : "all_reduce (2)"});
    // Sequence parallelism leaves the norms' and the row-parallel biases'
    // gradients partial: summed over the tp ranks after the pipeline.
    EXPECT_EQ(names(t, 0, "communication", 1), sp ? Names{"all_reduce (2)"} : Names{});
  }
}

TEST(StepTrace, PipelineRanksRunTheirStagesAndWaitForTheirNeighbours) {
  LayoutProblem pr = problem();
  pr.global_batch = 8;
  for (const Layout& l : {Layout{.pp = 2, .micro_batch = 1},
                          Layout{.pp = 2, .schedule = PipelineSchedule::interleaved_1f1b, .virtual_stages = 2,
                                 .micro_batch = 1}}) {
    SCOPED_TRACE(pipeline_schedule_name(l.schedule));
    const Trace t = check_trace(pr, l, hand_built_rates());
    // Each stage's modules: one layer per virtual stage when interleaved.
    const std::vector<std::set<std::string>> modules =
        l.virtual_stages == 1 ? std::vector<std::set<std::string>>{{"embedding", "h.0", "h.1"}, {"h.2", "h.3", "head"}}
                              : std::vector<std::set<std::string>>{{"embedding", "h.0", "h.2"}, {"h.1", "h.3", "head"}};
    for (int rank : {0, 1}) {
      std::map<std::string, int> count;
      for (const std::string& n : names(t, rank, "compute", 1)) ++count[n];
      std::set<std::string> held;
      for (const auto& [name, n] : count) {
        EXPECT_EQ(n, 8) << name;  // once per micro-batch
        held.insert(name.substr(0, name.find(' ')));
      }
      EXPECT_EQ(held, modules[static_cast<size_t>(rank)]);
    }
    // The second stage waits for the first one's activation before its
    // first forward: idle, then the transfer.
    const std::vector<Event>& later = t.events.at(1);
    EXPECT_EQ(later[1].cat, "idle");
    EXPECT_EQ(later[2].name, "recv (2)");
    EXPECT_EQ(later[3].name, l.virtual_stages == 1 ? "h.2 forward" : "h.1 forward");
    // The first stage receives the gradients coming back, then sums the
    // tied embedding's gradient with the last stage's copy.
    std::vector<std::string> comm = names(t, 0, "communication", 1);
    ASSERT_GT(comm.size(), 1u);
    EXPECT_EQ(comm.back(), "all_reduce (2)");
    comm.pop_back();
    for (const std::string& n : comm) EXPECT_EQ(n, "recv (2)");
  }
}

TEST(StepTrace, GridCollectivesAreOverTheGridsGroups) {
  // 2D: a 2 x 2 grid, every collective over a row or column of 2.
  const Trace two_d =
      check_trace(problem(), Layout{.tp = 4, .tp_mode = TensorParallelMode::two_d, .micro_batch = 4}, hand_built_rates());
  std::set<std::string> comm;
  for (const Event& e : two_d.events.at(3))
    if (e.cat == "communication") comm.insert(e.name);
  EXPECT_EQ(comm, (std::set<std::string>{"all_gather (2)", "reduce_scatter (2)", "all_reduce (2)"}));
  // 2.5D: a 2 x 2 grid in two layers sums the matrices' gradients over the
  // depth after the pipeline, and the norms', biases' and positions' over
  // the 4 ranks of a token group.
  const Trace depth = check_trace(
      problem(), Layout{.tp = 8, .tp_mode = TensorParallelMode::two_and_half_d, .tp_depth = 2, .micro_batch = 4},
      hand_built_rates());
  std::vector<std::string> after = names(depth, 5, "communication", 1);
  EXPECT_EQ(after, (std::vector<std::string>{"all_reduce (2)", "all_reduce (4)"}));
}

// A memory policy's exposed moves between tiers show where their phase
// ends, as transfer spans named as the chunk manager names its moves: the
// forward and backward's after the last backward, the update's between the
// gradient check and the update. Here every parameter and half the
// optimizer state is off the device and nothing is prefetched, so every
// phase waits for its copies, and on NVMe for its reads too.
TEST(StepTrace, OffloadedStateMovesAreTransferSpansWhereTheirPhaseEnds) {
  MachineRates rates = hand_built_rates();
  rates.host_device = {1e-6, 1e10};
  rates.nvme_read_bytes_per_s = 2e9;
  rates.nvme_write_bytes_per_s = 1e9;
  const Layout l{.micro_batch = 4, .memory_policy = MemoryPolicy::fixed};
  for (bool nvme : {false, true}) {
    SCOPED_TRACE(nvme ? "nvme" : "host");
    StepMemoryOptions o{.precision = DType::f32, .bucket_bytes = 1 << 20, .memory = {}};
    o.memory.policy = MemoryPolicy::fixed;
    o.memory.offload_param_frac = 1.0;
    o.memory.offload_optim_frac = 0.5;
    o.memory.prefetch = 0;
    // Only the directory's existence is checked: nothing runs.
    if (nvme) o.memory.nvme_dir = std::filesystem::temp_directory_path();
    StepPieces pieces;
    const StepTimePrediction p = predict_step_time(problem(), l, o, rates, &pieces);
    EXPECT_GT(pieces.model_moves.copy_s, 0.0);
    EXPECT_GT(pieces.update_moves.copy_s, 0.0);
    EXPECT_EQ(pieces.model_moves.disk_s > 0.0, nvme);
    EXPECT_NEAR(pieces.model_moves.total() + pieces.update_moves.total(), p.transfer_s, 1e-12 * p.step_s);

    const Trace t = check_trace(problem(), l, rates, o);
    std::vector<const Event*> direct;
    for (const Event& e : t.events.at(0))
      if (e.depth == 1) direct.push_back(&e);
    const auto check = std::find_if(direct.begin(), direct.end(),
                                    [](const Event* e) { return e->name == "gradient check"; });
    ASSERT_NE(check, direct.end());
    const size_t at = static_cast<size_t>(check - direct.begin());
    std::vector<std::string> around;
    for (size_t i = at - (nvme ? 3 : 2); i < direct.size(); ++i) around.push_back(direct[i]->name);
    std::vector<std::string> expected{"embedding backward", "chunk move"};
    if (nvme) expected.push_back("nvme read");
    expected.insert(expected.end(), {"gradient check", "chunk move"});
    if (pieces.update_moves.disk_s > 0.0) expected.push_back("nvme read");
    expected.push_back("clip and update");
    EXPECT_EQ(around, expected);
    EXPECT_NEAR(direct[at - (nvme ? 2 : 1)]->dur, pieces.model_moves.copy_s * 1e6, 1e-9 * p.step_s * 1e6);
    EXPECT_NEAR(direct[at + 1]->dur, pieces.update_moves.copy_s * 1e6, 1e-9 * p.step_s * 1e6);
  }
}

}  // namespace
}  // namespace loom
