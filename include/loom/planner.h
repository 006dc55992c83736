// loom planner: what a training step costs in memory and FLOPs, computed from
// shapes alone. The benchmarks and tests hold the allocator's measured
// figures against these, and a run can be checked against its budgets
// before anything is allocated.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/memory.h"
#include "loom/nn.h"
#include "loom/parallel.h"
#include "loom/trace.h"

namespace loom {

// Model FLOPs of one training step (forward + backward), Megatron-LM's count
// (Narayanan et al. 2021) without recompute, with M = layer_matmul_weights:
//   6 B s L M + 12 B s^2 L q + 6 B s h V (q = n_head * head_dim, h unless
// model.head_dim says otherwise);
// for GPT-2 (M = 12 h^2) that is 72 B s L h^2 (1 + s/(6h) + V/(12 L h)).
// With LoRA the frozen weights take no weight gradient (4 instead of 6 per
// weight) and the adapters' r (in + out) weights per adapted layer add 6 each.
double training_flops_per_step(const GPTConfig& cfg, int64_t B, int64_t T);
// Its parts for one sequence of seq_len tokens: each block's, and the output
// head's.
double block_training_flops(const GPTConfig& cfg, int64_t seq_len);
double head_training_flops(const GPTConfig& cfg, int64_t seq_len);
// The weights of one block's matrix multiplies: q, k, v and the output
// projection (2 h q + 2 h kv, q = n_head * head_dim, kv = n_kv_head *
// head_dim) and the MLP (2 h I,
// SwiGLU 3 h I).
double layer_matmul_weights(const GPTConfig& cfg);

// Activation bytes one transformer block keeps from its forward to its
// backward, per rank, for a micro-batch of B x T tokens: Korthikanti et al.'s
// s b h (34 + 5 a s / h) adapted to what loom stores. With N = B T tokens,
// h = n_embd, a = n_head, t = tp, fp32 (4 bytes), and no a s^2 term because
// attention keeps only its log-sum-exp, not the probability matrix:
//   tensor parallel:          4 N (4h + 4) + 4 N (12h + a) / t
//   + sequence parallel:      4 N (16h + 4 + a) / t
//   full recompute:           4 N h   (4 N h / t with sequence parallelism)
// (x, the ln_1 and ln_2 outputs, the residual r and the norms' mean and rstd
// sit outside the tensor-parallel regions; qkv, attention out, fc and GELU
// out and the log-sum-exp inside.) Dropout masks are regenerated, not kept.
double activation_bytes_per_layer(const GPTConfig& cfg, int64_t B, int64_t T, int tp, bool sequence_parallel,
                                  bool checkpoint_activations);
// The same on a 2D/2.5D/3D grid (TensorGrid): every tensor a block keeps is
// split, its n = N / (q depth) token rows (N / q^2 on a cube) by q of its
// columns, and the norms' statistics are per row, held by each of the q
// ranks that split a row:
//   4 n ((16 h + a) / q + 4)   (GPT-2; LLaMA's widths as the 1D formula's)
//   full recompute:            4 n h / q
double grid_activation_bytes_per_layer(const GPTConfig& cfg, int64_t B, int64_t T, const TensorGridShape& grid,
                                       bool checkpoint_activations);

// Parameter elements each tensor-parallel rank holds of a whole model (one
// pipeline stage, no LoRA), with t = tp:
//   1D         every matrix and the token table / t (k and v whole when
//              there are fewer kv heads than ranks), the column-parallel
//              layers' biases / t; the row-parallel layers' biases, the norms
//              and the positions whole;
//   2D/2.5D    every matrix / q^2 (a copy in each of the depth's layers), the
//              token table / q^2; biases, norms and positions / q;
//   3D         every matrix and the token table / q^3 = / t; biases, norms
//              and positions / q.
// The token table's rows are padded to the cut (ceil).
double tensor_parallel_param_elements(const GPTConfig& cfg, int tp, const TensorGridShape& grid);

// Elements each rank of a grid sends for one linear layer of `out` x `in`
// over N token rows, forward and backward (CommStats' ring model: an
// all-gather or reduce-scatter over g ranks sends (g - 1) pieces). With
// n = N / (q depth) rows per rank:
//   2D/2.5D (SUMMA)   3 (q-1) out in / q^2 + 2 (q-1) n out / q
//                     (2.5D sums the weight gradient over the depth once per
//                     step besides: grid_weight_gradient_elements_sent);
//   3D (the cube)     3 (q-1) out in / q^3 + (q-1) n (3 in + 2 out) / q.
// 1D's pair of column- and row-parallel layers all-reduces the [N, h]
// activation once forward and once backward: 4 (tp-1) / tp N h.
double grid_linear_elements_sent(int64_t out, int64_t in, int64_t N, const TensorGridShape& grid);
// Elements each rank of a grid sends over the grid's groups in one training
// step of `micro_batches` micro-batches of B x T tokens (one pipeline stage
// holding the whole model, no adapters): per micro-batch every block's four
// layers (grid_linear_elements_sent) and its norms' statistics (forward: the
// row sums, LayerNorm's two; backward: [n, 2]), the embedding's scatter and
// gather over the table group, the head over the padded vocabulary and the
// vocabulary-parallel cross-entropy's [n] and [n, 2] all-reduces; per step
// one all-reduce per set of partial gradients (the biases, norms and
// positions over their token axes; 2.5D's matrices and token table over
// the depth) and the loss's sum over the inner token group.
double grid_step_elements_sent(const GPTConfig& cfg, int64_t B, int64_t T, int64_t micro_batches,
                               const TensorGridShape& grid);
// Elements each rank sends per step to sum a 2.5D grid's weight gradient of
// `out` x `in` over the depth (an all-reduce of its out in / q^2 block); 0 on
// 2D and 3D, whose weight gradients are whole.
double grid_weight_gradient_elements_sent(int64_t out, int64_t in, const TensorGridShape& grid);

// Model-state bytes per rank for `params` parameters on `ranks` data-parallel
// ranks under ZeRO `stage` (Rajbhandari et al. 2020). fp32 training keeps
// parameters, gradients and both AdamW moments at 4 bytes: 16, 8+8/N,
// 4+12/N, 16/N bytes per parameter for stages 0-3. bf16/f16 keep 2-byte
// parameters, 12 bytes of fp32 master weights and moments, and gradients of
// 2 bytes under stages 0-1 (rounded once from the transient fp32 sum of the
// micro-batches) or 4 under stages 2-3 (the sharded fp32 accumulation):
// 16, 4+12/N, 2+16/N, 18/N.
double zero_model_state_bytes(int stage, DType precision, double params, int ranks);

// The cost a pipeline's stages are balanced by: each transformer layer's
// training FLOPs for one sequence of `seq_len` tokens, with the output head's
// (the tied V x C matmul) folded into the last; the embedding lookup and the
// cross-entropy's O(V) per token are left out, as in Megatron's count. The
// costs sum to training_flops_per_step(cfg, 1, seq_len).
std::vector<double> pipeline_layer_costs(const GPTConfig& cfg, int64_t seq_len);

// Layers per virtual stage for `virtual_stages` = pp * chunks stages: the
// override when one is given (validated: one entry per virtual stage, each at
// least 1, summing to n_layer; Error naming parallel.stage_layers otherwise),
// else balance_layers over pipeline_layer_costs. Error when there are more
// virtual stages than layers.
std::vector<int> pipeline_stage_layers(const GPTConfig& cfg, int64_t seq_len, int virtual_stages,
                                       const std::vector<int>& override_layers);

// ---------------------------------------------------------------------------
// Layout validity, as data
// ---------------------------------------------------------------------------

// How a run spreads over ranks and memory: the choices a layout search
// varies, each the value of one config key.
struct Layout {
  int64_t dp = 1, tp = 1, pp = 1;              // parallel.dp, .tp, .pp
  TensorParallelMode tp_mode = TensorParallelMode::one_d;  // parallel.tp_mode
  int64_t tp_depth = 1;                        // parallel.tp_depth (2.5d)
  bool sequence_parallel = false;              // parallel.sequence_parallel
  PipelineSchedule schedule = PipelineSchedule::one_f_one_b;  // parallel.schedule
  int64_t virtual_stages = 1;                  // parallel.virtual_stages
  int64_t micro_batch = 1;                     // train.micro_batch_size
  int zero_stage = 0;                          // zero.stage
  bool recompute = false;                      // train.activation_checkpointing
  MemoryPolicy memory_policy = MemoryPolicy::none;  // memory.policy
};

// What a layout is held against: the model, the batch, and what else the
// user fixed.
struct LayoutProblem {
  GPTConfig model;
  int64_t global_batch = 1;  // train.batch_size
  int64_t seq_len = 1;       // train.seq_len
  // parallel.stage_layers is set: an interleaved pipeline's layers need not
  // split evenly.
  bool stage_layers_given = false;
  // model.preset = "custom": a fix may name model.* keys.
  bool model_shape_settable = false;
};

// Why a layout breaks a rule, in ConfigError's terms: the key to change,
// what is wrong with its value, and values that would work.
struct LayoutViolation {
  std::string key, problem, fix;
  std::string rule = {};  // the LayoutRule's name
};

// One rule a layout must satisfy: a predicate returning its violation.
struct LayoutRule {
  const char* name;
  std::optional<LayoutViolation> (*check)(const LayoutProblem&, const Layout&);
};

// Every layout rule, in the order they are checked (a rule may assume the
// ones before it hold). plan_training throws the first violation as a
// ConfigError; the layout search reports it as the reason a candidate was
// rejected, so the two never disagree.
std::span<const LayoutRule> layout_rules();
// The first rule `layout` breaks, or nullopt when it is valid.
std::optional<LayoutViolation> check_layout(const LayoutProblem& problem, const Layout& layout);

// Every layout of `world` ranks (dp * tp * pp = world) the search considers,
// valid or not: each tensor-parallel mode whose grid tp forms (1D always;
// 2.5D at every depth), sequence-parallel setting, schedule, virtual-stage
// count up to one past a layer per stage, micro-batch size dividing the
// batch, ZeRO stage, recompute setting and memory policy.
std::vector<Layout> layout_candidates(const LayoutProblem& problem, int64_t world);

// The settings that select `layout`, as `loom train --set` takes them
// ("parallel.tp=2", ...), one per Layout field.
std::vector<std::string> layout_settings(const Layout& layout);

// ---------------------------------------------------------------------------
// Machine rates: what the time model prices work with
// ---------------------------------------------------------------------------

// Hockney's alpha-beta model: moving b bytes takes latency + b / bandwidth.
struct LinkCost {
  double latency_s = 0.0;
  double bytes_per_s = 0.0;
  double seconds(double bytes) const { return latency_s + bytes / bytes_per_s; }
};

enum class Collective : uint8_t { all_reduce, reduce_scatter, all_gather, send_recv };
const char* collective_name(Collective op);  // "all_reduce", ...

// One fp32 GEMM, C[m, n] = A[m, k] B[k, n], and the rate it ran at on
// `threads` OpenMP threads (0: all of the machine's, as calibrations before
// thread counts were recorded measured).
struct GemmSample {
  int64_t m = 0, n = 0, k = 0;
  double flops_per_s = 0.0;
  int threads = 0;
};

// Causal attention of one head over one sequence of seq_len tokens, forward
// and backward (loom's attention kernels, not GEMMs), and their times.
struct AttentionSample {
  int64_t seq_len = 0, head_dim = 0;
  double forward_s = 0.0, backward_s = 0.0;
  int threads = 0;  // as GemmSample's
};

// Where the ranks of a collective sit: `size` ranks inside one aligned block
// of `span` consecutive world ranks (DeviceMesh order: pp outermost, then
// dp, tp innermost; a grid's tp rank t sits at layer t / q^2, row
// (t / q) % q, column t % q). A node holds ranks_per_node consecutive world
// ranks, so the group stays on one node when its span divides
// ranks_per_node, and crosses nodes otherwise.
struct RankGroup {
  int size = 1;
  int64_t span = 1;
  // `size` consecutive ranks: a tensor-parallel group, a grid's row.
  static RankGroup consecutive(int size) { return {size, size}; }
  // `size` ranks `stride` apart: a data-parallel group (stride tp), a grid's
  // column (stride q).
  static RankGroup strided(int size, int64_t stride) { return {size, size * stride}; }
};

// A collective over `group` ranks, its cost fitted against the bytes of each
// rank's buffer (all_reduce: the buffer; reduce_scatter: the input;
// all_gather: the output; send_recv: the message).
struct CollectiveCost {
  Collective op = Collective::all_reduce;
  int group = 2;
  LinkCost cost;
};

// A machine's rates, measured here (`loom calibrate`) or read from a
// hardware description file for machines not at hand (hardware/*.json).
// Measured rates price work directly; a hardware file gives peaks, and the
// time model derives the rest (GEMMs at peak * gemm_efficiency, collectives
// as rings over the intra- or inter-node link).
struct MachineRates {
  std::string description;  // where the figures come from
  // fp32 GEMM rates on a grid of shapes (calibration); empty for a
  // hardware file, which prices a GEMM at peak_flops * gemm_efficiency.
  std::vector<GemmSample> gemm;
  // Attention kernel times on a grid of (seq_len, head_dim) (calibration);
  // empty: attention is priced at its products' GEMM rate.
  std::vector<AttentionSample> attention;
  double peak_flops_fp32 = 0.0, peak_flops_bf16 = 0.0;
  double gemm_efficiency = 1.0;      // the fraction of peak large GEMMs reach
  double memory_bytes_per_s = 0.0;   // streaming copy within device memory
  double device_memory_bytes = 0.0;  // per device
  std::vector<CollectiveCost> collectives;  // measured; empty for a hardware file
  int ranks_per_node = 1;
  LinkCost intra_node, inter_node;   // one link's latency and bandwidth
  LinkCost host_device;              // zero bandwidth: the device is the host
  double nvme_read_bytes_per_s = 0.0, nvme_write_bytes_per_s = 0.0;  // 0: not measured

  // Local ranks share this machine's device (a calibrated CPU: ranks are
  // threads dividing its cores), rather than having one each (GPUs).
  bool shared_by_local_ranks = false;
  // The OpenMP threads a calibration ran with, which local ranks divide
  // (run_local: each of w ranks gets max(1, threads / w)); 0 when unknown
  // (a hardware file, or a calibration from before it was recorded).
  int threads = 0;

  // Seconds of one GEMM in `precision` on `threads` threads (0: all):
  // interpolated in log space between the shapes measured at the thread
  // count nearest to it (clamped to the grid; the CPU backend computes every
  // precision's GEMMs in fp32, which is what was measured), or, from a
  // hardware file, the precision's peak * gemm_efficiency.
  double gemm_seconds(int64_t m, int64_t n, int64_t k, DType precision = DType::f32, int threads = 0) const;
  // Seconds of causal attention of one head over one sequence, forward or
  // backward: interpolated like GEMMs between the measured (seq_len,
  // head_dim), or at the rate of a (seq_len, seq_len, head_dim) GEMM.
  double attention_seconds(int64_t seq_len, int64_t head_dim, bool backward, DType precision = DType::f32,
                           int threads = 0) const;
  // Seconds of a collective over `group` moving a buffer of `bytes` per
  // rank: the measured fit for that op and group size where there is one
  // (a calibration measures ranks on this one machine), else a ring over the
  // intra-node link when the group stays on one node, or the inter-node link
  // when it crosses nodes (each rank with its own port, as in the hardware
  // files: the ring runs at one port's bandwidth): all_reduce
  // 2 (g-1) (a + b / (g B)), reduce_scatter and all_gather
  // (g-1) (a + b / (g B)), send_recv a + b / B. For send_recv, `group.size`
  // is the number of ranks exchanging messages at once (a message waits
  // longer when they outnumber the cores; the measurement with the nearest
  // count is used) and `group.span` the block holding a sender and its
  // receiver.
  double collective_seconds(Collective op, double bytes, RankGroup group) const;
  // Whether a group's ranks share one node.
  bool within_node(RankGroup group) const;
};

struct CalibrationOptions {
  // Each of m, n, k takes every size. From 32: a micro-batch of one short
  // sequence, or a small model's width, is priced at its own rate rather
  // than at the smallest size's.
  std::vector<int64_t> gemm_sizes{32, 128, 512, 2048};
  // The thread counts GEMMs and attention are measured at (local ranks run
  // on a share of the threads, and small products gain little from more);
  // empty: 1, 2, 4, ... below the OpenMP threads, and those.
  std::vector<int> threads;
  std::vector<int64_t> attention_seq_lens{64, 256, 1024}, attention_head_dims{32, 64, 128};
  std::vector<int> groups{2, 4};                     // local ranks the collectives are timed on
  int64_t memory_bytes = int64_t(256) << 20;         // the buffer the copy rate is timed on
  std::filesystem::path nvme_dir;                    // empty: the NVMe rates are not measured
  uint64_t nvme_bytes = uint64_t(256) << 20;
  std::function<void(const std::string&)> progress;  // one line per measurement
};

// Measures this machine: GEMM rates on the grid, the attention kernels, the
// copy rate, each collective at two sizes per group on local ranks (fitted
// to alpha-beta; send_recv between pairs of ranks, all pairs at once),
// and the NVMe rates when a directory is given. About half a minute with the
// defaults on a small CPU.
MachineRates calibrate_machine(const CalibrationOptions& options);

// ---------------------------------------------------------------------------
// Step time
// ---------------------------------------------------------------------------

// What a layout leaves open that changes a step's memory and time.
struct StepMemoryOptions {
  DType precision = DType::f32;           // zero.precision
  int64_t bucket_bytes = int64_t(25) << 20;  // zero.bucket_bytes
  // Chunk placement (memory.*): its policy is Layout::memory_policy, the
  // rest (offload fractions, chunk size, prefetch, NVMe directory,
  // micro_batches) is read from here.
  MemoryOptions memory;
};

// One micro-batch's forward and backward seconds on each virtual stage, and
// the seconds an activation (or its gradient) takes from one rank to the next.
struct PipelineCosts {
  std::vector<double> forward_s, backward_s;  // per virtual stage
  double transfer_s = 0.0;
};

// A pipeline step as the schedule runs it, action by action.
struct PipelineTimeline {
  struct Span {
    int rank = 0;
    PipelineAction action;
    double start_s = 0.0, end_s = 0.0;
  };
  bool completed = false;  // false: the ranks' schedules deadlock
  double makespan_s = 0.0;
  std::vector<double> busy_s;  // per pipeline rank
  std::vector<Span> spans;     // every action of every rank
};

// Runs every pipeline rank's pipeline_actions in order, each action as soon
// as its rank is free and its input has arrived (transfer_s after the
// neighbour finished): run_pipeline's timeline for these costs.
PipelineTimeline simulate_pipeline(PipelineSchedule schedule, int stages, int micro_batches, int chunks,
                                   const PipelineCosts& costs);

// Moves between tiers, [from][to]: their bytes, and how many there are
// (copies and NVMe requests, each paying a latency).
struct TierMoves {
  TierTraffic bytes, count;
};

// One rank's traffic between tiers in one training step under a memory
// policy, as the chunk manager moves it: its bytes are what the step adds
// to MemoryReport::traffic, to the byte. Split by phase: forward and
// backward of every micro-batch (`model`), and the optimizer step with
// what follows it (`update`: auto's placement after its warm-up step); and
// by whether the code waits for a move as it issues it (`waited`: a chunk
// fetched at its acquire, a gradient written out, the update's staging, a
// copy that an all-gather's issue synchronizes, an NVMe read it blocks on)
// or starts it ahead of the work that needs it (`ahead`: a prefetched
// chunk's copy on one rank or its NVMe read, the update's NVMe reads of
// later chunks, every NVMe write behind).
struct StepTraffic {
  struct Phase {
    TierMoves waited, ahead;
  };
  int dp_rank = 0;
  Phase model, update;
  TierTraffic bytes() const;  // all four parts' bytes
};

// Every rank's StepTraffic in step `step` (counted from 1) of a run,
// counted during the memory model's replay of the chunk stores
// (predict_step_memory's, with its placement): the first step learns the
// chunks' order, so nothing is prefetched, and auto places the state after
// it; the second moves auto's parameters to the device at their first use;
// from the third on every step moves the same. Under memory.policy =
// "none" nothing moves (the ZeRO stores keep everything on the device).
// predict_step_memory's assumption holds here too: auto's budgets hold every
// chunk on the device, so from its third step nothing moves.
std::vector<StepTraffic> predict_step_traffic(const LayoutProblem& problem, const Layout& layout,
                                              const StepMemoryOptions& options, int step);

// One rank's trainable gradient elements on each pipeline stage, and those
// of them that a model-parallel reduction completes after the pipeline
// (Trainer::reduce_model_parallel_gradients): partial sums over tensor-
// parallel axes (sequence-parallel norms and biases, a grid's replicated
// parameters), one fused all-reduce per set of axes; and the tied
// embedding's copy on the first and last stages, summed between them.
struct StageGradients {
  double trainable = 0.0;
  std::map<TpAxes, double> over_tp;  // by TpAxes (1D: kTpAll)
  double tied_across_stages = 0.0;
  // Trainer's defer_reduction_: pipeline stages or partial gradients hold
  // the data-parallel reduction back until after the pipeline, so it does
  // not overlap the last backward.
  bool reduced_after_pipeline = false;
};
std::vector<StageGradients> predict_stage_gradients(const LayoutProblem& problem, const Layout& layout);

// The predicted step of a layout on a machine, for its busiest rank.
struct StepTimePrediction {
  double compute_s = 0.0;        // forward, backward and recompute work
  double communication_s = 0.0;  // exposed: tp/sp collectives, pipeline sends, dp/ZeRO not hidden by compute
  double bubble_s = 0.0;         // pipeline idle, sends included
  double transfer_s = 0.0;       // exposed: host/NVMe traffic of offloaded state
  double optimizer_s = 0.0;      // gradient norm, AdamW and its collectives
  double step_s = 0.0;
  double tokens_per_s = 0.0;
  double mfu = 0.0;  // model FLOPs (planner.h's count) over the step's peak FLOPs
  PipelineTimeline pipeline;
  // Under a memory policy, the steady step's traffic of the rank whose
  // transfers are exposed longest (the one transfer_s is of).
  StepTraffic traffic;
};

// One collective of a predicted step: the ranks of its group, and its
// seconds.
struct PredictedCollective {
  Collective op = Collective::all_reduce;
  int group = 1;
  double seconds = 0.0;
};

// One module's forward or backward for one micro-batch on one rank, named as
// the model's parameter groups are ("embedding", "h.<layer>", "head"): its
// compute, and the collectives it issues inside, in order (their seconds sum
// to communication_s).
struct PredictedModule {
  std::string name;
  double compute_s = 0.0, communication_s = 0.0;
  std::vector<PredictedCollective> collectives;
};

// Seconds of a memory policy's moves between tiers on the two resources
// that run them: the copy engine (host <-> device, or memory copies where
// the device is the host) and the disk (NVMe reads and writes).
struct TransferSeconds {
  double copy_s = 0.0, disk_s = 0.0;
  double total() const { return copy_s + disk_s; }
};

// The pieces predict_step_time sums to a step, for its timeline
// (predict_step_trace).
struct StepPieces {
  // Per virtual stage, one micro-batch's modules in the order they run
  // (forward: embedding, blocks, head; backward the reverse). A virtual
  // stage's forward_s / backward_s in the pipeline is their sum.
  std::vector<std::vector<PredictedModule>> forward, backward;
  double transfer_s = 0.0;  // an activation (or its gradient) to the next pipeline rank
  // ZeRO's parameter gathers over the data-parallel ranks: stages 1-2 once
  // a step, stage 3 before every micro-batch's forward and its backward.
  std::optional<PredictedCollective> step_gather, pass_gather;
  // After the pipeline, on the stage whose part after it is the longest, in
  // the Trainer's order: the model-parallel reductions (StageGradients: a
  // fused all-reduce per set of tensor-parallel axes, then the tied
  // embedding's between the first and last stages) and what the
  // data-parallel gradient reduction leaves exposed.
  std::vector<PredictedCollective> after_pipeline;
  // StepTimePrediction::optimizer_s: the gradient norm's read of the
  // gradients, then the update.
  double gradient_check_s = 0.0, update_s = 0.0;
  // A memory policy's exposed moves (their sum is
  // StepTimePrediction::transfer_s): the forward and backward's beyond the
  // pipeline's work, and the update's beyond the optimizer's.
  TransferSeconds model_moves, update_moves;
};

// Prices every piece of a step with `rates`: each GEMM by its rank-local
// shape, attention by MachineRates::attention_seconds, memory-bound
// kernels by the bytes they read and write, each collective by its alpha-beta
// cost over its group, and the pipeline by simulating its schedule. Local
// ranks that share the device (rates.shared_by_local_ranks) get 1 / ranks of
// it each.
//
// Offloaded state (memory.policy static/auto) moves what
// predict_step_traffic gives for a steady step: between the host and the
// device at rates.host_device (its latency per move), or, where the device
// is the host (no host_device link: a calibrated CPU), as memory copies
// that read and write every byte at memory_bytes_per_s on the rank's share;
// NVMe reads and writes at the NVMe rates, the disk shared by the node's
// ranks. What the code waits for is exposed; what it starts ahead runs
// beside its phase's work (forward and backward, or the optimizer) on the
// copy engine or the disk, and only what outlasts that work is exposed. On
// a CPU no copy is hidden: the CPU backend's (default, synchronous) streams
// run a copy on the rank's thread as it is issued; only NVMe I/O overlaps.
// Throws Error when a layout moves NVMe bytes and the rates have no NVMe
// figures. With `pieces`, also the pieces it sums, one by one.
StepTimePrediction predict_step_time(const LayoutProblem& problem, const Layout& layout,
                                     const StepMemoryOptions& options, const MachineRates& rates,
                                     StepPieces* pieces = nullptr);

// The predicted step as a timeline of every world rank (DeviceMesh order: pp
// outermost, then dp, tp innermost), in the measured trace's terms
// (trace.h, `trace.path`) so the two open side by side: from time 0, the
// step span "step 1" of StepTimePrediction::step_s; inside it, in order,
// ZeRO-1/2's gather, the rank's pipeline actions as simulate_pipeline
// places them (each a module span "<module> forward" / "<module> backward"
// per module of its virtual stage, with the module's collectives
// "<op> (<group size>)" inside, spread evenly through its compute; ZeRO-3's
// gather before each; the time a rank waits for a neighbour's activation or
// gradient idle, its last PipelineCosts::transfer_s "recv (<pp>)"), then,
// from the pipeline's makespan on every rank, a memory policy's exposed
// moves of the forward and backward (category transfer: the copies'
// "chunk move", the disk's "nvme read", as the chunk manager names its
// moves), the model-parallel reductions, the exposed data-parallel one, and
// the optimizer's "gradient check", the update's exposed moves and "clip
// and update". Ranks of one pipeline stage share their spans.
struct PredictedTrace {
  StepTimePrediction prediction;
  std::vector<std::vector<TraceSpan>> ranks;  // per world rank, in ticks
  double ticks_per_us = 1e3;                  // fine enough for pieces well under a nanosecond
  std::string json() const { return chrome_trace_json(ranks, ticks_per_us); }
};
PredictedTrace predict_step_trace(const LayoutProblem& problem, const Layout& layout,
                                  const StepMemoryOptions& options, const MachineRates& rates);

// A training run a publication reports, to hold the time model's what-if
// against: the model and layout as published, the machine (a file in
// hardware/), and the seconds per iteration reported, or implied by a
// reported per-GPU throughput and the paper's own FLOP count.
struct PublishedRun {
  std::string name;         // "GPT-3 175B, sequence parallel + selective recompute"
  std::string source;       // "Korthikanti et al. 2022, Tables 3 and 5"
  std::string hardware;     // "a100-sxm-80gb.json"
  LayoutProblem problem;
  Layout layout;
  DType precision = DType::bf16;
  double reported_step_s = 0.0;
  std::string assumptions;  // what the publication leaves open and loom assumes
};
// Megatron-LM's runs on Selene (A100 80GB, 8 per node, one 200 Gb/s HDR port
// per GPU): Narayanan et al. 2021 (Table 2, GPT-3 175B and 530B under PTD
// parallelism and under ZeRO-3), Korthikanti et al. 2022 (Table 5, 22B to 1T
// with full recompute, and with sequence parallelism and selective
// recompute, which loom's attention, keeping only its log-sum-exp, does
// without recomputing anything).
std::vector<PublishedRun> published_runs();

// JSON, written atomically. load_machine_rates reads what save wrote and
// hardware description files alike, and throws Error naming the file and
// the field for a missing, mistyped or non-positive value.
void save_machine_rates(const MachineRates& rates, const std::filesystem::path& path);
MachineRates load_machine_rates(const std::filesystem::path& path);
// Where `loom calibrate` writes and the planner looks by default:
// $XDG_CACHE_HOME/loom/calibration.json, else ~/.cache/loom/calibration.json,
// else calibration.json in the working directory.
std::filesystem::path default_calibration_path();

// ---------------------------------------------------------------------------
// Memory model
// ---------------------------------------------------------------------------

// One named part of a peak: the bytes of the tensors of one kind live then.
struct MemoryTerm {
  std::string name;
  double bytes;
};

// One tier's high-water mark in a step: the bytes, where in the step it
// falls, and what is live then, term by term.
struct TierPeak {
  double bytes = 0.0;
  // The allocator's reserved high-water mark (Allocator::peak_reserved):
  // blocks rounded up to their size class, cached free blocks included.
  double reserved = 0.0;
  std::string phase;
  std::vector<MemoryTerm> terms;
};

// One rank's peaks (rank: its world rank in DeviceMesh order, pp outermost,
// then dp, tp innermost).
struct RankMemory {
  int pp_stage = 0, dp_rank = 0, tp_rank = 0;
  TierPeak tiers[3];  // by Tier
  double peak(Tier t) const { return tiers[static_cast<int>(t)].bytes; }
  // "device peak 1.2 MiB (reserved 1.3 MiB) in h.3 backward:", then a line
  // per term.
  std::string describe(Tier t) const;
};

// The peak bytes per rank and tier of one steady-state training step (the
// second: the first learns ZeRO-3's acquisition order and auto's placement)
// of `layout`, as the allocators count them: Allocator::peak (bytes
// requested) and peak_reserved (blocks of the caching allocator; which
// cached block a tensor reuses is as with synchronous streams, since under
// asynchronous ones a block returns to the cache when its stream's work ends). Built
// from how loom allocates, not from running it: the parameter groups each
// rank holds (its pipeline stage's layers, tensor-parallel shards, LoRA's
// frozen base), the ZeRO stores' buffers (working parameters, gradients,
// fp32 masters and moments, bucket scratch, gathered groups) or a memory
// policy's chunk stores (payloads on their tiers, gathered and prefetched
// chunks, gradient chunks, the optimizer's staging, NVMe buffers), the
// tensors each module keeps from its forward to its backward and the
// temporaries of each, the pipeline schedule's order and its pending sends,
// and the optimizer step. The allocations are replayed in the step's order
// and the live bytes' maximum taken, so the peak's terms are the tensors
// live at that moment. Assumed: the pipeline's layers balanced as
// model_parallel_for balances them without parallel.stage_layers; a send
// held until the schedules guarantee its delivery (a run may free it
// sooner); auto with budgets that hold every chunk on the device.
std::vector<RankMemory> predict_step_memory(const LayoutProblem& problem, const Layout& layout,
                                            const StepMemoryOptions& options);
// The most device bytes any rank's step holds outside the chunk stores of a
// memory policy (activations and their temporaries, frozen weights and their
// fp32 copies): what plan_memory is given besides the model state.
double device_bytes_beside_chunks(const LayoutProblem& problem, const Layout& layout,
                                  const StepMemoryOptions& options);

// "3,3,2": n_layer layers over `parts` virtual stages as evenly as they go,
// in parallel.stage_layers' syntax.
std::string even_stage_layers(int64_t n_layer, int64_t parts);

}  // namespace loom
