// Pruning: the exact sparsity of every matrix, the 2:4 pattern, Wanda's
// activation-aware choice, its calibration statistics, the errors, and the
// pruned checkpoint as an ordinary one.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include <gtest/gtest.h>

#include "loom/prune.h"
#include "loom/train.h"
#include "test_util.h"
#include "zero/zero_test_util.h"

namespace loom {
namespace {

using testing::error_of;

GPTConfig small_model() { return testing::small_gpt(0.0f); }

// LLaMA's variants: RMSNorm, RoPE, SwiGLU, q, k, v apart, no biases.
GPTConfig llama_model() {
  GPTConfig c = small_model();
  testing::llama_variant(2)(c);
  return c;
}

std::vector<float> values(const ParamStore& ps) {
  const Tensor f = ps.flat();
  return {f.data<float>(), f.data<float>() + f.numel()};
}

// Runs the model's forward over a few batches of random tokens while `cal`
// collects.
void calibrate(const GPT& model, const ParamStore& ps) {
  const std::vector<int32_t> tokens = testing::random_tokens(4 * 16 + 1, model.config().vocab_size, 7);
  ForwardOptions fo;
  fo.training = false;
  for (int b = 0; b < 2; ++b) {
    MicroBatchState s;
    const_cast<GPT&>(model).forward(const_cast<ParamStore&>(ps), s, tokens.data(), tokens.data() + 1, {4, 16}, fo);
  }
}

TEST(Prune, PrunableParamsAreTheLinearLayersWeights) {
  for (bool llama : {false, true}) {
    const GPTConfig c = llama ? llama_model() : small_model();
    GPT model(c);
    const std::vector<int> ids = prunable_params(model.layout());
    // GPT-2: c_attn, attn.c_proj, c_fc, mlp.c_proj; LLaMA: q, k, v, o, gate, up, down.
    EXPECT_EQ(ids.size(), static_cast<size_t>(c.n_layer * (llama ? 7 : 4)));
    for (int id : ids) {
      const ParamSpec& p = model.layout().param(id);
      EXPECT_EQ(p.shape.size(), 2u) << p.name;
      EXPECT_NE(model.layout().group_name(p.group), "embedding") << p.name;
    }
  }
}

TEST(Prune, MagnitudeZeroesTheSmallestToTheExactSparsityOfEachMatrix) {
  GPT model(small_model());
  ParamStore ps(model.layout(), 1);
  const std::vector<float> before = values(ps);
  for (double sparsity : {0.3, 0.5, 0.9}) {
    ps.flat().copy_from(Tensor::borrow(const_cast<float*>(before.data()), {static_cast<int64_t>(before.size())},
                                       DType::f32, Tier::host));
    const PruneReport r = prune_model(model, ps, {.method = PruneMethod::magnitude, .sparsity = sparsity});
    const std::vector<float> after = values(ps);
    const std::vector<int> ids = prunable_params(model.layout());
    ASSERT_EQ(r.matrices.size(), ids.size());
    int64_t zeros = 0;
    for (size_t k = 0; k < ids.size(); ++k) {
      const ParamSpec& p = model.layout().param(ids[k]);
      const int64_t want = std::llround(sparsity * static_cast<double>(p.numel()));
      EXPECT_EQ(r.matrices[k].zeros, want) << p.name;
      float largest_pruned = 0.0f, smallest_kept = INFINITY;
      int64_t counted = 0;
      for (int64_t i = p.offset; i < p.offset + p.numel(); ++i) {
        const size_t u = static_cast<size_t>(i);
        if (after[u] == 0.0f) {
          ++counted;
          largest_pruned = std::max(largest_pruned, std::fabs(before[u]));
        } else {
          EXPECT_EQ(after[u], before[u]);
          smallest_kept = std::min(smallest_kept, std::fabs(before[u]));
        }
      }
      EXPECT_EQ(counted, want) << p.name;
      EXPECT_LE(largest_pruned, smallest_kept) << p.name;
      zeros += counted;
    }
    // Nothing else changes: embeddings, norms, biases.
    std::vector<bool> pruned(before.size(), false);
    for (int id : ids)
      for (int64_t i = 0; i < model.layout().param(id).numel(); ++i)
        pruned[static_cast<size_t>(model.layout().param(id).offset + i)] = true;
    for (size_t i = 0; i < before.size(); ++i) {
      if (!pruned[i]) {
        ASSERT_EQ(after[i], before[i]) << "element " << i;
      }
    }
    EXPECT_EQ(r.nonzeros, r.numel - zeros - static_cast<int64_t>(std::count(before.begin(), before.end(), 0.0f)));
  }
}

TEST(Prune, WandaReachesTheExactSparsityOfEachMatrixRowByRow) {
  GPT model(small_model());
  ParamStore ps(model.layout(), 1);
  WandaCalibration cal;
  calibrate(model, ps);
  const PruneReport r = prune_model(model, ps, {.method = PruneMethod::wanda, .sparsity = 0.3}, &cal);
  const std::vector<float> after = values(ps);
  for (int id : prunable_params(model.layout())) {
    const ParamSpec& p = model.layout().param(id);
    EXPECT_EQ(cal.tokens(id), 2 * 4 * 16) << p.name;
    const int64_t rows = p.shape[0], cols = p.shape[1];
    int64_t total = 0, fewest = cols, most = 0;
    for (int64_t row = 0; row < rows; ++row) {
      const float* w = after.data() + p.offset + row * cols;
      const int64_t z = std::count(w, w + cols, 0.0f);
      total += z;
      fewest = std::min(fewest, z);
      most = std::max(most, z);
    }
    EXPECT_EQ(total, std::llround(0.3 * static_cast<double>(p.numel()))) << p.name;
    EXPECT_LE(most - fewest, 1) << p.name;
  }
  EXPECT_EQ(r.matrices.size(), prunable_params(model.layout()).size());
}

TEST(Prune, TwoFourZeroesTheTwoLowestOfEveryFourConsecutiveWeights) {
  for (PruneMethod method : {PruneMethod::magnitude, PruneMethod::wanda}) {
    GPT model(small_model());
    ParamStore ps(model.layout(), 3);
    const std::vector<float> before = values(ps);
    WandaCalibration cal;
    calibrate(model, ps);
    prune_model(model, ps, {.method = method, .pattern = SparsityPattern::two_four}, &cal);
    const std::vector<float> after = values(ps);
    for (int id : prunable_params(model.layout())) {
      const ParamSpec& p = model.layout().param(id);
      const std::vector<double> norms = cal.input_norms(id);
      const int64_t cols = p.shape[1];
      for (int64_t g = p.offset; g < p.offset + p.numel(); g += 4) {
        int zeros = 0;
        double worst_pruned = 0.0, best_kept = INFINITY;
        for (int64_t i = g; i < g + 4; ++i) {
          const size_t u = static_cast<size_t>(i);
          const double score =
              std::fabs(before[u]) * (method == PruneMethod::wanda ? norms[static_cast<size_t>((i - p.offset) % cols)]
                                                                  : 1.0);
          if (after[u] == 0.0f) {
            ++zeros;
            worst_pruned = std::max(worst_pruned, score);
          } else {
            best_kept = std::min(best_kept, score);
          }
        }
        ASSERT_EQ(zeros, 2) << p.name << " group at " << g - p.offset;
        ASSERT_LE(worst_pruned, best_kept) << p.name << " group at " << g - p.offset;
      }
    }
  }
}

TEST(Prune, WandaKeepsASmallWeightOnALoudInputThatMagnitudeDrops) {
  // Column 1's input is 100x column 0's: Wanda keeps its weight 0.5 and
  // drops column 0's 1.0 instead, where magnitude drops the smaller 0.5.
  const std::vector<double> norms = {0.1, 10.0, 1.0, 1.0};
  for (SparsityPattern pattern : {SparsityPattern::unstructured, SparsityPattern::two_four}) {
    std::vector<float> by_magnitude = {1.0f, 0.5f, 0.8f, 0.9f}, by_wanda = by_magnitude;
    const PruneOptions o{.pattern = pattern, .sparsity = 0.5};
    prune_matrix(by_magnitude.data(), 1, 4, o, {}, "w");
    prune_matrix(by_wanda.data(), 1, 4, o, norms, "w");
    EXPECT_EQ(by_magnitude, (std::vector<float>{1.0f, 0.0f, 0.0f, 0.9f}));
    EXPECT_EQ(by_wanda, (std::vector<float>{0.0f, 0.5f, 0.0f, 0.9f}));
  }
}

TEST(Prune, CalibrationHoldsTheL2NormOfEachInputFeature) {
  ParamLayout layout;
  const int group = layout.add_group("g");
  LinearPart q, k;
  q.name = "q";
  q.out = 3;
  k.name = "k";
  k.out = 2;
  const Linear fc(layout, {q, k}, 4, group, 0.02f, false);
  ParamStore ps(layout, 1);
  const std::vector<float> x = {1, -2, 3, 0, 4, 0.5f, -1, 2};  // [2, 4]
  Tensor in = Tensor::empty({2, 4}), out = Tensor::empty({2, 5});
  in.copy_from(Tensor::borrow(const_cast<float*>(x.data()), {2, 4}, DType::f32, Tier::host));
  std::vector<double> norms;
  {
    WandaCalibration cal;
    fc.forward(ps, out.data<float>(), in.data<float>(), 2);
    fc.forward(ps, out.data<float>(), in.data<float>(), 2);
    // Both parts read the same input.
    for (const char* name : {"q.weight", "k.weight"}) {
      EXPECT_EQ(cal.tokens(layout.find(name)), 4);
      norms = cal.input_norms(layout.find(name));
      ASSERT_EQ(norms.size(), 4u);
      for (size_t j = 0; j < 4; ++j)
        EXPECT_DOUBLE_EQ(norms[j], std::sqrt(2.0 * (x[j] * x[j] + x[4 + j] * x[4 + j]))) << name << " feature " << j;
    }
  }
  // Uninstalled with the calibration: a later one sees nothing before.
  WandaCalibration later;
  EXPECT_EQ(later.tokens(layout.find("q.weight")), 0);
}

// The logits of a forward over fixed random tokens.
std::vector<float> logits(const GPT& model, ParamStore& ps) {
  const std::vector<int32_t> tokens = testing::random_tokens(2 * 16 + 1, model.config().vocab_size, 11);
  ForwardOptions fo;
  fo.training = false;
  MicroBatchState s;
  model.forward(ps, s, tokens.data(), tokens.data() + 1, {2, 16}, fo);
  const Tensor l = s.logits.clone(Tier::host);
  return {l.data<float>(), l.data<float>() + l.numel()};
}

TEST(Prune, ChannelsGiveASmallerDenseModelWithTheMaskedOriginalsLogits) {
  for (const GPTConfig& c : {small_model(), llama_model()}) {
    GPT model(c);
    ParamStore ps(model.layout(), 5);
    const int64_t I = c.intermediate(), keep = I - std::llround(0.25 * static_cast<double>(I));
    const SmallerModel smaller = remove_channels(model, ps, 0.25);
    EXPECT_EQ(smaller.model->config().intermediate_size, keep);
    EXPECT_EQ(smaller.report.numel, smaller.model->layout().numel());
    ASSERT_EQ(smaller.pruning.kept.size(), static_cast<size_t>(c.n_layer));
    for (const std::vector<int64_t>& kept : smaller.pruning.kept) {
      ASSERT_EQ(static_cast<int64_t>(kept.size()), keep);
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()) && std::adjacent_find(kept.begin(), kept.end()) == kept.end());
    }
    // The original with the removed channels zeroed: every parameter that
    // has a row or column per channel (the shapes the two models differ in)
    // loses the removed ones.
    const HostSection host;
    float* w = ps.flat().data<float>();
    int masked = 0;
    for (const ParamSpec& p : model.layout().params()) {
      const Shape& q = smaller.model->layout().param(smaller.model->layout().find(p.name)).shape;
      if (q == p.shape) continue;
      ++masked;
      const int64_t layer = std::stoll(p.name.substr(2, p.name.find('.', 2) - 2));
      const std::vector<int64_t>& kept = smaller.pruning.kept[static_cast<size_t>(layer)];
      const int64_t cols = p.shape.size() == 2 ? p.shape[1] : 1;
      const bool rows_are_channels = p.shape[0] == I && q[0] == keep;
      for (int64_t i = 0; i < p.numel(); ++i) {
        const int64_t channel = rows_are_channels ? i / cols : i % cols;
        if (!std::binary_search(kept.begin(), kept.end(), channel)) w[p.offset + i] = 0.0f;
      }
    }
    // GPT-2: c_fc weight and bias, c_proj; LLaMA: gate, up, down.
    EXPECT_EQ(masked, static_cast<int>(c.n_layer) * 3);
    const std::vector<float> masked_logits = logits(model, ps), smaller_logits = logits(*smaller.model, *smaller.params);
    ASSERT_EQ(masked_logits.size(), smaller_logits.size());
    float scale = 0.0f, diff = 0.0f;
    for (size_t i = 0; i < masked_logits.size(); ++i) {
      scale = std::max(scale, std::fabs(masked_logits[i]));
      diff = std::max(diff, std::fabs(masked_logits[i] - smaller_logits[i]));
    }
    EXPECT_LE(diff, 1e-5f * scale) << "llama " << (c.mlp == MlpKind::swiglu);
  }
}

TEST(Prune, ChannelsDropTheLeastImportantFirst) {
  GPT model(small_model());
  ParamStore ps(model.layout(), 5);
  const int64_t I = model.config().intermediate();
  {
    // Channel 5 of layer 1 writes nothing (its c_proj column is zero).
    const HostSection host;
    const ParamSpec& proj = model.layout().param(model.layout().find("h.1.mlp.c_proj.weight"));
    for (int64_t r = 0; r < proj.shape[0]; ++r) ps.flat().data<float>()[proj.offset + r * I + 5] = 0.0f;
  }
  const StructuredPruning p = choose_channels(model, ps, 1.0 / static_cast<double>(I));
  EXPECT_FALSE(std::binary_search(p.kept[1].begin(), p.kept[1].end(), int64_t{5}));
  EXPECT_TRUE(std::binary_search(p.kept[0].begin(), p.kept[0].end(), int64_t{5}));
  EXPECT_CONTAINS(error_of([&] { choose_channels(model, ps, 0.9999); }), "removes all");
  EXPECT_CONTAINS(error_of([] { validate({.method = PruneMethod::channels, .pattern = SparsityPattern::two_four}); }),
                  "--method channels");
}

TEST(Prune, BadInputsAreErrorsNamingTheFix) {
  for (double s : {0.0, 1.0, -0.5, 1.5, std::nan("")})
    EXPECT_CONTAINS(error_of([&] { validate(PruneOptions{.sparsity = s}); }), "outside (0, 1)");
  EXPECT_CONTAINS(error_of([] { validate({.pattern = SparsityPattern::two_four, .sparsity = 0.7}); }),
                  "--sparsity 0.5");
  std::vector<float> w(12, 1.0f);
  const std::string odd = error_of(
      [&] { prune_matrix(w.data(), 2, 6, {.pattern = SparsityPattern::two_four}, {}, "h.0.attn.c_proj.weight"); });
  EXPECT_CONTAINS(odd, "h.0.attn.c_proj.weight has 6 inputs");
  EXPECT_CONTAINS(odd, "--pattern unstructured");
  EXPECT_CONTAINS(error_of([] { parse_prune_method("random"); }), "magnitude, wanda, channels or heads");
  EXPECT_EQ(parse_prune_method("heads"), PruneMethod::heads);
  EXPECT_CONTAINS(error_of([] { parse_sparsity_pattern("4:8"); }), "unstructured or 2:4");
  EXPECT_EQ(parse_sparsity_pattern("2:4"), SparsityPattern::two_four);
  GPT model(small_model());
  ParamStore ps(model.layout(), 1);
  EXPECT_CONTAINS(error_of([&] { prune_model(model, ps, {.method = PruneMethod::wanda}); }), "--data");
  const WandaCalibration idle;
  EXPECT_CONTAINS(error_of([&] { prune_model(model, ps, {.method = PruneMethod::wanda}, &idle); }),
                  "saw no input of h.0.attn.c_attn.weight");
  // An existing --out, even an empty directory, is left as it was.
  testing::TempDir dir;
  dir.write("out/notes.txt", "mine");
  const auto contents = testing::tree_contents(dir.path());
  const PruneReport r = prune_model(model, ps, {});
  EXPECT_CONTAINS(error_of([&] { write_pruned_checkpoint(dir / "out", model, ps, {}, r, {}); }), "exists");
  EXPECT_EQ(testing::tree_contents(dir.path()), contents);
}

TEST(Prune, ThePrunedCheckpointLoadsAsAnOrdinaryOneAndNamesItsMasks) {
  GPT model(small_model());
  ParamStore ps(model.layout(), 1);
  const PruneOptions o{.sparsity = 0.4};
  const PruneReport r = prune_model(model, ps, o);
  testing::TempDir dir;
  write_pruned_checkpoint(dir / "pruned", model, ps, o, r, {"source-ckpt", "tok.model", "abc"});
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(dir / "pruned"));
  EXPECT_EQ(info.step, 0);
  EXPECT_EQ(info.fields.at("tokenizer_sha256"), "abc");
  const GPTConfig loaded = checkpoint_model_config(info);
  GPT again(loaded);
  ParamStore back(again.layout(), 99);
  load_weights(info, again, back);
  EXPECT_EQ(values(back), values(ps));
  std::vector<std::string> names;
  for (const PruneReport::Matrix& m : r.matrices) names.push_back(m.name);
  EXPECT_EQ(pruned_params(info), names);
  EXPECT_EQ(info.fields.at(kPruningField).at("method"), "magnitude");
}

// ---------------------------------------------------------------------------
// Attention heads
// ---------------------------------------------------------------------------

// 4 heads of width 8: GPT-2 (multi-head, packed q | k | v) and LLaMA (2
// key/value groups of 2 query heads).
GPTConfig four_heads(bool llama) {
  GPTConfig c = testing::small_gpt(0.0f, 2, 4);
  if (llama) testing::llama_variant(2)(c);
  return c;
}

// The output projection's weight of layer `layer`: the matrix whose input
// (columns) are the heads.
const ParamSpec& output_projection(const GPT& model, const GPT& smaller, int64_t layer) {
  for (const ParamSpec& p : model.layout().params()) {
    const ParamSpec& q = smaller.layout().param(smaller.layout().find(p.name));
    if (p.linear_weight && p.group == model.block_group(static_cast<int>(layer)) && q.shape[1] != p.shape[1]) return p;
  }
  LOOM_CHECK(false, "no output projection in layer ", layer);
  return model.layout().param(0);
}

// Zeroes the output projection's columns of the heads `smaller` lacks, in
// every layer: the original model with those heads' outputs masked.
void mask_removed_heads(const GPT& model, ParamStore& ps, const SmallerModel& smaller) {
  const HostSection host;
  float* w = ps.flat().data<float>();
  const int64_t hd = model.config().head_dim();
  for (int64_t l = 0; l < model.config().n_layer; ++l) {
    const ParamSpec& p = output_projection(model, *smaller.model, l);
    const std::vector<int64_t>& kept = smaller.pruning.kept[static_cast<size_t>(l)];
    for (int64_t r = 0; r < p.shape[0]; ++r)
      for (int64_t c = 0; c < p.shape[1]; ++c)
        if (!std::binary_search(kept.begin(), kept.end(), c / hd)) w[p.offset + r * p.shape[1] + c] = 0.0f;
  }
}

float max_rel_diff(const std::vector<float>& a, const std::vector<float>& ref) {
  EXPECT_EQ(a.size(), ref.size());
  float scale = 0.0f, diff = 0.0f;
  for (size_t i = 0; i < ref.size() && i < a.size(); ++i) {
    scale = std::max(scale, std::fabs(ref[i]));
    diff = std::max(diff, std::fabs(a[i] - ref[i]));
  }
  return diff / scale;
}

// Runs `body` on four_heads' GPT-2 and LLaMA, each scored by weights alone
// and over calibration data.
void for_each_variant(const std::function<void(bool llama, bool data, const GPT& model, ParamStore& ps)>& body) {
  for (bool llama : {false, true})
    for (bool data : {false, true}) {
      SCOPED_TRACE(str(llama ? "llama" : "gpt2", data ? ", calibrated" : ", by weights"));
      GPT model(four_heads(llama));
      ParamStore ps(model.layout(), 5);
      body(llama, data, model, ps);
    }
}

TEST(PruneHeads, GiveASmallerDenseModelWithTheMaskedOriginalsLogits) {
  for_each_variant([](bool llama, bool data, const GPT& model, ParamStore& ps) {
    const GPTConfig& c = model.config();
    std::optional<WandaCalibration> cal;
    if (data) {
      cal.emplace();
      calibrate(model, ps);
    }
    // One head (GPT-2) or one key/value group of two (LLaMA) per layer.
    const SmallerModel smaller = remove_heads(model, ps, llama ? 0.5 : 0.25, cal ? &*cal : nullptr);
    const GPTConfig& s = smaller.model->config();
    EXPECT_EQ(s.n_head, llama ? 2 : 3);
    EXPECT_EQ(s.kv_heads(), llama ? 1 : 3);
    EXPECT_EQ(s.head_dim(), c.head_dim());
    EXPECT_NE(s.q_dim(), s.n_embd);
    EXPECT_EQ(s.n_embd, c.n_embd);
    EXPECT_EQ(smaller.report.numel, smaller.model->layout().numel());
    EXPECT_LT(smaller.report.numel, model.layout().numel());
    for (const std::vector<int64_t>& kept : smaller.pruning.kept) {
      ASSERT_EQ(static_cast<int64_t>(kept.size()), s.n_head);
      EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
      if (llama) {
        EXPECT_EQ(kept[0] / 2, kept[1] / 2) << "a whole key/value group";
      }
    }
    mask_removed_heads(model, ps, smaller);
    EXPECT_LE(max_rel_diff(logits(*smaller.model, *smaller.params), logits(model, ps)), 1e-5f);
  });
}

// The lowest summed score leaves; ties go to the lower index.
TEST(PruneHeads, TheLeastImportantGroupLeavesFirst) {
  for_each_variant([](bool llama, bool data, const GPT& model, ParamStore& ps) {
    const GPTConfig& c = model.config();
    const GPT shape_of_smaller(remove_heads(model, ps, 0.5).pruning.config);
    const int64_t hd = c.head_dim();
    {
      // Layer 0: every head writes nothing, so all tie; layer 1: head 2
      // (LLaMA: group 1, heads 2 and 3) writes nothing.
      const HostSection host;
      float* w = ps.flat().data<float>();
      for (int64_t l : {0, 1}) {
        const ParamSpec& p = output_projection(model, shape_of_smaller, l);
        const int64_t first = l == 0 ? 0 : 2 * hd, last = l == 0 ? c.q_dim() : (llama ? 4 : 3) * hd;
        for (int64_t r = 0; r < p.shape[0]; ++r)
          for (int64_t col = first; col < last; ++col) w[p.offset + r * p.shape[1] + col] = 0.0f;
      }
    }
    std::optional<WandaCalibration> cal;
    if (data) {
      cal.emplace();
      calibrate(model, ps);
    }
    const StructuredPruning p = choose_heads(model, ps, llama ? 0.5 : 0.25, cal ? &*cal : nullptr);
    EXPECT_EQ(p.kept[0], llama ? (std::vector<int64_t>{2, 3}) : (std::vector<int64_t>{1, 2, 3}));
    EXPECT_EQ(p.kept[1], llama ? (std::vector<int64_t>{0, 1}) : (std::vector<int64_t>{0, 1, 3}));
  });
}

// With calibration a head scores ||X_h|| ||W_o[:, h]||: recomputed here from
// the calibration's input norms, the lowest is the one removed.
TEST(PruneHeads, CalibratedScoresAreTheHeadInputTimesItsOutputColumns) {
  const GPTConfig c = four_heads(false);
  GPT model(c);
  ParamStore ps(model.layout(), 9);
  WandaCalibration cal;
  calibrate(model, ps);
  const StructuredPruning p = choose_heads(model, ps, 0.25, &cal);
  const GPT smaller(p.config);
  const int64_t hd = c.head_dim();
  const HostSection host;
  const float* w = ps.flat().data<float>();
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const ParamSpec& o = output_projection(model, smaller, l);
    const std::vector<double> x = cal.input_norms(model.layout().find(o.name));
    std::vector<double> score(static_cast<size_t>(c.n_head));
    for (int64_t h = 0; h < c.n_head; ++h) {
      double xs = 0.0, ws = 0.0;
      for (int64_t col = h * hd; col < (h + 1) * hd; ++col) {
        xs += x[static_cast<size_t>(col)] * x[static_cast<size_t>(col)];
        for (int64_t r = 0; r < o.shape[0]; ++r) ws += std::pow(w[o.offset + r * o.shape[1] + col], 2);
      }
      score[static_cast<size_t>(h)] = std::sqrt(xs) * std::sqrt(ws);
    }
    const int64_t lowest = std::min_element(score.begin(), score.end()) - score.begin();
    const std::vector<int64_t>& kept = p.kept[static_cast<size_t>(l)];
    EXPECT_EQ(std::find(kept.begin(), kept.end(), lowest), kept.end()) << "layer " << l;
    EXPECT_EQ(kept.size(), 3u);
  }
}

TEST(PruneHeads, BadInputsAreErrorsNamingTheFix) {
  GPT model(four_heads(false));
  ParamStore ps(model.layout(), 1);
  EXPECT_CONTAINS(error_of([&] { choose_heads(model, ps, 0.1); }), "--sparsity 0.1 removes none of the 4 heads");
  EXPECT_CONTAINS(error_of([&] { choose_heads(model, ps, 0.9); }), "--sparsity 0.9 removes all 4 heads");
  GPT llama(four_heads(true));
  ParamStore lps(llama.layout(), 1);
  EXPECT_CONTAINS(error_of([&] { choose_heads(llama, lps, 0.2); }), "removes none of the 2 key/value groups");
  EXPECT_CONTAINS(error_of([&] { choose_heads(llama, lps, 0.8); }), "removes all 2 key/value groups");
  EXPECT_CONTAINS(error_of([] { validate({.method = PruneMethod::heads, .pattern = SparsityPattern::two_four}); }),
                  "--method heads removes whole heads");
  const WandaCalibration idle;
  EXPECT_CONTAINS(error_of([&] { choose_heads(model, ps, 0.5, &idle); }), "saw no input of h.0.attn.c_proj.weight");
}

// The pruned checkpoint (heads of width 8 beside n_embd 32 / 2 heads = 16)
// loads under tensor and data parallelism and fine-tunes as on one rank.
struct PrunedLayout {
  std::string name;
  bool llama = false;
  testing::DataParallelRun run;
};

class PrunedHeadsUnderLayout : public ::testing::TestWithParam<PrunedLayout> {};

TEST_P(PrunedHeadsUnderLayout, LoadsAndFineTunesAsSingleRank) {
  const bool llama = GetParam().llama;
  GPT model(four_heads(llama));
  ParamStore ps(model.layout(), 3);
  const SmallerModel smaller = remove_heads(model, ps, 0.5);
  testing::TempDir dir;
  write_pruned_checkpoint(dir / "pruned", *smaller.model, *smaller.params, {.method = PruneMethod::heads}, smaller.report,
                          {});
  const CheckpointInfo info = read_checkpoint_info(resolve_checkpoint(dir / "pruned"));
  const GPTConfig loaded = checkpoint_model_config(info);
  ASSERT_TRUE(loaded == smaller.model->config());
  EXPECT_EQ(loaded.head_size, 8);
  EXPECT_EQ(loaded.n_head, 2);
  EXPECT_EQ(info.fields.at(kPruningField).at("method"), "heads");
  auto pruned_run = [&](testing::DataParallelRun r) {
    r.model = loaded;
    r.steps = 4;
    r.init = [&](Trainer& t) { load_weights(info, t, 0); };
    return testing::run_layout(r);
  };
  const testing::RunResult ref = pruned_run(testing::layout(0, 0));
  EXPECT_EQ(ref.initial_params, values(*smaller.params));
  EXPECT_NE(ref.params, ref.initial_params);  // the steps moved the weights
  const testing::RunResult a = pruned_run(GetParam().run);
  EXPECT_TRUE(testing::bit_equal(a.initial_params, ref.initial_params));
  EXPECT_TRUE(testing::matches_reference(a, ref, 1e-5));
}

std::vector<PrunedLayout> pruned_layouts() {
  std::vector<PrunedLayout> v;
  for (bool llama : {false, true}) {
    const std::string name = llama ? "llama" : "gpt2";
    testing::DataParallelRun tp = testing::layout(1, 0);
    tp.tp = 2;
    v.push_back({name + "_tp2", llama, tp});
    v.push_back({name + "_dp2", llama, testing::layout(2, 1)});
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(Prune, PrunedHeadsUnderLayout, ::testing::ValuesIn(pruned_layouts()),
                         [](const auto& info) { return info.param.name; });

}  // namespace
}  // namespace loom
