#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "loom/inference.h"
#include "loom/io.h"
#include "loom/quant.h"
#include "quant_test_util.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using testing::error_of;
using testing::TempDir;
using testing::tree_contents;
using quant_testing::greedy_requests;
using quant_testing::source_info;

struct Case {
  std::string preset;
  QuantizeOptions options;
};

class QuantizedCheckpoint : public ::testing::TestWithParam<Case> {};

// The quantized checkpoint loads with its Linear weights quantized (and
// nothing else), and generates greedily the tokens of the fp32 model built
// from its dequantized weights: prefill and decode run the quantized kernels.
TEST_P(QuantizedCheckpoint, GeneratesAsTheFp32ModelOfItsDequantizedWeights) {
  const Case& k = GetParam();
  GPTConfig cfg = GPTConfig::preset(k.preset);
  cfg.block_size = 16;
  const GPT model(cfg);
  const ParamStore original(model.layout(), 5);
  const TempDir dir;
  quantize_checkpoint(source_info(dir / "src", cfg), model.layout(), original, k.options, dir / "q");

  const CheckpointInfo info = read_checkpoint_info(dir / "q");
  EXPECT_EQ(checkpoint_quantization(info)->method, k.options.method);
  const GPT loaded_model(checkpoint_model_config(info));
  const std::unique_ptr<ParamStore> loaded = load_inference_weights(info, loaded_model);
  ParamStore dequantized(loaded_model.layout(), 0);
  const ParamLayout& layout = loaded_model.layout();
  int quantized = 0;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const int id = static_cast<int>(i);
    EXPECT_EQ(loaded->quantized(id) != nullptr, quantizable(layout.param(id))) << layout.param(id).name;
    quantized += loaded->quantized(id) != nullptr;
    dequantized.param(id).copy_from(loaded->param(id));
  }
  EXPECT_GT(quantized, 0);

  const std::vector<GenerationRequest> reqs = greedy_requests(cfg.vocab_size);
  const std::vector<GenerationResult> got = Generator(loaded_model, *loaded, 2).run(reqs);
  const std::vector<GenerationResult> want = Generator(loaded_model, dequantized, 2).run(reqs);
  for (size_t i = 0; i < reqs.size(); ++i) EXPECT_EQ(got[i].tokens, want[i].tokens) << "sequence " << i;
}

INSTANTIATE_TEST_SUITE_P(Methods, QuantizedCheckpoint,
                         ::testing::Values(Case{"tiny", {QuantMethod::int8, 0}},
                                           Case{"llama-tiny", {QuantMethod::int8, 0}},
                                           Case{"tiny", {QuantMethod::int4, 64}},
                                           Case{"llama-tiny", {QuantMethod::int4, 32}}),
                         [](const auto& info) {
                           std::string name = str(info.param.preset, "_", quant_method_name(info.param.options.method));
                           for (char& c : name)
                             if (c == '-') c = '_';
                           return name;
                         });

// model.safetensors holds integers, scales and zero points for the Linear
// weights, int8 for the output table (the tied token embedding), fp32 for
// the rest; the manifest says how it was made.
TEST(QuantizedCheckpointFile, HoldsIntegerLinearsAndFloatEverythingElse) {
  const GPTConfig cfg = GPTConfig::preset("tiny");
  const GPT model(cfg);
  const ParamStore original(model.layout(), 5);
  const TempDir dir;
  const auto q = quantize_checkpoint(source_info(dir / "src", cfg), model.layout(), original,
                                     {QuantMethod::int4, 64}, dir / "q");
  const SafetensorsReader r(dir / "q" / "model.safetensors");
  for (const ParamSpec& p : model.layout().params()) {
    SCOPED_TRACE(p.name);
    if (p.linear_weight) {
      EXPECT_EQ(r.entry(p.name).dtype, DType::u8);
      EXPECT_EQ(r.entry(p.name).shape, Shape({p.shape[0], p.shape[1] / 2}));
      EXPECT_EQ(r.entry(p.name + ".scale").shape, Shape({p.shape[0], p.shape[1] / 64}));
      EXPECT_EQ(r.entry(p.name + ".zero").dtype, DType::u8);
    } else if (p.output_table) {
      EXPECT_EQ(p.name, "wte.weight");
      EXPECT_EQ(r.entry(p.name).dtype, DType::i8);
      EXPECT_EQ(r.entry(p.name).shape, p.shape);
      EXPECT_EQ(r.entry(p.name + ".scale").shape, Shape({p.shape[0], 1}));
      EXPECT_FALSE(r.contains(p.name + ".zero"));
    } else {
      EXPECT_EQ(r.entry(p.name).dtype, DType::f32);
      EXPECT_FALSE(r.contains(p.name + ".scale"));
    }
  }
  const CheckpointInfo info = read_checkpoint_info(dir / "q");
  EXPECT_EQ(info.step, 7);
  EXPECT_EQ(info.fields.at("quantization").at("group"), 64);
  EXPECT_EQ(info.fields.at("quantization").at("source"), (dir / "src").string());
  EXPECT_LT(q->nbytes(), 4 * static_cast<size_t>(model.layout().numel()));
}

TEST(QuantizedCheckpointFile, RefusalsNameTheFix) {
  const GPTConfig cfg = GPTConfig::preset("llama-tiny");
  const GPT model(cfg);
  const ParamStore original(model.layout(), 5);
  const TempDir dir;
  const CheckpointInfo source = source_info(dir / "src", cfg);

  // A group that does not divide a weight's input (the MLP's 160).
  EXPECT_CONTAINS(
      error_of([&] { quantize_checkpoint(source, model.layout(), original, {QuantMethod::int4, 64}, dir / "q"); }),
      "160 input columns, not a multiple of the int4 group 64");
  EXPECT_FALSE(fs::exists(dir / "q"));

  // A directory the user made is never replaced; an earlier quantization is.
  dir.write("mine/notes.txt", "keep me");
  const auto before = tree_contents(dir / "mine");
  EXPECT_CONTAINS(error_of([&] { quantize_checkpoint(source, model.layout(), original, {}, dir / "mine"); }),
                  "exists and is not a quantized checkpoint");
  EXPECT_EQ(tree_contents(dir / "mine"), before);
  quantize_checkpoint(source, model.layout(), original, {QuantMethod::int4, 32}, dir / "q");
  quantize_checkpoint(source, model.layout(), original, {}, dir / "q");
  const CheckpointInfo info = read_checkpoint_info(dir / "q");
  EXPECT_EQ(checkpoint_quantization(info)->method, QuantMethod::int8);

  // Quantizing it again, or loading it where fp32 weights are needed.
  const std::unique_ptr<ParamStore> loaded = load_inference_weights(info, model);
  const std::string again =
      error_of([&] { quantize_checkpoint(info, model.layout(), *loaded, {}, dir / "q2"); });
  EXPECT_CONTAINS(again, "is already quantized (int8)");
  EXPECT_CONTAINS(again, (dir / "src").string());
  ParamStore fp32(model.layout(), 0);
  EXPECT_CONTAINS(error_of([&] { load_weights(info, model, fp32); }), "train from the fp32 checkpoint it was made from");
}

}  // namespace
}  // namespace loom
