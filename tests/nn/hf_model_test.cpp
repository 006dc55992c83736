// Parity with transformers: each tests/fixtures/hf/<model> checkpoint is
// loaded through HFCheckpoint into a GPT built from its config.json, and one
// forward and backward is compared with the model's own float64 logits, loss
// and parameter gradients (<model>.reference.safetensors, fixtures README).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "hf/hf_fixtures.h"
#include "loom/device.h"
#include "loom/hf.h"
#include "loom/io.h"
#include "loom/nn.h"

namespace loom {
namespace {

struct Fixture {
  const char* name;
  const char* covers;
};

void PrintTo(const Fixture& f, std::ostream* os) { *os << f.name << " (" << f.covers << ")"; }

class HFModelParity : public ::testing::TestWithParam<Fixture> {};

// The reference's tensor in loom's layout.
std::vector<float> reference_in_loom_layout(const SafetensorsReader& ref, const HFParam& p) {
  const Tensor t = ref.load("grad." + p.hf_name);
  EXPECT_EQ(t.shape(), p.hf_shape()) << p.hf_name;
  const float* v = t.data<float>();
  std::vector<float> out(v, v + t.numel());
  if (p.transform == HFTransform::transpose) {
    const int64_t rows = p.loom_shape[0], cols = p.loom_shape[1];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) out[static_cast<size_t>(r * cols + c)] = v[c * rows + r];
  }
  return out;
}

TEST_P(HFModelParity, LogitsLossAndEveryGradientMatchTransformers) {
  const std::filesystem::path dir = std::filesystem::path(LOOM_SOURCE_DIR "/tests/fixtures/hf") / GetParam().name;
  const HFModelConfig hf = read_hf_config(dir);
  const GPTConfig cfg = GPTConfig::from_hf(hf);
  const HFParamMap map(hf);
  const HFCheckpoint ckpt(dir);
  ckpt.check(map);
  const SafetensorsReader ref(dir.string() + ".reference.safetensors");

  GPT model(cfg);
  ParamStore ps(model.layout(), 0);
  GradStore gs(model.layout());
  // The model's parameters are exactly the map's, name for name and shape for shape.
  ASSERT_EQ(model.layout().params().size(), map.params().size());
  for (int id = 0; id < static_cast<int>(model.layout().params().size()); ++id) {
    const ParamSpec& spec = model.layout().param(id);
    const HFParam* p = map.by_loom(spec.name);
    ASSERT_NE(p, nullptr) << spec.name << " is not in the HF map";
    ASSERT_EQ(spec.shape, p->loom_shape) << spec.name;
    std::vector<float> v(static_cast<size_t>(spec.numel()));
    ckpt.read_param(*p, v.data());
    ps.param(id).copy_from(Tensor::from_host(v.data(), spec.shape, DType::f32, Tier::host));
  }

  SCOPED_TRACE(GetParam().covers);
  testing::forward_backward_like_reference(model, ps, gs, ref);
  for (int id = 0; id < static_cast<int>(model.layout().params().size()); ++id) {
    const ParamSpec& spec = model.layout().param(id);
    const std::vector<float> want = reference_in_loom_layout(ref, *map.by_loom(spec.name));
    testing::expect_gradient_near(gs.grad(id), want.data(), spec.numel(), 1e-4, spec.name);
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HFModelParity,
                         ::testing::Values(Fixture{"gpt2", "GPT-2: LayerNorm, learned positions, GELU, tied"},
                                           Fixture{"llama", "GQA 4/2, llama3 RoPE, SwiGLU 160, untied"},
                                           Fixture{"llama_mqa", "multi-query, linear RoPE, SwiGLU 96, untied"}),
                         [](const auto& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace loom
