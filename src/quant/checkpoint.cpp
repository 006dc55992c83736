// Quantized checkpoints: model.safetensors with the Linear weights as
// integers plus their scales (and zero points), every other parameter in
// fp32, and a manifest naming the method; committed atomically.
#include <bit>

#include <nlohmann/json.hpp>

#include "loom/device.h"
#include "loom/io.h"
#include "loom/kernels.h"
#include "loom/quant.h"
#include "loom/train.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModelFile = "model.safetensors";

// The tensors of a quantized weight beside its integer values.
std::string scale_name(const std::string& weight) { return weight + ".scale"; }
std::string zero_name(const std::string& weight) { return weight + ".zero"; }
std::string smooth_name(const std::string& weight) { return weight + ".smooth"; }

// The manifest fields an inference load reads, copied from the source.
constexpr const char* kKeptFields[] = {"step", "model", "tokenizer", "tokenizer_sha256", "config", "dataset"};

// A quantized weight of the file, validated against the parameter it
// replaces; the method follows from the stored dtype.
QuantizedWeight read_quantized(const SafetensorsReader& r, const ParamSpec& p) {
  const std::string& name = p.name;
  const int64_t rows = p.shape[0], cols = p.shape[1];
  const SafetensorsReader::Entry& values = r.entry(name);
  const SafetensorsReader::Entry& scales = r.entry(scale_name(name));
  QuantizedWeight q;
  // int8 values with smoothing factors are W8A8's.
  q.method = values.dtype != DType::i8       ? QuantMethod::int4
             : r.contains(smooth_name(name)) ? QuantMethod::w8a8
                                             : QuantMethod::int8;
  q.rows = rows;
  q.cols = cols;
  const int64_t groups = scales.shape.size() == 2 ? scales.shape[1] : 0;
  q.group = groups > 0 && cols % groups == 0 ? cols / groups : 0;
  const bool int4 = q.method == QuantMethod::int4;
  const Shape values_shape{rows, int4 ? cols / 2 : cols};
  // The kernels take int4 groups of a power of two, at least a block.
  const bool valid = (values.dtype == DType::i8 || values.dtype == DType::u8) && values.shape == values_shape &&
                     scales.dtype == DType::f32 && q.group > 0 && scales.shape[0] == rows &&
                     (int4 ? std::has_single_bit(static_cast<uint64_t>(q.group)) && q.group >= cpu::kInt4Block &&
                                 r.contains(zero_name(name))
                           : groups == 1);
  if (!valid)
    throw Error(str("quantized weight '", name, "' in '", r.path().string(), "' is ", dtype_name(values.dtype), " ",
                    shape_str(values.shape), " with scales ", shape_str(scales.shape),
                    ": not an int8, int4 or w8a8 form of the model's ", shape_str(p.shape), " (rewrite it with loom quantize)"));
  q.values = r.load(name, Tier::device);
  q.scales = r.load(scale_name(name), Tier::device);
  if (q.method == QuantMethod::w8a8) {
    const SafetensorsReader::Entry& smooth = r.entry(smooth_name(name));
    if (smooth.dtype != DType::f32 || smooth.shape != Shape({cols}))
      throw Error(str("smoothing factors '", smooth_name(name), "' in '", r.path().string(), "' are ",
                      dtype_name(smooth.dtype), " ", shape_str(smooth.shape), ", not f32 [", cols,
                      "] for the weight's input columns (rewrite it with loom quantize)"));
    q.smooth = r.load(smooth_name(name), Tier::device);
  }
  if (int4) {
    const SafetensorsReader::Entry& zeros = r.entry(zero_name(name));
    if (zeros.dtype != DType::u8 || zeros.shape != scales.shape)
      throw Error(str("zero points '", zero_name(name), "' in '", r.path().string(), "' are ", dtype_name(zeros.dtype),
                      " ", shape_str(zeros.shape), ", not u8 ", shape_str(scales.shape), " as its scales"));
    q.zeros = r.load(zero_name(name), Tier::device);
  }
  return q;
}

}  // namespace

std::optional<QuantizeOptions> checkpoint_quantization(const CheckpointInfo& info) {
  if (!info.fields.contains(kQuantizationField)) return std::nullopt;
  const nlohmann::json& j = info.fields.at(kQuantizationField);
  if (!j.is_object() || !j.contains("method") || !j.at("method").is_string())
    throw Error(str("manifest of checkpoint '", info.dir.string(), "' has a malformed '", kQuantizationField,
                    "': ", j.dump(), " (rewrite it with loom quantize)"));
  QuantizeOptions o;
  o.method = parse_quant_method(j.at("method").get<std::string>());
  if (o.method == QuantMethod::int4) o.group = j.value("group", int64_t{0});
  if (o.method == QuantMethod::w8a8) o.alpha = j.value("alpha", o.alpha);
  return o;
}

void save_quantized_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                               const QuantizedParamStore& params, const QuantizeOptions& options, const fs::path& out) {
  std::error_code ec;
  if (fs::exists(out, ec)) {
    // Quantizing again into the same directory replaces what loom wrote
    // there; anything else is the user's.
    bool ours = false;
    try {
      ours = read_manifest(out).fields.contains(kQuantizationField);
    } catch (const Error&) {
    }
    if (!ours)
      throw Error(str("--out '", out.string(), "' exists and is not a quantized checkpoint: choose a new directory"));
  }
  std::vector<SafetensorsSpec> specs;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    if (const QuantizedWeight* q = params.quantized(static_cast<int>(i))) {
      specs.push_back({p.name, q->values.dtype(), q->values.shape()});
      specs.push_back({scale_name(p.name), DType::f32, q->scales.shape()});
      if (q->zeros.defined()) specs.push_back({zero_name(p.name), DType::u8, q->zeros.shape()});
      if (q->smooth.defined()) specs.push_back({smooth_name(p.name), DType::f32, q->smooth.shape()});
    } else {
      specs.push_back({p.name, DType::f32, p.shape});
    }
  }
  nlohmann::json quantization = {{"method", quant_method_name(options.method)}, {"source", fs::absolute(source.dir).lexically_normal().string()}};
  if (options.method == QuantMethod::int4) quantization["group"] = options.group;
  if (options.method == QuantMethod::w8a8) quantization["alpha"] = options.alpha;
  std::map<std::string, std::string> metadata{{"format", "loom"}, {"quantization", quantization.dump()}};

  fs::create_directories(out.parent_path().empty() ? fs::path(".") : out.parent_path());
  AtomicDirWriter dir(out);
  FileDigest digest;
  {
    const HostSection host;
    SafetensorsWriter w(dir.path(kModelFile), specs, metadata);
    for (size_t i = 0; i < layout.params().size(); ++i) {
      const ParamSpec& p = layout.params()[i];
      if (const QuantizedWeight* q = params.quantized(static_cast<int>(i))) {
        w.write(p.name, q->values.raw());
        w.write(scale_name(p.name), q->scales.raw());
        if (q->zeros.defined()) w.write(zero_name(p.name), q->zeros.raw());
        if (q->smooth.defined()) w.write(smooth_name(p.name), q->smooth.raw());
      } else {
        w.write(p.name, params.param(static_cast<int>(i)).raw());
      }
    }
    w.finish();
    digest = w.digest();
  }
  nlohmann::json fields = nlohmann::json::object();
  for (const char* key : kKeptFields)
    if (source.fields.contains(key)) fields[key] = source.fields.at(key);
  fields[kQuantizationField] = quantization;
  write_manifest(dir.temp_dir(), fields, {{kModelFile, digest}});
  dir.commit();
}

std::unique_ptr<QuantizedParamStore> quantize_checkpoint(const CheckpointInfo& source, const ParamLayout& layout,
                                                         const ParamStore& params, const QuantizeOptions& options,
                                                         const fs::path& out, const SmoothQuantCalibration* calibration) {
  if (const std::optional<QuantizeOptions> q = checkpoint_quantization(source))
    throw Error(str("checkpoint '", source.dir.string(), "' is already quantized (", quant_method_name(q->method),
                    "): quantize the fp32 checkpoint it was made from, ",
                    source.fields.at(kQuantizationField).value("source", std::string("its source"))));
  std::unique_ptr<QuantizedParamStore> quantized = quantize_params(layout, params, options, calibration);
  save_quantized_checkpoint(source, layout, *quantized, options, out);
  return quantized;
}

std::unique_ptr<ParamStore> load_inference_weights(const CheckpointInfo& info, const GPT& model) {
  const ParamLayout& layout = model.layout();
  if (!checkpoint_quantization(info)) {
    auto params = std::make_unique<ParamStore>(layout, 0);
    load_weights(info, model, *params);
    return params;
  }
  // What each weight is comes from the file: a quantizable weight stored with
  // scales is quantized, anything else fp32.
  const SafetensorsReader r(info.dir / kModelFile);
  std::map<int, QuantizedWeight> weights;
  const HostSection host;
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    if (quantizable(p) && r.contains(scale_name(p.name))) weights.emplace(static_cast<int>(i), read_quantized(r, p));
  }
  auto params = std::make_unique<QuantizedParamStore>(layout, std::move(weights));
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const ParamSpec& p = layout.params()[i];
    if (params->quantized(static_cast<int>(i)) != nullptr) continue;
    const SafetensorsReader::Entry& e = r.entry(p.name);
    if (e.dtype != DType::f32 || e.shape != p.shape)
      throw Error(str("tensor '", p.name, "' in '", r.path().string(), "' is ", dtype_name(e.dtype), " ",
                      shape_str(e.shape), ", the model needs f32 ", shape_str(p.shape)));
    r.read(p.name, params->param(static_cast<int>(i)).raw(), e.bytes);
  }
  return params;
}

}  // namespace loom
