// Generation: the KV cache pool and the forward pass over a decode batch,
// the new positions of several sequences packed into one batch of rows, each
// sequence reusing the keys and values of its earlier positions.
#include <algorithm>

#include "loom/device.h"
#include "loom/nn.h"
#include "loom/quant.h"

namespace loom {

KVCachePool::KVCachePool(const GPTConfig& cfg, int64_t capacity, int64_t max_length)
    : KVCachePool(cfg, capacity, max_length, cfg.kv_heads(), 0, static_cast<int>(cfg.n_layer)) {}

KVCachePool::KVCachePool(const GPT& model, int64_t capacity, int64_t max_length)
    : KVCachePool(model.config(), capacity, max_length, model.config().local_kv_heads(model.parallel().tp.size()),
                  model.decode_layers().begin, model.decode_layers().size()) {}

KVCachePool::KVCachePool(const GPTConfig& cfg, int64_t capacity, int64_t max_length, int64_t kv_heads,
                         int first_layer, int n_layer)
    : first_layer_(first_layer),
      n_layer_(n_layer),
      kv_heads_(kv_heads),
      head_dim_(cfg.head_dim()),
      max_len_(max_length > 0 ? max_length : cfg.block_size) {
  if (capacity <= 0) throw Error(str("a KV cache pool needs at least one slot, not ", capacity));
  if (max_len_ > cfg.block_size)
    throw Error(str("a KV cache of ", max_len_, " positions exceeds the model's context model.block_size = ",
                    cfg.block_size));
  slots_.resize(static_cast<size_t>(capacity));
}

int KVCachePool::allocate() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].kv.defined()) continue;
    // The kernels write every position before it is read: no zeroing.
    slots_[i].kv = Tensor::empty({n_layer_, 2, kv_heads_, max_len_, head_dim_});
    slots_[i].length = 0;
    return static_cast<int>(i);
  }
  return -1;
}

const KVCachePool::Slot& KVCachePool::taken(int slot) const {
  LOOM_CHECK(slot >= 0 && slot < capacity() && slots_[static_cast<size_t>(slot)].kv.defined(), "KV cache slot ",
             slot, " is not taken");
  return slots_[static_cast<size_t>(slot)];
}

void KVCachePool::release(int slot) {
  taken(slot);
  slots_[static_cast<size_t>(slot)] = Slot{};
}

void KVCachePool::reset(int slot) {
  taken(slot);
  slots_[static_cast<size_t>(slot)].length = 0;
}

int64_t KVCachePool::length(int slot) const { return taken(slot).length; }

int64_t KVCachePool::active() const {
  return std::count_if(slots_.begin(), slots_.end(), [](const Slot& s) { return s.kv.defined(); });
}

size_t KVCachePool::slot_bytes() const {
  return static_cast<size_t>(n_layer_ * 2 * kv_heads_ * max_len_ * head_dim_) * sizeof(float);
}

size_t KVCachePool::bytes_in_use() const {
  size_t bytes = 0;
  for (const Slot& s : slots_) bytes += s.kv.defined() ? s.kv.nbytes() : 0;
  return bytes;
}

float* const* DecodeBatch::keys(int layer) const {
  return static_cast<float* const*>(caches.raw()) + static_cast<int64_t>(layer) * 2 * S;
}

float* const* DecodeBatch::values(int layer) const { return keys(layer) + S; }

Tensor Embedding::forward_decode(const ParamStore& ps, const Tensor& token_ids, const DecodeBatch& batch) const {
  LOOM_CHECK(!tp_.splits_tokens(), "generation under sequence parallelism");
  const int32_t* tokens = token_ids.data<int32_t>();
  // Each sequence's rows get the positions from its cached length on.
  auto add_positions = [&](Tensor& out) {
    if (wpe_ >= 0)
      for (int64_t s = 0; s < batch.S; ++s) {
        const int64_t row = batch.offsets[static_cast<size_t>(s)];
        const int64_t n = batch.offsets[static_cast<size_t>(s) + 1] - row;
        ops::position_embedding_add(out.data<float>() + row * C_, ps.param(wpe_).data<float>(), 0, n, n, C_,
                                    batch.lengths[static_cast<size_t>(s)]);
      }
  };
  if (const QuantizedWeight* q = ps.quantized(wte_)) {
    LOOM_CHECK(tp_.size() == 1, "a quantized token table on a tensor-parallel rank");
    Tensor out = Tensor::empty({batch.N, C_});
    quantized_embedding_lookup(out.data<float>(), tokens, *q, batch.N);
    add_positions(out);
    return out;
  }
  const float* wte = ps.param(wte_).data<float>();
  if (tp_.size() > 1) {
    // Vocabulary-parallel: each rank looks up the tokens in its rows (zeros
    // for the rest), and one rank's rows are the sum.
    const int64_t rows = ps.layout().param(wte_).shape[0];
    Tensor partial = Tensor::empty({batch.N, C_});
    ops::embedding_lookup_range(partial.data<float>(), tokens, wte, tp_.rank() * rows, rows, batch.N, C_);
    Tensor out = TensorParallelRegion::leave_forward(tp_, partial);
    add_positions(out);
    return out;
  }
  Tensor out = Tensor::empty({batch.N, C_});
  if (wpe_ < 0) {
    ops::embedding_lookup_range(out.data<float>(), tokens, wte, 0, vocab_, batch.N, C_);
    return out;
  }
  for (int64_t s = 0; s < batch.S; ++s) {
    const int64_t row = batch.offsets[static_cast<size_t>(s)];
    ops::embedding_forward(out.data<float>() + row * C_, tokens + row, wte, ps.param(wpe_).data<float>(), 1,
                           batch.offsets[static_cast<size_t>(s) + 1] - row, C_, batch.lengths[static_cast<size_t>(s)]);
  }
  return out;
}

Tensor CausalSelfAttention::forward_decode(const ParamStore& ps, const float* in, const DecodeBatch& batch,
                                           int layer) const {
  // This rank's heads: attention needs no communication, c_proj sums them.
  const int64_t local_C = local_heads_ * hs_;
  const Linear& c_attn = std::get<ColumnParallelLinear>(c_attn_).local();
  Tensor qkv = Tensor::empty({batch.N, c_attn.out_features()});
  c_attn.forward(ps, qkv.data<float>(), in, batch.N);
  rotate(qkv.data<float>(), batch);
  Tensor att = Tensor::empty({batch.N, local_C});
  ops::attention_decode(att.data<float>(), nullptr, batch.keys(layer), batch.values(layer), qkv.data<float>(),
                        batch.cache_lens.data<int32_t>(), batch.row_offsets.data<int32_t>(), batch.S, batch.N, local_C,
                        local_heads_, local_kv_heads_, batch.max_len);
  return std::get<RowParallelLinear>(c_proj_).forward(ps, att);
}

void Block::forward_decode(const ParamStore& ps, float* x, const DecodeBatch& batch) const {
  const int64_t N = batch.N;
  Norm::Saved ln;
  ln_1_.forward(ps, ln, x, N);
  Tensor tmp = attn_.forward_decode(ps, ln.out.data<float>(), batch, index_);
  ops::accumulate(x, tmp.data<float>(), N * C_);
  ln_2_.forward(ps, ln, x, N);
  MLP::Saved mlp;
  tmp = mlp_.forward(ps, mlp, ln.out, AdapterDropout{});
  ops::accumulate(x, tmp.data<float>(), N * C_);
}

LayerRange GPT::decode_layers() const {
  LOOM_CHECK(num_chunks() == 1, "generation runs one chunk of layers per rank, not ", num_chunks());
  return chunks_.front();
}

Tensor GPT::decode_head_input(ParamStore& ps, KVCachePool& pool, std::span<const DecodeInput> inputs,
                              bool all_positions, Communicator* pipeline) const {
  const TensorParallel& tp = mp_.tp;
  if (tp.grid)
    throw Error("generation runs under 1D tensor parallelism only: load the checkpoint with parallel.tp_mode = \"1d\"");
  const LayerRange layers = decode_layers();
  LOOM_CHECK(!tp.splits_tokens(), "generation under sequence parallelism");
  const bool staged = !(mp_.first_stage && mp_.last_stage);
  LOOM_CHECK(!staged || (pipeline && pipeline->size() > 1), "a pipeline stage generates with its pipeline group");
  LOOM_CHECK(pool.first_layer_ == layers.begin && pool.n_layer_ == layers.size() &&
                 pool.kv_heads_ == cfg_.local_kv_heads(tp.size()) && pool.head_dim_ == cfg_.head_dim(),
             "the KV cache pool was built for another model");
  const int64_t C = cfg_.n_embd;
  DecodeBatch batch;
  batch.S = static_cast<int64_t>(inputs.size());
  batch.max_len = pool.max_length();
  batch.offsets.push_back(0);
  std::vector<int32_t> tokens;
  std::vector<float*> addresses(static_cast<size_t>(cfg_.n_layer * 2 * batch.S));
  std::vector<bool> seen(static_cast<size_t>(pool.capacity()));
  for (int64_t s = 0; s < batch.S; ++s) {
    const DecodeInput& in = inputs[static_cast<size_t>(s)];
    const KVCachePool::Slot& slot = pool.taken(in.slot);
    LOOM_CHECK(!seen[static_cast<size_t>(in.slot)], "KV cache slot ", in.slot, " appears twice in a decode batch");
    seen[static_cast<size_t>(in.slot)] = true;
    const int64_t n = static_cast<int64_t>(in.tokens.size());
    if (n == 0) throw Error(str("sequence ", s, " of the decode batch has no new tokens"));
    if (slot.length + n > pool.max_length())
      throw Error(str("sequence ", s, " of the decode batch would hold ", slot.length + n,
                      " positions, more than the KV cache's ", pool.max_length(),
                      " (the model's context): shorten it or let the context slide"));
    batch.lengths.push_back(static_cast<int32_t>(slot.length));
    batch.offsets.push_back(static_cast<int32_t>(batch.offsets.back() + n));
    tokens.insert(tokens.end(), in.tokens.begin(), in.tokens.end());
    // This stage's layers (indexed by their layer in the model) hold caches.
    float* base = slot.kv.data<float>();
    const int64_t part = slot.kv.numel() / (2 * pool.n_layer_);  // one layer's keys (or values)
    for (int64_t l = layers.begin; l < layers.end; ++l)
      for (int64_t kv = 0; kv < 2; ++kv)
        addresses[static_cast<size_t>((l * 2 + kv) * batch.S + s)] = base + ((l - layers.begin) * 2 + kv) * part;
  }
  batch.N = batch.offsets.back();
  LOOM_CHECK(batch.S > 0, "an empty decode batch");
  if (mp_.first_stage) embedding_.check_tokens(tokens.data(), batch.N);
  batch.cache_lens = Tensor::from_host(batch.lengths.data(), {batch.S}, DType::i32);
  batch.row_offsets = Tensor::from_host(batch.offsets.data(), {batch.S + 1}, DType::i32);
  static_assert(sizeof(float*) == sizeof(int64_t), "addresses travel as i64 elements");
  batch.caches = Tensor::from_host(addresses.data(), {cfg_.n_layer, 2, batch.S}, DType::i64);

  // The activations pass from stage to stage (the same tp rank of each).
  const int stage = staged ? pipeline->rank() : 0;
  Tensor x;
  if (mp_.first_stage) {
    ps.acquire(embedding_group_);
    x = embedding_.forward_decode(ps, Tensor::from_host(tokens.data(), {batch.N}, DType::i32), batch);
    ps.release(embedding_group_);
  } else {
    x = Tensor::empty({batch.N, C});
    pipeline->recv(x, stage - 1, 0);
  }
  for (const Block& block : blocks_) {
    ps.acquire(block.group());
    block.forward_decode(ps, x.data<float>(), batch);
    ps.release(block.group());
  }
  for (int64_t s = 0; s < batch.S; ++s)
    pool.slots_[static_cast<size_t>(inputs[static_cast<size_t>(s)].slot)].length +=
        batch.offsets[static_cast<size_t>(s) + 1] - batch.offsets[static_cast<size_t>(s)];
  if (!mp_.last_stage) {
    pipeline->send(x, stage + 1, 0);
    return {};
  }

  // Sampling needs only each sequence's last position.
  Tensor rows = x;
  if (!all_positions) {
    rows = Tensor::empty({batch.S, C});
    for (int64_t s = 0; s < batch.S; ++s)
      ops::copy(rows.data<float>() + s * C, x.data<float>() + (batch.offsets[static_cast<size_t>(s) + 1] - 1) * C,
                static_cast<size_t>(C) * sizeof(float));
  }
  Norm::Saved ln;
  ps.acquire(lnf_group_);
  ln_f_.forward(ps, ln, rows.data<float>(), rows.numel() / C);
  ps.release(lnf_group_);
  return ln.out;
}

Tensor GPT::forward_decode(ParamStore& ps, KVCachePool& pool, std::span<const DecodeInput> inputs,
                           bool all_positions, Communicator* pipeline) const {
  // Every product computes each sequence's rows alone: its tokens do not
  // depend on the batch around it.
  const FixedRowBlocks fixed_rows;
  const Tensor h = decode_head_input(ps, pool, inputs, all_positions, pipeline);
  const TensorParallel& tp = mp_.tp;
  const int64_t V = cfg_.vocab_size;
  int64_t R = static_cast<int64_t>(inputs.size());
  if (all_positions)
    for (const DecodeInput& in : inputs) R += static_cast<int64_t>(in.tokens.size()) - 1;
  Tensor logits = Tensor::empty({R, V});
  // The last stage's logits, which every stage samples from.
  if (!mp_.last_stage) {
    pipeline->broadcast(logits, pipeline->size() - 1);
    return logits;
  }
  ps.acquire(head_group());
  if (tp.size() == 1) {
    head_logits(ps, logits.data<float>(), h.data<float>(), R, V);
  } else {
    // Vocabulary-parallel head: the ranks' slices are gathered, so that every
    // rank samples from the same whole rows and all draw the same tokens
    // (exactly, for any sampling settings). The rows are few, one per
    // sequence when decoding: R * V floats, small beside the V * C head
    // weights.
    const int64_t Vl = local_vocab_;
    Tensor local = Tensor::empty({R, Vl});
    head_logits(ps, local.data<float>(), h.data<float>(), R, Vl);
    Tensor gathered = Tensor::empty({tp.size(), R, Vl});
    tp.group->all_gather(local, gathered);
    // [tp, R, Vl] -> [R, V], without the last rank's padding rows.
    for (int64_t r = 0; r < tp.size(); ++r) {
      const int64_t n = std::min(Vl, V - r * Vl);
      for (int64_t i = 0; i < R; ++i)
        ops::copy(logits.data<float>() + i * V + r * Vl, gathered.data<float>() + (r * R + i) * Vl,
                  static_cast<size_t>(n) * sizeof(float));
    }
  }
  ps.release(head_group());
  if (!mp_.first_stage) pipeline->broadcast(logits, pipeline->size() - 1);
  return logits;
}

std::vector<std::vector<TokenLogit>> GPT::decode_top_k(ParamStore& ps, KVCachePool& pool,
                                                       std::span<const DecodeInput> inputs, int64_t k,
                                                       Communicator* pipeline) const {
  const FixedRowBlocks fixed_rows;
  const Tensor h = decode_head_input(ps, pool, inputs, false, pipeline);
  const TensorParallel& tp = mp_.tp;
  const int64_t S = static_cast<int64_t>(inputs.size()), V = cfg_.vocab_size, Vl = local_vocab_;
  k = std::min(k, V);
  LOOM_CHECK(k > 0 && V < (int64_t{1} << 24), "top ", k, " of ", V, " tokens (ids travel exactly as floats)");
  auto before = [](const TokenLogit& a, const TokenLogit& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  // Every rank's k best of each row, [tp, S, k, (logit, id)]; id -1 where a
  // rank has fewer than k tokens.
  Tensor all = Tensor::empty({tp.size(), S, k, 2}, DType::f32, Tier::host);
  if (mp_.last_stage) {
    Tensor local = Tensor::empty({S, Vl});
    ps.acquire(head_group());
    head_logits(ps, local.data<float>(), h.data<float>(), S, Vl);
    ps.release(head_group());
    const Tensor host = local.clone(Tier::host);
    const int64_t first = tp.rank() * Vl, n = std::min(Vl, V - first), kept = std::min(k, n);
    Tensor best = Tensor::empty({S, k, 2}, DType::f32, Tier::host);
    std::vector<TokenLogit> row(static_cast<size_t>(n));
    for (int64_t s = 0; s < S; ++s) {
      for (int64_t i = 0; i < n; ++i)
        row[static_cast<size_t>(i)] = {host.data<float>()[s * Vl + i], static_cast<int32_t>(first + i)};
      std::partial_sort(row.begin(), row.begin() + kept, row.end(), before);
      float* out = best.data<float>() + s * k * 2;
      for (int64_t i = 0; i < k; ++i) {
        out[2 * i] = i < kept ? row[static_cast<size_t>(i)].logit : 0.0f;
        out[2 * i + 1] = i < kept ? static_cast<float>(row[static_cast<size_t>(i)].id) : -1.0f;
      }
    }
    if (tp.size() > 1)
      tp.group->all_gather(best, all);
    else
      all = best;
  }
  if (!(mp_.first_stage && mp_.last_stage)) pipeline->broadcast(all, pipeline->size() - 1);
  // Merged: the k best of the ranks' candidates are the row's k best.
  std::vector<std::vector<TokenLogit>> top(static_cast<size_t>(S));
  for (int64_t s = 0; s < S; ++s) {
    std::vector<TokenLogit>& t = top[static_cast<size_t>(s)];
    for (int64_t r = 0; r < tp.size(); ++r)
      for (int64_t i = 0; i < k; ++i) {
        const float* c = all.data<float>() + ((r * S + s) * k + i) * 2;
        if (c[1] >= 0.0f) t.push_back({c[0], static_cast<int32_t>(c[1])});
      }
    std::partial_sort(t.begin(), t.begin() + k, t.end(), before);
    t.resize(static_cast<size_t>(k));
  }
  return top;
}

}  // namespace loom
