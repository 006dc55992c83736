#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

int Embedding::add_token_table(ParamLayout& layout, int64_t vocab, int64_t C, int group, const TensorParallel& tp,
                               bool tied_copy) {
  ParamParallel parallel;
  parallel.split = TensorSplit{0, tp.size(), tp.rank(), 1};
  parallel.tied_copy = tied_copy;
  return layout.add("wte.weight", {vocab, C}, ParamInit::normal_(0.02f), true, group, parallel);
}

Embedding::Embedding(ParamLayout& layout, int64_t vocab, int64_t block_size, int64_t C, int group,
                     const TensorParallel& tp, bool tied_copy)
    : tp_(tp), vocab_(vocab), block_size_(block_size), C_(C) {
  wte_ = add_token_table(layout, vocab, C, group, tp, tied_copy);
  ParamParallel positions;
  positions.partial_grad = tp.splits_tokens();
  wpe_ = layout.add("wpe.weight", {block_size, C}, ParamInit::normal_(0.01f), true, group, positions);
}

Tensor Embedding::forward(const ParamStore& ps, const int32_t* tokens, const BatchShape& bs, int64_t pos0) const {
  if (pos0 + bs.T > block_size_)
    throw Error(str("sequence of ", pos0 + bs.T, " positions exceeds the model's context model.block_size = ",
                    block_size_, ": shorten the sequence (train.seq_len) or raise block_size"));
  const int64_t N = bs.N();
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_)
      throw Error(str("token id ", tokens[i], " at position ", i, " is outside the vocabulary [0, ", vocab_,
                      "): the data was tokenized with a different vocabulary than model.vocab_size"));
  }
  const float* wte = ps.param(wte_).data<float>();
  const float* wpe = ps.param(wpe_).data<float>();
  if (tp_.size() == 1) {
    Tensor out = Tensor::empty({bs.B, bs.T, C_});
    cpu::embedding_forward(out.data<float>(), tokens, wte, wpe, bs.B, bs.T, C_, pos0);
    return out;
  }
  const int64_t rows = ps.layout().param(wte_).shape[0];
  Tensor partial = Tensor::empty({N, C_});
  cpu::embedding_lookup_range(partial.data<float>(), tokens, wte, tp_.rank() * rows, rows, N, C_);
  Tensor out = TensorParallelRegion::leave_forward(tp_, partial);
  partial = Tensor();
  cpu::position_embedding_add(out.data<float>(), wpe, tp_.first_row(N), out.numel() / C_, bs.T, C_, pos0);
  return out;
}

void Embedding::backward(const Grads& g, const Tensor& dout, const int32_t* tokens, const BatchShape& bs) const {
  float* dwte = g.grads.grad(wte_).data<float>();
  float* dwpe = g.grads.grad(wpe_).data<float>();
  if (tp_.size() == 1) {
    cpu::embedding_backward(dwte, dwpe, dout.data<float>(), tokens, bs.B, bs.T, C_, 0);
    return;
  }
  const int64_t N = bs.N();
  cpu::position_embedding_backward(dwpe, dout.data<float>(), tp_.first_row(N), dout.numel() / C_, bs.T, C_);
  const Tensor full = TensorParallelRegion::leave_backward(tp_, dout);
  const int64_t rows = g.params.layout().param(wte_).shape[0];
  cpu::embedding_lookup_range_backward(dwte, full.data<float>(), tokens, tp_.rank() * rows, rows, N, C_);
}

}  // namespace loom
