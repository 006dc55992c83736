#include "loom/kernels.h"
#include "loom/nn.h"

namespace loom {

Embedding::Embedding(ParamLayout& layout, int64_t vocab, int64_t block_size, int64_t C, int group)
    : vocab_(vocab), block_size_(block_size), C_(C) {
  wte_ = layout.add("wte.weight", {vocab, C}, ParamInit::normal_(0.02f), true, group);
  wpe_ = layout.add("wpe.weight", {block_size, C}, ParamInit::normal_(0.01f), true, group);
}

void Embedding::forward(const ParamStore& ps, float* out, const int32_t* tokens, const BatchShape& bs,
                        int64_t pos0) const {
  if (pos0 + bs.T > block_size_)
    throw Error(str("sequence of ", pos0 + bs.T, " positions exceeds the model's context model.block_size = ",
                    block_size_, ": shorten the sequence (train.seq_len) or raise block_size"));
  for (int64_t i = 0; i < bs.N(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_)
      throw Error(str("token id ", tokens[i], " at position ", i, " is outside the vocabulary [0, ", vocab_,
                      "): the data was tokenized with a different vocabulary than model.vocab_size"));
  }
  cpu::embedding_forward(out, tokens, ps.param(wte_).data<float>(), ps.param(wpe_).data<float>(), bs.B, bs.T, C_,
                         pos0);
}

void Embedding::backward(const Grads& g, const float* dout, const int32_t* tokens, const BatchShape& bs) const {
  cpu::embedding_backward(g.grads.grad(wte_).data<float>(), g.grads.grad(wpe_).data<float>(), dout, tokens, bs.B,
                          bs.T, C_, 0);
}

}  // namespace loom
