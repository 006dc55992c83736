#include <algorithm>

#include "loom/zero.h"

namespace loom {

void validate(const ZeroOptions& opts) {
  if (opts.stage < 0 || opts.stage > 3) throw Error(str("zero.stage = ", opts.stage, " is not a ZeRO stage: use 0, 1, 2 or 3"));
  if (opts.precision != DType::f32 && opts.precision != DType::bf16 && opts.precision != DType::f16)
    throw Error(str("precision = ", dtype_name(opts.precision), " is not a training precision: use fp32, bf16 or fp16"));
  if (opts.bucket_bytes <= 0) throw Error(str("zero.bucket_bytes = ", opts.bucket_bytes, " must be positive"));
}

ZeroPartition::ZeroPartition(const ParamLayout& layout, int ranks, int rank, int64_t bucket_numel)
    : ranks_(ranks), rank_(rank) {
  LOOM_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "rank ", rank, " of ", ranks);
  const int groups = layout.num_groups();
  // Backward completes groups from the last to the first, so buckets are
  // packed from the end: the first bucket to fill is the first to reduce.
  std::vector<std::pair<int, int>> spans;
  int end = groups;
  int64_t filled = 0;
  for (int g = groups - 1; g >= 0; --g) {
    const auto [lo, hi] = layout.group_range(g);
    filled += hi - lo;
    if (bucket_numel <= 0 || filled >= bucket_numel || g == 0) {
      spans.emplace_back(g, end);
      end = g;
      filled = 0;
    }
  }
  std::reverse(spans.begin(), spans.end());
  bucket_of_group_.assign(static_cast<size_t>(groups), 0);
  for (const auto& [first, last] : spans) {
    ZeroBucket b;
    b.first_group = first;
    b.end_group = last;
    b.begin = layout.group_range(first).first;
    b.end = layout.group_range(last - 1).second;
    b.shard = (b.numel() + ranks - 1) / ranks;
    b.padded_begin = padded_numel_;
    b.shard_begin = shard_numel_;
    padded_numel_ += b.shard * ranks;
    shard_numel_ += b.shard;
    for (int g = first; g < last; ++g) bucket_of_group_[static_cast<size_t>(g)] = static_cast<int>(buckets_.size());
    buckets_.push_back(b);
  }
}

const ZeroBucket& ZeroPartition::bucket_containing(int64_t flat) const {
  auto it = std::upper_bound(buckets_.begin(), buckets_.end(), flat,
                             [](int64_t x, const ZeroBucket& b) { return x < b.end; });
  LOOM_CHECK(it != buckets_.end() && it->begin <= flat, "flat element ", flat, " is in no bucket");
  return *it;
}

FlatRange ZeroPartition::owned(const ZeroBucket& b, int r) const {
  const int64_t lo = std::min(b.end, b.begin + r * b.shard);
  return {lo, std::min(b.end, lo + b.shard)};
}

int64_t ZeroPartition::shard_position(int64_t flat) const {
  const ZeroBucket& b = bucket_containing(flat);
  const FlatRange own = owned(b);
  LOOM_CHECK(own.begin <= flat && flat < own.end, "flat element ", flat, " is not in rank ", rank_, "'s shard");
  return b.shard_begin + (flat - own.begin);
}

}  // namespace loom
