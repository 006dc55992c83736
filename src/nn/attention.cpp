#include <vector>

#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

CausalSelfAttention::CausalSelfAttention(ParamLayout& layout, const std::string& prefix, const GPTConfig& cfg,
                                         int group, float proj_std, const TensorParallel& tp)
    : n_head_(cfg.n_head), hs_(cfg.head_dim()), local_heads_(cfg.n_head / tp.feature_parts()),
      local_kv_heads_(cfg.local_kv_heads(static_cast<int>(tp.feature_parts()))),
      token_parts_(tp.grid ? tp.token_parts() : 1) {
  const int64_t C = cfg.n_embd, q = cfg.q_dim(), nkv = cfg.kv_heads(), ways = tp.feature_parts();
  LOOM_CHECK(n_head_ % ways == 0, n_head_, " heads do not split over ", ways, " tensor-parallel parts");
  LOOM_CHECK(nkv % ways == 0 || (!tp.grid && ways % nkv == 0), nkv, " kv heads over ", ways,
             " tensor-parallel parts");
  if (cfg.positions == PositionKind::rope) {
    inv_freq_.resize(static_cast<size_t>(hs_ / 2));
    cpu::rope_inv_freq(inv_freq_.data(), hs_, cfg.rope_theta, cfg.rope_scaling);
  }
  if (tp.grid) {
    // Each of q, k and v is cut over the grid block by block, so every
    // rank's output columns are whole heads of each.
    const std::vector<GridLinearPart> parts_in =
        cfg.packed_qkv ? std::vector<GridLinearPart>{{prefix + ".c_attn", 3 * q, 3}}
                       : std::vector<GridLinearPart>{
                             {prefix + ".q", q, 1}, {prefix + ".k", nkv * hs_, 1}, {prefix + ".v", nkv * hs_, 1}};
    c_attn_ = GridLinear(layout, parts_in, C, group, 0.02f, tp, cfg.attention_bias, GridSide::entering);
    c_proj_ = GridLinear(layout, {{prefix + ".c_proj", C, 1}}, q, group, proj_std, tp, cfg.attention_bias,
                         GridSide::leaving);
    return;
  }
  if (cfg.packed_qkv) {
    // q, k and v are three blocks of c_attn's rows: splitting each block keeps
    // whole heads on every rank, so attention itself needs no communication.
    c_attn_ = ColumnParallelLinear(layout, prefix + ".c_attn", C, 3 * q, group, 0.02f, tp, 3,
                                   cfg.adapter("attn.c_attn"));
  } else {
    const ParamParallel split = tp.cut(0);
    std::vector<LinearPart> parts{{prefix + ".q", q, split, split, 0, 0, cfg.adapter("attn.q")},
                                  {prefix + ".k", nkv * hs_, split, split, 0, 0, cfg.adapter("attn.k")},
                                  {prefix + ".v", nkv * hs_, split, split, 0, 0, cfg.adapter("attn.v")}};
    if (nkv % tp.size() != 0) {
      // Fewer kv heads than ranks: every rank holds k and v whole and uses the
      // rows of the kv head its query heads share; the ranks' gradients of k
      // and v are partial sums.
      ParamParallel replicated;
      replicated.partial_grad = kTpAll;
      const int64_t head = tp.rank() / (tp.size() / nkv);
      for (size_t i = 1; i < parts.size(); ++i) {
        parts[i].weight = parts[i].bias = replicated;
        parts[i].first_row = head * hs_;
        parts[i].rows = hs_;
      }
    }
    c_attn_ = ColumnParallelLinear(layout, parts, C, group, 0.02f, tp, cfg.attention_bias);
  }
  c_proj_ = RowParallelLinear(layout, prefix + ".c_proj", q, C, group, proj_std, tp, cfg.attention_bias,
                              cfg.adapter("attn.c_proj"));
}

void CausalSelfAttention::rotate(float* qkv, int64_t B, int64_t T, int64_t pos0, bool inverse) const {
  if (inv_freq_.empty()) return;
  const int64_t half = hs_ / 2;
  const Tensor inv_freq = Tensor::from_host(inv_freq_.data(), {half}, DType::f32);
  Tensor cos = Tensor::empty({T, half}), sin = Tensor::empty({T, half});
  ops::rope_tables(cos.data<float>(), sin.data<float>(), inv_freq.data<float>(), T, half, pos0);
  rotate(qkv, cos, sin, B, T, inverse);
}

void CausalSelfAttention::rotate(float* qkv, const DecodeBatch& batch) const {
  if (inv_freq_.empty()) return;
  const int64_t half = hs_ / 2;
  const Tensor inv_freq = Tensor::from_host(inv_freq_.data(), {half}, DType::f32);
  Tensor cos = Tensor::empty({batch.N, half}), sin = Tensor::empty({batch.N, half});
  for (int64_t s = 0; s < batch.S; ++s) {
    const int64_t row = batch.offsets[static_cast<size_t>(s)];
    ops::rope_tables(cos.data<float>() + row * half, sin.data<float>() + row * half, inv_freq.data<float>(),
                     batch.offsets[static_cast<size_t>(s) + 1] - row, half, batch.lengths[static_cast<size_t>(s)]);
  }
  rotate(qkv, cos, sin, 1, batch.N, /*inverse=*/false);
}

void CausalSelfAttention::rotate(float* qkv, const Tensor& cos, const Tensor& sin, int64_t B, int64_t T,
                                 bool inverse) const {
  const int64_t q_width = local_heads_ * hs_, stride = q_width + 2 * local_kv_heads_ * hs_;
  const struct {
    float* x;
    int64_t heads;
  } parts[] = {{qkv, local_heads_}, {qkv + q_width, local_kv_heads_}};
  for (const auto& p : parts) {
    if (inverse)
      ops::rope_backward(p.x, p.x, cos.data<float>(), sin.data<float>(), B, T, p.heads, hs_, stride,
                         ops::GradWrite::overwrite);
    else
      ops::rope_forward(p.x, p.x, cos.data<float>(), sin.data<float>(), B, T, p.heads, hs_, stride);
  }
}

Tensor CausalSelfAttention::forward(const ParamStore& ps, Saved& s, const Tensor& in, const BatchShape& whole,
                                    const AdapterDropout& drop) const {
  const BatchShape bs{whole.B / token_parts_, whole.T};  // this rank's sequences
  const int64_t local_C = hs_ * local_heads_;
  s.qkv = parallel_forward(c_attn_, ps, in, drop);
  rotate(s.qkv.data<float>(), bs.B, bs.T, 0, /*inverse=*/false);
  s.att = Tensor::empty({bs.N(), local_C});
  s.lse = Tensor::empty({bs.B, local_heads_, bs.T});
  ops::attention_forward(s.att.data<float>(), s.lse.data<float>(), s.qkv.data<float>(), bs.B, bs.T, local_C,
                         local_heads_, local_kv_heads_);
  return parallel_forward(c_proj_, ps, s.att, drop);
}

Tensor CausalSelfAttention::backward(const Grads& g, const Tensor& dout, const Tensor& in, const Saved& s,
                                     const BatchShape& whole, const AdapterDropout& drop) const {
  const BatchShape bs{whole.B / token_parts_, whole.T};
  const int64_t local_C = hs_ * local_heads_;
  Tensor datt = parallel_backward(c_proj_, g, dout, s.att, drop);
  Tensor dqkv = Tensor::empty(s.qkv.shape());
  ops::attention_backward(dqkv.data<float>(), datt.data<float>(), s.att.data<float>(), s.lse.data<float>(),
                          s.qkv.data<float>(), bs.B, bs.T, local_C, local_heads_, local_kv_heads_,
                          ops::GradWrite::overwrite);
  datt = Tensor();
  rotate(dqkv.data<float>(), bs.B, bs.T, 0, /*inverse=*/true);
  return parallel_backward(c_attn_, g, dqkv, in, drop);
}

}  // namespace loom
