// The activations a rank's blocks keep from forward to backward, read from
// the device tier's allocator, held to the adapted Korthikanti et al. formula
// (activation_bytes_per_layer in planner.h) for plain, tensor-parallel,
// sequence-parallel and fully recomputed blocks, and on 2D, 2.5D and 3D
// grids (grid_activation_bytes_per_layer).
#include <gtest/gtest.h>

#include "loom/comm.h"
#include "loom/nn.h"
#include "loom/planner.h"
#include "test_util.h"

namespace loom {
namespace {

GPTConfig model_config() {
  GPTConfig c;
  c.n_layer = 4;
  c.n_head = 8;
  c.n_embd = 128;
  c.vocab_size = 256;
  c.block_size = 64;
  return c;
}

struct Case {
  int tp;
  bool sequence_parallel, recompute;
  TensorGridShape grid = {};
};

// Runs f(world, mp) on each of the case's tp local ranks, `mp` holding its
// tensor-parallel group (and grid).
template <typename F>
void on_ranks(const Case& c, F&& f) {
  run_local(c.tp, [&](Communicator& world) {
    MeshShape shape;
    shape[MeshAxis::tp] = c.tp;
    const DeviceMesh mesh(world, shape, c.grid);
    ModelParallel mp;
    mp.tp = {&world, c.sequence_parallel, mesh.tensor_grid()};
    f(world, mp);
  });
}

// Bytes the device tier holds after the blocks' forward beyond what it held
// before, per rank. The blocks sit in a middle pipeline stage (no embedding,
// no head), so the input comes from outside and is in `before`; the output,
// the same size, stands in for it in `after`, and the difference is exactly
// the layers' saved activations.
std::vector<double> measure(const GPTConfig& cfg, const Case& c) {
  // A grid's token groups each take whole sequences: 4 of them on these.
  const BatchShape bs{c.grid.ranks() > 1 ? 4 : 2, 64};
  std::vector<double> measured(static_cast<size_t>(c.tp), 0.0);
  on_ranks(c, [&](Communicator& world, ModelParallel mp) {
    mp.chunks = {{0, static_cast<int>(cfg.n_layer)}};
    mp.first_stage = mp.last_stage = false;
    GPT model(cfg, mp);
    ParamStore params(model.layout(), 7);
    const std::vector<int32_t> tokens = testing::random_tokens(bs.N(), cfg.vocab_size, 3);
    MicroBatchState state;
    ForwardOptions fo;
    fo.checkpoint_activations = c.recompute;
    model.begin(state, tokens.data(), tokens.data(), bs, fo);
    Tensor x = Tensor::empty({mp.tp.local_rows(bs.N()), mp.tp.local_width(cfg.n_embd)});
    fill_normal(x.data<float>(), x.numel(), 11, 0, 0.0f, 1.0f);
    Allocator& device = MemoryContext::current().tier(Tier::device);
    const double before = static_cast<double>(device.used());
    Tensor y = model.forward_chunk(params, state, 0, x);
    measured[static_cast<size_t>(world.rank())] = static_cast<double>(device.used()) - before;
  });
  return measured;
}

// LLaMA's variants: RMSNorm's one statistic, SwiGLU's gate | up, 2 kv heads
// (split over 2 ranks, one shared by 2 of 4 ranks), no learned positions.
GPTConfig llama_config() {
  GPTConfig c = model_config();
  c.norm = NormKind::rmsnorm;
  c.positions = PositionKind::rope;
  c.mlp = MlpKind::swiglu;
  c.intermediate_size = 320;
  c.n_kv_head = 2;
  c.packed_qkv = false;
  c.attention_bias = c.mlp_bias = c.tied_embeddings = false;
  return c;
}

// Heads of 24 beside n_embd 128 / 8 heads = 16: q and the attention output
// are 192 wide.
GPTConfig wide_heads_config() {
  GPTConfig c = llama_config();
  c.head_size = 24;
  return c;
}

TEST(ActivationMemory, MatchesTheAdaptedKorthikantiFormula) {
  for (const GPTConfig& cfg : {model_config(), llama_config(), wide_heads_config()}) {
    for (const Case& c : {Case{1, false, false}, Case{2, false, false}, Case{2, true, false}, Case{4, false, false},
                          Case{4, true, false}, Case{1, false, true}, Case{2, true, true}}) {
      const double expected = static_cast<double>(cfg.n_layer) *
                              activation_bytes_per_layer(cfg, 2, 64, c.tp, c.sequence_parallel, c.recompute);
      for (double bytes : measure(cfg, c)) {
        std::printf("%s tp=%d sp=%d recompute=%d: %.0f bytes per rank, formula %.0f (ratio %.4f)\n",
                    cfg.mlp == MlpKind::swiglu ? (cfg.head_size > 0 ? "llama head_dim 24" : "llama") : "gpt2", c.tp, c.sequence_parallel, c.recompute, bytes,
                    expected, bytes / expected);
        EXPECT_NEAR(bytes / expected, 1.0, 0.01)
            << "tp " << c.tp << " sp " << c.sequence_parallel << " recompute " << c.recompute;
      }
    }
  }
}

// 2D (tp 4), 2.5D (tp 8, depth 2) and 3D (tp 8): every rank holds its
// share, within 1% of the grid formula, and the cube's split of every term
// by tp is below 0.6 of 1D's activations at tp 8.
TEST(ActivationMemory, GridsMatchTheGridFormula) {
  for (const GPTConfig& cfg : {model_config(), llama_config()}) {
    for (const Case& c : {Case{4, false, false, {2, 1}}, Case{8, false, false, {2, 2}},
                          Case{8, false, false, {2, 2, true}}, Case{8, false, true, {2, 2, true}}}) {
      const double expected =
          static_cast<double>(cfg.n_layer) * grid_activation_bytes_per_layer(cfg, 4, 64, c.grid, c.recompute);
      for (double bytes : measure(cfg, c)) {
        std::printf("%s tp=%d %s recompute=%d: %.0f bytes per rank, formula %.0f (ratio %.4f)\n",
                    cfg.mlp == MlpKind::swiglu ? "llama" : "gpt2", c.tp,
                    c.grid.cube ? "3d" : c.grid.depth > 1 ? "2.5d" : "2d", c.recompute, bytes, expected,
                    bytes / expected);
        EXPECT_NEAR(bytes / expected, 1.0, 0.01) << "tp " << c.tp << " depth " << c.grid.depth;
      }
    }
  }
  const GPTConfig cfg = model_config();
  EXPECT_LT(grid_activation_bytes_per_layer(cfg, 4, 64, {2, 2, true}, false),
            0.6 * activation_bytes_per_layer(cfg, 4, 64, 8, false, false));
}

// Every rank's parameter elements are the documented share
// (tensor_parallel_param_elements): 1D at tp 2 and 4 (LLaMA's 2 kv heads
// whole on 4 ranks), 2D, 2.5D and 3D.
TEST(ParamMemory, EveryRankHoldsTheDocumentedShare) {
  for (const GPTConfig& cfg : {model_config(), llama_config()})
    for (const Case& c : {Case{2, false, false}, Case{4, false, false}, Case{4, false, false, {2, 1}},
                          Case{8, false, false, {2, 2}}, Case{8, false, false, {2, 2, true}}}) {
      std::vector<double> held(static_cast<size_t>(c.tp), 0.0);
      on_ranks(c, [&](Communicator& world, const ModelParallel& mp) {
        held[static_cast<size_t>(world.rank())] = static_cast<double>(GPT(cfg, mp).layout().numel());
      });
      const double expected = tensor_parallel_param_elements(cfg, c.tp, c.grid);
      for (double n : held) EXPECT_NEAR(n / expected, 1.0, 0.02) << "tp " << c.tp << " grid q " << c.grid.q;
      std::printf("%s tp=%d grid %dx%dx%d: %.0f elements per rank, formula %.0f\n",
                  cfg.mlp == MlpKind::swiglu ? "llama" : "gpt2", c.tp, c.grid.q, c.grid.q, c.grid.depth, held[0],
                  expected);
    }
}

TEST(ActivationMemory, SequenceParallelismDividesEveryTermByTp) {
  const GPTConfig cfg = model_config();
  const double plain = activation_bytes_per_layer(cfg, 2, 64, 1, false, false);
  EXPECT_DOUBLE_EQ(activation_bytes_per_layer(cfg, 2, 64, 2, true, false), plain / 2);
  EXPECT_LT(activation_bytes_per_layer(cfg, 2, 64, 2, false, false), plain);
  EXPECT_GT(activation_bytes_per_layer(cfg, 2, 64, 2, false, false), plain / 2);
}

}  // namespace
}  // namespace loom
