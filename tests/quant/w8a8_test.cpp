#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <vector>

#include "kernels/kernel_test_util.h"
#include "loom/device.h"
#include "loom/io.h"
#include "loom/quant.h"
#include "quant_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::random_tokens;
using testing::TempDir;
using cpu::kernel_testing::random_vector;
using quant_testing::greedy_requests;
using quant_testing::source_info;

// Per column max|x| of a [n, cols] matrix.
std::vector<float> column_max(const std::vector<float>& x, int64_t cols) {
  std::vector<float> m(static_cast<size_t>(cols), 0.0f);
  for (size_t i = 0; i < x.size(); ++i) m[i % m.size()] = std::max(m[i % m.size()], std::fabs(x[i]));
  return m;
}

// X W^T = (X / s)(W diag(s))^T in fp32, for activations with outlier
// columns: the smoothing changes no product beyond fp32 rounding.
TEST(SmoothQuant, SmoothingIsAnIdentityInFp32) {
  const int64_t N = 9, rows = 12, cols = 40;
  std::vector<float> x = random_vector(N * cols, 1, -1.0f, 1.0f);
  for (int64_t t = 0; t < N; ++t) x[static_cast<size_t>(t * cols + 5)] *= 80.0f;  // an outlier channel
  const std::vector<float> w = random_vector(rows * cols, 2, -0.2f, 0.2f);
  for (double alpha : {0.0, 0.5, 0.85, 1.0}) {
    SCOPED_TRACE(alpha);
    const std::vector<float> s = smoothing_factors(column_max(x, cols), w.data(), rows, cols, alpha);
    EXPECT_NE(s[5], 1.0f);
    for (int64_t t = 0; t < N; ++t)
      for (int64_t o = 0; o < rows; ++o) {
        float y = 0.0f, ys = 0.0f, mag = 0.0f;
        for (int64_t c = 0; c < cols; ++c) {
          const float xv = x[static_cast<size_t>(t * cols + c)], wv = w[static_cast<size_t>(o * cols + c)];
          const float sc = s[static_cast<size_t>(c)];
          y += xv * wv;
          ys += (xv / sc) * (wv * sc);
          mag += std::fabs(xv * wv);
        }
        EXPECT_LE(std::fabs(ys - y), 1e-5f * mag) << "row " << t << ", output " << o;
      }
  }
}

// alpha = 1 moves the whole range into the weights (every smoothed
// activation column peaks at 1), alpha = 0 none (every smoothed weight
// column peaks at 1); a column without input or weight keeps s = 1.
TEST(SmoothQuant, AlphaMovesTheRangeBetweenActivationsAndWeights) {
  const int64_t rows = 6, cols = 10;
  std::vector<float> xmax = random_vector(cols, 3, 0.5f, 50.0f);
  std::vector<float> w = random_vector(rows * cols, 4, -1.0f, 1.0f);
  xmax[2] = 0.0f;
  for (int64_t o = 0; o < rows; ++o) w[static_cast<size_t>(o * cols + 7)] = 0.0f;
  const std::vector<float> wmax = column_max(w, cols);
  const std::vector<float> s1 = smoothing_factors(xmax, w.data(), rows, cols, 1.0);
  const std::vector<float> s0 = smoothing_factors(xmax, w.data(), rows, cols, 0.0);
  for (size_t c = 0; c < static_cast<size_t>(cols); ++c) {
    SCOPED_TRACE(c);
    if (c == 2 || c == 7) {
      EXPECT_EQ(s1[c], 1.0f);
      EXPECT_EQ(s0[c], 1.0f);
      continue;
    }
    EXPECT_FLOAT_EQ(xmax[c] / s1[c], 1.0f);
    EXPECT_FLOAT_EQ(wmax[c] * s0[c], 1.0f);
  }
}

// Runs the model's forward over random tokens (what `loom quantize --data`
// does over the shard) and returns the last batch's logits.
std::vector<float> forward(const GPT& model, const ParamStore& ps, uint64_t seed, int batches = 1) {
  const std::vector<int32_t> tokens = random_tokens(2 * 16 + 1, model.config().vocab_size, seed);
  ForwardOptions fo;
  fo.training = false;
  MicroBatchState s;
  for (int b = 0; b < batches; ++b)
    const_cast<GPT&>(model).forward(const_cast<ParamStore&>(ps), s, tokens.data(), tokens.data() + 1, {2, 16}, fo);
  const Tensor l = s.logits.clone(Tier::host);
  return {l.data<float>(), l.data<float>() + l.numel()};
}

class W8A8Checkpoint : public ::testing::TestWithParam<const char*> {};

// The saved checkpoint loads as the in-memory W8A8 model: every Linear
// weight int8 with its smoothing, the same logits bit for bit, the same
// greedy generations (prefill and decode through the W8A8 kernel); its
// logits stay near the fp32 model's.
TEST_P(W8A8Checkpoint, LoadsAsTheInMemoryModel) {
  GPTConfig cfg = GPTConfig::preset(GetParam());
  cfg.block_size = 16;
  const GPT model(cfg);
  const ParamStore original(model.layout(), 5);
  const TempDir dir;
  const QuantizeOptions options{.method = QuantMethod::w8a8, .alpha = 0.6};
  std::unique_ptr<QuantizedParamStore> memory;
  {
    SmoothQuantCalibration calibration;
    forward(model, original, 1, 2);
    memory = quantize_checkpoint(source_info(dir / "src", cfg), model.layout(), original, options, dir / "q",
                                 &calibration);
  }
  const CheckpointInfo info = read_checkpoint_info(dir / "q");
  const std::optional<QuantizeOptions> stored = checkpoint_quantization(info);
  ASSERT_TRUE(stored.has_value());
  EXPECT_EQ(stored->method, QuantMethod::w8a8);
  EXPECT_EQ(stored->alpha, 0.6);
  const GPT loaded_model(checkpoint_model_config(info));
  const std::unique_ptr<ParamStore> loaded = load_inference_weights(info, loaded_model);
  const ParamLayout& layout = loaded_model.layout();
  const SafetensorsReader r(dir / "q" / "model.safetensors");
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    const QuantizedWeight* q = loaded->quantized(static_cast<int>(i));
    ASSERT_EQ(q != nullptr, quantizable(p)) << p.name;
    if (q == nullptr) continue;
    if (p.output_table) {  // weight-only int8 under every method
      EXPECT_EQ(q->method, QuantMethod::int8) << p.name;
      EXPECT_FALSE(r.contains(p.name + ".smooth"));
      continue;
    }
    EXPECT_EQ(q->method, QuantMethod::w8a8) << p.name;
    EXPECT_EQ(r.entry(p.name).dtype, DType::i8);
    EXPECT_EQ(r.entry(p.name + ".smooth").shape, Shape({p.shape[1]}));
    ops::synchronize();
    EXPECT_EQ(0, std::memcmp(q->smooth.data<float>(), memory->quantized(static_cast<int>(i))->smooth.data<float>(),
                             q->smooth.nbytes()))
        << p.name;
  }

  const std::vector<float> got = forward(loaded_model, *loaded, 9), want = forward(model, *memory, 9);
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(0, std::memcmp(got.data(), want.data(), got.size() * sizeof(float)));
  const std::vector<float> fp32 = forward(model, original, 9);
  double diff = 0.0, mag = 0.0;
  for (size_t i = 0; i < got.size(); ++i) diff += std::fabs(got[i] - fp32[i]), mag += std::fabs(fp32[i]);
  EXPECT_LT(diff, 0.05 * mag) << "W8A8 logits far from fp32's";

  const std::vector<GenerationRequest> reqs = greedy_requests(cfg.vocab_size);
  const std::vector<GenerationResult> from_file = Generator(loaded_model, *loaded, 2).run(reqs);
  const std::vector<GenerationResult> in_memory = Generator(model, *memory, 2).run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(from_file[i].tokens, in_memory[i].tokens) << "sequence " << i;
}

INSTANTIATE_TEST_SUITE_P(Presets, W8A8Checkpoint, ::testing::Values("tiny", "llama-tiny"), [](const auto& info) {
  std::string name = info.param;
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
});

TEST(W8A8Quantize, RefusalsNameTheFix) {
  const GPTConfig cfg = GPTConfig::preset("tiny");
  const GPT model(cfg);
  const ParamStore original(model.layout(), 5);
  const TempDir dir;
  const CheckpointInfo source = source_info(dir / "src", cfg);
  const QuantizeOptions w8a8{.method = QuantMethod::w8a8};

  EXPECT_CONTAINS(error_of([&] { quantize_checkpoint(source, model.layout(), original, w8a8, dir / "q"); }),
                  "give calibration data with --data");
  SmoothQuantCalibration calibration;
  EXPECT_CONTAINS(
      error_of([&] { quantize_checkpoint(source, model.layout(), original, w8a8, dir / "q", &calibration); }),
      "SmoothQuant's calibration saw no input of");
  forward(model, original, 1);
  for (double alpha : {-0.1, 1.5})
    EXPECT_CONTAINS(error_of([&] {
                      quantize_checkpoint(source, model.layout(), original,
                                          {.method = QuantMethod::w8a8, .alpha = alpha}, dir / "q", &calibration);
                    }),
                    "--alpha");
  EXPECT_FALSE(fs::exists(dir / "q"));

  quantize_checkpoint(source, model.layout(), original, w8a8, dir / "q", &calibration);
  const CheckpointInfo info = read_checkpoint_info(dir / "q");
  const std::unique_ptr<ParamStore> loaded = load_inference_weights(info, model);
  const std::string again =
      error_of([&] { quantize_checkpoint(info, model.layout(), *loaded, w8a8, dir / "q2", &calibration); });
  EXPECT_CONTAINS(again, "is already quantized (w8a8)");
  EXPECT_CONTAINS(again, (dir / "src").string());
}

}  // namespace
}  // namespace loom
