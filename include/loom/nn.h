// loom nn: the GPT-2 model as explicit modules, each with a hand-written
// forward and backward (no general autograd).
//
// Modules hold shapes and parameter ids, never parameter memory: they read
// parameters from a ParamStore and accumulate gradients into a GradStore.
// What a forward keeps for its backward lives in a `Saved` struct owned by the
// caller, so several micro-batches can be in flight (pipeline schedules) and
// activation checkpointing is a matter of keeping less and recomputing.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "loom/core.h"
#include "loom/store.h"

namespace loom {

// ---------------------------------------------------------------------------
// Configuration
// ---------------------------------------------------------------------------

struct GPTConfig {
  int64_t n_layer = 2;
  int64_t n_head = 4;
  int64_t n_embd = 64;
  int64_t vocab_size = 256;
  int64_t block_size = 64;  // context length: number of learned positions
  float dropout = 0.0f;

  // "tiny", "gpt2" (124M), "gpt2-medium", "gpt2-large", "gpt2-xl".
  static GPTConfig preset(std::string_view name);
  static std::vector<std::string> preset_names();

  // Throws Error naming the field and the constraint.
  void validate() const;
  int64_t num_params() const;
};

// Per-micro-batch settings of a forward pass.
struct ForwardOptions {
  bool training = true;                 // dropout active (when config.dropout > 0)
  bool checkpoint_activations = false;  // keep only block inputs; recompute in backward
  uint64_t dropout_key = 0;             // stream key of this step's dropout masks
  int64_t first_sequence = 0;           // global index of the micro-batch's first sequence
};

// Everything a forward pass needs to know about its micro-batch.
struct BatchShape {
  int64_t B = 0;
  int64_t T = 0;
  int64_t N() const { return B * T; }
};

// Gradient-carrying context for backward.
struct Grads {
  ParamStore& params;
  GradStore& grads;
};

// ---------------------------------------------------------------------------
// Modules
// ---------------------------------------------------------------------------

// y = x W^T + b with W stored [out, in] (PyTorch's nn.Linear layout).
class Linear {
 public:
  Linear() = default;
  Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std);
  void forward(const ParamStore& ps, float* out, const float* in, int64_t N) const;
  // din may be null (input needs no gradient).
  void backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N) const;
  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  int weight_id() const { return weight_; }
  int bias_id() const { return bias_; }

 private:
  int64_t in_ = 0, out_ = 0;
  int weight_ = -1, bias_ = -1;
};

class LayerNorm {
 public:
  LayerNorm() = default;
  LayerNorm(ParamLayout& layout, const std::string& name, int64_t C, int group);
  struct Saved {
    Tensor out, mean, rstd;
  };
  // Allocates s.out, s.mean, s.rstd.
  void forward(const ParamStore& ps, Saved& s, const float* in, int64_t N) const;
  void backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N) const;

 private:
  int64_t C_ = 0;
  int weight_ = -1, bias_ = -1;
};

// Token + learned position embedding.
class Embedding {
 public:
  Embedding() = default;
  Embedding(ParamLayout& layout, int64_t vocab, int64_t block_size, int64_t C, int group);
  // Throws Error for a token id outside [0, vocab) or pos0 + T > block_size.
  void forward(const ParamStore& ps, float* out, const int32_t* tokens, const BatchShape& bs, int64_t pos0 = 0) const;
  void backward(const Grads& g, const float* dout, const int32_t* tokens, const BatchShape& bs) const;
  int wte_id() const { return wte_; }
  int wpe_id() const { return wpe_; }

 private:
  int64_t vocab_ = 0, block_size_ = 0, C_ = 0;
  int wte_ = -1, wpe_ = -1;
};

// Multi-head causal self-attention: c_attn (QKV), flash-style attention, c_proj.
class CausalSelfAttention {
 public:
  CausalSelfAttention() = default;
  CausalSelfAttention(ParamLayout& layout, const std::string& prefix, int64_t C, int64_t n_head, int group,
                      float proj_std);
  struct Saved {
    Tensor qkv, att, lse;
  };
  // out[N,C] = c_proj(attention(c_attn(in))).
  void forward(const ParamStore& ps, Saved& s, float* out, const float* in, const BatchShape& bs) const;
  // Accumulates into din[N,C].
  void backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s,
                const BatchShape& bs) const;

  // Inference with a KV cache: appends the keys and values of the n new
  // positions (pos0, pos0 + n) to k_cache/v_cache ([B, n_head, block_size, hs])
  // and attends each new query to every cached position up to its own.
  void forward_cached(const ParamStore& ps, float* out, const float* in, float* k_cache, float* v_cache,
                      int64_t B, int64_t n, int64_t pos0, int64_t block_size) const;

  const Linear& c_attn() const { return c_attn_; }
  const Linear& c_proj() const { return c_proj_; }
  int64_t n_head() const { return n_head_; }

 private:
  int64_t C_ = 0, n_head_ = 0;
  Linear c_attn_, c_proj_;
};

class MLP {
 public:
  MLP() = default;
  MLP(ParamLayout& layout, const std::string& prefix, int64_t C, int group, float proj_std);
  struct Saved {
    Tensor fc, act;
  };
  void forward(const ParamStore& ps, Saved& s, float* out, const float* in, int64_t N) const;
  void backward(const Grads& g, float* din, const float* dout, const float* in, const Saved& s, int64_t N) const;

 private:
  int64_t C_ = 0;
  Linear c_fc_, c_proj_;
};

// Pre-LayerNorm transformer block:
//   r = x + drop(attn(ln_1(x)));  y = r + drop(mlp(ln_2(r)))
class Block {
 public:
  Block() = default;
  Block(ParamLayout& layout, int index, const GPTConfig& cfg, int group);

  struct Saved {
    Tensor x;  // the input, kept in both modes
    bool recompute = false;
    LayerNorm::Saved ln_1, ln_2;
    CausalSelfAttention::Saved attn;
    Tensor resid;  // r
    MLP::Saved mlp;
  };
  // Returns y. With opts.checkpoint_activations, s keeps only x.
  Tensor forward(const ParamStore& ps, Saved& s, const Tensor& x, const BatchShape& bs,
                 const ForwardOptions& opts) const;
  // dres holds dL/dy on entry and dL/dx on return (the residual stream's
  // gradient flows through in place).
  void backward(const Grads& g, float* dres, Saved& s, const BatchShape& bs, const ForwardOptions& opts) const;

  // Inference: x ([B, n, C]) is updated in place, keys and values appended
  // to this layer's slice of the cache.
  void forward_cached(const ParamStore& ps, float* x, float* k_cache, float* v_cache, int64_t B, int64_t n,
                      int64_t pos0, int64_t block_size) const;

  int group() const { return group_; }

 private:
  void forward_into(const ParamStore& ps, Saved& s, float* y, const BatchShape& bs, const ForwardOptions& opts) const;

  int index_ = 0, group_ = 0;
  int64_t C_ = 0;
  float dropout_ = 0.0f;
  LayerNorm ln_1_, ln_2_;
  CausalSelfAttention attn_;
  MLP mlp_;
};

// ---------------------------------------------------------------------------
// GPT-2
// ---------------------------------------------------------------------------

// Keys and values of past positions, for sampling one token at a time.
class KVCache {
 public:
  KVCache(const GPTConfig& cfg, int64_t B);
  int64_t length() const { return length_; }
  void clear() { length_ = 0; }

 private:
  friend class GPT;
  Tensor k_, v_;  // [n_layer, B, n_head, block_size, hs]
  int64_t B_ = 0;
  int64_t length_ = 0;
};

class GPT {
 public:
  explicit GPT(const GPTConfig& cfg);
  // Stores refer to the layout inside: a GPT stays where it is built.
  GPT(const GPT&) = delete;
  GPT& operator=(const GPT&) = delete;

  const GPTConfig& config() const { return cfg_; }
  const ParamLayout& layout() const { return layout_; }
  // Parameter groups: 0 = embedding, 1..n_layer = blocks, n_layer + 1 = ln_f.
  int block_group(int i) const { return 1 + i; }

  // Forward of one micro-batch with targets: returns the mean cross-entropy
  // over positions whose target is not -1 and keeps what backward needs.
  // Throws Error for bad token ids, T > block_size, or a non-finite loss.
  float forward(ParamStore& ps, const int32_t* tokens, const int32_t* targets, const BatchShape& bs,
                const ForwardOptions& opts = {});
  // Backward of the last forward. dloss is dObjective/dloss_i for each
  // position (e.g. 1 / tokens in the global batch, times the loss scale).
  // Accumulates into the GradStore and frees the saved activations.
  void backward(ParamStore& ps, GradStore& gs, float dloss);

  // The logits of the last forward ([B, T, V]); valid until backward.
  Tensor logits() const { return logits_; }

  // Inference: feeds `n` new tokens per sequence ([B, n]) through the model,
  // appending to the cache, and returns the logits of the last position [B, V].
  Tensor forward_cached(ParamStore& ps, KVCache& cache, const int32_t* tokens, int64_t n);

 private:
  GPTConfig cfg_;
  ParamLayout layout_;
  Embedding embedding_;
  std::vector<Block> blocks_;
  LayerNorm ln_f_;

  // Saved state of the last forward.
  BatchShape bs_;
  ForwardOptions opts_;
  std::vector<int32_t> tokens_, targets_;
  std::vector<Block::Saved> saved_;
  Tensor x_final_;
  LayerNorm::Saved ln_f_saved_;
  Tensor logits_, lse_;
  int64_t valid_targets_ = 0;
};

}  // namespace loom
