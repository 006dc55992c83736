// The time model: a step priced piece by piece from a machine's rates.
//
// A rank's step is its pipeline's makespan (every micro-batch's forward and
// backward through its layers, with the tensor-parallel collectives inside
// them, scheduled by simulate_pipeline), then the model-parallel gradient
// reductions and what data parallelism leaves exposed of its own, then the
// optimizer, then what a memory policy's moves between tiers leave exposed.
// Each piece follows what loom's modules do (src/nn, src/zero, the
// Trainer): the shapes below are the rank-local GEMM shapes of the
// column/row-parallel layers (or a grid's SUMMA and cube layers), the
// collectives the ones the layers, stores and Trainer issue, in their order
// (tests/train/plan_command_test holds them to a traced run's).
#include <algorithm>
#include <array>
#include <optional>

#include "loom/planner.h"

namespace loom {

namespace {

constexpr double kF32 = 4.0;  // activations are fp32 in every precision

// What one micro-batch costs on one rank, split the way the prediction
// reports it.
struct Split {
  double compute_s = 0.0, communication_s = 0.0;
  template <typename Part>
  Split& operator+=(const Part& o) {
    compute_s += o.compute_s;
    communication_s += o.communication_s;
    return *this;
  }
  double total() const { return compute_s + communication_s; }
};

// One module's forward or backward for one micro-batch: its split, and the
// collectives inside it in the order it issues them (their seconds sum to
// communication_s), which a predicted trace shows (StepPieces).
struct Cost {
  double compute_s = 0.0, communication_s = 0.0;
  std::vector<PredictedCollective> collectives;
  Cost& operator+=(const Cost& o) {
    compute_s += o.compute_s;
    communication_s += o.communication_s;
    collectives.insert(collectives.end(), o.collectives.begin(), o.collectives.end());
    return *this;
  }
  double total() const { return compute_s + communication_s; }
  // Records `times` issues of a collective over `group` ranks taking
  // `seconds` each (none over a group of one, which costs nothing) and
  // returns `seconds`, for the caller's sum.
  double issue(Collective op, int64_t group, double seconds, int times = 1) {
    if (group > 1)
      for (int k = 0; k < times; ++k) collectives.push_back({op, static_cast<int>(group), seconds});
    return seconds;
  }
  // Records each in order; returns their seconds summed left to right (as
  // `a + b + c` sums them).
  double issue(std::initializer_list<PredictedCollective> list) {
    double sum = 0.0;
    for (const PredictedCollective& c : list) sum += issue(c.op, c.group, c.seconds);
    return sum;
  }
};

// `backward` after the forward it recomputes first (activation
// checkpointing, Block::backward): all of the block's forward but the MLP's
// output projection, whose output the backward does not need
// (`projection`: its cost, its collectives the forward's from index `at`
// on). The recompute's collectives come before the backward's.
void add_recompute(Cost& backward, const Cost& forward, const Cost& projection, size_t at) {
  std::vector<PredictedCollective> again = forward.collectives;
  const auto first = again.begin() + static_cast<std::ptrdiff_t>(at);
  again.erase(first, first + static_cast<std::ptrdiff_t>(projection.collectives.size()));
  backward.compute_s += forward.compute_s - projection.compute_s;
  backward.communication_s += forward.communication_s - projection.communication_s;
  backward.collectives.insert(backward.collectives.begin(), again.begin(), again.end());
}

// How a rank runs on its device. A GPU is each rank's own. A calibrated CPU
// is shared by the local ranks: each of w runs its kernels on
// max(1, threads / w) of the calibration's threads (run_local's budget),
// priced at the rates measured on that many; when w exceeds the threads,
// each thread gets threads / w of a core. Memory bandwidth is shared w
// ways. (A calibration that recorded no thread counts prices kernels on all
// threads, shared w ways.) A node's disk serves its ranks' NVMe reads and
// writes: every local rank of a calibrated CPU, or the GPUs of one node.
struct DeviceShare {
  int threads = 0;               // the rank's kernels' threads (0: all)
  double compute = 1.0;          // times the compute-bound kernels' time on them
  double memory = 1.0;           // times memory-bound work's time at the whole device's rate
  double disk = 1.0;             // times NVMe I/O's time at the disk's rate

  static DeviceShare of(const MachineRates& rates, int64_t world) {
    if (!rates.shared_by_local_ranks)
      return {.disk = static_cast<double>(std::min<int64_t>(world, rates.ranks_per_node))};
    const double w = static_cast<double>(world);
    if (rates.threads <= 0) return {0, w, w, w};
    const int threads = static_cast<int>(std::max<int64_t>(1, rates.threads / world));
    return {threads, std::max(1.0, w * threads / rates.threads), w, w};
  }
};

struct Shapes {
  const GPTConfig& m;
  int64_t B, T, N;  // micro-batch sequences, tokens each, rows
  int64_t tp;
  bool sp;
  TensorGridShape grid;  // ranks() 1: 1D
  DeviceShare share;
  DType precision;
  const MachineRates& rates;
};

// One GEMM, C[m, n] = A[m, k] B[k, n], on this rank's share of the device.
double gemm(const Shapes& s, int64_t m, int64_t n, int64_t k) {
  return s.share.compute * s.rates.gemm_seconds(m, n, k, s.precision, s.share.threads);
}
// Causal attention of `sequences_heads` (sequence, head) pairs.
double attention(const Shapes& s, double sequences_heads, bool backward) {
  return s.share.compute * sequences_heads *
         s.rates.attention_seconds(s.T, s.m.head_dim(), backward, s.precision, s.share.threads);
}

// One linear layer's GEMMs for N rows: forward (N, out, in), and backward's
// input gradient (N, in, out) and weight gradient (out, in, N).
struct Linear {
  int64_t in = 0, out = 0;
  double forward(const Shapes& s, int64_t N) const { return gemm(s, N, out, in); }
  double backward(const Shapes& s, int64_t N, bool weight_gradient) const {
    return gemm(s, N, in, out) + (weight_gradient ? gemm(s, out, in, N) : 0.0);
  }
};

// A tensor-parallel collective of the whole [N, C] activation.
double tp_collective(const Shapes& s, Collective op) {
  return s.rates.collective_seconds(op, kF32 * static_cast<double>(s.N * s.m.n_embd),
                                    RankGroup::consecutive(static_cast<int>(s.tp)));
}

// A grid's groups (TensorGrid; a cube's depth is q): a row of q consecutive
// ranks (hidden), a column of a layer (weight: q ranks q apart), the layers
// at one position (depth: q^2 apart), and a column over every layer (token:
// q * depth ranks spanning the grid).
RankGroup grid_row(const TensorGridShape& g) { return RankGroup::consecutive(g.q); }
RankGroup grid_column(const TensorGridShape& g) { return RankGroup::strided(g.q, g.q); }
RankGroup grid_depth(const TensorGridShape& g) { return RankGroup::strided(g.depth, int64_t{g.q} * g.q); }
RankGroup grid_token(const TensorGridShape& g) { return {g.q * g.depth, g.ranks()}; }

// Bytes-bound work: read plus written bytes at the device's copy rate, on
// this rank's share of the device.
double memory_seconds(const Shapes& s, double bytes) { return s.share.memory * bytes / s.rates.memory_bytes_per_s; }

// A grid's linear layer of `out` x `in` (global) on its n = N / (q depth)
// token rows (SummaLinear, CubeLinear): forward and backward GEMMs and
// collectives, each collective priced by its whole buffer over the q ranks
// of its group.
std::pair<Cost, Cost> grid_linear_cost(const Shapes& s, int64_t out, int64_t in, bool weight_gradient,
                                       GridSide side) {
  const int64_t q = s.grid.q, n = s.N / (q * s.grid.depth);
  const auto over = [&](RankGroup group) {
    return [&s, group](Collective op, double elements) {
      return s.rates.collective_seconds(op, kF32 * elements, group);
    };
  };
  const double o = static_cast<double>(out), i = static_cast<double>(in), rows = static_cast<double>(n);
  Cost f, b;
  if (!s.grid.cube) {
    // SUMMA: q GEMMs against the column's panels; the panels gathered over
    // the column, the partial outputs scattered over the row; backward
    // gathers dy over the row and the panels again, and scatters dW over
    // the column.
    const auto row = over(grid_row(s.grid)), column = over(grid_column(s.grid));
    const double panels = column(Collective::all_gather, o * i / static_cast<double>(q));
    f.compute_s = static_cast<double>(q) * gemm(s, n, out / q, in / q);
    const int R = grid_row(s.grid).size, K = grid_column(s.grid).size;
    f.communication_s = f.issue({{Collective::all_gather, K, panels},
                                 {Collective::reduce_scatter, R, row(Collective::reduce_scatter, rows * o)}});
    b.compute_s = static_cast<double>(q) * (gemm(s, n, in / q, out / q) + (weight_gradient ? gemm(s, out / q, in / q, n) : 0.0));
    b.communication_s =
        b.issue({{Collective::all_gather, R, row(Collective::all_gather, rows * o)},
                 {Collective::all_gather, K, panels},
                 {Collective::reduce_scatter, K, column(Collective::reduce_scatter, o * i / static_cast<double>(q))}});
    return {f, b};
  }
  // The cube: one GEMM on the gathered input and weight; x gathered over the
  // axis splitting the input features, W over the depth, the output
  // scattered over the axis splitting the output features (an entering
  // layer's input is split over the columns and its output over the rows; a
  // leaving layer's the other way); backward gathers dy, W and x and
  // scatters dx and dW.
  const bool entering = side == GridSide::entering;
  const auto input_axis = over(entering ? grid_row(s.grid) : grid_column(s.grid));
  const auto output_axis = over(entering ? grid_column(s.grid) : grid_row(s.grid));
  const auto depth = over(grid_depth(s.grid));
  const double weight = depth(Collective::all_gather, o * i / static_cast<double>(q * q));
  f.compute_s = gemm(s, q * n, out / q, in / q);
  const int In = (entering ? grid_row(s.grid) : grid_column(s.grid)).size;
  const int Out = (entering ? grid_column(s.grid) : grid_row(s.grid)).size;
  const int D = grid_depth(s.grid).size;
  f.communication_s = f.issue({{Collective::all_gather, In, input_axis(Collective::all_gather, rows * i)},
                               {Collective::all_gather, D, weight},
                               {Collective::reduce_scatter, Out, output_axis(Collective::reduce_scatter, rows * o)}});
  b.compute_s = gemm(s, q * n, in / q, out / q) + (weight_gradient ? gemm(s, out / q, in / q, q * n) : 0.0);
  b.communication_s =
      b.issue({{Collective::all_gather, Out, output_axis(Collective::all_gather, rows * o)},
               {Collective::all_gather, D, weight},
               {Collective::all_gather, In, input_axis(Collective::all_gather, rows * i)},
               {Collective::reduce_scatter, In, input_axis(Collective::reduce_scatter, rows * i)},
               {Collective::reduce_scatter, D, depth(Collective::reduce_scatter, o * i / static_cast<double>(q * q))}});
  return {f, b};
}

// One block on a grid: its four grid layers, attention on the rank's heads
// of its token rows, the elementwise kernels on its share, and each norm's
// statistics all-reduced over the q ranks of a row (forward one or two
// [n] vectors, backward [n, 2]).
std::pair<Cost, Cost> grid_block_cost(const Shapes& s, bool recompute) {
  const GPTConfig& m = s.m;
  const int64_t C = m.n_embd, q = s.grid.q, I = m.intermediate();
  const int64_t n = s.N / (q * s.grid.depth);
  const bool swiglu = m.mlp == MlpKind::swiglu;
  const double rows = static_cast<double>(n);
  // block_matmuls alternates entering (q|k|v, fc) and leaving layers.
  const std::array<MatrixShape, 4> matmuls = m.block_matmuls();
  std::array<std::pair<Cost, Cost>, 4> linears;
  for (size_t i = 0; i < matmuls.size(); ++i)
    linears[i] = grid_linear_cost(s, matmuls[i].out, matmuls[i].in, !m.lora.enabled(),
                                  i % 2 == 0 ? GridSide::entering : GridSide::leaving);
  // Each norm (ln_1 before attention, ln_2 before the MLP) all-reduces its
  // statistics over the row, [n] floats each, and backward its two sums,
  // [n, 2].
  const RankGroup row = grid_row(s.grid);
  const int statistics = m.norm == NormKind::layernorm ? 2 : 1;
  const double norm_forward = s.rates.collective_seconds(Collective::all_reduce, kF32 * rows, row);
  const double norm_backward = s.rates.collective_seconds(Collective::all_reduce, kF32 * 2.0 * rows, row);
  // In the order the block runs them: forward ln_1, the attention's two
  // layers, ln_2, the MLP's two; backward the reverse.
  Cost forward, backward;
  size_t projection_at = 0;  // where the MLP's output layer's collectives start in the forward's
  for (size_t i = 0; i < linears.size(); ++i) {
    if (i % 2 == 0)
      forward.communication_s += statistics * forward.issue(Collective::all_reduce, row.size, norm_forward, statistics);
    if (i + 1 == linears.size()) projection_at = forward.collectives.size();
    forward += linears[i].first;
  }
  for (size_t i = linears.size(); i-- > 0;) {
    backward += linears[i].second;
    if (i % 2 == 0) backward.communication_s += backward.issue(Collective::all_reduce, row.size, norm_backward);
  }
  const double sequences_heads = static_cast<double>(s.B / (q * s.grid.depth) * (m.n_head / q));
  const double elementwise = kF32 * rows * (10.0 * static_cast<double>(C / q) + (swiglu ? 3.0 : 2.0) * static_cast<double>(I / q));
  forward.compute_s += attention(s, sequences_heads, false) + memory_seconds(s, elementwise);
  backward.compute_s += attention(s, sequences_heads, true) + memory_seconds(s, 2.0 * elementwise);
  if (recompute) add_recompute(backward, forward, linears[3].first, projection_at);
  return {forward, backward};
}

// One transformer block's forward and backward (with its recomputed forward
// under activation checkpointing) for one micro-batch.
std::pair<Cost, Cost> block_cost(const Shapes& s, bool recompute) {
  if (s.grid.ranks() > 1) return grid_block_cost(s, recompute);
  const GPTConfig& m = s.m;
  const int64_t C = m.n_embd, q = m.q_dim(), hs = m.head_dim(), t = s.tp;
  const int64_t kv = m.kv_heads() % t == 0 ? m.kv_heads() / t * hs : hs;  // split, or one shared head
  const int64_t I = m.intermediate();
  const bool swiglu = m.mlp == MlpKind::swiglu;
  const bool trained = !m.lora.enabled();  // a frozen base takes no weight gradient
  const Linear layers[] = {{C, q / t + 2 * kv}, {q / t, C}, {C, (swiglu ? 2 : 1) * I / t}, {I / t, C}};
  // Causal attention of this rank's heads over the micro-batch's sequences.
  const double sequences_heads = static_cast<double>(s.B * (m.n_head / t));
  const double attention_forward = attention(s, sequences_heads, false);
  const double attention_backward = attention(s, sequences_heads, true);
  // Memory-bound kernels, fp32 elements read plus written per row: each norm
  // 2 C, each residual add 3 C (on N / tp rows under sequence parallelism),
  // and the MLP's activation (GELU 2 I, SwiGLU 3 I) on this rank's columns.
  const double rows = static_cast<double>(s.sp ? s.N / t : s.N);
  const double elementwise = kF32 * (rows * 10.0 * static_cast<double>(C) +
                                     static_cast<double>(s.N) * (swiglu ? 3.0 : 2.0) * static_cast<double>(I / t));
  Cost forward;
  for (const Linear& l : layers) forward.compute_s += l.forward(s, s.N);
  forward.compute_s += attention_forward + memory_seconds(s, elementwise);
  // Attention's and the MLP's outputs are summed over the tensor-parallel
  // ranks; under sequence parallelism their inputs are all-gathered and the
  // outputs reduce-scattered instead.
  if (s.sp) {
    const double gather = tp_collective(s, Collective::all_gather), scatter = tp_collective(s, Collective::reduce_scatter);
    forward.communication_s = 2.0 * (gather + scatter);
    for (int k = 0; k < 2; ++k) {
      forward.issue(Collective::all_gather, s.tp, gather);
      forward.issue(Collective::reduce_scatter, s.tp, scatter);
    }
  } else {
    forward.communication_s = 2.0 * forward.issue(Collective::all_reduce, s.tp, tp_collective(s, Collective::all_reduce), 2);
  }
  // The MLP's output layer: the last GEMM, and the last collective (its
  // output's sum or scatter).
  Cost projection{layers[3].forward(s, s.N), 0.0, {}};
  projection.communication_s = projection.issue(
      s.sp ? Collective::reduce_scatter : Collective::all_reduce, s.tp,
      tp_collective(s, s.sp ? Collective::reduce_scatter : Collective::all_reduce));
  Cost backward;
  for (const Linear& l : layers) backward.compute_s += l.backward(s, s.N, trained);
  backward.compute_s += attention_backward + memory_seconds(s, 2.0 * elementwise);
  // Each collective's backward is its dual (an all-gather's a
  // reduce-scatter), the same buffers in reverse order. Under sequence
  // parallelism each of the MLP and attention first gathers its input again
  // for its weight gradient (the forward kept only the rank's tokens), then
  // gathers the output's gradient and reduce-scatters the input's.
  if (s.sp) {
    const double gather = tp_collective(s, Collective::all_gather), scatter = tp_collective(s, Collective::reduce_scatter);
    for (int k = 0; k < 2; ++k)
      backward.communication_s += backward.issue({{Collective::all_gather, static_cast<int>(s.tp), gather},
                                                  {Collective::all_gather, static_cast<int>(s.tp), gather},
                                                  {Collective::reduce_scatter, static_cast<int>(s.tp), scatter}});
  } else {
    backward.communication_s = forward.communication_s;
    backward.collectives = forward.collectives;
  }
  if (recompute) add_recompute(backward, forward, projection, forward.collectives.size() - projection.collectives.size());
  return {forward, backward};
}

// The embedding (first stage) and the final norm, output head and
// cross-entropy (last stage) for one micro-batch.
std::pair<Cost, Cost> embedding_cost(const Shapes& s) {
  if (s.grid.ranks() > 1) {
    // Embedding::grid_forward: the table group's rows looked up and
    // reduce-scattered; backward gathers them. The table group is a layer's
    // column on 2D/2.5D, a column over every layer on a cube.
    const RankGroup table = s.grid.cube ? grid_token(s.grid) : grid_column(s.grid);
    const int64_t q = s.grid.q, n = s.N / (q * s.grid.depth);
    const double gathered = kF32 * static_cast<double>(table.size * n * (s.m.n_embd / q));
    Cost forward{memory_seconds(s, 2.0 * gathered), 0.0, {}}, backward{memory_seconds(s, 2.0 * gathered), 0.0, {}};
    forward.communication_s = forward.issue(Collective::reduce_scatter, table.size,
                                            s.rates.collective_seconds(Collective::reduce_scatter, gathered, table));
    backward.communication_s = backward.issue(Collective::all_gather, table.size,
                                              s.rates.collective_seconds(Collective::all_gather, gathered, table));
    return {forward, backward};
  }
  const double bytes = kF32 * 2.0 * static_cast<double>(s.N * s.m.n_embd);
  Cost forward{memory_seconds(s, bytes), 0.0, {}}, backward{memory_seconds(s, bytes), 0.0, {}};
  // A vocabulary-parallel lookup sums the ranks' rows: all-reduced, or under
  // sequence parallelism reduce-scattered to each rank's tokens, whose
  // gradients backward then gathers.
  if (s.sp) {
    forward.communication_s =
        forward.issue(Collective::reduce_scatter, s.tp, tp_collective(s, Collective::reduce_scatter));
    backward.communication_s = backward.issue(Collective::all_gather, s.tp, tp_collective(s, Collective::all_gather));
  } else {
    forward.communication_s = forward.issue(Collective::all_reduce, s.tp, tp_collective(s, Collective::all_reduce));
  }
  return {forward, backward};
}

std::pair<Cost, Cost> head_cost(const Shapes& s) {
  if (s.grid.ranks() > 1) {
    // The head as a grid's entering layer over the token table, the logits'
    // memory traffic and the vocabulary-parallel cross-entropy's all-reduces
    // of [n] and [n, 2] (the rows' max, their sums) over the q ranks
    // splitting the vocabulary.
    const int64_t q = s.grid.q, n = s.N / (q * s.grid.depth);
    const double V = static_cast<double>(GridLinear::local_features(s.m.vocab_size, s.grid));
    const double rows = static_cast<double>(n);
    // The final norm's statistics over the row first (as a block's norms),
    // its backward's sums last.
    const RankGroup row = grid_row(s.grid);
    const int statistics = s.m.norm == NormKind::layernorm ? 2 : 1;
    Cost forward, backward;
    forward.communication_s +=
        statistics * forward.issue(Collective::all_reduce, row.size,
                                   s.rates.collective_seconds(Collective::all_reduce, kF32 * rows, row), statistics);
    const auto [head_forward, head_backward] =
        grid_linear_cost(s, static_cast<int64_t>(V) * q, s.m.n_embd, !s.m.lora.enabled(), GridSide::entering);
    forward += head_forward;
    backward += head_backward;
    backward.communication_s += backward.issue(Collective::all_reduce, row.size,
                                               s.rates.collective_seconds(Collective::all_reduce, kF32 * 2.0 * rows, row));
    const double bytes = kF32 * (3.0 * rows * V + 2.0 * rows * static_cast<double>(s.m.n_embd / q));
    forward.compute_s += memory_seconds(s, bytes);
    backward.compute_s += memory_seconds(s, bytes);
    // The vocabulary is split over the columns on 2D/2.5D, the rows on a cube.
    const RankGroup vocabulary = s.grid.cube ? grid_column(s.grid) : grid_row(s.grid);
    forward.communication_s += forward.issue(
        {{Collective::all_reduce, vocabulary.size, s.rates.collective_seconds(Collective::all_reduce, kF32 * rows, vocabulary)},
         {Collective::all_reduce, vocabulary.size,
          s.rates.collective_seconds(Collective::all_reduce, kF32 * 2.0 * rows, vocabulary)}});
    return {forward, backward};
  }
  const int64_t C = s.m.n_embd, V = (s.m.vocab_size + s.tp - 1) / s.tp;
  const Linear head{C, V};
  const bool trained = !s.m.lora.enabled();
  // Logits written, then read by the softmax and overwritten by their
  // gradient; the final norm's 2 C per row.
  const double bytes = kF32 * (3.0 * static_cast<double>(s.N * V) + 2.0 * static_cast<double>(s.N * C));
  Cost forward{head.forward(s, s.N) + memory_seconds(s, bytes), 0.0, {}};
  Cost backward{head.backward(s, s.N, trained) + memory_seconds(s, bytes), 0.0, {}};
  // Under sequence parallelism the head gathers the final norm's tokens
  // (and backward reduce-scatters their gradient); otherwise the input's
  // gradient is a partial sum over the vocabulary's shards, all-reduced.
  // Vocabulary-parallel cross-entropy: the rows' max [N], then their sums
  // [N, 2].
  const RankGroup tp = RankGroup::consecutive(static_cast<int>(s.tp));
  if (s.sp) {
    forward.communication_s = forward.issue(Collective::all_gather, s.tp, tp_collective(s, Collective::all_gather));
    backward.communication_s =
        backward.issue(Collective::reduce_scatter, s.tp, tp_collective(s, Collective::reduce_scatter));
  } else {
    backward.communication_s = backward.issue(Collective::all_reduce, s.tp, tp_collective(s, Collective::all_reduce));
  }
  forward.communication_s += forward.issue(
      {{Collective::all_reduce, tp.size,
        s.rates.collective_seconds(Collective::all_reduce, kF32 * static_cast<double>(s.N), tp)},
       {Collective::all_reduce, tp.size,
        s.rates.collective_seconds(Collective::all_reduce, kF32 * 2.0 * static_cast<double>(s.N), tp)}});
  return {forward, backward};
}

// A module's cost as StepPieces holds it.
PredictedModule module_piece(std::string name, const Cost& c) {
  return {std::move(name), c.compute_s, c.communication_s, c.collectives};
}

// The bytes a step's moves read from and write to NVMe, whichever tier is
// on the other side.
double nvme_read_bytes(const TierTraffic& t) {
  return static_cast<double>(t.at(Tier::nvme, Tier::host) + t.at(Tier::nvme, Tier::device));
}
double nvme_written_bytes(const TierTraffic& t) {
  return static_cast<double>(t.at(Tier::host, Tier::nvme) + t.at(Tier::device, Tier::nvme));
}

// Offloaded state: the seconds moves take on the copy engine and the disk.
TransferSeconds transfer_seconds(const Shapes& s, const TierMoves& m) {
  const auto both = [](const TierTraffic& t, Tier a, Tier b) { return static_cast<double>(t.at(a, b) + t.at(b, a)); };
  const double copied = both(m.bytes, Tier::host, Tier::device);
  TransferSeconds t;
  if (s.rates.host_device.bytes_per_s > 0.0) {
    t.copy_s = both(m.count, Tier::host, Tier::device) * s.rates.host_device.latency_s +
               copied / s.rates.host_device.bytes_per_s;
  } else {
    // The device is the host: a move is a memory copy, every byte read and
    // written.
    t.copy_s = memory_seconds(s, 2.0 * copied);
  }
  const double read = nvme_read_bytes(m.bytes), written = nvme_written_bytes(m.bytes);
  if (read + written > 0.0)
    t.disk_s = s.share.disk * (read / s.rates.nvme_read_bytes_per_s + written / s.rates.nvme_write_bytes_per_s);
  return t;
}

// The exposed seconds of one phase's moves beside `work` seconds of its
// computation: what the code waits for, and what it started ahead beyond
// the work that hides it (the copy engine and the disk run beside the
// computation and each other), counted on the resource that runs longer.
TransferSeconds exposed_transfers(const Shapes& s, const StepTraffic::Phase& phase, double work) {
  TransferSeconds waited = transfer_seconds(s, phase.waited);
  TransferSeconds ahead = transfer_seconds(s, phase.ahead);
  if (s.rates.host_device.bytes_per_s <= 0.0) {
    // The CPU backend's synchronous streams run a copy on the rank's thread
    // as it is issued, prefetch or not.
    waited.copy_s += ahead.copy_s;
    ahead.copy_s = 0.0;
  }
  const double beyond = std::max(0.0, std::max(ahead.copy_s, ahead.disk_s) - work);
  (ahead.copy_s >= ahead.disk_s ? waited.copy_s : waited.disk_s) += beyond;
  return waited;
}

// What a stage does after the pipeline, priced: the reductions in the order
// the Trainer issues them (their exposed seconds), ZeRO's parameter gathers
// and the optimizer.
struct AfterPipeline {
  std::vector<PredictedCollective> reductions;
  double reductions_s = 0.0, gathers_s = 0.0, optimizer_s = 0.0, gradient_check_s = 0.0;
  std::optional<PredictedCollective> step_gather, pass_gather;
  void reduce(Collective op, int group, double seconds) {
    if (group <= 1) return;
    reductions.push_back({op, group, seconds});
    reductions_s += seconds;
  }
  double total() const { return reductions_s + gathers_s + optimizer_s; }
};

// The ranks a reduction over tensor-parallel `axes` spans
// (TensorParallel::group_over; 1D: the whole tp group).
RankGroup tp_axes_group(const Shapes& s, TpAxes axes) {
  if (s.grid.ranks() <= 1 || axes == kTpAll) return RankGroup::consecutive(static_cast<int>(s.tp));
  switch (axes) {
    case kTpCols: return grid_row(s.grid);
    case kTpRows: return grid_column(s.grid);
    case kTpDepth: return grid_depth(s.grid);
    default: {
      // Two axes: the token rows over a layer's column and the depth, or on
      // a cube its row and the depth; they span the grid.
      const int depth = (axes & kTpDepth) ? s.grid.depth : 1;
      return {s.grid.q * depth, s.grid.ranks()};
    }
  }
}

// From the third step on every step moves the same (predict_step_traffic).
constexpr int kSteadyStep = 3;

}  // namespace

StepTimePrediction predict_step_time(const LayoutProblem& problem, const Layout& layout,
                                     const StepMemoryOptions& options, const MachineRates& rates,
                                     StepPieces* pieces) {
  const DType precision = options.precision;
  const GPTConfig& m = problem.model;
  const int64_t world = layout.dp * layout.tp * layout.pp;
  const int64_t accumulation = problem.global_batch / (layout.dp * layout.micro_batch);
  const Shapes s{m,
                 layout.micro_batch,
                 problem.seq_len,
                 layout.micro_batch * problem.seq_len,
                 layout.tp,
                 layout.sequence_parallel,
                 tensor_grid_shape(layout.tp_mode, layout.tp, layout.tp_depth),
                 DeviceShare::of(rates, world),
                 precision,
                 rates};
  StepTimePrediction p;

  // The pipeline: each virtual stage's layers, the embedding before the
  // first and the head after the last.
  const int V = static_cast<int>(layout.pp * layout.virtual_stages);
  const std::vector<int> layers = pipeline_stage_layers(m, problem.seq_len, V, {});
  const auto [block_forward, block_backward] = block_cost(s, layout.recompute);
  const auto [embed_forward, embed_backward] = embedding_cost(s);
  const auto [head_forward, head_backward] = head_cost(s);
  PipelineCosts costs;
  Split per_micro_batch;  // the busiest rank's compute and communication, for the split
  std::vector<Split> rank_cost(static_cast<size_t>(layout.pp));
  for (int v = 0; v < V; ++v) {
    Split f, b;
    for (int l = 0; l < layers[static_cast<size_t>(v)]; ++l) {
      f += block_forward;
      b += block_backward;
    }
    if (v == 0) {
      f += embed_forward;
      b += embed_backward;
    }
    if (v == V - 1) {
      f += head_forward;
      b += head_backward;
    }
    costs.forward_s.push_back(f.total());
    costs.backward_s.push_back(b.total());
    rank_cost[static_cast<size_t>(v % layout.pp)] += f;
    rank_cost[static_cast<size_t>(v % layout.pp)] += b;
  }
  if (pieces) {
    // The modules of each virtual stage as the stage runs them; the blocks
    // are named by their layer, as the model's parameter groups are.
    *pieces = StepPieces{};
    pieces->forward.resize(static_cast<size_t>(V));
    pieces->backward.resize(static_cast<size_t>(V));
    int first_layer = 0;
    for (int v = 0; v < V; ++v) {
      std::vector<PredictedModule>& f = pieces->forward[static_cast<size_t>(v)];
      std::vector<PredictedModule>& b = pieces->backward[static_cast<size_t>(v)];
      if (v == 0) f.push_back(module_piece("embedding", embed_forward));
      for (int l = 0; l < layers[static_cast<size_t>(v)]; ++l)
        f.push_back(module_piece(str("h.", first_layer + l), block_forward));
      if (v == V - 1) f.push_back(module_piece("head", head_forward));
      if (v == V - 1) b.push_back(module_piece("head", head_backward));
      for (int l = layers[static_cast<size_t>(v)]; l-- > 0;)
        b.push_back(module_piece(str("h.", first_layer + l), block_backward));
      if (v == 0) b.push_back(module_piece("embedding", embed_backward));
      first_layer += layers[static_cast<size_t>(v)];
    }
  }
  // What a pipeline send carries: the rank's token rows (and columns on a
  // grid) of the residual stream.
  const double activation_bytes =
      kF32 * static_cast<double>(s.N * m.n_embd) /
      (s.grid.ranks() > 1 ? static_cast<double>(s.grid.ranks())
                          : layout.sequence_parallel ? static_cast<double>(layout.tp) : 1.0);
  // Every pipeline pair exchanges at once; a stage's neighbour is dp * tp
  // ranks on.
  costs.transfer_s = rates.collective_seconds(Collective::send_recv, activation_bytes,
                                              {static_cast<int>(world), 2 * layout.dp * layout.tp});
  p.pipeline = simulate_pipeline(layout.pp > 1 ? layout.schedule : PipelineSchedule::gpipe,
                                 static_cast<int>(layout.pp), static_cast<int>(accumulation),
                                 static_cast<int>(layout.virtual_stages), costs);
  LOOM_CHECK(p.pipeline.completed, "the pipeline schedule of a valid layout deadlocks in simulation");
  const size_t busiest = static_cast<size_t>(
      std::max_element(p.pipeline.busy_s.begin(), p.pipeline.busy_s.end()) - p.pipeline.busy_s.begin());
  per_micro_batch = rank_cost[busiest];
  p.compute_s = static_cast<double>(accumulation) * per_micro_batch.compute_s;
  p.communication_s = static_cast<double>(accumulation) * per_micro_batch.communication_s;
  p.bubble_s = p.pipeline.makespan_s - p.pipeline.busy_s[busiest];

  // After the pipeline, on each stage: the model-parallel reductions, the
  // data-parallel one, ZeRO's gathers and the optimizer, over the stage's
  // trainable elements; the slowest stage sets the step.
  const double element = static_cast<double>(dtype_size(precision));
  const int dp = static_cast<int>(layout.dp);
  const RankGroup dp_group = RankGroup::strided(dp, layout.tp);
  const Collective reduce = layout.zero_stage == 0 ? Collective::all_reduce : Collective::reduce_scatter;
  const double last_backward = costs.backward_s[busiest];
  const auto after_pipeline = [&](const StageGradients& g) {
    AfterPipeline a;
    for (const auto& [axes, n] : g.over_tp) {
      const RankGroup group = tp_axes_group(s, axes);
      a.reduce(Collective::all_reduce, group.size, rates.collective_seconds(Collective::all_reduce, n * element, group));
    }
    if (g.tied_across_stages > 0.0) {
      // The first and the last stage's ranks at the same place in theirs.
      const RankGroup ends{2, (layout.pp - 1) * layout.dp * layout.tp + 1};
      a.reduce(Collective::all_reduce, ends.size,
               rates.collective_seconds(Collective::all_reduce, g.tied_across_stages * element, ends));
    }
    if (dp > 1) {
      const double grad_bytes = g.trainable * element;
      const double reduction = rates.collective_seconds(reduce, grad_bytes, dp_group);
      // Gradient buckets reduce while the last micro-batch's backward runs
      // (what outlasts it, and at least the last bucket, is exposed), unless
      // the reduction waits for the pipeline to finish.
      const double buckets = std::max(1.0, grad_bytes / static_cast<double>(options.bucket_bytes));
      a.reduce(reduce, dp,
               g.reduced_after_pipeline ? reduction : std::max(reduction / buckets, reduction - last_backward));
      // Stages 1-2 publish the updated shards once a step; stage 3 gathers
      // each group before its forward and again before its backward, every
      // micro-batch.
      const double gather = rates.collective_seconds(Collective::all_gather, grad_bytes, dp_group);
      if (layout.zero_stage == 1 || layout.zero_stage == 2) {
        a.gathers_s = gather;
        a.step_gather = PredictedCollective{Collective::all_gather, dp, gather};
      }
      if (layout.zero_stage == 3) {
        a.gathers_s = 2.0 * static_cast<double>(accumulation) * gather;
        a.pass_gather = PredictedCollective{Collective::all_gather, dp, gather};
      }
    }
    // AdamW over this rank's shard: parameters, gradients and both moments
    // read, the parameters and moments written (fp32, 28 bytes), the working
    // copy rewritten below fp32; the gradient norm reads the gradients once
    // more.
    const double shard = layout.zero_stage >= 1 ? g.trainable / static_cast<double>(dp) : g.trainable;
    a.optimizer_s = memory_seconds(s, shard * (28.0 + 4.0 + (precision == DType::f32 ? 0.0 : 2.0 * element)));
    a.gradient_check_s = memory_seconds(s, shard * 4.0);
    return a;
  };
  AfterPipeline after;
  for (const StageGradients& g : predict_stage_gradients(problem, layout)) {
    AfterPipeline a = after_pipeline(g);
    if (a.total() >= after.total()) after = std::move(a);
  }
  p.communication_s += after.reductions_s + after.gathers_s;
  p.optimizer_s = after.optimizer_s;
  if (pieces) {
    pieces->transfer_s = costs.transfer_s;
    pieces->after_pipeline = after.reductions;
    pieces->step_gather = after.step_gather;
    pieces->pass_gather = after.pass_gather;
    pieces->gradient_check_s = after.gradient_check_s;
    pieces->update_s = after.optimizer_s - after.gradient_check_s;
  }

  // A memory policy's moves between tiers: the forward and backward's
  // beside the pipeline's work, the update's beside the optimizer's; the
  // rank that waits longest.
  if (layout.memory_policy != MemoryPolicy::none) {
    for (const StepTraffic& t : predict_step_traffic(problem, layout, options, kSteadyStep)) {
      const TierTraffic bytes = t.bytes();
      if (nvme_read_bytes(bytes) + nvme_written_bytes(bytes) > 0.0 &&
          (rates.nvme_read_bytes_per_s <= 0.0 || rates.nvme_write_bytes_per_s <= 0.0))
        throw Error(str("memory.nvme_dir places model state on NVMe, and the machine rates have no NVMe figures "
                        "to price its reads and writes: run `loom calibrate --nvme-dir DIR` with DIR on the disk "
                        "of memory.nvme_dir (or give the hardware file an \"nvme\" entry with read_bytes_per_s "
                        "and write_bytes_per_s)"));
      const TransferSeconds model = exposed_transfers(s, t.model, p.pipeline.makespan_s);
      const TransferSeconds update = exposed_transfers(s, t.update, p.optimizer_s);
      const double exposed = model.total() + update.total();
      if (exposed >= p.transfer_s) {
        p.transfer_s = exposed;
        p.traffic = t;
        if (pieces) {
          pieces->model_moves = model;
          pieces->update_moves = update;
        }
      }
    }
  }

  p.step_s =
      p.pipeline.makespan_s + after.reductions_s + after.gathers_s + p.optimizer_s + p.transfer_s;
  p.tokens_per_s = static_cast<double>(problem.global_batch * problem.seq_len) / p.step_s;
  const double peak = (precision != DType::f32 && rates.peak_flops_bf16 > 0 ? rates.peak_flops_bf16
                                                                             : rates.peak_flops_fp32) *
                      (rates.shared_by_local_ranks ? 1.0 : static_cast<double>(world));
  p.mfu = training_flops_per_step(m, problem.global_batch, problem.seq_len) / (p.step_s * peak);
  return p;
}

}  // namespace loom
