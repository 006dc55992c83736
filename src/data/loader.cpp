#include <nlohmann/json.hpp>

#include "data/shard_windows.h"
#include "loom/data.h"

namespace loom {

namespace {

// Streams of the loader's randomness; each epoch and shard draws its own.
uint64_t order_key(uint64_t seed, int64_t epoch) {
  return stream_key(stream_key(seed, "data.loader.order"), static_cast<uint64_t>(epoch), 0);
}

int64_t window_offset(uint64_t seed, int64_t epoch, size_t shard, int seq_len) {
  uint64_t key = stream_key(stream_key(seed, "data.loader.offset"), static_cast<uint64_t>(epoch), shard);
  return static_cast<int64_t>(Philox::block(key, 0, 0)[0] % static_cast<uint32_t>(seq_len));
}

}  // namespace

void to_json(nlohmann::json& j, const LoaderState& s) {
  j = nlohmann::json{{"epoch", s.epoch}, {"step", s.step}, {"micro", s.micro}};
}

void from_json(const nlohmann::json& j, LoaderState& s) {
  for (const char* key : {"epoch", "step", "micro"})
    if (!j.contains(key) || !j.at(key).is_number_integer())
      throw Error(str("loader state ", j.dump(), " lacks the integer \"", key, "\"; the checkpoint is corrupt"));
  s.epoch = j.at("epoch").get<int64_t>();
  s.step = j.at("step").get<int64_t>();
  s.micro = j.at("micro").get<int64_t>();
}

TokenLoader::TokenLoader(const LoaderOptions& opts) : opts_(opts) {
  if (opts.micro_batch <= 0) throw Error(str("loader: micro_batch must be positive, got ", opts.micro_batch));
  if (opts.dp_size <= 0 || opts.dp_rank < 0 || opts.dp_rank >= opts.dp_size)
    throw Error(str("loader: dp_rank ", opts.dp_rank, " is not in [0, dp_size = ", opts.dp_size, ")"));
  const int64_t per_step = static_cast<int64_t>(opts.micro_batch) * opts.dp_size;
  if (opts.global_batch <= 0 || opts.global_batch % per_step != 0)
    throw Error(str("loader: global_batch ", opts.global_batch,
                    " must be a positive multiple of micro_batch * dp_size = ", opts.micro_batch, " * ", opts.dp_size,
                    " = ", per_step));
  shards_ = data::open_shards(opts.shards, opts.seq_len, "training loader");
  masks_ = data::open_masks(opts.masks, shards_, opts.seq_len, "training loader");

  // With shuffling a shard's windows start at a per-epoch offset below T, so
  // it holds the windows that fit after the largest offset, the same each
  // epoch; packed rows (masks) are whole windows, never cut at an offset.
  const int64_t T = opts.seq_len;
  first_window_.push_back(0);
  for (const auto& shard : shards_) {
    int64_t windows = offsets() ? (shard.size() - T) / T : (shard.size() - 1) / T;
    first_window_.push_back(first_window_.back() + windows);
  }
  windows_per_epoch_ = first_window_.back();
  if (windows_per_epoch_ < opts.global_batch)
    throw Error(str("training loader: the shards hold ", windows_per_epoch_, " sequences of seq_len + 1 = ", T + 1,
                    " tokens, fewer than one global batch of ", opts.global_batch, " sequences (",
                    data::describe_shards(shards_), "); lower the batch size or seq_len, or prepare more text"));
}

int64_t TokenLoader::next(std::span<int32_t> inputs, std::span<int32_t> targets) {
  const int64_t B = opts_.micro_batch, T = opts_.seq_len;
  LOOM_CHECK(static_cast<int64_t>(inputs.size()) == B * T && static_cast<int64_t>(targets.size()) == B * T,
             "loader batch buffers hold ", inputs.size(), " and ", targets.size(), " tokens, not B*T = ", B * T);
  const int64_t first_in_batch = opts_.dp_rank * (opts_.global_batch / opts_.dp_size) + state_.micro * B;
  const int64_t first = state_.step * opts_.global_batch + first_in_batch;
  const uint64_t key = order_key(opts_.seed, state_.epoch);
  for (int64_t row = 0; row < B; ++row) {
    const uint64_t position = static_cast<uint64_t>(first + row);
    const int64_t w =
        opts_.shuffle
            ? static_cast<int64_t>(data::permute_index(position, static_cast<uint64_t>(windows_per_epoch_), key))
            : static_cast<int64_t>(position);
    const size_t s = data::shard_of_window(first_window_, w);
    const int64_t offset = offsets() ? window_offset(opts_.seed, state_.epoch, s, opts_.seq_len) : 0;
    const int64_t start = offset + (w - first_window_[s]) * T;
    shards_[s].read(start, inputs.subspan(row * T, T));
    shards_[s].read(start + 1, targets.subspan(row * T, T));
    if (!masks_.empty()) masks_[s].apply(start + 1, targets.subspan(row * T, T));
  }
  if (++state_.micro == micro_batches_per_step()) {
    state_.micro = 0;
    if (++state_.step == steps_per_epoch()) {
      state_.step = 0;
      ++state_.epoch;
    }
  }
  return first_in_batch;
}

void TokenLoader::restore(const LoaderState& s) {
  if (s.epoch < 0 || s.step < 0 || s.step >= steps_per_epoch() || s.micro < 0 || s.micro >= micro_batches_per_step())
    throw Error(str("loader state (epoch ", s.epoch, ", step ", s.step, ", micro ", s.micro,
                    ") does not fit this loader's ", steps_per_epoch(), " steps per epoch of ",
                    micro_batches_per_step(),
                    " micro-batches; resume with the dataset, seq_len and batch size "
                    "the checkpoint was trained with"));
  state_ = s;
}

void TokenLoader::check_vocab(int vocab_size) const { data::check_shard_vocab(shards_, vocab_size); }

}  // namespace loom
