// What the training and evaluation loaders share: opening the shards, and
// locating windows of T + 1 tokens that never straddle two shards.
#pragma once

#include <filesystem>
#include <string_view>
#include <vector>

#include "loom/data.h"

namespace loom::data {

// Opens every shard; throws Error when there are none or a shard holds fewer
// than seq_len + 1 tokens (not a single window). `role` names the loader.
std::vector<TokenShard> open_shards(const std::vector<std::filesystem::path>& paths, int seq_len,
                                    std::string_view role);

// Opens the loss masks of `shards`, one each or none; throws Error naming a
// mask whose token count differs from its shard's, or whose row length is not
// seq_len (the rows would be cut mid-example).
std::vector<LossMask> open_masks(const std::vector<std::filesystem::path>& paths,
                                 const std::vector<TokenShard>& shards, int seq_len, std::string_view role);

// Throws Error naming the first shard whose largest token id is >= vocab_size.
void check_shard_vocab(const std::vector<TokenShard>& shards, int vocab_size);

// "a.bin (1000 tokens), b.bin (20 tokens)", for messages.
std::string describe_shards(const std::vector<TokenShard>& shards);

// first_window[s] is the index of shard s's first window and
// first_window.back() the total; returns the shard holding window w.
size_t shard_of_window(const std::vector<int64_t>& first_window, int64_t w);

// A bijection of [0, n) that is a pure function of (key, i): an epoch's order
// without materializing it, so any rank computes any position directly.
uint64_t permute_index(uint64_t i, uint64_t n, uint64_t key);

}  // namespace loom::data
