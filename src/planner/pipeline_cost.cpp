#include <numeric>

#include "loom/parallel.h"
#include "loom/planner.h"

namespace loom {

namespace {

// "3,3,2"
std::string layer_list(const std::vector<int>& layers) {
  std::string text;
  for (size_t i = 0; i < layers.size(); ++i) text += str(i ? "," : "", layers[i]);
  return text;
}

std::vector<int> balanced_stage_layers(const GPTConfig& cfg, int64_t seq_len, int virtual_stages) {
  const std::vector<double> costs = pipeline_layer_costs(cfg, seq_len);
  const std::vector<int> bounds = balance_layers(costs, virtual_stages);
  std::vector<int> layers(static_cast<size_t>(virtual_stages));
  for (size_t k = 0; k < layers.size(); ++k) layers[k] = bounds[k + 1] - bounds[k];
  return layers;
}

}  // namespace

// Megatron-LM's count, split where the layers are: training_flops_per_step
// for one sequence is
//   6 s L M + 12 s^2 L h + 6 s h V
// of which each block does 6 s M + 12 s^2 h (3 x its forward's 2 s M matmul
// and 4 s^2 h attention-score FLOPs; GPT-2: M = 12 h^2) and the head 6 s h V. The
// embedding lookup does no multiply-adds; the cross-entropy's O(V) per token
// is left out against the head's O(V h), as Megatron leaves it out.
std::vector<double> pipeline_layer_costs(const GPTConfig& cfg, int64_t seq_len) {
  LOOM_CHECK(cfg.n_layer >= 1 && seq_len >= 1, "layer costs of ", cfg.n_layer, " layers at seq_len ", seq_len);
  std::vector<double> costs(static_cast<size_t>(cfg.n_layer), block_training_flops(cfg, seq_len));
  costs.back() += head_training_flops(cfg, seq_len);
  return costs;
}

std::vector<int> pipeline_stage_layers(const GPTConfig& cfg, int64_t seq_len, int virtual_stages,
                                       const std::vector<int>& override_layers) {
  LOOM_CHECK(virtual_stages >= 1, "a pipeline of ", virtual_stages, " virtual stages");
  if (virtual_stages > cfg.n_layer)
    throw Error(str("a pipeline of ", virtual_stages, " virtual stages needs at least a layer each, and the model has ",
                    cfg.n_layer, ": use at most ", cfg.n_layer, " stages (parallel.pp * parallel.virtual_stages)"));
  if (override_layers.empty()) return balanced_stage_layers(cfg, seq_len, virtual_stages);

  const std::string fix =
      str("set parallel.stage_layers = \"", layer_list(balanced_stage_layers(cfg, seq_len, virtual_stages)),
          "\", or leave it empty to balance the stages by cost");
  if (static_cast<int>(override_layers.size()) != virtual_stages)
    throw Error(str("parallel.stage_layers has ", override_layers.size(), " entries, and the pipeline's ",
                    virtual_stages, " virtual stages need one each: ", fix));
  for (size_t k = 0; k < override_layers.size(); ++k)
    if (override_layers[k] < 1)
      throw Error(str("parallel.stage_layers gives virtual stage ", k, " ", override_layers[k],
                      " layers, and every stage needs at least one: ", fix));
  const int64_t sum = std::accumulate(override_layers.begin(), override_layers.end(), int64_t{0});
  if (sum != cfg.n_layer)
    throw Error(str("parallel.stage_layers sums to ", sum, " layers, and the model has ", cfg.n_layer, ": ", fix));
  return override_layers;
}

}  // namespace loom
