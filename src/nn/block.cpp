#include <cmath>

#include "loom/device.h"
#include "loom/nn.h"

namespace loom {

namespace {
// Dropout sites of a block; with the layer index and the step's key they name
// a mask stream that does not depend on the parallel layout.
enum DropoutSite : uint64_t { kAttnResidual = 0, kMlpResidual = 1, kAdapterInputs = 2 };
}  // namespace

Block::Block(ParamLayout& layout, int index, const GPTConfig& cfg, int group, const TensorParallel& tp)
    : tp_(tp), index_(index), group_(group), C_total_(cfg.n_embd), C_(tp.local_width(cfg.n_embd)),
      dropout_(cfg.dropout) {
  const std::string prefix = "h." + std::to_string(index);
  // GPT-2 scales the init of the projections into the residual stream by
  // 1/sqrt(2 * n_layer) so the stream's variance does not grow with depth.
  const float proj_std = 0.02f / std::sqrt(2.0f * static_cast<float>(cfg.n_layer));
  ln_1_ = Norm(layout, prefix + ".ln_1", cfg, group, tp);
  attn_ = CausalSelfAttention(layout, prefix + ".attn", cfg, group, proj_std, tp);
  ln_2_ = Norm(layout, prefix + ".ln_2", cfg, group, tp);
  mlp_ = MLP(layout, prefix + ".mlp", cfg, group, proj_std, tp);
}

Tensor Block::forward(const ParamStore& ps, Saved& s, const Tensor& x, const BatchShape& bs,
                      const ForwardOptions& opts) const {
  Tensor y = Tensor::empty(x.shape());
  s.x = x;
  s.recompute = opts.checkpoint_activations;
  forward_into(ps, s, y.data<float>(), bs, opts);
  if (s.recompute) {
    Tensor input = s.x;
    s = Saved{};
    s.x = input;
    s.recompute = true;
  }
  return y;
}

AdapterDropout Block::adapter_dropout(const BatchShape& bs, const ForwardOptions& opts) const {
  // The linear layers' inputs hold every token row of the micro-batch (a
  // column-parallel layer gathers them under sequence parallelism).
  return {opts.training, stream_key(opts.dropout_key, static_cast<uint64_t>(index_), kAdapterInputs),
          opts.first_sequence * bs.T};
}

void Block::forward_into(const ParamStore& ps, Saved& s, float* y, const BatchShape& bs,
                         const ForwardOptions& opts) const {
  const int64_t rows = tp_.local_rows(bs.N());
  const bool drop = opts.training && dropout_ > 0.0f;
  // The masks are indexed by global element, so sequence-parallel shards
  // and a grid's blocks draw their slice of the same masks.
  const uint64_t first = tp_.first_element(opts.first_sequence * bs.T, bs.N(), C_total_);
  const float* x = s.x.data<float>();

  ln_1_.forward(ps, s.ln_1, x, rows);
  {
    Tensor a = attn_.forward(ps, s.attn, s.ln_1.out, bs, adapter_dropout(bs, opts));
    if (drop)
      ops::dropout_forward(a.data<float>(), a.data<float>(), rows, C_, C_total_, dropout_,
                           stream_key(opts.dropout_key, static_cast<uint64_t>(index_), kAttnResidual), first);
    s.resid = Tensor::empty(s.x.shape());
    ops::add(s.resid.data<float>(), x, a.data<float>(), rows * C_);
  }
  ln_2_.forward(ps, s.ln_2, s.resid.data<float>(), rows);
  if (!y) {
    mlp_.forward_activation(ps, s.mlp, s.ln_2.out, adapter_dropout(bs, opts));
    return;
  }
  Tensor m = mlp_.forward(ps, s.mlp, s.ln_2.out, adapter_dropout(bs, opts));
  if (drop)
    ops::dropout_forward(m.data<float>(), m.data<float>(), rows, C_, C_total_, dropout_,
                         stream_key(opts.dropout_key, static_cast<uint64_t>(index_), kMlpResidual), first);
  ops::add(y, s.resid.data<float>(), m.data<float>(), rows * C_);
}

void Block::backward(const Grads& g, float* dres, Saved& s, const BatchShape& bs, const ForwardOptions& opts) const {
  const int64_t rows = tp_.local_rows(bs.N());
  const bool drop = opts.training && dropout_ > 0.0f;
  const uint64_t first = tp_.first_element(opts.first_sequence * bs.T, bs.N(), C_total_);
  if (s.recompute) {
    // Activation checkpointing: rebuild this block's activations from its
    // input. Same kernels, same inputs, same dropout masks: the same bits.
    // The MLP's output projection and the last residual are not needed.
    forward_into(g.params, s, nullptr, bs, opts);
  }

  // y = r + drop(mlp(ln_2(r)))
  Tensor dm = Tensor::borrow(dres, {rows, C_}, DType::f32, Tier::device);
  if (drop) {
    dm = Tensor::empty({rows, C_});
    ops::dropout_backward(dm.data<float>(), dres, rows, C_, C_total_, dropout_,
                          stream_key(opts.dropout_key, static_cast<uint64_t>(index_), kMlpResidual), first,
                          ops::GradWrite::overwrite);
  }
  Tensor dln = mlp_.backward(g, dm, s.ln_2.out, s.mlp, adapter_dropout(bs, opts));
  ln_2_.backward(g, dres, dln.data<float>(), s.resid.data<float>(), s.ln_2, rows, /*accumulate=*/true);

  // r = x + drop(attn(ln_1(x))); dres now holds dL/dr.
  dm = Tensor::borrow(dres, {rows, C_}, DType::f32, Tier::device);
  if (drop) {
    dm = Tensor::empty({rows, C_});
    ops::dropout_backward(dm.data<float>(), dres, rows, C_, C_total_, dropout_,
                          stream_key(opts.dropout_key, static_cast<uint64_t>(index_), kAttnResidual), first,
                          ops::GradWrite::overwrite);
  }
  dln = attn_.backward(g, dm, s.ln_1.out, s.attn, bs, adapter_dropout(bs, opts));
  dm = Tensor();
  ln_1_.backward(g, dres, dln.data<float>(), s.x.data<float>(), s.ln_1, rows, /*accumulate=*/true);
  s = Saved{};
}

}  // namespace loom
