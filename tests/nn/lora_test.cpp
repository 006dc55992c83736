// LoRA adapters on linear layers (LoRAConfig): the adapter's gradients
// against finite differences (with and without dropout on its input),
// PEFT's initialization and dropout, a zero B leaving the base model's
// output unchanged, target validation, and LLaMA's adapters against PEFT's
// (tests/fixtures/hf/llama_lora).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "hf/hf_fixtures.h"
#include "loom/device.h"
#include "loom/hf.h"
#include "loom/io.h"
#include "loom/nn.h"
#include "test_util.h"

namespace loom {
namespace {

using testing::random_tokens;

LoRAConfig lora(std::vector<std::string> targets, int64_t r = 2, float alpha = 6.0f, float dropout = 0.0f) {
  LoRAConfig c;
  c.r = r;
  c.alpha = alpha;
  c.dropout = dropout;
  c.targets = std::move(targets);
  return c;
}

// A training micro-batch's adapter dropout, its tokens from global row 40.
AdapterDropout training_dropout() { return {true, stream_key(17, 3, 2), 40}; }

// sum(w * linear(x)) in double, for finite differences.
double objective(const Linear& lin, const ParamStore& ps, const std::vector<float>& x, const std::vector<float>& w,
                 int64_t N, const AdapterDropout& drop) {
  std::vector<float> y(static_cast<size_t>(N * lin.out_features()));
  lin.forward(ps, y.data(), x.data(), N, true, drop);
  double sum = 0.0;
  for (size_t i = 0; i < y.size(); ++i) sum += static_cast<double>(w[i]) * y[i];
  return sum;
}

// dA, dB and din of an adapted Linear against finite differences of its
// forward; with dropout the masks are fixed by the micro-batch's key, so the
// objective is a smooth function of the parameters and the input.
void expect_gradients_match_finite_differences(float dropout) {
  constexpr int64_t N = 6, in = 5, out = 4;
  ParamLayout layout;
  const int group = layout.add_group("g");
  const Linear lin(layout, "blk.fc", in, out, group, 0.3f, {}, {}, true, lora({"fc"}, 2, 6.0f, dropout));
  const AdapterDropout drop = training_dropout();
  ASSERT_GE(lin.lora_a_id(), 0);
  EXPECT_FALSE(layout.param(lin.weight_id()).trainable);
  EXPECT_FALSE(layout.param(lin.bias_id()).trainable);
  EXPECT_EQ(layout.param(lin.lora_a_id()).name, "blk.fc.lora_A.weight");
  EXPECT_EQ(layout.param(lin.lora_b_id()).shape, (Shape{out, 2}));
  ParamStore ps(layout, 3);
  GradStore gs(layout);
  const HostSection host;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  // B starts at zero, which would make A's gradient zero: give it values.
  float* B = ps.param(lin.lora_b_id()).data<float>();
  for (int64_t i = 0; i < out * 2; ++i) B[i] = normal(rng);
  std::vector<float> x(N * in), w(N * out), dx(N * in);
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = normal(rng);
  lin.backward({ps, gs}, dx.data(), w.data(), x.data(), N, true, drop);

  const auto check = [&](float* values, const float* analytic, int64_t n, const char* what) {
    for (int64_t i = 0; i < n; ++i) {
      const float keep = values[i];
      const float h = 1e-2f;
      values[i] = keep + h;
      const double up = objective(lin, ps, x, w, N, drop);
      values[i] = keep - h;
      const double down = objective(lin, ps, x, w, N, drop);
      values[i] = keep;
      const double numeric = (up - down) / (2.0 * h);
      EXPECT_NEAR(analytic[i], numeric, 2e-3 * std::max(1.0, std::fabs(numeric))) << what << " " << i;
    }
  };
  check(ps.param(lin.lora_a_id()).data<float>(), gs.grad(lin.lora_a_id()).data<float>(), 2 * in, "dA");
  check(B, gs.grad(lin.lora_b_id()).data<float>(), out * 2, "dB");
  check(x.data(), dx.data(), N * in, "dx");
}

TEST(LoRA, GradientsMatchFiniteDifferences) { expect_gradients_match_finite_differences(0.0f); }

TEST(LoRA, GradientsWithDropoutMatchFiniteDifferences) { expect_gradients_match_finite_differences(0.3f); }

// A Linear whose base weight is zero and whose adapter is the identity
// (r = in = out, alpha = r, A = B = I): its output is the adapter's input,
// dropped.
struct IdentityAdapter {
  static constexpr int64_t N = 100, C = 64;
  explicit IdentityAdapter(float dropout)
      : lin(layout, "blk.fc", C, C, layout.add_group("g"), 0.0f, {}, {}, false,
            lora({"fc"}, C, static_cast<float>(C), dropout)),
        ps(layout, 1) {
    const HostSection host;
    for (int id : {lin.lora_a_id(), lin.lora_b_id()}) {
      float* m = ps.param(id).data<float>();
      for (int64_t i = 0; i < C; ++i)
        for (int64_t j = 0; j < C; ++j) m[i * C + j] = i == j ? 1.0f : 0.0f;
    }
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> uniform(0.5f, 1.5f);  // never zero
    for (float& v : x) v = uniform(rng);
  }
  std::vector<float> forward(const AdapterDropout& drop) const {
    const HostSection host;
    std::vector<float> y(N * C);
    lin.forward(ps, y.data(), x.data(), N, true, drop);
    return y;
  }
  ParamLayout layout;
  Linear lin;
  ParamStore ps;
  std::vector<float> x = std::vector<float>(N * C);
};

TEST(LoRA, DropoutDropsAboutPOfTheAdapterInputAndScalesTheRest) {
  const float p = 0.3f;
  const IdentityAdapter id(p);
  const std::vector<float> y = id.forward(training_dropout());
  int64_t dropped = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    if (y[i] == 0.0f) {
      ++dropped;
      continue;
    }
    EXPECT_FLOAT_EQ(y[i], id.x[i] / (1.0f - p)) << i;
  }
  EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(y.size()), p, 0.02);
  // Another micro-batch (other rows of the global batch) draws another mask.
  AdapterDropout later = training_dropout();
  later.first_row += IdentityAdapter::N;
  EXPECT_NE(id.forward(later), y);
}

TEST(LoRA, DropoutDrawsNoMaskOutsideTraining) {
  const IdentityAdapter id(0.5f);
  AdapterDropout eval = training_dropout();
  eval.training = false;
  for (const std::vector<float>& y : {id.forward(eval), id.forward({})})
    for (size_t i = 0; i < y.size(); ++i) ASSERT_FLOAT_EQ(y[i], id.x[i]) << i;
}

// p = 0 in training: no mask, the same bits forward and backward as a layer
// given no dropout context at all.
TEST(LoRA, ZeroDropoutIsTheNoDropoutPathBitForBit) {
  constexpr int64_t N = 9, in = 12, out = 7;
  ParamLayout layout;
  const Linear lin(layout, "blk.fc", in, out, layout.add_group("g"), 0.3f, {}, {}, true, lora({"fc"}));
  ParamStore ps(layout, 5);
  const HostSection host;
  std::mt19937 rng(2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t i = 0; i < out * 2; ++i) ps.param(lin.lora_b_id()).data<float>()[i] = normal(rng);
  std::vector<float> x(N * in), dy(N * out);
  for (float& v : x) v = normal(rng);
  for (float& v : dy) v = normal(rng);
  const auto run = [&](const AdapterDropout& drop) {
    GradStore gs(layout);
    std::vector<float> y(N * out), dx(N * in);
    lin.forward(ps, y.data(), x.data(), N, true, drop);
    lin.backward({ps, gs}, dx.data(), dy.data(), x.data(), N, true, drop);
    for (int id : {lin.lora_a_id(), lin.lora_b_id()}) {
      const Tensor g = gs.grad(id);
      y.insert(y.end(), g.data<float>(), g.data<float>() + g.numel());
    }
    y.insert(y.end(), dx.begin(), dx.end());
    return y;
  };
  const std::vector<float> with = run(training_dropout()), without = run({});
  ASSERT_EQ(with.size(), without.size());
  EXPECT_EQ(std::memcmp(with.data(), without.data(), with.size() * sizeof(float)), 0);
}

TEST(LoRA, AInitializedAsPeftDoesAndBZero) {
  constexpr int64_t in = 400, r = 8;
  ParamLayout layout;
  const Linear lin(layout, "c_attn", in, 30, layout.add_group("g"), 0.02f, {}, {}, true, lora({"c_attn"}, r));
  ParamStore ps(layout, 11);
  const HostSection host;
  const Tensor A = ps.param(lin.lora_a_id());
  // kaiming_uniform(a = sqrt(5)): uniform in +-1/sqrt(in), variance 1 / (3 in).
  const double bound = 1.0 / std::sqrt(static_cast<double>(in));
  double sum_sq = 0.0, max_abs = 0.0;
  for (int64_t i = 0; i < A.numel(); ++i) {
    const double v = A.data<float>()[i];
    sum_sq += v * v;
    max_abs = std::max(max_abs, std::fabs(v));
  }
  EXPECT_LE(max_abs, bound);
  EXPECT_GT(max_abs, 0.95 * bound);
  EXPECT_NEAR(sum_sq / static_cast<double>(A.numel()), bound * bound / 3.0, 0.05 * bound * bound / 3.0);
  const Tensor B = ps.param(lin.lora_b_id());
  for (int64_t i = 0; i < B.numel(); ++i) ASSERT_EQ(B.data<float>()[i], 0.0f);
}

// GPT-2 "tiny" (2 blocks), with the given adapters.
GPTConfig small(LoRAConfig l = {}) {
  GPTConfig c = GPTConfig::preset("tiny");
  c.lora = std::move(l);
  return c;
}

TEST(LoRA, ZeroBLeavesTheBaseModelsLossUnchanged) {
  const std::vector<int32_t> tok = random_tokens(2 * 8 + 1, 37, 3);
  const auto loss = [&](const GPTConfig& cfg) {
    GPT model(cfg);
    ParamStore ps(model.layout(), 5);
    MicroBatchState s;
    ForwardOptions fo;
    fo.training = false;
    model.forward(ps, s, tok.data(), tok.data() + 1, {2, 8}, fo);
    return s.host_loss_sum();
  };
  GPT adapted(small(lora({"c_attn", "c_proj", "c_fc"})));
  int adapters = 0;
  for (const ParamSpec& p : adapted.layout().params()) adapters += p.name.ends_with("lora_A.weight");
  EXPECT_EQ(adapters, 2 * 4);  // c_attn, attn.c_proj, c_fc, mlp.c_proj per block
  EXPECT_EQ(loss(small(lora({"c_attn", "c_proj", "c_fc"}))), loss(small()));
}

TEST(LoRA, TargetsMatchBySuffixAndUnknownOnesAreErrorsListingTheValidNames) {
  GPT mlp_only(small(lora({"mlp.c_proj"})));
  int adapted = 0;
  for (const ParamSpec& p : mlp_only.layout().params()) {
    if (p.name.find("lora_") == std::string::npos) continue;
    ++adapted;
    EXPECT_NE(p.name.find(".mlp.c_proj."), std::string::npos) << p.name;
  }
  EXPECT_EQ(adapted, 2 * 2);
  try {
    GPT bad(small(lora({"c_atn"})));
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("did you mean \"c_attn\""), std::string::npos) << m;
    EXPECT_NE(m.find("mlp.c_proj"), std::string::npos) << m;
  }
  for (float p : {-0.1f, 1.0f}) {
    try {
      GPT bad(small(lora({"c_attn"}, 2, 6.0f, p)));
      FAIL() << "no error for lora.dropout = " << p;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("lora.dropout"), std::string::npos) << e.what();
    }
  }
  EXPECT_NO_THROW(GPT{small(lora({"c_attn"}, 2, 6.0f, 0.1f))});
}


// ---------------------------------------------------------------------------
// LLaMA: an adapter per stacked parameter, against PEFT
// ---------------------------------------------------------------------------

// The llama fixture's model with the adapters llama_lora/adapter_config.json
// describes (PEFT's q_proj ... down_proj are loom's q ... down).
GPTConfig llama_with_fixture_adapters() {
  GPTConfig cfg = GPTConfig::from_hf(read_hf_config(testing::hf_fixture("llama")));
  std::ifstream in(testing::hf_fixture("llama_lora") / "adapter_config.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  cfg.lora.r = j.at("r").get<int64_t>();
  cfg.lora.alpha = j.at("lora_alpha").get<float>();
  for (const std::string& m : j.at("target_modules").get<std::vector<std::string>>())
    cfg.lora.targets.push_back(m.substr(0, m.rfind("_proj")));
  return cfg;
}

TEST(LoRA, LlamaTargetsAdaptEachStackedParameterAndNameOAndDown) {
  GPTConfig cfg = GPTConfig::preset("llama-tiny");
  cfg.lora = lora({"k", "o", "down"});
  const GPT model(cfg);
  std::vector<std::string> adapted;
  for (const ParamSpec& p : model.layout().params())
    if (p.name.starts_with("h.0.") && p.name.ends_with(".lora_A.weight")) adapted.push_back(p.name);
  EXPECT_EQ(adapted, (std::vector<std::string>{"h.0.attn.k.lora_A.weight", "h.0.attn.c_proj.lora_A.weight",
                                               "h.0.mlp.c_proj.lora_A.weight"}));
  EXPECT_EQ(model.layout().numel(), cfg.num_params());
  cfg.lora = lora({"c_attn"});
  try {
    cfg.validate();
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string m = e.what();
    ASSERT_NE(m.find("valid: "), std::string::npos) << m;
    std::vector<std::string> valid;
    for (std::string rest = m.substr(m.find("valid: ") + 7) + ", "; !rest.empty(); rest = rest.substr(rest.find(", ") + 2))
      valid.push_back(rest.substr(0, rest.find(", ")));
    for (const char* name : {"q", "k", "v", "o", "gate", "up", "down"})
      EXPECT_NE(std::find(valid.begin(), valid.end(), name), valid.end()) << name << " missing from: " << m;
  }
}

// The llama fixture with PEFT's adapter on every projection (q, k, v
// stacked, gate and up stacked, GQA 4/2): loom's forward gives PEFT's logits
// and loss, and its backward the adapters' gradients (fixtures README).
TEST(LoRA, LlamaAdapterMatchesPeftLogitsLossAndGradients) {
  const GPTConfig cfg = llama_with_fixture_adapters();
  const HFParamMap map(read_hf_config(testing::hf_fixture("llama")));
  const HFCheckpoint base(testing::hf_fixture("llama")), adapter(testing::hf_fixture("llama_lora"), "adapter_model");
  const SafetensorsReader ref(testing::hf_fixture("llama_lora.reference.safetensors"));
  GPT model(cfg);
  ParamStore ps(model.layout(), 0);
  GradStore gs(model.layout());
  // PEFT's name of an adapter factor: its base weight's HF module, prefixed.
  const auto peft_name = [&](const ParamSpec& p) {
    const size_t at = p.name.find(".lora_");
    const HFParam* w = map.by_loom(p.name.substr(0, at) + ".weight");
    EXPECT_NE(w, nullptr) << p.name;
    return "base_model.model." + w->hf_name.substr(0, w->hf_name.rfind(".weight")) + p.name.substr(at);
  };
  int adapters = 0;
  for (int id = 0; id < static_cast<int>(model.layout().params().size()); ++id) {
    const ParamSpec& spec = model.layout().param(id);
    std::vector<float> v(static_cast<size_t>(spec.numel()));
    if (const HFParam* p = map.by_loom(spec.name)) {
      base.read_param(*p, v.data());
    } else {
      adapter.read_f32(peft_name(spec), v.data(), spec.numel());
      ++adapters;
    }
    ps.param(id).copy_from(Tensor::from_host(v.data(), spec.shape, DType::f32, Tier::host));
  }
  EXPECT_EQ(static_cast<size_t>(adapters), adapter.tensors().size());

  testing::forward_backward_like_reference(model, ps, gs, ref);
  for (int id = 0; id < static_cast<int>(model.layout().params().size()); ++id) {
    const ParamSpec& spec = model.layout().param(id);
    if (map.by_loom(spec.name)) continue;  // frozen: PEFT computes no gradient
    const Tensor want = ref.load("grad." + peft_name(spec));
    testing::expect_gradient_near(gs.grad(id), want.data<float>(), want.numel(), 1e-4, spec.name);
  }
}

}  // namespace
}  // namespace loom
