#include <cmath>

#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

namespace {
// The embedding's dropout site sits outside every block; any index past the
// last block names it.
constexpr uint64_t kEmbeddingDropoutLayer = ~0ull;
}  // namespace

GPT::GPT(const GPTConfig& cfg) : cfg_(cfg) {
  cfg_.validate();
  int g = layout_.add_group("embedding");
  embedding_ = Embedding(layout_, cfg_.vocab_size, cfg_.block_size, cfg_.n_embd, g);
  for (int i = 0; i < cfg_.n_layer; ++i) {
    g = layout_.add_group("h." + std::to_string(i));
    blocks_.emplace_back(layout_, i, cfg_, g);
  }
  g = layout_.add_group("ln_f");
  ln_f_ = LayerNorm(layout_, "ln_f", cfg_.n_embd, g);
  LOOM_CHECK(layout_.numel() == cfg_.num_params(), "layout has ", layout_.numel(), " parameters, formula says ",
             cfg_.num_params());
}

float GPT::forward(ParamStore& ps, const int32_t* tokens, const int32_t* targets, const BatchShape& bs,
                   const ForwardOptions& opts) {
  const int64_t N = bs.N(), C = cfg_.n_embd, V = cfg_.vocab_size;
  const int emb_group = 0, lnf_group = layout_.num_groups() - 1;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < -1 || targets[i] >= V)
      throw Error(str("target id ", targets[i], " at position ", i, " is outside the vocabulary [0, ", V,
                      ") (and is not -1, the ignore index)"));
  }
  bs_ = bs;
  opts_ = opts;
  tokens_.assign(tokens, tokens + N);
  targets_.assign(targets, targets + N);
  saved_.assign(blocks_.size(), Block::Saved{});

  ps.acquire(emb_group);
  Tensor x = Tensor::empty({bs.B, bs.T, C});
  embedding_.forward(ps, x.data<float>(), tokens, bs);
  ps.release(emb_group);
  if (opts.training && cfg_.dropout > 0.0f)
    cpu::dropout_forward(x.data<float>(), x.data<float>(), N * C, cfg_.dropout,
                         stream_key(opts.dropout_key, kEmbeddingDropoutLayer, 0),
                         static_cast<uint64_t>(opts.first_sequence * bs.T * C));

  for (size_t i = 0; i < blocks_.size(); ++i) {
    ps.acquire(blocks_[i].group());
    x = blocks_[i].forward(ps, saved_[i], x, bs, opts);
    ps.release(blocks_[i].group());
  }
  x_final_ = x;

  // The output head is tied to the token embedding: logits = ln_f(x) wte^T.
  ps.acquire(lnf_group);
  ln_f_.forward(ps, ln_f_saved_, x.data<float>(), N);
  ps.release(lnf_group);
  ps.acquire(emb_group);
  logits_ = Tensor::empty({bs.B, bs.T, V});
  cpu::linear_forward(logits_.data<float>(), ln_f_saved_.out.data<float>(),
                      ps.param(embedding_.wte_id()).data<float>(), nullptr, N, C, V);
  ps.release(emb_group);

  lse_ = Tensor::empty({N});
  Tensor losses = Tensor::empty({N});
  cpu::cross_entropy_forward(losses.data<float>(), lse_.data<float>(), logits_.data<float>(), targets, N, V);
  double sum = 0.0;
  valid_targets_ = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] == -1) continue;
    sum += losses.data<float>()[i];
    ++valid_targets_;
  }
  const float loss = valid_targets_ ? static_cast<float>(sum / static_cast<double>(valid_targets_)) : 0.0f;
  if (!std::isfinite(loss))
    throw Error(str("the loss is ", loss, " (not finite): training diverged; lower train.lr, enable "
                    "train.grad_clip, or use a lower-risk precision"));
  return loss;
}

void GPT::backward(ParamStore& ps, GradStore& gs, float dloss) {
  LOOM_CHECK(logits_.defined(), "backward without a preceding forward");
  const int64_t N = bs_.N(), C = cfg_.n_embd, V = cfg_.vocab_size;
  const int emb_group = 0, lnf_group = layout_.num_groups() - 1;
  const Grads g{ps, gs};

  // Softmax-cross-entropy gradient, written over the logits in place.
  Tensor dl = Tensor::empty({N});
  dl.fill_(dloss);
  float* dlogits = logits_.data<float>();
  cpu::cross_entropy_backward(dlogits, dlogits, lse_.data<float>(), targets_.data(), dl.data<float>(), N, V);

  ps.acquire(emb_group);
  ps.acquire(lnf_group);
  Tensor dlnf = Tensor::zeros({N, C});
  cpu::linear_backward(dlnf.data<float>(), gs.grad(embedding_.wte_id()).data<float>(), nullptr, dlogits,
                       ln_f_saved_.out.data<float>(), ps.param(embedding_.wte_id()).data<float>(), N, C, V);
  logits_ = Tensor();
  lse_ = Tensor();
  Tensor dres = Tensor::zeros({bs_.B, bs_.T, C});
  ln_f_.backward(g, dres.data<float>(), dlnf.data<float>(), x_final_.data<float>(), ln_f_saved_, N);
  dlnf = Tensor();
  ln_f_saved_ = LayerNorm::Saved{};
  x_final_ = Tensor();
  ps.release(lnf_group);
  gs.group_ready(lnf_group);
  ps.release(emb_group);

  for (size_t i = blocks_.size(); i-- > 0;) {
    ps.acquire(blocks_[i].group());
    blocks_[i].backward(g, dres.data<float>(), saved_[i], bs_, opts_);
    ps.release(blocks_[i].group());
    gs.group_ready(blocks_[i].group());
  }

  // The lookup's backward scatters into the gradients without reading the
  // table, so the embedding is not acquired again (under ZeRO-3 that saves
  // a third all-gather of the largest group).
  const float* demb = dres.data<float>();
  Tensor dropped;
  if (opts_.training && cfg_.dropout > 0.0f) {
    dropped = Tensor::zeros({N, C});
    cpu::dropout_backward(dropped.data<float>(), dres.data<float>(), N * C, cfg_.dropout,
                          stream_key(opts_.dropout_key, kEmbeddingDropoutLayer, 0),
                          static_cast<uint64_t>(opts_.first_sequence * bs_.T * C));
    demb = dropped.data<float>();
  }
  embedding_.backward(g, demb, tokens_.data(), bs_);
  gs.group_ready(emb_group);
}

}  // namespace loom
