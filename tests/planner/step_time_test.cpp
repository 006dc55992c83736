// The time model's accounting on synthetic rates, where each piece has a
// closed form: GEMM work by shape, recompute, tensor-parallel collectives,
// the pipeline bubble, ZeRO's gathers, offloaded state's transfers, and
// parts that sum to the step.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <tuple>

#include "loom/planner.h"

namespace loom {
namespace {

// A hardware-file machine (GEMMs at a flat rate) with free memory traffic,
// so compute time is GEMM and attention work alone.
MachineRates flat_rates() {
  MachineRates r;
  r.description = "synthetic";
  r.peak_flops_fp32 = 1e12;
  r.peak_flops_bf16 = 4e12;
  r.gemm_efficiency = 0.5;
  r.memory_bytes_per_s = 1e30;
  r.device_memory_bytes = 1e12;
  r.ranks_per_node = 8;
  r.intra_node = {1e-5, 1e10};
  r.inter_node = {1e-5, 1e9};
  return r;
}

LayoutProblem problem() {
  GPTConfig m;
  m.n_layer = 4;
  m.n_head = 4;
  m.n_embd = 64;
  m.vocab_size = 256;
  m.block_size = 64;
  return LayoutProblem{.model = m, .global_batch = 8, .seq_len = 64};
}

// A step with 1 MiB gradient buckets.
StepTimePrediction predict(const LayoutProblem& pr, const Layout& l, const MachineRates& r,
                           DType precision = DType::f32) {
  return predict_step_time(pr, l, {.precision = precision, .bucket_bytes = 1 << 20, .memory = {}}, r);
}

double sum_of_parts(const StepTimePrediction& p) {
  return p.compute_s + p.communication_s + p.bubble_s + p.transfer_s + p.optimizer_s;
}

TEST(StepTime, SingleRankComputeIsTheGemmAndAttentionWork) {
  const LayoutProblem pr = problem();
  const MachineRates r = flat_rates();
  const StepTimePrediction p = predict(pr, Layout{.micro_batch = 2}, r);
  const GPTConfig& m = pr.model;
  const double N = 8.0 * 64, B = 8, T = 64, C = 64, L = 4, V = 256;
  // Each weight: 2 flops per row forward, 4 backward; the head's V x C too.
  // Causal attention: 2 B T^2 C forward, 2.5 times that backward.
  const double flops = 6.0 * N * (L * layer_matmul_weights(m) + C * V) + 7.0 * B * T * T * C * L;
  EXPECT_NEAR(p.compute_s * r.peak_flops_fp32 * r.gemm_efficiency / flops, 1.0, 1e-12);
  EXPECT_EQ(p.communication_s, 0.0);
  EXPECT_EQ(p.bubble_s, 0.0);
  EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  EXPECT_GT(p.mfu, 0.0);
  EXPECT_LT(p.mfu, 1.0);
  // bf16 GEMMs at the bf16 peak: a quarter of the time here.
  const StepTimePrediction bf16 = predict(pr, Layout{.micro_batch = 2}, r, DType::bf16);
  EXPECT_NEAR(bf16.compute_s / p.compute_s, 0.25, 1e-12);
}

// Activation checkpointing reruns each block's forward but the MLP's output
// projection (C x 4C), whose output the backward does not need.
TEST(StepTime, RecomputeAddsTheBlocksForwardButTheMlpOutput) {
  const LayoutProblem pr = problem();
  const MachineRates r = flat_rates();
  const StepTimePrediction plain = predict(pr, Layout{.micro_batch = 2}, r);
  const StepTimePrediction again =
      predict(pr, Layout{.micro_batch = 2, .recompute = true}, r);
  const double N = 8.0 * 64, B = 8, T = 64, C = 64, L = 4;
  const double block_forward =
      2.0 * N * L * (layer_matmul_weights(pr.model) - 4 * C * C) + 2.0 * B * T * T * C * L;
  EXPECT_NEAR((again.compute_s - plain.compute_s) * 0.5e12 / block_forward, 1.0, 1e-12);
}

TEST(StepTime, TensorParallelCollectivesFollowTheLayers) {
  const LayoutProblem pr = problem();
  const MachineRates r = flat_rates();
  for (bool sp : {false, true}) {
    const Layout l{.tp = 2, .sequence_parallel = sp, .micro_batch = 2};
    const StepTimePrediction p = predict(pr, l, r);
    const double rows = 2.0 * 64, act = 4.0 * rows * 64, C = 64;
    // Per block and micro-batch: forward two all-reduces, or two all-gathers
    // and two reduce-scatters; backward the same all-reduces, or for each
    // half the input gathered again, then an all-gather and a
    // reduce-scatter. The embedding's all-reduce (sp: a reduce-scatter, and
    // backward an all-gather); the head's input gradient all-reduced (sp: the
    // input gathered, its gradient reduce-scattered); the cross-entropy's
    // all-reduces of N and 2 N floats.
    const RankGroup tp = RankGroup::consecutive(2);
    const double gather = r.collective_seconds(Collective::all_gather, act, tp);
    const double scatter = r.collective_seconds(Collective::reduce_scatter, act, tp);
    const double all_reduce = r.collective_seconds(Collective::all_reduce, act, tp);
    const double block = sp ? 2 * (gather + scatter) + 2 * (2 * gather + scatter) : 4 * all_reduce;
    const double ends = sp ? 2 * (gather + scatter) : 2 * all_reduce;
    const double per_micro_batch = 4 * block + ends + r.collective_seconds(Collective::all_reduce, 4.0 * rows, tp) +
                                   r.collective_seconds(Collective::all_reduce, 8.0 * rows, tp);
    // Under sequence parallelism the norms, the row-parallel biases and the
    // positions have partial gradients, summed once a step: per layer two
    // LayerNorms' 2 C and two biases' C, the final norm's 2 C, 64 positions.
    const double partial = sp ? r.collective_seconds(Collective::all_reduce, 4.0 * (4 * 6 * C + 2 * C + 64 * C), tp) : 0.0;
    EXPECT_NEAR(p.communication_s / (4 * per_micro_batch + partial), 1.0, 1e-12) << "sp " << sp;
    EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  }
}

// On a grid, with free latency, the collectives' time is the bytes each
// rank sends (grid_linear_elements_sent, held to CommStats by
// tests/nn/grid_linear_test.cpp) over the link's rate: the block's four
// layers, the norms' statistics, the embedding's scatter and gather, the
// final norm, the head and the cross-entropy's three all-reduces, and once
// a step 2.5D's depth reduction and the replicated parameters' partial
// gradients.
TEST(StepTime, GridCollectivesSendWhatTheLayersSend) {
  const LayoutProblem pr = problem();
  MachineRates r = flat_rates();
  r.intra_node = {0.0, 1e10};
  const GPTConfig& m = pr.model;
  const int64_t C = m.n_embd, I = m.intermediate(), V = m.vocab_size, L = m.n_layer;
  for (const auto& [mode, tp, depth] : {std::tuple{TensorParallelMode::two_d, 4, 1},
                                        std::tuple{TensorParallelMode::two_and_half_d, 8, 2},
                                        std::tuple{TensorParallelMode::three_d, 8, 1}}) {
    const Layout l{.tp = tp, .tp_mode = mode, .tp_depth = depth, .micro_batch = 4};
    const TensorGridShape g = tensor_grid_shape(mode, tp, depth);
    const int64_t N = 4 * 64, q = g.q;
    const double n = static_cast<double>(N) / (q * g.depth), ring = (q - 1.0) / q;
    double block = 0.0, matrices = 0.0;
    for (const auto& [out, in] : {std::pair{3 * C, C}, std::pair{C, C}, std::pair{I, C}, std::pair{C, I}}) {
      block += grid_linear_elements_sent(out, in, N, g);
      matrices += grid_weight_gradient_elements_sent(out, in, g);
    }
    block += 2 * 2 * 2 * ring * n + 2 * 2 * ring * 2 * n;  // LayerNorm's two statistics, backward's sums
    const int64_t table_group = g.cube ? q * q : q, vocab_parts = g.cube ? q * q : q;
    const int64_t padded_vocab = (V + vocab_parts - 1) / vocab_parts * vocab_parts;
    const double embedding = 2.0 * (table_group - 1) * n * static_cast<double>(C / q);
    // The final norm's statistics and sums, the head, the cross-entropy's
    // all-reduces of [n] and [n, 2].
    const double head = 2 * 2 * ring * n + 2 * ring * 2 * n + grid_linear_elements_sent(padded_vocab, C, N, g) +
                        2 * ring * 3 * n;
    const double micro_batches = static_cast<double>(pr.global_batch / l.micro_batch);
    // The norms, the positions and the linears' biases (a rank's q-th of
    // each), summed over the q * depth ranks of a token group, by a ring.
    const double token_group = static_cast<double>(q * g.depth);
    const double replicated = static_cast<double>(L * (4 * C + 3 * C + C + I + C) + 2 * C + m.block_size * C) / q;
    const double partial = 2.0 * (token_group - 1) / token_group * replicated;
    const double elements = micro_batches * (static_cast<double>(L) * block + embedding + head) +
                            static_cast<double>(L) * matrices + partial;
    const StepTimePrediction p = predict(pr, l, r);
    EXPECT_NEAR(p.communication_s * 1e10 / (4.0 * elements), 1.0, 1e-9) << tensor_parallel_mode_name(mode);
    EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  }
}

TEST(StepTime, PipelineBubbleFollowsTheSchedule) {
  LayoutProblem pr = problem();
  pr.global_batch = 16;
  const MachineRates r = flat_rates();
  const StepTimePrediction one = predict(pr, Layout{.micro_batch = 1}, r);
  for (PipelineSchedule schedule : {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b}) {
    const StepTimePrediction p =
        predict(pr, Layout{.pp = 2, .schedule = schedule, .micro_batch = 1}, r);
    // About half the work per rank, and a bubble near (p-1)/(m+p-1) = 1/17
    // of the step (the stages' costs differ by the embedding and the head).
    EXPECT_LT(p.compute_s, 0.6 * one.compute_s);
    EXPECT_GT(p.bubble_s / p.step_s, 0.5 / 17);
    EXPECT_LT(p.bubble_s / p.step_s, 2.0 / 17);
    EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  }
  const StepTimePrediction interleaved = predict(
      pr, Layout{.pp = 2, .schedule = PipelineSchedule::interleaved_1f1b, .virtual_stages = 2, .micro_batch = 1}, r);
  const StepTimePrediction plain = predict(pr, Layout{.pp = 2, .micro_batch = 1}, r);
  EXPECT_LT(interleaved.bubble_s, plain.bubble_s);
}

TEST(StepTime, DataParallelReductionAndZeroGathers) {
  const LayoutProblem pr = problem();
  const MachineRates r = flat_rates();
  const StepTimePrediction single = predict(pr, Layout{.micro_batch = 2}, r);
  std::vector<double> comm;
  for (int stage = 0; stage <= 3; ++stage) {
    const StepTimePrediction p =
        predict(pr, Layout{.dp = 2, .micro_batch = 2, .zero_stage = stage}, r);
    EXPECT_NEAR(p.compute_s / single.compute_s, 0.5, 1e-12);  // half the micro-batches each
    EXPECT_GT(p.communication_s, 0.0);
    EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
    comm.push_back(p.communication_s);
  }
  // Stage 3 gathers every group twice per micro-batch; stages 1-2 once a step.
  EXPECT_GT(comm[3], comm[1]);
  EXPECT_EQ(comm[1], comm[2]);
}

// On nodes of 4, dp2 x tp4 keeps each tp group on a node and puts its dp
// pairs (4 ranks apart) on two: the tp collectives stay on the intra-node
// link and the data-parallel reduce-scatter and all-gather move to the
// inter-node one. With free latency and one bucket (all of the reduction
// exposed), each sends b / 2 of b gradient bytes per rank.
TEST(StepTime, ACollectiveCrossingNodesRunsOnTheInterNodeLink) {
  const LayoutProblem pr = problem();
  MachineRates one_node = flat_rates();
  one_node.intra_node = {0.0, 1e10};
  one_node.inter_node = {0.0, 1e9};
  MachineRates nodes_of_4 = one_node;
  nodes_of_4.ranks_per_node = 4;
  const StepMemoryOptions one_bucket{.precision = DType::f32, .bucket_bytes = 1 << 30, .memory = {}};
  const Layout tp4{.tp = 4, .micro_batch = 2};
  EXPECT_EQ(predict_step_time(pr, tp4, one_bucket, nodes_of_4).communication_s,
            predict_step_time(pr, tp4, one_bucket, one_node).communication_s);
  const Layout hybrid{.dp = 2, .tp = 4, .micro_batch = 2, .zero_stage = 1};
  // A tp rank's gradient: its quarter of the matrices, the embedding table
  // and the column-parallel biases; the norms, the row-parallel biases and
  // the positions whole.
  const double C = 64, L = 4, V = 256;
  const double b = 4.0 * (L * (12 * C * C + 7 * C) / 4 + V * C / 4 + L * (4 * C + 2 * C) + 2 * C + 64 * C);
  const double crossing = predict_step_time(pr, hybrid, one_bucket, nodes_of_4).communication_s -
                          predict_step_time(pr, hybrid, one_bucket, one_node).communication_s;
  EXPECT_NEAR(crossing / (2 * (b / 2) * (1 / 1e9 - 1 / 1e10)), 1.0, 1e-9);
}

// On a calibrated CPU of 2 threads, a single rank runs its kernels on both
// (here 1.5x one thread's rate); two ranks run on one thread each; four
// share two threads' worth, half a thread each. Each rank's GEMMs are
// priced at the rate measured on its own thread count.
TEST(StepTime, LocalRanksRunOnTheirShareOfTheCalibratedThreads) {
  const LayoutProblem pr = problem();
  MachineRates r = flat_rates();
  r.shared_by_local_ranks = true;
  r.threads = 2;
  for (int threads : {1, 2})
    for (int64_t m : {1, 100000})
      for (int64_t n : {1, 100000})
        for (int64_t k : {1, 100000}) r.gemm.push_back({m, n, k, threads == 1 ? 1e9 : 1.5e9, threads});
  const double single = predict(pr, Layout{.micro_batch = 2}, r).compute_s;
  const double dp2 = predict(pr, Layout{.dp = 2, .micro_batch = 2}, r).compute_s;
  const double dp4 = predict(pr, Layout{.dp = 4, .micro_batch = 2}, r).compute_s;
  // A rank of dp w does 1/w of the work at its rate: 1.5 / w of the single
  // rank's time at one thread, twice that at half a thread.
  EXPECT_NEAR(dp2 / single, 1.5 / 2, 1e-12);
  EXPECT_NEAR(dp4 / single, 1.5 / 4 * 2, 1e-12);
}

TEST(StepTime, LocalRanksSharingTheDeviceEachGetAShare) {
  const LayoutProblem pr = problem();
  MachineRates r = flat_rates();
  const StepTimePrediction own = predict(pr, Layout{.dp = 2, .micro_batch = 2}, r);
  r.shared_by_local_ranks = true;
  const StepTimePrediction shared = predict(pr, Layout{.dp = 2, .micro_batch = 2}, r);
  EXPECT_NEAR(shared.compute_s / own.compute_s, 2.0, 1e-12);
}

// Offloaded state: problem()'s model on one rank in one micro-batch, its
// parameters all off the device and half its optimizer state, on the host
// or on NVMe (only the directory's existence is checked: nothing runs).
Layout offloaded() { return Layout{.micro_batch = 8, .memory_policy = MemoryPolicy::fixed}; }

StepMemoryOptions offload_options(int prefetch, bool nvme) {
  StepMemoryOptions o;
  o.bucket_bytes = 1 << 20;
  o.memory.policy = MemoryPolicy::fixed;
  o.memory.offload_param_frac = 1.0;
  o.memory.offload_optim_frac = 0.5;
  o.memory.prefetch = prefetch;
  if (nvme) o.memory.nvme_dir = std::filesystem::temp_directory_path();
  return o;
}

StepTraffic steady_traffic(const StepMemoryOptions& o) {
  const std::vector<StepTraffic> t = predict_step_traffic(problem(), offloaded(), o, 3);
  EXPECT_EQ(t.size(), 1u);
  return t.at(0);
}

double between_host_and_device(const TierTraffic& t) {
  return static_cast<double>(t.at(Tier::host, Tier::device) + t.at(Tier::device, Tier::host));
}

// What the code waits for, over the link's and the disk's rates: what the
// step's transfers cost when nothing hides them.
double waited_seconds(const StepTraffic& t, const MachineRates& r) {
  double s = 0.0;
  for (const StepTraffic::Phase* p : {&t.model, &t.update}) {
    const TierMoves& m = p->waited;
    s += between_host_and_device(m.count) * r.host_device.latency_s +
         between_host_and_device(m.bytes) / r.host_device.bytes_per_s;
    if (r.nvme_read_bytes_per_s > 0)
      s += static_cast<double>(m.bytes.at(Tier::nvme, Tier::host)) / r.nvme_read_bytes_per_s +
           static_cast<double>(m.bytes.at(Tier::host, Tier::nvme)) / r.nvme_write_bytes_per_s;
  }
  return s;
}

// On a calibrated CPU the device is the host (no host_device link): a move
// is a memory copy on the rank's thread, every byte read and written, and
// the CPU backend's synchronous streams hide none of it, prefetched or not.
TEST(StepTime, OffloadedStateOnACpuIsPricedAsMemoryCopies) {
  MachineRates r = flat_rates();
  r.memory_bytes_per_s = 1e10;
  for (int prefetch : {0, 2}) {
    const StepMemoryOptions o = offload_options(prefetch, false);
    const double bytes = between_host_and_device(steady_traffic(o).bytes());
    EXPECT_GT(bytes, 0.0);
    const StepTimePrediction p = predict_step_time(problem(), offloaded(), o, r);
    EXPECT_NEAR(p.transfer_s / (2.0 * bytes / r.memory_bytes_per_s), 1.0, 1e-12) << "prefetch " << prefetch;
    EXPECT_TRUE(p.traffic.bytes() == steady_traffic(o).bytes());
    EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  }
}

// With a host-device link and no prefetch every move is waited for: the
// transfer term is the bytes over the bandwidth, plus a latency per move.
TEST(StepTime, WithNothingAheadTransfersCostBytesOverTheLink) {
  MachineRates r = flat_rates();
  r.host_device = {0.0, 1e10};
  const StepMemoryOptions o = offload_options(0, false);
  const StepTraffic t = steady_traffic(o);
  EXPECT_TRUE(t.model.ahead.bytes == TierTraffic{});
  EXPECT_TRUE(t.update.ahead.bytes == TierTraffic{});
  const double bytes = between_host_and_device(t.bytes());
  EXPECT_GT(bytes, 0.0);
  const StepTimePrediction p = predict_step_time(problem(), offloaded(), o, r);
  EXPECT_NEAR(p.transfer_s / (bytes / 1e10), 1.0, 1e-12);
  EXPECT_NEAR(sum_of_parts(p) / p.step_s, 1.0, 1e-12);
  const StepTimePrediction without = predict(problem(), Layout{.micro_batch = 8}, r);
  EXPECT_NEAR((p.step_s - without.step_s) / p.transfer_s, 1.0, 1e-9);

  r.host_device.latency_s = 1e-6;
  double moves = 0.0;
  for (const StepTraffic::Phase* phase : {&t.model, &t.update}) moves += between_host_and_device(phase->waited.count);
  EXPECT_NEAR(predict_step_time(problem(), offloaded(), o, r).transfer_s / (bytes / 1e10 + moves * 1e-6), 1.0, 1e-12);
}

// NVMe traffic is priced at the NVMe rates, which a rates file may lack:
// then the layout is refused with the way to measure them.
TEST(StepTime, NvmeTransfersNeedTheNvmeRates) {
  MachineRates r = flat_rates();
  r.host_device = {0.0, 1e10};
  const StepMemoryOptions o = offload_options(2, true);
  try {
    predict_step_time(problem(), offloaded(), o, r);
    ADD_FAILURE() << "NVMe traffic priced without NVMe rates";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loom calibrate --nvme-dir"), std::string::npos) << e.what();
  }
  // Slow kernels: everything started ahead (the prefetched chunks' reads,
  // the update's reads of later chunks, the writes behind) is hidden, and
  // what is waited for is exposed.
  r.nvme_read_bytes_per_s = 2e9;
  r.nvme_write_bytes_per_s = 1e9;
  r.memory_bytes_per_s = 1e7;
  const StepTraffic t = steady_traffic(o);
  EXPECT_GT(t.bytes().at(Tier::nvme, Tier::host), 0);
  EXPECT_GT(t.bytes().at(Tier::host, Tier::nvme), 0);
  EXPECT_GT(t.model.ahead.bytes.at(Tier::nvme, Tier::host), 0);
  EXPECT_GT(t.update.ahead.bytes.at(Tier::host, Tier::nvme), 0);
  const StepTimePrediction p = predict_step_time(problem(), offloaded(), o, r);
  EXPECT_NEAR(p.transfer_s / waited_seconds(t, r), 1.0, 1e-12);
}

// More overlap never lengthens the step: a deeper prefetch starts more
// moves ahead (and keeps chunks longer, so moves no more bytes), and
// slower kernels leave more time to hide them behind.
TEST(StepTime, MoreOverlapNeverLengthensTheStep) {
  MachineRates cpu = flat_rates();
  cpu.memory_bytes_per_s = 1e10;
  cpu.nvme_read_bytes_per_s = 1e8;
  cpu.nvme_write_bytes_per_s = 1e8;
  MachineRates linked = cpu;
  linked.host_device = {1e-6, 1e9};
  for (const MachineRates* r : {&cpu, &linked})
    for (bool nvme : {false, true}) {
      const std::string what = str(r == &cpu ? "cpu" : "linked", nvme ? " nvme" : " host");
      double previous = std::numeric_limits<double>::infinity();
      for (int prefetch = 0; prefetch <= 3; ++prefetch) {
        const StepTimePrediction p = predict_step_time(problem(), offloaded(), offload_options(prefetch, nvme), *r);
        EXPECT_LE(p.step_s, previous) << what << ", prefetch " << prefetch;
        EXPECT_GT(p.transfer_s, 0.0) << what;
        previous = p.step_s;
      }
      // Prefetching hides something wherever moves can run beside the
      // kernels: on a link, or the disk.
      const double none = predict_step_time(problem(), offloaded(), offload_options(0, nvme), *r).transfer_s;
      const double some = predict_step_time(problem(), offloaded(), offload_options(2, nvme), *r).transfer_s;
      if (r == &linked || nvme) {
        EXPECT_LT(some, none) << what;
      }
      // Kernels ten times slower hide at least as much (on a CPU the
      // copies are memory work themselves, and slow down with them).
      if (r == &linked) {
        MachineRates slow = *r;
        slow.peak_flops_fp32 /= 10;
        slow.memory_bytes_per_s /= 10;
        EXPECT_LE(predict_step_time(problem(), offloaded(), offload_options(2, nvme), slow).transfer_s, some) << what;
      }
    }
}

}  // namespace
}  // namespace loom
