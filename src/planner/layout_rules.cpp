// The rules a layout must satisfy, as data: each rule is a predicate that
// returns why a layout breaks it (the key to change, what is wrong, and the
// values that would work), so that the config check (plan_training) and the
// layout search hold layouts to exactly the same rules.
#include <algorithm>
#include <array>

#include "loom/planner.h"

namespace loom {

namespace {

// The valid values nearest to `x` in [lo, hi], one below and one above where
// they exist, for the "fix:" part of a message.
template <typename Valid>
std::vector<int64_t> nearest_valid(int64_t x, int64_t lo, int64_t hi, Valid valid) {
  std::vector<int64_t> found;
  for (int64_t v = std::min(x - 1, hi); v >= lo; --v)
    if (valid(v)) {
      found.push_back(v);
      break;
    }
  for (int64_t v = std::max(x + 1, lo); v <= hi; ++v)
    if (valid(v)) {
      found.push_back(v);
      break;
    }
  return found;
}

// "<key> = a or b", or nothing when no value was found.
std::string assign_one_of(std::string_view key, const std::vector<int64_t>& values) {
  if (values.empty()) return "";
  std::string text = str(key, " = ", values[0]);
  for (size_t i = 1; i < values.size(); ++i) text += str(" or ", values[i]);
  return text;
}

// "set a, or b, or c" of the alternatives that are not empty.
std::string set_one_of(std::initializer_list<std::string> alternatives) {
  std::string text;
  for (const std::string& a : alternatives)
    if (!a.empty()) text += str(text.empty() ? "set " : ", or ", a);
  return text;
}

using Found = std::optional<LayoutViolation>;

// Micro-batches per step and rank; meaningful once batch_divides holds.
int64_t accumulation(const LayoutProblem& p, const Layout& l) { return p.global_batch / (l.dp * l.micro_batch); }

Found batch_divides(const LayoutProblem& p, const Layout& l) {
  const int64_t per_step = l.dp * l.micro_batch;
  if (p.global_batch % per_step == 0) return std::nullopt;
  const int64_t down = p.global_batch / per_step * per_step;
  return LayoutViolation{
      "train.batch_size",
      l.dp == 1 ? str("must be a multiple of train.micro_batch_size = ", l.micro_batch)
                : str("must be a multiple of train.micro_batch_size * parallel.dp = ", l.micro_batch, " * ", l.dp,
                      " = ", per_step),
      str("set train.batch_size to ", down > 0 ? str(down, " or ") : std::string(), down + per_step)};
}

// Attention splits by head (q, and the output projection's input, are
// n_head * head_dim wide); the residual width n_embd is never split.
Found tp_divides_heads(const LayoutProblem& p, const Layout& l) {
  const GPTConfig& m = p.model;
  if (l.tp_mode != TensorParallelMode::one_d || m.n_head % l.tp == 0) return std::nullopt;
  return LayoutViolation{
      "parallel.tp",
      str("must divide model.n_head = ", m.n_head, ", since each tensor-parallel rank computes whole attention heads"),
      set_one_of({assign_one_of("parallel.tp",
                                nearest_valid(l.tp, 1, m.n_head, [&](int64_t t) { return m.n_head % t == 0; })),
                  p.model_shape_settable
                      ? assign_one_of("model.n_head", nearest_valid(m.n_head, 1, 1024,
                                                                    [&](int64_t h) {
                                                                      return h % l.tp == 0 && (m.head_size > 0 || m.n_embd % h == 0);
                                                                    }))
                      : std::string()})};
}

// kv heads split like the query heads, or, fewer than the ranks, are shared
// by an equal number of them.
Found tp_fits_kv_heads(const LayoutProblem& p, const Layout& l) {
  const GPTConfig& m = p.model;
  const int64_t nkv = m.kv_heads();
  if (l.tp_mode != TensorParallelMode::one_d || nkv % l.tp == 0 || l.tp % nkv == 0) return std::nullopt;
  return LayoutViolation{"parallel.tp",
                         str("must divide or be a multiple of model.n_kv_head = ", nkv,
                             ", since each tensor-parallel rank computes whole kv heads or shares one"),
                         assign_one_of("parallel.tp", nearest_valid(l.tp, 1, m.n_head, [&](int64_t t) {
                                         return m.n_head % t == 0 && (nkv % t == 0 || t % nkv == 0);
                                       }))};
}

Found tp_divides_intermediate(const LayoutProblem& p, const Layout& l) {
  const int64_t inter = p.model.intermediate();
  if (l.tp_mode != TensorParallelMode::one_d || inter % l.tp == 0) return std::nullopt;
  return LayoutViolation{"parallel.tp", str("must divide the MLP's model.intermediate_size = ", inter),
                         p.model_shape_settable ? str("set model.intermediate_size to a multiple of ", l.tp)
                                                : str("choose parallel.tp dividing ", inter)};
}

// The vocabulary is padded to a multiple of tp (the padding rows are masked
// out of the softmax), so only a vocabulary smaller than the group fails.
Found tp_within_vocab(const LayoutProblem& p, const Layout& l) {
  if (p.model.vocab_size >= l.tp) return std::nullopt;
  return LayoutViolation{"parallel.tp",
                         str("may not exceed model.vocab_size = ", p.model.vocab_size,
                             ", since each tensor-parallel rank holds at least one row of the embedding"),
                         str("set parallel.tp <= ", p.model.vocab_size)};
}

// The grid a layout's tensor-parallel ranks form (q 0: none).
TensorGridShape grid_of(const Layout& l) { return tensor_grid_shape(l.tp_mode, l.tp, l.tp_depth); }

bool on_grid(const Layout& l) { return l.tp_mode != TensorParallelMode::one_d; }

Found tp_depth_needs_2p5d(const LayoutProblem&, const Layout& l) {
  if (l.tp_depth == 1 || l.tp_mode == TensorParallelMode::two_and_half_d) return std::nullopt;
  return LayoutViolation{"parallel.tp_depth",
                         str("layers a 2.5D grid, and parallel.tp_mode = \"",
                             tensor_parallel_mode_name(l.tp_mode), "\""),
                         "set parallel.tp_mode = \"2.5d\", or parallel.tp_depth = 1"};
}

// 2D needs tp = q^2, 2.5D tp = q^2 * depth, 3D tp = q^3, with q >= 2.
Found tp_forms_grid(const LayoutProblem&, const Layout& l) {
  if (!on_grid(l) || grid_of(l).q > 0) return std::nullopt;
  const bool layered = l.tp_mode == TensorParallelMode::two_and_half_d;
  const std::string shape = l.tp_mode == TensorParallelMode::three_d ? "a cube q * q * q"
                            : layered ? str("q * q * parallel.tp_depth = q * q * ", l.tp_depth)
                                      : "a square q * q";
  std::string fix =
      assign_one_of("parallel.tp", nearest_valid(l.tp, 1, 1 << 20, [&](int64_t t) {
        return tensor_grid_shape(l.tp_mode, t, l.tp_depth).q > 0;
      }));
  if (layered) {
    const std::string depth =
        assign_one_of("parallel.tp_depth", nearest_valid(l.tp_depth, 1, l.tp, [&](int64_t d) {
          return tensor_grid_shape(l.tp_mode, l.tp, d).q > 0;
        }));
    fix = set_one_of({fix, depth});
  } else {
    fix = "set " + fix;
  }
  return LayoutViolation{"parallel.tp",
                         str("does not form a ", tensor_parallel_mode_name(l.tp_mode), " grid of ",
                             shape, " ranks with q >= 2"),
                         fix};
}

// A grid splits the hidden width, the heads (query and kv) and the MLP's
// columns over its side q; a cube cuts a layer's output rows (the hidden
// width, the heads' rows, the MLP's columns) into q^2 parts besides.
Found grid_divides_model(const LayoutProblem& p, const Layout& l) {
  const TensorGridShape grid = on_grid(l) ? grid_of(l) : TensorGridShape{0, 1};
  const int64_t q = grid.q;
  if (q == 0) return std::nullopt;
  const GPTConfig& m = p.model;
  const std::string side = grid.cube ? "parallel.tp = q * q * q" : "parallel.tp = q * q * parallel.tp_depth";
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"model.n_embd", m.n_embd},
                                   {"model.n_head", m.n_head},
                                   {"model.n_kv_head", m.kv_heads()},
                                   {"model.intermediate_size", m.intermediate()}})
    if (value % q != 0)
      return LayoutViolation{"parallel.tp", str("makes a grid of side ", q, ", which must divide ", key, " = ", value),
                             str("choose ", side, " with q dividing ", key)};
  if (!grid.cube) return std::nullopt;
  for (const auto& [key, value] : {std::pair<const char*, int64_t>{"model.n_embd", m.n_embd},
                                   {"model.n_head * head_dim", m.q_dim()},
                                   {"model.n_kv_head * head_dim", m.kv_heads() * m.head_dim()},
                                   {"model.intermediate_size", m.intermediate()}})
    if (value % (q * q) != 0)
      return LayoutViolation{"parallel.tp",
                             str("makes a cube of side ", q, ", whose q^2 = ", q * q, " must divide ", key, " = ",
                                 value),
                             str("choose ", side, " with q^2 dividing ", key)};
  return std::nullopt;
}

// Attention needs whole sequences, so each of the grid's q * depth token
// groups gets whole sequences of every micro-batch.
Found grid_splits_sequences(const LayoutProblem& p, const Layout& l) {
  const TensorGridShape grid = on_grid(l) ? grid_of(l) : TensorGridShape{0, 1};
  const int64_t parts = int64_t{grid.q} * grid.depth;
  if (grid.q == 0 || l.micro_batch % parts == 0) return std::nullopt;
  return LayoutViolation{
      "train.micro_batch_size",
      str("must split its sequences evenly over the grid's ", parts,
          grid.cube ? " token groups (q * q)" : " token groups (q * parallel.tp_depth)"),
      "set " + assign_one_of("train.micro_batch_size",
                             nearest_valid(l.micro_batch, 1, p.global_batch / l.dp, [&](int64_t b) {
                               return b % parts == 0 && p.global_batch % (l.dp * b) == 0;
                             }))};
}

Found grid_excludes_sequence_parallel(const LayoutProblem&, const Layout& l) {
  if (!on_grid(l) || !l.sequence_parallel) return std::nullopt;
  return LayoutViolation{"parallel.sequence_parallel",
                         str("splits 1D tensor parallelism's activations by token, and parallel.tp_mode = \"",
                             tensor_parallel_mode_name(l.tp_mode), "\" splits them already"),
                         "set parallel.sequence_parallel = false, or parallel.tp_mode = \"1d\""};
}

Found sequence_parallel_needs_tp(const LayoutProblem&, const Layout& l) {
  if (!l.sequence_parallel || l.tp > 1) return std::nullopt;
  return LayoutViolation{"parallel.sequence_parallel",
                         "splits activations over the tensor-parallel ranks, and parallel.tp = 1",
                         "set parallel.tp >= 2, or parallel.sequence_parallel = false"};
}

Found sequence_parallel_splits_rows(const LayoutProblem& p, const Layout& l) {
  const int64_t rows = l.micro_batch * p.seq_len;
  if (!l.sequence_parallel || rows % l.tp == 0) return std::nullopt;
  return LayoutViolation{
      "train.seq_len",
      str("under parallel.sequence_parallel the token rows of a micro-batch, train.micro_batch_size * "
          "train.seq_len = ",
          l.micro_batch, " * ", p.seq_len, " = ", rows, ", must split evenly over parallel.tp = ", l.tp, " ranks"),
      set_one_of({assign_one_of("train.seq_len", nearest_valid(p.seq_len, 1, p.model.block_size,
                                                               [&](int64_t t) { return l.micro_batch * t % l.tp == 0; })),
                  assign_one_of("train.micro_batch_size",
                                nearest_valid(l.micro_batch, 1, p.global_batch / l.dp,
                                              [&](int64_t b) {
                                                return b * p.seq_len % l.tp == 0 && p.global_batch % (l.dp * b) == 0;
                                              })),
                  "parallel.sequence_parallel = false"})};
}

Found virtual_stages_need_interleaving(const LayoutProblem&, const Layout& l) {
  if (l.virtual_stages <= 1 || l.schedule == PipelineSchedule::interleaved_1f1b) return std::nullopt;
  return LayoutViolation{"parallel.virtual_stages",
                         str("only the interleaved_1f1b schedule runs several model chunks per pipeline rank, and "
                             "parallel.schedule = \"",
                             pipeline_schedule_name(l.schedule), "\""),
                         "set parallel.schedule = \"interleaved_1f1b\", or parallel.virtual_stages = 1"};
}

Found interleaving_needs_pipeline(const LayoutProblem&, const Layout& l) {
  if (l.schedule != PipelineSchedule::interleaved_1f1b || l.pp > 1) return std::nullopt;
  return LayoutViolation{"parallel.schedule",
                         "interleaves the model chunks of several pipeline ranks, and parallel.pp = 1",
                         "set parallel.pp >= 2, or parallel.schedule = \"1f1b\""};
}

Found interleaving_needs_chunks(const LayoutProblem&, const Layout& l) {
  if (l.schedule != PipelineSchedule::interleaved_1f1b || l.virtual_stages >= 2) return std::nullopt;
  return LayoutViolation{"parallel.schedule",
                         "needs at least 2 model chunks per pipeline rank, and parallel.virtual_stages = 1",
                         "set parallel.virtual_stages >= 2, or parallel.schedule = \"1f1b\""};
}

Found layer_per_virtual_stage(const LayoutProblem& p, const Layout& l) {
  const GPTConfig& m = p.model;
  const int64_t stages = l.pp * l.virtual_stages;
  if (m.n_layer >= stages) return std::nullopt;
  const std::string more_layers = p.model_shape_settable ? str("model.n_layer >= ", stages) : "";
  if (l.virtual_stages > 1)
    return LayoutViolation{
        "parallel.virtual_stages",
        str("parallel.pp * parallel.virtual_stages = ", l.pp, " * ", l.virtual_stages, " = ", stages,
            " virtual stages need a layer each, and model.n_layer = ", m.n_layer),
        set_one_of({m.n_layer / l.pp >= 2 ? str("parallel.virtual_stages <= ", m.n_layer / l.pp) : "",
                    m.n_layer / l.virtual_stages >= 2 ? str("parallel.pp <= ", m.n_layer / l.virtual_stages) : "",
                    more_layers})};
  return LayoutViolation{"parallel.pp",
                         str("each of the ", l.pp, " pipeline stages needs a layer, and model.n_layer = ", m.n_layer),
                         set_one_of({str("parallel.pp <= ", m.n_layer), more_layers})};
}

// Without parallel.stage_layers, balancing by cost would give the model
// chunks of an interleaved pipeline different layer counts, which its
// schedule does not allow.
Found interleaving_splits_layers_evenly(const LayoutProblem& p, const Layout& l) {
  const GPTConfig& m = p.model;
  const int64_t stages = l.pp * l.virtual_stages;
  if (l.schedule != PipelineSchedule::interleaved_1f1b || p.stage_layers_given || m.n_layer % stages == 0)
    return std::nullopt;
  return LayoutViolation{
      "parallel.virtual_stages",
      str("without parallel.stage_layers, interleaved_1f1b splits the model.n_layer = ", m.n_layer,
          " layers evenly over parallel.pp * parallel.virtual_stages = ", l.pp, " * ", l.virtual_stages, " = ",
          stages, " virtual stages"),
      set_one_of({str("parallel.stage_layers = \"", even_stage_layers(m.n_layer, stages), "\""),
                  assign_one_of("parallel.virtual_stages",
                                nearest_valid(l.virtual_stages, 2, m.n_layer / l.pp,
                                              [&](int64_t c) { return m.n_layer % (l.pp * c) == 0; })),
                  p.model_shape_settable ? assign_one_of("model.n_layer",
                                                         nearest_valid(m.n_layer, stages, 1024,
                                                                       [&](int64_t n) { return n % stages == 0; }))
                                         : std::string()})};
}

Found pipeline_filled(const LayoutProblem& p, const Layout& l) {
  if (l.pp == 1 || accumulation(p, l) >= l.pp) return std::nullopt;
  const int64_t per_rank = p.global_batch / l.dp;
  return LayoutViolation{
      "train.batch_size",
      str("a pipeline of parallel.pp = ", l.pp, " stages needs at least ", l.pp,
          " micro-batches per step and rank to fill, and train.batch_size / (parallel.dp * "
          "train.micro_batch_size) = ",
          p.global_batch, " / (", l.dp, " * ", l.micro_batch, ") = ", accumulation(p, l)),
      set_one_of({str("train.batch_size = ", l.pp * l.dp * l.micro_batch),
                  assign_one_of("train.micro_batch_size",
                                nearest_valid(l.micro_batch, 1, l.micro_batch - 1, [&](int64_t b) {
                                  return per_rank % b == 0 && per_rank / b >= l.pp &&
                                         (!l.sequence_parallel || b * p.seq_len % l.tp == 0);
                                }))})};
}

Found interleaving_groups_micro_batches(const LayoutProblem& p, const Layout& l) {
  if (l.schedule != PipelineSchedule::interleaved_1f1b || accumulation(p, l) % l.pp == 0) return std::nullopt;
  const int64_t round = l.pp * l.dp * l.micro_batch;
  const int64_t down = accumulation(p, l) / l.pp * round;
  return LayoutViolation{
      "train.batch_size",
      str("interleaved_1f1b runs the micro-batches in groups of parallel.pp = ", l.pp,
          ", and train.batch_size / (parallel.dp * train.micro_batch_size) = ", p.global_batch, " / (", l.dp, " * ",
          l.micro_batch, ") = ", accumulation(p, l), " per step and rank, not a multiple of ", l.pp),
      str("set train.batch_size = ", down, " or ", down + round)};
}

// The chunk manager gathers and reduces chunks over the data-parallel group
// alone; it has no notion of a parameter split over tp or pp.
Found chunks_shard_over_data_parallel_only(const LayoutProblem&, const Layout& l) {
  if (l.memory_policy == MemoryPolicy::none) return std::nullopt;
  for (const auto& [key, ranks] : {std::pair<const char*, int64_t>{"parallel.tp", l.tp}, {"parallel.pp", l.pp}})
    if (ranks > 1)
      return LayoutViolation{"memory.policy",
                             str("shards the chunks over the data-parallel ranks only, and ", key, " = ", ranks),
                             str("set ", key, " = 1 (parallel.dp gives the ranks), or memory.policy = \"none\"")};
  return std::nullopt;
}

Found chunks_shard_as_zero3(const LayoutProblem&, const Layout& l) {
  if (l.memory_policy == MemoryPolicy::none || l.zero_stage == 3 || (l.dp == 1 && l.zero_stage == 0))
    return std::nullopt;
  return LayoutViolation{
      "zero.stage",
      str("under memory.policy = \"", memory_policy_name(l.memory_policy),
          "\" the chunks shard the parameters, gradients and optimizer state over the data-parallel ranks as stage 3 "
          "does",
          l.dp > 1 ? str(", and parallel.dp = ", l.dp) : std::string(" (on one rank, stage 0 is the same)")),
      str("set zero.stage = 3", l.dp > 1 ? "" : " or 0", ", or memory.policy = \"none\"")};
}

Found sharded_gradients_without_pipeline(const LayoutProblem&, const Layout& l) {
  if (l.zero_stage < 2 || l.pp == 1) return std::nullopt;
  return LayoutViolation{"zero.stage",
                         str("stages 2 and 3 shard the gradients as each micro-batch produces them, and a pipeline "
                             "(parallel.pp = ",
                             l.pp, ") accumulates a step's micro-batch gradients locally before it reduces them"),
                         "set zero.stage = 0 or 1, or parallel.pp = 1"};
}

Found sharded_gradients_without_tensor_parallel(const LayoutProblem&, const Layout& l) {
  if (l.zero_stage < 2 || l.tp == 1) return std::nullopt;
  return LayoutViolation{"zero.stage",
                         str("stages 2 and 3 are not supported with tensor parallelism (parallel.tp = ", l.tp, ") yet"),
                         "set zero.stage = 0 or 1, or parallel.tp = 1"};
}

// In the order they are checked: a rule may assume the ones before it hold
// (the pipeline rules count micro-batches only once the batch divides).
constexpr std::array kRules{
    LayoutRule{"batch_divides", batch_divides},
    LayoutRule{"tp_depth_needs_2p5d", tp_depth_needs_2p5d},
    LayoutRule{"tp_forms_grid", tp_forms_grid},
    LayoutRule{"grid_excludes_sequence_parallel", grid_excludes_sequence_parallel},
    LayoutRule{"grid_divides_model", grid_divides_model},
    LayoutRule{"grid_splits_sequences", grid_splits_sequences},
    LayoutRule{"tp_divides_heads", tp_divides_heads},
    LayoutRule{"tp_fits_kv_heads", tp_fits_kv_heads},
    LayoutRule{"tp_divides_intermediate", tp_divides_intermediate},
    LayoutRule{"tp_within_vocab", tp_within_vocab},
    LayoutRule{"sequence_parallel_needs_tp", sequence_parallel_needs_tp},
    LayoutRule{"sequence_parallel_splits_rows", sequence_parallel_splits_rows},
    LayoutRule{"virtual_stages_need_interleaving", virtual_stages_need_interleaving},
    LayoutRule{"interleaving_needs_pipeline", interleaving_needs_pipeline},
    LayoutRule{"interleaving_needs_chunks", interleaving_needs_chunks},
    LayoutRule{"layer_per_virtual_stage", layer_per_virtual_stage},
    LayoutRule{"interleaving_splits_layers_evenly", interleaving_splits_layers_evenly},
    LayoutRule{"pipeline_filled", pipeline_filled},
    LayoutRule{"interleaving_groups_micro_batches", interleaving_groups_micro_batches},
    LayoutRule{"chunks_shard_over_data_parallel_only", chunks_shard_over_data_parallel_only},
    LayoutRule{"chunks_shard_as_zero3", chunks_shard_as_zero3},
    LayoutRule{"sharded_gradients_without_pipeline", sharded_gradients_without_pipeline},
    LayoutRule{"sharded_gradients_without_tensor_parallel", sharded_gradients_without_tensor_parallel},
};

}  // namespace

std::string even_stage_layers(int64_t n_layer, int64_t parts) {
  std::string text;
  for (int64_t i = 0; i < parts; ++i) text += str(i ? "," : "", n_layer / parts + (i < n_layer % parts ? 1 : 0));
  return text;
}

std::span<const LayoutRule> layout_rules() { return kRules; }

std::vector<Layout> layout_candidates(const LayoutProblem& problem, int64_t world) {
  std::vector<Layout> found;
  const auto divisors = [](int64_t n) {
    std::vector<int64_t> d;
    for (int64_t i = 1; i <= n; ++i)
      if (n % i == 0) d.push_back(i);
    return d;
  };
  // Each tp's modes: 1D, and every grid its ranks form (2.5D at each depth).
  const auto modes = [&](int64_t tp) {
    std::vector<std::pair<TensorParallelMode, int64_t>> m{{TensorParallelMode::one_d, 1}};
    if (tensor_grid_shape(TensorParallelMode::two_d, tp, 1).q > 0) m.push_back({TensorParallelMode::two_d, 1});
    for (int64_t depth : divisors(tp))
      if (depth > 1 && tensor_grid_shape(TensorParallelMode::two_and_half_d, tp, depth).q > 0)
        m.push_back({TensorParallelMode::two_and_half_d, depth});
    if (tensor_grid_shape(TensorParallelMode::three_d, tp, 1).q > 0) m.push_back({TensorParallelMode::three_d, 1});
    return m;
  };
  Layout l;
  for (int64_t tp : divisors(world))
    for (const auto& [mode, depth] : modes(tp))
      for (int64_t pp : divisors(world / tp))
        for (int sp = 0; sp < 2; ++sp)
          for (PipelineSchedule schedule :
               {PipelineSchedule::gpipe, PipelineSchedule::one_f_one_b, PipelineSchedule::interleaved_1f1b})
            for (int64_t chunks = 1; chunks <= problem.model.n_layer / pp + 1; ++chunks)
              for (int64_t micro_batch : divisors(problem.global_batch))
                for (int zero_stage = 0; zero_stage <= 3; ++zero_stage)
                  for (int recompute = 0; recompute < 2; ++recompute)
                    for (MemoryPolicy policy : {MemoryPolicy::none, MemoryPolicy::fixed, MemoryPolicy::automatic}) {
                      l.dp = world / (tp * pp);
                      l.tp = tp;
                      l.tp_mode = mode;
                      l.tp_depth = depth;
                      l.pp = pp;
                      l.sequence_parallel = sp != 0;
                      l.schedule = schedule;
                      l.virtual_stages = chunks;
                      l.micro_batch = micro_batch;
                      l.zero_stage = zero_stage;
                      l.recompute = recompute != 0;
                      l.memory_policy = policy;
                      found.push_back(l);
                    }
  return found;
}

std::vector<std::string> layout_settings(const Layout& l) {
  const auto flag = [](bool on) { return on ? "true" : "false"; };
  std::vector<std::string> settings{str("parallel.dp=", l.dp), str("parallel.tp=", l.tp)};
  if (l.tp_mode != TensorParallelMode::one_d) {
    settings.push_back(str("parallel.tp_mode=", tensor_parallel_mode_name(l.tp_mode)));
    settings.push_back(str("parallel.tp_depth=", l.tp_depth));
  }
  settings.insert(settings.end(), {
          str("parallel.pp=", l.pp),
          str("parallel.sequence_parallel=", flag(l.sequence_parallel)),
          str("parallel.schedule=", pipeline_schedule_name(l.schedule)),
          str("parallel.virtual_stages=", l.virtual_stages),
          str("train.micro_batch_size=", l.micro_batch),
          str("zero.stage=", l.zero_stage),
          str("train.activation_checkpointing=", flag(l.recompute)),
          str("memory.policy=", memory_policy_name(l.memory_policy))});
  return settings;
}

std::optional<LayoutViolation> check_layout(const LayoutProblem& problem, const Layout& layout) {
  for (const LayoutRule& rule : kRules)
    if (std::optional<LayoutViolation> found = rule.check(problem, layout)) {
      found->rule = rule.name;
      return found;
    }
  return std::nullopt;
}

}  // namespace loom
