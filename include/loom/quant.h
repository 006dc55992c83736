// loom quant: weight-only quantization of the Linear layers' weights for
// inference (int8 per output channel, int4 group-wise with zero points), the
// quantized checkpoint `loom quantize` writes, and the parameter store that
// serves one to the model (docs/checkpoints.md).
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
#include <string_view>
#include <vector>

#include "loom/core.h"
#include "loom/store.h"

namespace loom {

class GPT;
struct CheckpointInfo;

enum class QuantMethod : uint8_t { int8, int4 };
const char* quant_method_name(QuantMethod m);
// "int8" or "int4"; Error naming the choices otherwise.
QuantMethod parse_quant_method(std::string_view name);
// int4 groups are 32, 64 or 128 input columns; Error naming them otherwise.
void check_quant_group(int64_t group);

// A Linear's [rows, cols] weight (rows = outputs), in the formats of
// kernels.h's quantized linear.
struct QuantizedWeight {
  QuantMethod method = QuantMethod::int8;
  int64_t rows = 0, cols = 0;
  int64_t group = 0;  // input columns per scale: cols for int8
  Tensor values;      // int8: i8 [rows, cols]; int4: u8 [rows, cols / 2], packed
  Tensor scales;      // f32 [rows, cols / group]
  Tensor zeros;       // int4: u8 [rows, cols / group]; int8: undefined
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
// The fp32 [rows, cols] matrix the kernels compute with, on w's tier.
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
// (ParamSpec::output_table). The table is int8 under every method: its error
// reaches every logit directly, and int8 already cuts its bytes to a quarter.
bool quantizable(const ParamSpec& p);

// Every quantizable weight of `params` quantized, the other parameters
// copied. Error naming the weight and the fix when its
// input width is not a multiple of an int4 group.
std::unique_ptr<QuantizedParamStore> quantize_params(const ParamLayout& layout, const ParamStore& params,
                                                     const QuantizeOptions& options);

// The manifest field of a quantized checkpoint: {"method", "group", "source"}.
inline constexpr const char* kQuantizationField = "quantization";

// Writes a quantized checkpoint to `out`: model.safetensors (the fp32
// parameters under their names; a quantized weight as <name> (I8, or U8
// packed), <name>.scale and, for int4, <name>.zero) and a manifest with the
// source's model, step and tokenizer, the method and the group; committed
// atomically. Error if `out` exists.
void save_quantized_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                               const QuantizedParamStore& params, const QuantizeOptions& options,
                               const std::filesystem::path& out);
// `loom quantize`: the source checkpoint's weights (`params`, fp32)
// quantized and saved to `out`; returns them. Error when the source is
// itself quantized, naming the checkpoint it was made from.
std::unique_ptr<QuantizedParamStore> quantize_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                                                         const ParamStore& params, const QuantizeOptions& options,
                                                         const std::filesystem::path& out);
// The options a quantized checkpoint was written with, or nullopt for an
// fp32 checkpoint.
std::optional<QuantizeOptions> checkpoint_quantization(const CheckpointInfo& info);
// A checkpoint's weights for inference: an fp32 checkpoint's in a
// ParamStore, a quantized one's in a QuantizedParamStore.
std::unique_ptr<ParamStore> load_inference_weights(const CheckpointInfo& info, const GPT& model);

}  // namespace loom
