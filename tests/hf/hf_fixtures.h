// The Hugging Face fixtures of tests/fixtures/hf (tests/fixtures/README.md),
// and broken copies of them.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <algorithm>
#include <cmath>

#include "loom/device.h"
#include "loom/io.h"
#include "loom/nn.h"
#include "test_util.h"

namespace loom::testing {

inline std::filesystem::path hf_fixture(const std::string& name) {
  return std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/hf" / name;
}

// The targets of a reference's input_ids [B, T] as transformers' labels =
// input_ids has them: position t predicts token t + 1; the last position
// of each row has none (-1).
inline std::vector<int32_t> next_token_targets(const Tensor& ids) {
  const int64_t B = ids.shape()[0], T = ids.shape()[1];
  std::vector<int32_t> targets(static_cast<size_t>(B * T), -1);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t + 1 < T; ++t) targets[static_cast<size_t>(b * T + t)] = ids.data<int32_t>()[b * T + t + 1];
  return targets;
}

// One forward (eval mode) and backward of `model` over a reference's batch
// (<model>.reference.safetensors): its loss and logits must be the
// reference's (1e-5); the gradients are left in gs.
inline void forward_backward_like_reference(const GPT& model, ParamStore& ps, GradStore& gs,
                                            const SafetensorsReader& ref) {
  const Tensor ids = ref.load("input_ids");
  const std::vector<int32_t> targets = next_token_targets(ids);
  ForwardOptions fo;
  fo.training = false;
  MicroBatchState s;
  model.forward(ps, s, ids.data<int32_t>(), targets.data(), {ids.shape()[0], ids.shape()[1]}, fo);
  const double loss = s.host_loss_sum() / static_cast<double>(s.valid_targets);
  const float want_loss = ref.load("loss").data<float>()[0];
  EXPECT_NEAR(loss, want_loss, 1e-5 * want_loss);
  const Tensor want_logits = ref.load("logits");
  const Tensor logits = s.logits.clone(Tier::host);
  ASSERT_EQ(logits.numel(), want_logits.numel());
  for (int64_t i = 0; i < logits.numel(); ++i)
    ASSERT_NEAR(logits.data<float>()[i], want_logits.data<float>()[i], 1e-5) << "logits[" << i << "]";
  model.backward(ps, gs, s, 1.0f / static_cast<float>(s.valid_targets));
  ops::synchronize();
}

// A gradient against the reference's, within `tolerance` of the largest
// reference element.
inline void expect_gradient_near(const Tensor& grad, const float* want, int64_t n, double tolerance,
                                 const std::string& name) {
  double scale = 0;
  for (int64_t i = 0; i < n; ++i) scale = std::max(scale, std::fabs(static_cast<double>(want[i])));
  const Tensor got = grad.clone(Tier::host);
  ASSERT_EQ(got.numel(), n) << name;
  for (int64_t i = 0; i < n; ++i)
    ASSERT_NEAR(got.data<float>()[i], want[i], tolerance * scale) << "grad of " << name << "[" << i << "]";
}

// One tensor of a safetensors file, as stored.
struct Raw {
  std::string name;
  DType dtype;
  Shape shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<Raw> load_all(const std::filesystem::path& file) {
  const SafetensorsReader r(file);
  std::vector<Raw> out;
  for (const SafetensorsReader::Entry& e : r.entries()) {
    out.push_back({e.name, e.dtype, e.shape, std::vector<uint8_t>(e.bytes)});
    r.read(e.name, out.back().bytes.data(), e.bytes);
  }
  return out;
}

inline void save_all(const std::filesystem::path& file, const std::vector<Raw>& tensors) {
  std::vector<SafetensorsTensor> list;
  for (const Raw& t : tensors) list.push_back({t.name, t.dtype, t.shape, t.bytes.data()});
  write_safetensors(file, list, {{"format", "pt"}});
}

// A copy of fixture `name` in `dir` whose model.safetensors `edit` rewrites.
template <typename Edit>
std::filesystem::path edited_copy(const TempDir& dir, const std::string& name, Edit edit) {
  const std::filesystem::path out = dir / name;
  std::filesystem::copy(hf_fixture(name), out, std::filesystem::copy_options::recursive);
  std::vector<Raw> tensors = load_all(out / "model.safetensors");
  edit(tensors);
  save_all(out / "model.safetensors", tensors);
  return out;
}

}  // namespace loom::testing
