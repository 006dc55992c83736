// QuantizedParamStore: a model's parameters with its Linear weights held
// quantized, and the quantization of a whole store.
#include "loom/device.h"
#include "loom/quant.h"

namespace loom {

QuantizedParamStore::QuantizedParamStore(const ParamLayout& layout, std::map<int, QuantizedWeight> weights)
    : ParamStore(layout), weights_(std::move(weights)) {
  int64_t floats = 0;
  for (size_t id = 0; id < layout.params().size(); ++id) {
    const ParamSpec& p = layout.params()[id];
    const auto it = weights_.find(static_cast<int>(id));
    if (it == weights_.end()) {
      offsets_.push_back(floats);
      floats += p.numel();
      continue;
    }
    LOOM_CHECK(quantizable(p) && p.shape == Shape({it->second.rows, it->second.cols}), "quantized weight for ",
               p.name, " (", shape_str(p.shape), "): ", it->second.rows, " x ", it->second.cols);
    offsets_.push_back(-1);
  }
  floats_ = Tensor::zeros({floats});
}

Tensor QuantizedParamStore::param(int id) const {
  if (const QuantizedWeight* q = quantized(id)) return dequantize(*q);
  const ParamSpec& p = layout_.param(id);
  return floats_.flat(offsets_.at(static_cast<size_t>(id)), p.numel()).view(p.shape);
}

const QuantizedWeight* QuantizedParamStore::quantized(int id) const {
  const auto it = weights_.find(id);
  return it == weights_.end() ? nullptr : &it->second;
}

size_t QuantizedParamStore::nbytes() const {
  size_t bytes = floats_.nbytes();
  for (const auto& [id, q] : weights_) bytes += q.nbytes();
  return bytes;
}

bool quantizable(const ParamSpec& p) { return p.linear_weight || p.output_table; }

std::unique_ptr<QuantizedParamStore> quantize_params(const ParamLayout& layout, const ParamStore& params,
                                                     const QuantizeOptions& options,
                                                     const SmoothQuantCalibration* calibration) {
  check_quantize_options(options, calibration != nullptr);
  std::map<int, QuantizedWeight> weights;
  const HostSection host;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    const int id = static_cast<int>(i);
    if (!quantizable(p)) continue;
    if (params.quantized(id) != nullptr)
      throw Error(str("weight '", p.name, "' is already quantized: quantize the fp32 checkpoint it was made from"));
    const int64_t rows = p.shape[0], cols = p.shape[1];
    const QuantMethod method = p.output_table ? QuantMethod::int8 : options.method;
    if (method == QuantMethod::int4 && cols % options.group != 0)
      throw Error(str("weight '", p.name, "' has ", cols, " input columns, not a multiple of the int4 group ",
                      options.group, ": choose a --group that divides it (32, 64 or 128) or --method int8"));
    const Tensor w = params.param(id);
    switch (method) {
      case QuantMethod::int8: weights.emplace(id, quantize_int8(w.data<float>(), rows, cols, Tier::device)); break;
      case QuantMethod::int4:
        weights.emplace(id, quantize_int4(w.data<float>(), rows, cols, options.group, Tier::device));
        break;
      case QuantMethod::w8a8:
        if (calibration->tokens(id) == 0)
          throw Error(str("SmoothQuant's calibration saw no input of ", p.name,
                          ": run the model's forward over calibration data (--data) while it collects"));
        weights.emplace(id, quantize_w8a8(w.data<float>(), rows, cols, calibration->input_max(id), options.alpha,
                                          Tier::device));
        break;
    }
  }
  auto out = std::make_unique<QuantizedParamStore>(layout, std::move(weights));
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const int id = static_cast<int>(i);
    if (out->quantized(id) == nullptr) out->param(id).copy_from(params.param(id));
  }
  return out;
}

}  // namespace loom
