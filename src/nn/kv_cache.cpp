// Incremental inference: the forward pass for sampling, one chunk of new
// positions at a time, reusing the keys and values of earlier positions.
#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

KVCache::KVCache(const GPTConfig& cfg, int64_t B) : B_(B) {
  const Shape shape{cfg.n_layer, B, cfg.kv_heads(), cfg.block_size, cfg.head_dim()};
  k_ = Tensor::zeros(shape);
  v_ = Tensor::zeros(shape);
}

void CausalSelfAttention::forward_cached(const ParamStore& ps, float* out, const float* in, float* k_cache,
                                         float* v_cache, int64_t B, int64_t n, int64_t pos0,
                                         int64_t block_size) const {
  const int64_t C = n_head_ * hs_;
  Tensor qkv = Tensor::empty({B, n, c_attn_.local().out_features()});
  c_attn_.local().forward(ps, qkv.data<float>(), in, B * n);
  rotate(qkv.data<float>(), B, n, pos0, /*inverse=*/false);
  Tensor att = Tensor::empty({B, n, C});
  ops::attention_cached(att.data<float>(), k_cache, v_cache, qkv.data<float>(), B, n, pos0, block_size, C, n_head_,
                        local_kv_heads_);
  c_proj_.local().forward(ps, out, att.data<float>(), B * n);
}

void Block::forward_cached(const ParamStore& ps, float* x, float* k_cache, float* v_cache, int64_t B, int64_t n,
                           int64_t pos0, int64_t block_size) const {
  const int64_t N = B * n;
  Norm::Saved ln;
  Tensor tmp = Tensor::empty({N, C_});
  ln_1_.forward(ps, ln, x, N);
  attn_.forward_cached(ps, tmp.data<float>(), ln.out.data<float>(), k_cache, v_cache, B, n, pos0, block_size);
  ops::accumulate(x, tmp.data<float>(), N * C_);
  ln_2_.forward(ps, ln, x, N);
  MLP::Saved mlp;
  tmp = mlp_.forward(ps, mlp, ln.out, AdapterDropout{});
  ops::accumulate(x, tmp.data<float>(), N * C_);
}

Tensor GPT::forward_cached(ParamStore& ps, KVCache& cache, const int32_t* tokens, int64_t n) {
  const int64_t B = cache.B_, C = cfg_.n_embd, V = cfg_.vocab_size;
  const int64_t pos0 = cache.length_;
  const int emb_group = embedding_group_, lnf_group = lnf_group_;
  LOOM_CHECK(mp_.tp.size() == 1 && mp_.first_stage && mp_.last_stage && num_chunks() == 1,
             "inference with a KV cache needs the whole model on one rank");
  if (n <= 0) throw Error("forward_cached needs at least one new token per sequence");
  const BatchShape bs{B, n};
  embedding_.check_tokens(tokens, B * n);
  ps.acquire(emb_group);
  Tensor x = embedding_.forward(ps, Tensor::from_host(tokens, {B * n}, DType::i32), bs, pos0);
  ps.release(emb_group);

  const int64_t layer_stride = cache.k_.numel() / cfg_.n_layer;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    ps.acquire(blocks_[i].group());
    blocks_[i].forward_cached(ps, x.data<float>(), cache.k_.data<float>() + static_cast<int64_t>(i) * layer_stride,
                              cache.v_.data<float>() + static_cast<int64_t>(i) * layer_stride, B, n, pos0,
                              cfg_.block_size);
    ps.release(blocks_[i].group());
  }
  cache.length_ += n;

  // Only the last position of each sequence is needed for sampling.
  Tensor last = Tensor::empty({B, C});
  for (int64_t b = 0; b < B; ++b)
    ops::copy(last.data<float>() + b * C, x.data<float>() + ((b + 1) * n - 1) * C, static_cast<size_t>(C) * 4);
  Norm::Saved ln;
  ps.acquire(lnf_group);
  ln_f_.forward(ps, ln, last.data<float>(), B);
  ps.release(lnf_group);
  Tensor logits = Tensor::empty({B, V});
  ps.acquire(head_group());
  ops::linear_forward(logits.data<float>(), ln.out.data<float>(), ps.param(head_table()).data<float>(), nullptr, B, C,
                      V);
  ps.release(head_group());
  return logits;
}

}  // namespace loom
