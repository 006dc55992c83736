#include "data/shard_windows.h"

#include <algorithm>
#include <bit>

namespace loom::data {

std::vector<TokenShard> open_shards(const std::vector<std::filesystem::path>& paths, int seq_len,
                                    std::string_view role) {
  if (paths.empty())
    throw Error(str(role, ": no token shards given; pass the train.bin/val.bin of a prepared dataset"));
  if (seq_len <= 0) throw Error(str(role, ": seq_len must be positive, got ", seq_len));
  std::vector<TokenShard> shards;
  shards.reserve(paths.size());
  for (const auto& p : paths) {
    TokenShard shard(p);
    if (shard.size() < static_cast<int64_t>(seq_len) + 1)
      throw Error(str(role, ": token shard ", p, " holds ", shard.size(), " tokens, fewer than seq_len + 1 = ",
                      seq_len + 1, " needed for one sequence; lower seq_len or prepare more text"));
    shards.push_back(std::move(shard));
  }
  return shards;
}

std::vector<LossMask> open_masks(const std::vector<std::filesystem::path>& paths,
                                 const std::vector<TokenShard>& shards, int seq_len, std::string_view role) {
  if (!paths.empty() && paths.size() != shards.size())
    throw Error(str(role, ": ", paths.size(), " loss masks for ", shards.size(),
                    " token shards; give one mask per shard (dataset.json lists them) or none"));
  std::vector<LossMask> masks;
  masks.reserve(paths.size());
  for (size_t s = 0; s < paths.size(); ++s) {
    LossMask mask(paths[s]);
    if (mask.size() != shards[s].size())
      throw Error(str(role, ": loss mask ", paths[s], " covers ", mask.size(), " tokens but its token shard ",
                      shards[s].path(), " holds ", shards[s].size(),
                      "; they are from different runs of `loom prepare --sft`: prepare the dataset again"));
    if (mask.seq_len() != seq_len)
      throw Error(str(role, ": loss mask ", paths[s], " was packed for seq_len ", mask.seq_len(),
                      " but the loader's seq_len is ", seq_len, ": use seq_len ", mask.seq_len(),
                      " or run `loom prepare --sft` again with --seq-len ", seq_len));
    masks.push_back(std::move(mask));
  }
  return masks;
}

void check_shard_vocab(const std::vector<TokenShard>& shards, int vocab_size) {
  for (const auto& shard : shards) {
    int64_t max_id = shard.max_token_id();
    if (max_id >= vocab_size)
      throw Error(str("token shard ", shard.path(), " holds token id ", max_id, " but the model's vocab_size is ",
                      vocab_size, "; use the vocab_size of the tokenizer that wrote the shard (dataset.json)"));
  }
}

std::string describe_shards(const std::vector<TokenShard>& shards) {
  std::string out;
  for (const auto& shard : shards) {
    if (!out.empty()) out += ", ";
    out += str(shard.path(), " (", shard.size(), " tokens)");
  }
  return out;
}

size_t shard_of_window(const std::vector<int64_t>& first_window, int64_t w) {
  LOOM_CHECK(w >= 0 && w < first_window.back(), "window ", w, " outside [0, ", first_window.back(), ")");
  auto it = std::upper_bound(first_window.begin(), first_window.end(), w);
  return static_cast<size_t>(it - first_window.begin()) - 1;
}

uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key) {
  LOOM_CHECK(i < n, "index ", i, " outside [0, ", n, ")");
  if (n <= 1) return i;
  // A balanced Feistel network on the smallest even number of bits covering n
  // is a bijection of [0, 4^half); walking the cycle until the value falls
  // back below n restricts it to a bijection of [0, n), in under 4 steps on
  // average.
  const int bits = std::max(2, static_cast<int>(std::bit_width(n - 1)));
  const int half = (bits + 1) / 2;
  const uint64_t mask = (uint64_t{1} << half) - 1;
  constexpr int kRounds = 6;
  do {
    uint64_t left = i >> half, right = i & mask;
    for (int round = 0; round < kRounds; ++round) {
      uint64_t f = Philox::block(key, static_cast<uint64_t>(round), right)[0] & mask;
      uint64_t next_right = left ^ f;
      left = right;
      right = next_right;
    }
    i = (left << half) | right;
  } while (i >= n);
  return i;
}

}  // namespace loom::data
