// Reading a Hugging Face checkpoint directory. Each file is opened (and its
// header validated) by SafetensorsReader; what is checked here spans files:
// the index against the shards, and the tensors against config.json.
#include <algorithm>
#include <set>

#include <nlohmann/json.hpp>

#include "loom/config.h"
#include "loom/hf.h"
#include "loom/io.h"

namespace loom {

namespace fs = std::filesystem;

namespace {

// Conversion goes through a bounded staging buffer, so reading a tensor needs
// no second copy of it.
constexpr size_t kStagingBytes = 1 << 20;

bool is_float(DType dt) { return dt == DType::f32 || dt == DType::bf16 || dt == DType::f16; }

[[noreturn]] void refuse_pickles(const fs::path& dir, std::string_view stem) {
  const fs::path bin = dir / (std::string(stem == "model" ? "pytorch_model" : stem) + ".bin");
  const fs::path bin_index = fs::path(bin.string() + ".index.json");
  const bool pickles = fs::exists(bin) || fs::exists(bin_index);
  if (pickles)
    throw Error(str("Hugging Face checkpoint '", dir.string(), "' holds ",
                    (fs::exists(bin) ? bin : bin_index).filename().string(),
                    " (PyTorch pickle): loom reads only safetensors. Convert it with transformers: "
                    "AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(OUT, safe_serialization=True)"));
  throw Error(str("Hugging Face checkpoint '", dir.string(), "' has neither ", stem, ".safetensors nor ", stem,
                  ".safetensors.index.json", fs::is_directory(dir) ? "" : " (no such directory)"));
}

}  // namespace

HFCheckpoint::HFCheckpoint(fs::path dir, std::string_view stem) : dir_(std::move(dir)) {
  const fs::path single = dir_ / (std::string(stem) + ".safetensors");
  const fs::path index_path = fs::path(single.string() + ".index.json");
  // Which file lists each tensor: itself, or the index for the sharded form.
  std::map<std::string, fs::path, std::less<>> listed_in;
  if (fs::exists(index_path)) {
    sharded_ = true;
    listing_ = index_path;
    auto fail = [&](const std::string& problem) {
      return Error(str("checkpoint index '", index_path.string(), "': ", problem));
    };
    nlohmann::json index;
    try {
      index = nlohmann::json::parse(read_file(index_path));
    } catch (const nlohmann::json::exception& e) {
      throw fail(str("not valid JSON (", e.what(), ")"));
    }
    if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
      throw fail("has no \"weight_map\" object {tensor name: shard file}");
    for (const auto& [name, file] : index["weight_map"].items()) {
      if (!file.is_string() || file.get<std::string>().find('/') != std::string::npos)
        throw fail(str("weight_map[\"", name, "\"] is ", file.dump(), ", not a file name in the directory"));
      listed_in.emplace(name, dir_ / file.get<std::string>());
    }
  } else if (fs::exists(single)) {
    listing_ = single;
  } else {
    refuse_pickles(dir_, stem);
  }

  // Open each file once, in a fixed (sorted) order.
  std::set<fs::path> files;
  for (const auto& [name, file] : listed_in) files.insert(file);
  if (!sharded_) files.insert(single);
  for (const fs::path& file : files) {
    if (!fs::exists(file))
      throw Error(str("checkpoint index '", listing_.string(), "' names shard '", file.filename().string(),
                      "', which does not exist in ", dir_.string()));
    readers_.push_back(std::make_unique<SafetensorsReader>(file));
    const SafetensorsReader& r = *readers_.back();
    for (const SafetensorsReader::Entry& e : r.entries()) {
      if (sharded_) {
        auto it = listed_in.find(e.name);
        if (it == listed_in.end())
          throw Error(str("tensor '", e.name, "' is in shard '", file.string(), "' but not in the index '",
                          listing_.string(), "' (an incomplete index)"));
        if (it->second != file)
          throw Error(str("tensor '", e.name, "' is in shard '", file.string(), "' but the index '", listing_.string(),
                          "' places it in '", it->second.filename().string(), "'"));
      }
      if (index_.count(e.name))
        throw Error(str("tensor '", e.name, "' is in both '", tensors_[index_.at(e.name)].file.string(), "' and '",
                        file.string(), "'"));
      index_.emplace(e.name, tensors_.size());
      tensors_.push_back({e.name, e.dtype, e.shape, file});
      reader_index_.push_back(readers_.size() - 1);
    }
  }
  for (const auto& [name, file] : listed_in)
    if (!index_.count(name))
      throw Error(str("checkpoint index '", listing_.string(), "' places tensor '", name, "' in '",
                      file.filename().string(), "', which does not contain it"));

  // Sorted by name; the index map and the reader table follow the new order.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tensors_[a].name < tensors_[b].name; });
  std::vector<HFTensorInfo> sorted;
  std::vector<size_t> sorted_readers;
  index_.clear();
  for (size_t i : order) {
    index_.emplace(tensors_[i].name, sorted.size());
    sorted.push_back(std::move(tensors_[i]));
    sorted_readers.push_back(reader_index_[i]);
  }
  tensors_ = std::move(sorted);
  reader_index_ = std::move(sorted_readers);
}

HFCheckpoint::~HFCheckpoint() = default;

bool HFCheckpoint::contains(std::string_view name) const { return index_.find(name) != index_.end(); }

const HFTensorInfo& HFCheckpoint::tensor(std::string_view name) const {
  auto it = index_.find(name);
  if (it == index_.end()) {
    std::vector<std::string> names;
    for (const HFTensorInfo& t : tensors_) names.push_back(t.name);
    std::string hint;
    if (auto m = did_you_mean(name, names)) hint = str("; did you mean '", *m, "'?");
    throw Error(str("Hugging Face checkpoint '", listing_.string(), "' has no tensor '", name, "'", hint));
  }
  return tensors_[it->second];
}

const SafetensorsReader& HFCheckpoint::reader_of(std::string_view name) const {
  tensor(name);
  return *readers_[reader_index_[index_.find(name)->second]];
}

void HFCheckpoint::read_bytes_f32(std::string_view name, uint64_t byte_offset, int64_t numel, float* dst) const {
  const HFTensorInfo& t = tensor(name);
  if (!is_float(t.dtype))
    throw Error(str("tensor '", name, "' in '", t.file.string(), "' is ", dtype_name(t.dtype),
                    "; loom reads parameters stored as F32, BF16 or F16"));
  const SafetensorsReader& r = reader_of(name);
  const size_t elem = dtype_size(t.dtype);
  if (t.dtype == DType::f32) {
    r.read_range(name, byte_offset, dst, static_cast<size_t>(numel) * elem);
    return;
  }
  const int64_t per_chunk = std::min(static_cast<int64_t>(kStagingBytes / elem), numel);
  const Tensor staging = Tensor::empty({per_chunk}, t.dtype, Tier::host);
  for (int64_t done = 0; done < numel; done += per_chunk) {
    const int64_t n = std::min(per_chunk, numel - done);
    r.read_range(name, byte_offset + static_cast<uint64_t>(done) * elem, staging.raw(), static_cast<size_t>(n) * elem);
    convert(staging.raw(), t.dtype, dst + done, DType::f32, n);
  }
}

void HFCheckpoint::read_f32(std::string_view name, float* dst, int64_t numel) const {
  const HFTensorInfo& t = tensor(name);
  LOOM_CHECK(numel == shape_numel(t.shape), "tensor '", name, "' ", shape_str(t.shape), " read into ", numel,
             " floats");
  read_bytes_f32(name, 0, numel, dst);
}

void HFCheckpoint::read_rows_f32(std::string_view name, int64_t begin, int64_t end, float* dst) const {
  const HFTensorInfo& t = tensor(name);
  LOOM_CHECK(!t.shape.empty() && 0 <= begin && begin <= end && end <= t.shape[0], "rows [", begin, ", ", end,
             ") of '", name, "' ", shape_str(t.shape));
  const int64_t row = shape_numel(t.shape) / std::max<int64_t>(t.shape[0], 1);
  read_bytes_f32(name, static_cast<uint64_t>(begin * row) * dtype_size(t.dtype), (end - begin) * row, dst);
}

void HFCheckpoint::read_cols_f32(std::string_view name, int64_t begin, int64_t end, float* dst) const {
  const HFTensorInfo& t = tensor(name);
  LOOM_CHECK(t.shape.size() == 2 && 0 <= begin && begin <= end && end <= t.shape[1], "columns [", begin, ", ", end,
             ") of '", name, "' ", shape_str(t.shape));
  const int64_t width = end - begin;
  for (int64_t r = 0; r < t.shape[0]; ++r)
    read_bytes_f32(name, static_cast<uint64_t>(r * t.shape[1] + begin) * dtype_size(t.dtype), width, dst + r * width);
}

const std::string& HFCheckpoint::stored_name(const HFParam& p) const {
  if (!contains(p.hf_name) && !p.hf_alias.empty() && contains(p.hf_alias)) return p.hf_alias;
  return tensor(p.hf_name).name;
}

void HFCheckpoint::check(const HFParamMap& map) const {
  std::set<const HFParam*> found;
  for (const HFTensorInfo& t : tensors_) {
    const HFParam* p = map.by_hf(t.name);
    if (!p) {
      if (map.ignorable(t.name)) continue;
      std::vector<std::string> names;
      for (const HFParam& q : map.params()) names.push_back(q.hf_name);
      std::string hint;
      if (auto m = did_you_mean(t.name, names)) hint = str(" (did you mean '", *m, "'?)");
      throw Error(str("unexpected tensor '", t.name, "' in '", t.file.string(),
                      "': not a parameter of the model config.json describes", hint));
    }
    if (!found.insert(p).second)
      throw Error(str("tensor '", t.name, "' in '", t.file.string(), "' is stored twice (as '", p->hf_name, "' and '",
                      p->hf_alias, "')"));
    if (!is_float(t.dtype))
      throw Error(str("tensor '", t.name, "' in '", t.file.string(), "' is ", dtype_name(t.dtype),
                      "; loom reads parameters stored as F32, BF16 or F16"));
    if (t.shape != p->hf_shape())
      throw Error(str("tensor '", t.name, "' in '", t.file.string(), "' has shape ", shape_str(t.shape),
                      " but config.json implies ", shape_str(p->hf_shape())));
  }
  for (const HFParam& p : map.params())
    if (!found.count(&p))
      throw Error(str("tensor '", p.hf_name, "' (loom '", p.loom_name, "') is missing from '", listing_.string(),
                      "'"));
}

void HFCheckpoint::read_param(const HFParam& p, float* dst) const {
  read_param_rows(p, 0, p.loom_shape[0], dst);
}

void HFCheckpoint::read_param_rows(const HFParam& p, int64_t begin, int64_t end, float* dst) const {
  const std::string& name = stored_name(p);
  const HFTensorInfo& t = tensor(name);
  if (t.shape != p.hf_shape())
    throw Error(str("tensor '", name, "' in '", t.file.string(), "' has shape ", shape_str(t.shape), ", not ",
                    shape_str(p.hf_shape())));
  if (p.transform == HFTransform::none) {
    read_rows_f32(name, begin, end, dst);
    return;
  }
  // loom's rows are HF's columns: read them [in, rows], then transpose.
  const int64_t in = t.shape[0], rows = end - begin;
  const Tensor staged = Tensor::empty({in * rows}, DType::f32, Tier::host);
  const float* cols = staged.data<float>();
  read_cols_f32(name, begin, end, staged.data<float>());
  for (int64_t k = 0; k < in; ++k)
    for (int64_t r = 0; r < rows; ++r) dst[r * in + k] = cols[k * rows + r];
}

}  // namespace loom
