#include "loom/device.h"
#include "loom/nn.h"
#include "loom/quant.h"

namespace loom {

int Embedding::add_token_table(ParamLayout& layout, int64_t vocab, int64_t C, int group, const TensorParallel& tp,
                               TableCopies copies, const std::string& name) {
  // On a grid the table is cut as the output head's layer (an entering one)
  // cuts its weight.
  ParamParallel parallel = tp.grid ? tp.grid->linear_cut(GridSide::entering) : tp.cut(0);
  parallel.tied_across_stages = copies != TableCopies::none;
  parallel.tied_copy = copies == TableCopies::copy;
  return layout.add(name, {vocab, C}, ParamInit::normal_(0.02f), true, group, parallel);
}

Embedding::Embedding(ParamLayout& layout, const GPTConfig& cfg, int group, const TensorParallel& tp,
                     TableCopies copies)
    : tp_(tp), vocab_(cfg.vocab_size), block_size_(cfg.block_size), C_(cfg.n_embd) {
  wte_ = add_token_table(layout, vocab_, C_, group, tp, copies);
  if (cfg.positions != PositionKind::learned) return;
  ParamParallel positions;
  positions.partial_grad = tp.splits_tokens() ? kTpAll : 0;
  if (tp.grid) positions = tp.grid->column_cut(1);
  wpe_ = layout.add("wpe.weight", {block_size_, C_}, ParamInit::normal_(0.01f), true, group, positions);
}

void Embedding::check_tokens(const int32_t* tokens, int64_t N) const {
  for (int64_t i = 0; i < N; ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_)
      throw Error(str("token id ", tokens[i], " at position ", i, " is outside the vocabulary [0, ", vocab_,
                      "): the data was tokenized with a different vocabulary than model.vocab_size"));
  }
}

Tensor Embedding::forward(const ParamStore& ps, const Tensor& token_ids, const BatchShape& bs, int64_t pos0) const {
  if (pos0 + bs.T > block_size_)
    throw Error(str("sequence of ", pos0 + bs.T, " positions exceeds the model's context model.block_size = ",
                    block_size_, ": shorten the sequence (train.seq_len) or raise block_size"));
  const int64_t N = bs.N();
  LOOM_CHECK(token_ids.numel() == N && token_ids.dtype() == DType::i32, "the embedding needs ", N, " int32 tokens");
  const int32_t* tokens = token_ids.data<int32_t>();
  const float* wpe = wpe_ >= 0 ? ps.param(wpe_).data<float>() : nullptr;
  if (const QuantizedWeight* q = ps.quantized(wte_)) {
    // A quantized store holds a whole model (inference): the rows come
    // dequantized, the positions are added after.
    LOOM_CHECK(tp_.size() == 1, "a quantized token table on a tensor-parallel rank");
    Tensor out = Tensor::empty({bs.B, bs.T, C_});
    quantized_embedding_lookup(out.data<float>(), tokens, *q, N);
    if (wpe) ops::position_embedding_add(out.data<float>(), wpe, 0, N, bs.T, C_, pos0);
    return out;
  }
  const float* wte = ps.param(wte_).data<float>();
  if (tp_.grid) return grid_forward(ps, tokens, bs, pos0);
  if (tp_.size() == 1 && wpe) {
    Tensor out = Tensor::empty({bs.B, bs.T, C_});
    ops::embedding_forward(out.data<float>(), tokens, wte, wpe, bs.B, bs.T, C_, pos0);
    return out;
  }
  const int64_t rows = ps.layout().param(wte_).shape[0];
  Tensor partial = Tensor::empty({N, C_});
  ops::embedding_lookup_range(partial.data<float>(), tokens, wte, tp_.rank() * rows, rows, N, C_);
  Tensor out = TensorParallelRegion::leave_forward(tp_, partial);
  partial = Tensor();
  if (wpe) ops::position_embedding_add(out.data<float>(), wpe, tp_.first_row(N), out.numel() / C_, bs.T, C_, pos0);
  return out;
}

void Embedding::backward(const Grads& g, const Tensor& dout, const Tensor& token_ids, const BatchShape& bs) const {
  const int32_t* tokens = token_ids.data<int32_t>();
  float* dwte = g.grads.grad(wte_).data<float>();
  float* dwpe = wpe_ >= 0 ? g.grads.grad(wpe_).data<float>() : nullptr;
  if (tp_.size() == 1 && dwpe) {
    ops::embedding_backward(dwte, dwpe, dout.data<float>(), tokens, bs.B, bs.T, C_, 0);
    return;
  }
  const int64_t N = bs.N();
  if (tp_.grid) {
    grid_backward(g, dout, tokens, bs);
    return;
  }
  if (dwpe) ops::position_embedding_backward(dwpe, dout.data<float>(), tp_.first_row(N), dout.numel() / C_, bs.T, C_);
  const Tensor full = TensorParallelRegion::leave_backward(tp_, dout);
  const int64_t rows = g.params.layout().param(wte_).shape[0];
  ops::embedding_lookup_range_backward(dwte, full.data<float>(), tokens, tp_.rank() * rows, rows, N, C_);
}

// On a grid the table group's ranks hold the table's vocabulary rows of
// this rank's columns between them, and their token rows are consecutive:
// each looks up every one of those tokens in its rows, and the partial rows
// are reduce-scattered back to their ranks (a vocabulary-parallel embedding
// over the group, as 1D's over the tp group).
Tensor Embedding::grid_forward(const ParamStore& ps, const int32_t* tokens, const BatchShape& bs,
                               int64_t pos0) const {
  const TensorGrid& grid = *tp_.grid;
  Communicator& group = *grid.table_group;
  const int64_t N = bs.N(), rows = tp_.local_rows(N), C = tp_.local_width(C_), group_rows = group.size() * rows;
  const ParamSpec& table = ps.layout().param(wte_);
  const int64_t vocab_rows = table.shape[0];
  Tensor partial = Tensor::empty({group_rows, C});
  ops::embedding_lookup_range(partial.data<float>(), tokens + grid.table_first_block() * rows,
                              ps.param(wte_).data<float>(), table.parallel.split.index * vocab_rows, vocab_rows,
                              group_rows, C);
  Tensor out = Tensor::empty({rows, C});
  group.reduce_scatter(partial, out);
  if (wpe_ >= 0)
    ops::position_embedding_add(out.data<float>(), ps.param(wpe_).data<float>(), tp_.first_row(N), rows, bs.T, C,
                                pos0);
  return out;
}

void Embedding::grid_backward(const Grads& g, const Tensor& dout, const int32_t* tokens, const BatchShape& bs) const {
  const TensorGrid& grid = *tp_.grid;
  Communicator& group = *grid.table_group;
  const int64_t N = bs.N(), rows = tp_.local_rows(N), C = tp_.local_width(C_), group_rows = group.size() * rows;
  if (wpe_ >= 0)
    ops::position_embedding_backward(g.grads.grad(wpe_).data<float>(), dout.data<float>(), tp_.first_row(N), rows,
                                     bs.T, C);
  Tensor gathered = Tensor::empty({group_rows, C});
  group.all_gather(dout, gathered);
  const ParamSpec& table = g.params.layout().param(wte_);
  const int64_t vocab_rows = table.shape[0];
  ops::embedding_lookup_range_backward(g.grads.grad(wte_).data<float>(), gathered.data<float>(),
                                       tokens + grid.table_first_block() * rows,
                                       table.parallel.split.index * vocab_rows, vocab_rows, group_rows, C);
}

}  // namespace loom
