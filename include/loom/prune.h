// loom prune: weight pruning of a trained model (docs/pruning.md). The
// linear layers' weights (ParamSpec::linear_weight) lose their lowest-scoring
// elements, by magnitude |W_ij| or by Wanda's |W_ij| * ||X_j||_2 (Sun et al.
// 2023: X_j the layer's input feature j over calibration tokens), at a given
// sparsity or in NVIDIA's 2:4 pattern; the result is an ordinary checkpoint
// whose manifest names the pruned matrices, and fine-tuning from it keeps
// their zeros (AdamWConfig::keep_zeros).
#pragma once

#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "loom/nn.h"
#include "loom/store.h"

namespace loom {

// magnitude and wanda zero single weights; channels removes MLP
// intermediate channels and heads attention heads, each giving a smaller
// dense model.
enum class PruneMethod : uint8_t { magnitude, wanda, channels, heads };
// unstructured: any elements; two_four: 2 of every 4 consecutive weights
// along the input dimension.
enum class SparsityPattern : uint8_t { unstructured, two_four };

// "magnitude", "wanda", "channels", "heads"; "unstructured", "2:4". The parsers throw Error naming
// the flag and its choices.
const char* prune_method_name(PruneMethod m);
const char* sparsity_pattern_name(SparsityPattern p);
PruneMethod parse_prune_method(std::string_view name);
SparsityPattern parse_sparsity_pattern(std::string_view name);

struct PruneOptions {
  PruneMethod method = PruneMethod::magnitude;
  SparsityPattern pattern = SparsityPattern::unstructured;
  double sparsity = 0.5;  // the share of each matrix's weights zeroed; 2:4 is 0.5
};
// Error naming --sparsity when it is outside (0, 1), or not 0.5 under 2:4.
void validate(const PruneOptions& options);

// The parameters pruning applies to, by id: every linear layer's weight.
std::vector<int> prunable_params(const ParamLayout& layout);

// Zeroes the lowest-scoring elements of the [rows, cols] matrix `w` in place
// and returns its zeros. The score is |W_ij|, times col_norms[j] when given
// (Wanda). Unstructured, round(sparsity * rows * cols) elements go: the
// smallest of the whole matrix by magnitude, of each output row by Wanda
// (the rows' counts differ by at most one, so the matrix's total is exact).
// 2:4: the 2 lowest of every 4 consecutive elements of a row; Error naming
// `name` and the fix when cols is not a multiple of 4. Ties go to the lower
// index, so the result depends on the values alone.
int64_t prune_matrix(float* w, int64_t rows, int64_t cols, const PruneOptions& options,
                     std::span<const double> col_norms, std::string_view name);

// Wanda's calibration: while it lives, every linear layer's forward on the
// constructing thread adds its input's squares per feature (a
// ScopedLinearInputHook), summed in a fixed order.
class WandaCalibration {
 public:
  WandaCalibration();
  // ||X_j||_2 over every token the layer of weight `id` saw (some).
  std::vector<double> input_norms(int id) const;
  int64_t tokens(int id) const;

 private:
  struct Sums {
    std::vector<double> squares;  // per input feature
    int64_t tokens = 0;
  };
  std::unordered_map<int, Sums> sums_;
  ScopedLinearInputHook hook_;
};

struct PruneReport {
  struct Matrix {
    std::string name;
    int64_t numel = 0, zeros = 0;
  };
  std::vector<Matrix> matrices;  // the pruned ones, in layout order
  int64_t numel = 0;             // the whole model's parameters
  int64_t nonzeros = 0;          // of them, after pruning
};

// Prunes every prunable matrix of a whole model's reference ParamStore (the
// one of `loom eval`). Wanda reads `calibration`'s norms: Error without it.
PruneReport prune_model(const GPT& model, ParamStore& params, const PruneOptions& options,
                        const WandaCalibration* calibration = nullptr);

// Structured pruning: every layer keeps the same number of its MLP
// channels or attention heads, so the result is an ordinary, smaller
// GPTConfig (a smaller intermediate_size, or fewer heads of the same
// head_dim).
struct StructuredPruning {
  GPTConfig config;                        // the smaller model
  std::vector<std::vector<int64_t>> kept;  // per layer, the channels or query heads kept, ascending
};

// MLP channels. A channel's importance is the product, over the layer's
// matrices that have a row or column per channel (c_fc's row and c_proj's
// column; SwiGLU's gate and up rows and down column), of the L2 norm of its
// row or column; each layer drops its round(sparsity * I) least important
// (ties: the higher index). The matrices are found by data: the parameters
// whose shape changes with intermediate_size. Error naming --sparsity when
// it is outside (0, 1) or leaves no channel.
StructuredPruning choose_channels(const GPT& model, const ParamStore& params, double sparsity);

// Attention heads. With calibration (Wanda's, over --data), a head's score
// is ||X_h||_2 * ||W_o[:, h]||_F: the L2 norm of its slice of the output
// projection's input (the head's attention output over every calibration
// token) times the Frobenius norm of the output projection's columns that
// read it, a bound on what the head adds to the residual stream. Without
// calibration it is scored by its weights alone: the product of the
// Frobenius norms of its slices of q, k, v and the output projection (k and
// v: its key/value head's). Heads leave in whole key/value groups (a kv head
// and the n_head / n_kv_head query heads that share it; one head under
// multi-head attention), so the ratio stays integral: each layer drops the
// round(sparsity * n_kv_head) groups of lowest summed score (ties: the
// lower index first). The matrices are found by data: the parameters whose
// shape changes with n_head. Error naming --sparsity when the count rounds
// to no group or to all of them.
StructuredPruning choose_heads(const GPT& model, const ParamStore& params, double sparsity,
                               const WandaCalibration* calibration = nullptr);

// The smaller model's weights (`to` is of pruning.config): every parameter
// of `from`, each dimension that shrank gathered at the kept channels or
// heads' rows and columns.
void copy_kept(const GPT& from, const ParamStore& src, const StructuredPruning& pruning, const GPT& to,
               ParamStore& dst);

// choose_* and copy_kept in one: the smaller model, its weights and their
// report (no matrix pruned: the model is dense).
struct SmallerModel {
  StructuredPruning pruning;
  std::unique_ptr<GPT> model;
  std::unique_ptr<ParamStore> params;
  PruneReport report;
};
SmallerModel remove_channels(const GPT& model, const ParamStore& params, double sparsity);
SmallerModel remove_heads(const GPT& model, const ParamStore& params, double sparsity,
                          const WandaCalibration* calibration = nullptr);

// Where the pruned model comes from, for its manifest.
struct PrunedCheckpointSource {
  std::string checkpoint;  // as given
  std::filesystem::path tokenizer;
  std::string tokenizer_sha256;
};
// Writes the pruned model as the step-0 checkpoint of a new run directory
// `out` (out/step_00000000 and out/latest, fresh optimizer state), its
// manifest's "pruning" naming the method, pattern, sparsity and the pruned
// matrices (none after channels or heads: the smaller model is dense). Error when
// `out` exists: it is never overwritten.
std::filesystem::path write_pruned_checkpoint(const std::filesystem::path& out, const GPT& model,
                                              const ParamStore& params, const PruneOptions& options,
                                              const PruneReport& report, const PrunedCheckpointSource& source);
// Error naming `out` when it exists (checked before any work).
void check_prune_output(const std::filesystem::path& out);

}  // namespace loom
