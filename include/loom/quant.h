// loom quant: quantization of the Linear layers for inference: weight-only
// (int8 per output channel, int4 group-wise with zero points) or W8A8 (int8
// weights and per-token int8 activations, SmoothQuant's migration of
// activation outliers into the weights), the quantized checkpoint `loom
// quantize` writes, and the parameter store that serves one to the model
// (docs/checkpoints.md).
//
// Which weights are quantized is data: the parameters a Linear declares as
// its weight (ParamSpec::linear_weight) when quantizing, and at load what the
// checkpoint holds. A Linear asks its ParamStore for each weight's quantized
// form (ParamStore::quantized) and runs the quantized kernel when there is
// one; every other parameter (embeddings, norms, biases) stays fp32.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "loom/core.h"
#include "loom/nn.h"
#include "loom/store.h"

namespace loom {

class GPT;
struct CheckpointInfo;

enum class QuantMethod : uint8_t { int8, int4, w8a8 };
const char* quant_method_name(QuantMethod m);
// "int8", "int4" or "w8a8"; Error naming the choices otherwise.
QuantMethod parse_quant_method(std::string_view name);
// int4 groups are 32, 64 or 128 input columns; Error naming them otherwise.
void check_quant_group(int64_t group);
// SmoothQuant's migration strength alpha lies in [0, 1]; Error naming
// --alpha otherwise.
void check_smooth_alpha(double alpha);

// A Linear's [rows, cols] weight (rows = outputs), in the formats of
// kernels.h's quantized linear.
struct QuantizedWeight {
  QuantMethod method = QuantMethod::int8;
  int64_t rows = 0, cols = 0;
  int64_t group = 0;  // input columns per scale: cols for int8
  Tensor values;      // int8: i8 [rows, cols]; int4: u8 [rows, cols / 2], packed
  Tensor scales;      // f32 [rows, cols / group]
  Tensor zeros;       // int4: u8 [rows, cols / group]; int8: undefined
  Tensor smooth;      // w8a8: f32 [cols], 1 / s per input column, applied to the input before it is quantized
  int64_t groups() const { return cols / group; }
  size_t nbytes() const;
};

// Quantizes a [rows, cols] fp32 matrix (host memory). int8: per row scale =
// max|w| / 127 and q = round(w / scale). int4: per group of `group` columns
// the range [min(w, 0), max(w, 0)] in 15 steps, scale = range / 15, zero =
// round(-min / scale), q = round(w / scale) + zero; a constant group c is
// stored exactly (scale |c|, q - zero = sign(c)). Every element comes back
// within scale / 2 of w (plus the rounding of the product); an all-zero row
// or group has scale 0 and comes back exactly.
QuantizedWeight quantize_int8(const float* w, int64_t rows, int64_t cols, Tier tier = Tier::host);
QuantizedWeight quantize_int4(const float* w, int64_t rows, int64_t cols, int64_t group, Tier tier = Tier::host);

// SmoothQuant (Xiao et al. 2023): per input column j, with a_j = max|X_j|
// over the calibration tokens and w_j = max_o |W[o, j]|, s_j = a_j^alpha /
// w_j^(1 - alpha) (1 where a_j or w_j is 0). X W^T = (X diag(1/s)) (W
// diag(s))^T: the activation's outlier columns shrink, the weight's grow.
std::vector<float> smoothing_factors(std::span<const float> input_max, const float* w, int64_t rows, int64_t cols,
                                     double alpha);
// W diag(s) quantized as int8 (per output row), with 1 / s as `smooth`.
QuantizedWeight quantize_w8a8(const float* w, int64_t rows, int64_t cols, std::span<const float> input_max,
                              double alpha, Tier tier = Tier::host);
// The fp32 [rows, cols] matrix the kernels compute with, on w's tier (w8a8:
// with the smoothing undone, q * scale / s, the weight the model multiplies
// its unsmoothed input by).
Tensor dequantize(const QuantizedWeight& w);
// out[N, :rows] (rows ldo apart) = in[N, cols] @ W[first_row, first_row + rows)^T + bias[rows] (bias may be
// null), through ops (a stacked Linear's part writes its band of columns).
void quantized_linear_forward(float* out, int64_t ldo, const float* in, const QuantizedWeight& w, int64_t first_row,
                              int64_t rows, const float* bias, int64_t N);

// out[N, w.cols] = the rows tokens[0..N) of w dequantized, through ops (a
// quantized token table's lookup).
void quantized_embedding_lookup(float* out, const int32_t* tokens, const QuantizedWeight& w, int64_t N);

struct QuantizeOptions {
  QuantMethod method = QuantMethod::int8;
  int64_t group = 128;  // int4 only
  double alpha = 0.5;   // w8a8 only
};
// The options' own checks (int4's group, w8a8's alpha) and, for w8a8, that
// there is calibration data: Errors naming the flag to fix.
void check_quantize_options(const QuantizeOptions& options, bool calibrated);

// SmoothQuant's calibration: while it lives, every linear layer's forward on
// the constructing thread records max|x| per input column of each weight's
// input (ScopedLinearInputHook), over all the tokens it sees.
class SmoothQuantCalibration {
 public:
  SmoothQuantCalibration();
  // Tokens seen by weight `id`'s layer.
  int64_t tokens(int id) const;
  // max|x| per input column of weight `id`'s input.
  std::span<const float> input_max(int id) const;

 private:
  struct Stats {
    std::vector<float> max;
    int64_t tokens = 0;
  };
  std::map<int, Stats> stats_;
  ScopedLinearInputHook hook_;
};

// Parameters of one rank with some Linear weights held quantized: the rest
// in one fp32 buffer on the device tier (zero until written through param()).
class QuantizedParamStore final : public ParamStore {
 public:
  QuantizedParamStore(const ParamLayout& layout, std::map<int, QuantizedWeight> weights);
  // A quantized parameter comes back dequantized, in a fresh tensor (code
  // that reads weights as fp32, e.g. export, sees what the kernels use).
  Tensor param(int id) const override;
  const QuantizedWeight* quantized(int id) const override;
  // The bytes the model's weights take: the fp32 parameters and the
  // quantized ones with their scales and zero points.
  size_t nbytes() const;

 private:
  std::map<int, QuantizedWeight> weights_;
  std::vector<int64_t> offsets_;  // into floats_, -1 for a quantized parameter
  Tensor floats_;
};

// The parameters quantize_params converts: the linear layers' weights
// (ParamSpec::linear_weight) and the output head's table
// (ParamSpec::output_table). The table is weight-only int8 under every
// method: its error reaches every logit directly, and int8 already cuts its
// bytes to a quarter.
bool quantizable(const ParamSpec& p);

// Every quantizable weight of `params` quantized, the other parameters
// copied. Error naming the weight and the fix when its input width is not a
// multiple of an int4 group; w8a8 reads `calibration` (Error naming --data
// without it, or when it saw no input of a weight).
std::unique_ptr<QuantizedParamStore> quantize_params(const ParamLayout& layout, const ParamStore& params,
                                                     const QuantizeOptions& options,
                                                     const SmoothQuantCalibration* calibration = nullptr);

// The manifest field of a quantized checkpoint: {"method", "group" (int4),
// "alpha" (w8a8), "source"}.
inline constexpr const char* kQuantizationField = "quantization";

// Writes a quantized checkpoint to `out`: model.safetensors (the fp32
// parameters under their names; a quantized weight as <name> (I8, or U8
// packed), <name>.scale, for int4 <name>.zero and for w8a8 <name>.smooth)
// and a manifest with the source's model, step and tokenizer, the method and
// its group or alpha; committed atomically. Error if `out` exists.
void save_quantized_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                               const QuantizedParamStore& params, const QuantizeOptions& options,
                               const std::filesystem::path& out);
// `loom quantize`: the source checkpoint's weights (`params`, fp32)
// quantized and saved to `out`; returns them. Error when the source is
// itself quantized, naming the checkpoint it was made from.
std::unique_ptr<QuantizedParamStore> quantize_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                                                         const ParamStore& params, const QuantizeOptions& options,
                                                         const std::filesystem::path& out,
                                                         const SmoothQuantCalibration* calibration = nullptr);
// The options a quantized checkpoint was written with, or nullopt for an
// fp32 checkpoint.
std::optional<QuantizeOptions> checkpoint_quantization(const CheckpointInfo& info);
// A checkpoint's weights for inference: an fp32 checkpoint's in a
// ParamStore, a quantized one's in a QuantizedParamStore.
std::unique_ptr<ParamStore> load_inference_weights(const CheckpointInfo& info, const GPT& model);

}  // namespace loom
