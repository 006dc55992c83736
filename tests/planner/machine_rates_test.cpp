// MachineRates: pricing GEMMs and collectives, the rates file (calibrations
// and the shipped hardware descriptions), and a small real calibration.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "loom/io.h"
#include "loom/planner.h"
#include "test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;

// A rate that is a power law of the shape, which log-space interpolation
// reproduces exactly between grid points.
double power_law_rate(int64_t m, int64_t n, int64_t k) {
  return 1e9 * std::pow(static_cast<double>(m), 0.3) * std::pow(static_cast<double>(n), 0.2) *
         std::pow(static_cast<double>(k), 0.1);
}

MachineRates synthetic() {
  MachineRates r;
  r.description = "synthetic";
  for (int64_t m : {64, 1024})
    for (int64_t n : {64, 512, 4096})
      for (int64_t k : {128, 2048}) r.gemm.push_back({m, n, k, power_law_rate(m, n, k)});
  r.peak_flops_fp32 = 5e11;
  r.memory_bytes_per_s = 2e10;
  r.device_memory_bytes = 1e10;
  r.ranks_per_node = 4;
  r.intra_node = {1e-6, 1e10};
  r.inter_node = {5e-6, 1e9};
  r.collectives.push_back({Collective::all_reduce, 2, {2e-6, 4e9}});
  return r;
}

TEST(MachineRates, GemmTimeInterpolatesInLogSpaceAndClampsToTheGrid) {
  const MachineRates r = synthetic();
  auto flops = [](double m, double n, double k) { return 2 * m * n * k; };
  // On the grid and between its points (a power law is linear in log space).
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{64, 512, 128}, {256, 100, 700}, {1000, 4000, 2000}})
    EXPECT_NEAR(r.gemm_seconds(m, n, k) / (flops(m, n, k) / power_law_rate(m, n, k)), 1.0, 1e-9) << m << " " << n;
  // Beyond the grid a product runs at the rate of the nearest edge.
  EXPECT_NEAR(r.gemm_seconds(8192, 8192, 8192) / (flops(8192, 8192, 8192) / power_law_rate(1024, 4096, 2048)), 1.0,
              1e-9);
  EXPECT_NEAR(r.gemm_seconds(1, 1, 1) / (flops(1, 1, 1) / power_law_rate(64, 64, 128)), 1.0, 1e-9);
  // Without samples (a hardware file): peak times efficiency.
  MachineRates hw = r;
  hw.gemm.clear();
  hw.gemm_efficiency = 0.5;
  EXPECT_DOUBLE_EQ(hw.gemm_seconds(100, 200, 300), flops(100, 200, 300) / 2.5e11);
}

// A rank on t threads is priced by the samples measured at the thread count
// nearest t (by ratio; 0 asks for all of them). Samples without a count
// (older calibrations) stand for the machine's threads.
TEST(MachineRates, GemmTimeUsesTheSamplesOfTheNearestThreadCount) {
  MachineRates r;
  r.threads = 4;
  for (int threads : {1, 4})
    for (int64_t m : {64, 1024})
      for (int64_t n : {64, 1024})
        for (int64_t k : {64, 1024}) r.gemm.push_back({m, n, k, 1e9 * threads, threads});
  const double flops = 2.0 * 100 * 200 * 300;
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300, DType::f32, 1) * 1e9 / flops, 1.0, 1e-12);
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300, DType::f32, 4) * 4e9 / flops, 1.0, 1e-12);
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300) * 4e9 / flops, 1.0, 1e-12);
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300, DType::f32, 3) * 4e9 / flops, 1.0, 1e-12);  // 4/3 is nearer than 3
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300, DType::f32, 2) * 1e9 / flops, 1.0, 1e-12);  // a tie goes to the fewer
  for (GemmSample& g : r.gemm)
    if (g.threads == 4) g.threads = 0;
  EXPECT_NEAR(r.gemm_seconds(100, 200, 300, DType::f32, 4) * 4e9 / flops, 1.0, 1e-12);
}

TEST(MachineRates, AttentionTimeIsMeasuredOrPricedAtItsProductsRate) {
  MachineRates r = synthetic();
  // Without measurements: 2 T^2 hs flops at the (T, T, hs) GEMM's rate,
  // 2.5 times that backward.
  const double forward = r.attention_seconds(256, 64, false);
  EXPECT_NEAR(forward / r.gemm_seconds(256, 256, 64), 1.0, 1e-12);
  EXPECT_NEAR(r.attention_seconds(256, 64, true) / forward, 2.5, 1e-12);
  // Measured: the sample's time at a grid point; between points, a rate that
  // is a power law of the shape is reproduced exactly.
  auto time = [](int64_t T, int64_t hs, double rate) { return 2.0 * T * T * hs / rate; };
  auto rate = [](int64_t T, int64_t hs) { return 1e8 * std::pow(double(T), 0.5) * std::pow(double(hs), 0.25); };
  for (int64_t T : {64, 1024})
    for (int64_t hs : {32, 128}) r.attention.push_back({T, hs, time(T, hs, rate(T, hs)), 3 * time(T, hs, rate(T, hs))});
  EXPECT_NEAR(r.attention_seconds(64, 128, false) / time(64, 128, rate(64, 128)), 1.0, 1e-12);
  EXPECT_NEAR(r.attention_seconds(300, 50, false) / time(300, 50, rate(300, 50)), 1.0, 1e-9);
  EXPECT_NEAR(r.attention_seconds(300, 50, true) / (3 * time(300, 50, rate(300, 50))), 1.0, 1e-9);
}

TEST(MachineRates, CollectivesUseTheMeasuredFitElseARingOverTheRightLink) {
  const MachineRates r = synthetic();
  const auto ranks = RankGroup::consecutive;
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::all_reduce, 1e6, ranks(2)), 2e-6 + 1e6 / 4e9);
  EXPECT_EQ(r.collective_seconds(Collective::all_reduce, 1e6, ranks(1)), 0.0);
  // Not measured on 4 ranks: a ring on the intra-node link.
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::all_reduce, 1e6, ranks(4)), 2 * 3 * (1e-6 + 0.25e6 / 1e10));
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::all_gather, 1e6, ranks(4)), 3 * (1e-6 + 0.25e6 / 1e10));
  // Past a node: the inter-node link.
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::reduce_scatter, 8e6, ranks(8)), 7 * (5e-6 + 1e6 / 1e9));
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::send_recv, 1e6, ranks(8)), 5e-6 + 1e6 / 1e9);
  // Measured messages: the measurement with the nearest number of ranks.
  MachineRates m = r;
  m.collectives = {{Collective::send_recv, 2, {1e-6, 1e10}}, {Collective::send_recv, 4, {1e-3, 5e9}}};
  EXPECT_DOUBLE_EQ(m.collective_seconds(Collective::send_recv, 1e6, ranks(2)), 1e-6 + 1e6 / 1e10);
  EXPECT_DOUBLE_EQ(m.collective_seconds(Collective::send_recv, 1e6, ranks(3)), 1e-6 + 1e6 / 1e10);
  EXPECT_DOUBLE_EQ(m.collective_seconds(Collective::send_recv, 1e6, ranks(8)), 1e-3 + 1e6 / 5e9);
}

// The link follows where a group's ranks sit, not how many there are: on
// nodes of 4, two ranks 4 apart (a data-parallel pair under tp 4) cross
// nodes, and a column of a 2 x 2 grid (2 ranks 2 apart) does not; a block
// that does not divide the node (3 ranks) crosses it somewhere.
TEST(MachineRates, ALinkIsChosenByWhereTheGroupsRanksSit) {
  MachineRates r = synthetic();
  r.collectives.clear();
  EXPECT_TRUE(r.within_node(RankGroup::strided(2, 2)));
  EXPECT_FALSE(r.within_node(RankGroup::strided(2, 4)));
  EXPECT_FALSE(r.within_node(RankGroup::consecutive(3)));
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::all_reduce, 1e6, RankGroup::strided(2, 2)),
                   2 * (1e-6 + 0.5e6 / 1e10));
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::all_reduce, 1e6, RankGroup::strided(2, 4)),
                   2 * (5e-6 + 0.5e6 / 1e9));
  // A pipeline pair dp * tp = 2 ranks apart among 8 exchanging at once.
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::send_recv, 1e6, {8, 4}), 1e-6 + 1e6 / 1e10);
  EXPECT_DOUBLE_EQ(r.collective_seconds(Collective::send_recv, 1e6, {8, 8}), 5e-6 + 1e6 / 1e9);
}

TEST(MachineRates, FileRoundTripsEveryField) {
  testing::TempDir dir;
  MachineRates r = synthetic();
  r.peak_flops_bf16 = 1e12;
  r.gemm_efficiency = 0.9;
  r.host_device = {1e-5, 3e10};
  r.nvme_read_bytes_per_s = 2e9;
  r.nvme_write_bytes_per_s = 1e9;
  r.collectives.push_back({Collective::send_recv, 2, {0.0, 7e9}});
  r.attention = {{64, 32, 1e-5, 3e-5}, {64, 64, 2e-5, 5e-5}, {256, 32, 1e-4, 3e-4}, {256, 64, 2e-4, 6e-4}};
  save_machine_rates(r, dir.path() / "rates.json");
  const MachineRates back = load_machine_rates(dir.path() / "rates.json");
  EXPECT_EQ(back.description, r.description);
  ASSERT_EQ(back.gemm.size(), r.gemm.size());
  for (size_t i = 0; i < r.gemm.size(); ++i) {
    EXPECT_EQ(back.gemm[i].m, r.gemm[i].m);
    EXPECT_EQ(back.gemm[i].flops_per_s, r.gemm[i].flops_per_s);
  }
  ASSERT_EQ(back.attention.size(), 4u);
  EXPECT_EQ(back.attention[3].seq_len, 256);
  EXPECT_EQ(back.attention[3].backward_s, 6e-4);
  ASSERT_EQ(back.collectives.size(), 2u);
  EXPECT_EQ(back.collectives[1].op, Collective::send_recv);
  EXPECT_EQ(back.collectives[1].cost.bytes_per_s, 7e9);
  EXPECT_EQ(back.peak_flops_bf16, 1e12);
  EXPECT_EQ(back.gemm_efficiency, 0.9);
  EXPECT_EQ(back.host_device.bytes_per_s, 3e10);
  EXPECT_EQ(back.nvme_write_bytes_per_s, 1e9);
  EXPECT_EQ(back.inter_node.latency_s, 5e-6);
  EXPECT_EQ(back.ranks_per_node, 4);
}

TEST(MachineRates, ShippedHardwareFilesLoad) {
  int files = 0;
  for (const fs::directory_entry& e : fs::directory_iterator(LOOM_SOURCE_DIR "/hardware")) {
    SCOPED_TRACE(e.path().string());
    const MachineRates r = load_machine_rates(e.path());
    EXPECT_GT(r.peak_flops_bf16, r.peak_flops_fp32);
    EXPECT_GT(r.intra_node.bytes_per_s, r.inter_node.bytes_per_s);
    EXPECT_TRUE(r.gemm.empty());
    ++files;
  }
  EXPECT_GE(files, 5);
}

TEST(MachineRates, BadFilesNameTheFileAndTheField) {
  testing::TempDir dir;
  const fs::path good = dir.path() / "good.json";
  save_machine_rates(synthetic(), good);
  const std::string text = read_file(good);
  auto error_with = [&](const std::string& from, const std::string& to) {
    const fs::path bad = dir.path() / "bad.json";
    std::string edited = text;
    const size_t at = edited.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    edited.replace(at, from.size(), to);
    write_file_atomic(bad, edited);
    return error_of([&] { load_machine_rates(bad); });
  };
  std::string e = error_with("\"memory_bytes_per_s\"", "\"memory_bytes_per_sec\"");
  EXPECT_NE(e.find("bad.json: memory_bytes_per_s is missing"), std::string::npos) << e;
  e = error_with("\"ranks_per_node\": 4", "\"ranks_per_node\": 4, \"ranks_per_nod\": 4");
  EXPECT_NE(e.find("ranks_per_nod is not a known field"), std::string::npos) << e;
  e = error_with("\"op\": \"all_reduce\"", "\"op\": \"allreduce\"");
  EXPECT_NE(e.find("collectives[0].op 'allreduce' is not all_reduce"), std::string::npos) << e;
  e = error_with("\"bytes_per_s\": 10000000000.0", "\"bytes_per_s\": -1");
  EXPECT_NE(e.find("intra_node.bytes_per_s must be a positive number"), std::string::npos) << e;
  e = error_with("\"description\"", "\"description\": 1, \"x\"");
  EXPECT_NE(e.find("description must be a string"), std::string::npos) << e;
  e = error_with("{", "[");
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  MachineRates holey_attention = synthetic();
  holey_attention.attention = {{64, 32, 1e-5, 3e-5}, {64, 64, 2e-5, 5e-5}, {256, 32, 1e-4, 3e-4}};
  save_machine_rates(holey_attention, dir.path() / "attention.json");
  e = error_of([&] { load_machine_rates(dir.path() / "attention.json"); });
  EXPECT_NE(e.find("attention must hold each (seq_len, head_dim) of a full grid"), std::string::npos) << e;
  // A grid with a corner missing cannot be interpolated.
  MachineRates holed = synthetic();
  holed.gemm.pop_back();
  save_machine_rates(holed, dir.path() / "holed.json");
  e = error_of([&] { load_machine_rates(dir.path() / "holed.json"); });
  EXPECT_NE(e.find("gemm must hold each (m, n, k) of a full grid exactly once"), std::string::npos) << e;
}

TEST(Calibration, MeasuresEveryRateOnASmallGrid) {
  CalibrationOptions o;
  o.gemm_sizes = {16, 64};
  o.attention_seq_lens = {16, 64};
  o.attention_head_dims = {8, 16};
  o.groups = {2};
  o.memory_bytes = 1 << 20;
  o.threads = {1, 2};
  std::vector<std::string> lines;
  o.progress = [&](const std::string& line) { lines.push_back(line); };
  const MachineRates r = calibrate_machine(o);
  ASSERT_EQ(r.gemm.size(), 16u);  // each shape on 1 and on 2 threads
  for (const GemmSample& g : r.gemm) {
    EXPECT_GT(g.flops_per_s, 0.0);
    EXPECT_TRUE(g.threads == 1 || g.threads == 2);
  }
  EXPECT_EQ(r.threads, omp_get_max_threads());
  EXPECT_GT(r.peak_flops_fp32, 0.0);
  EXPECT_GT(r.memory_bytes_per_s, 0.0);
  EXPECT_GT(r.device_memory_bytes, 0.0);
  ASSERT_EQ(r.collectives.size(), 4u);
  for (const CollectiveCost& c : r.collectives) {
    EXPECT_EQ(c.group, 2);
    EXPECT_GT(c.cost.bytes_per_s, 0.0);
    EXPECT_GE(c.cost.latency_s, 0.0);
  }
  EXPECT_GT(r.intra_node.bytes_per_s, 0.0);
  ASSERT_EQ(r.attention.size(), 8u);
  for (const AttentionSample& a : r.attention) {
    EXPECT_GT(a.forward_s, 0.0);
    EXPECT_GT(a.backward_s, 0.0);
  }
  // gemm and attention on each thread count, memory, collectives; and a
  // warning when the machine was busy as it began.
  const auto warnings = std::count_if(lines.begin(), lines.end(),
                                      [](const std::string& l) { return l.starts_with("warning: the CPUs were"); });
  EXPECT_EQ(lines.size() - static_cast<size_t>(warnings), 6u);
  // One thread is measured with a copy on every thread at once, as local
  // ranks of one thread each run.
  const std::string one_thread = str("gemm on 1 thread, ", omp_get_max_threads(), " at once: 8 shapes");
  if (omp_get_max_threads() >= 2) {
    EXPECT_TRUE(std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return l.starts_with(one_thread); }))
        << one_thread;
  }
  // What calibrate measured, the planner reads back.
  testing::TempDir dir;
  save_machine_rates(r, dir.path() / "c.json");
  const MachineRates back = load_machine_rates(dir.path() / "c.json");
  EXPECT_EQ(back.gemm.size(), 16u);
  EXPECT_EQ(back.threads, r.threads);
  EXPECT_EQ(back.gemm_seconds(64, 64, 64, DType::f32, 1), r.gemm_seconds(64, 64, 64, DType::f32, 1));
}

}  // namespace
}  // namespace loom
