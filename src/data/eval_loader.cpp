#include <algorithm>

#include "data/shard_windows.h"
#include "loom/data.h"

namespace loom {

EvalLoader::EvalLoader(const std::vector<std::filesystem::path>& shards, int seq_len, int micro_batch, int dp_rank,
                       int dp_size, const std::vector<std::filesystem::path>& masks)
    : seq_len_(seq_len), micro_batch_(micro_batch) {
  if (micro_batch <= 0) throw Error(str("eval loader: micro_batch must be positive, got ", micro_batch));
  if (dp_size <= 0 || dp_rank < 0 || dp_rank >= dp_size)
    throw Error(str("eval loader: dp_rank ", dp_rank, " is not in [0, dp_size = ", dp_size, ")"));
  shards_ = data::open_shards(shards, seq_len, "eval loader");
  masks_ = data::open_masks(masks, shards_, seq_len, "eval loader");
  first_window_.push_back(0);
  for (const auto& shard : shards_) first_window_.push_back(first_window_.back() + (shard.size() - 1) / seq_len);
  const int64_t W = total_windows();
  begin_ = dp_rank * W / dp_size;
  end_ = (dp_rank + 1) * W / dp_size;
  const int64_t most_per_rank = (W + dp_size - 1) / dp_size;
  batches_ = (most_per_rank + micro_batch - 1) / micro_batch;
}

std::optional<int> EvalLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const int64_t B = micro_batch_, T = seq_len_;
  LOOM_CHECK(static_cast<int64_t>(inputs.size()) == B * T && static_cast<int64_t>(targets.size()) == B * T,
             "eval batch buffers hold ", inputs.size(), " and ", targets.size(), " tokens, not B*T = ", B * T);
  if (batch_ >= batches_) return std::nullopt;
  const int64_t first = begin_ + batch_ * B;
  const int rows = static_cast<int>(std::clamp<int64_t>(end_ - first, 0, B));
  for (int row = 0; row < rows; ++row) {
    const int64_t w = first + row;
    const size_t s = data::shard_of_window(first_window_, w);
    const int64_t start = (w - first_window_[s]) * T;
    shards_[s].read(start, inputs.subspan(row * T, T));
    shards_[s].read(start + 1, targets.subspan(row * T, T));
    if (!masks_.empty()) masks_[s].apply(start + 1, targets.subspan(row * T, T));
  }
  std::fill(inputs.begin() + rows * T, inputs.end(), 0);
  std::fill(targets.begin() + rows * T, targets.end(), -1);
  ++batch_;
  return rows;
}

void EvalLoader::check_vocab(int vocab_size) const { data::check_shard_vocab(shards_, vocab_size); }

}  // namespace loom
