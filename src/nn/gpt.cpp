#include <algorithm>
#include <cmath>

#include "loom/device.h"
#include "loom/nn.h"
#include "loom/quant.h"
#include "loom/trace.h"

namespace loom {

namespace {
// The embedding's dropout site sits outside every block; any index past the
// last block names it.
constexpr uint64_t kEmbeddingDropoutLayer = ~0ull;
// The trace's name for the final norm, the logits and the loss together.
constexpr std::string_view kHeadModule = "head";
}  // namespace

GPT::GPT(const GPTConfig& cfg, const ModelParallel& mp)
    : cfg_(cfg), mp_(mp), loss_(std::make_unique<CrossEntropyLoss>()) {
  cfg_.validate();
  const TensorParallel& tp = mp_.tp;
  if (tp.grid)
    check_grid();
  else
    check_tensor_parallel();
  chunks_ = mp_.chunks.empty() ? std::vector<LayerRange>{{0, static_cast<int>(cfg_.n_layer)}} : mp_.chunks;
  for (size_t c = 0; c < chunks_.size(); ++c)
    LOOM_CHECK(chunks_[c].begin >= (c ? chunks_[c - 1].end : 0) && chunks_[c].begin < chunks_[c].end &&
                   chunks_[c].end <= cfg_.n_layer,
               "bad layer range [", chunks_[c].begin, ", ", chunks_[c].end, ") for chunk ", c);
  local_vocab_ = tp.grid ? GridLinear::local_features(cfg_.vocab_size, tp.grid->shape())
                         : (cfg_.vocab_size + tp.feature_parts() - 1) / tp.feature_parts();
  // Fine-tuning through adapters freezes the whole base model, as PEFT does.
  layout_.set_added_trainable(!cfg_.lora.enabled());

  if (mp_.first_stage) {
    embedding_group_ = layout_.add_group("embedding");
    const bool shared = cfg_.tied_embeddings && !mp_.last_stage;
    embedding_ = Embedding(layout_, cfg_, embedding_group_, tp,
                           shared ? Embedding::TableCopies::owner : Embedding::TableCopies::none);
  }
  for (const LayerRange& chunk : chunks_) {
    chunk_first_block_.push_back(static_cast<int>(blocks_.size()));
    for (int i = chunk.begin; i < chunk.end; ++i)
      blocks_.emplace_back(layout_, i, cfg_, layout_.add_group("h." + std::to_string(i)), tp);
  }
  chunk_first_block_.push_back(static_cast<int>(blocks_.size()));
  if (mp_.last_stage) {
    lnf_group_ = layout_.add_group("ln_f");
    loss_ = std::make_unique<CrossEntropyLoss>(cfg_.vocab_size, local_vocab_, vocab_parallel());
    ln_f_ = Norm(layout_, "ln_f", cfg_, lnf_group_, tp);
    // A tied output head multiplies by the token embedding. A last stage
    // without the embedding keeps its own copy, which starts equal (same
    // name, same init) and stays equal because the copies' gradients are
    // summed. An untied head has a table of its own.
    if (!cfg_.tied_embeddings) {
      head_group_ = layout_.add_group("head");
      head_table_ = Embedding::add_token_table(layout_, cfg_.vocab_size, cfg_.n_embd, head_group_, tp,
                                               Embedding::TableCopies::none, "lm_head.weight");
    } else if (!mp_.first_stage) {
      head_group_ = layout_.add_group("head");
      head_table_ = Embedding::add_token_table(layout_, cfg_.vocab_size, cfg_.n_embd, head_group_, tp,
                                               Embedding::TableCopies::copy);
    }
    layout_.set_output_table(head_table());
    if (tp.grid) grid_head_ = GridLinear(head_table(), layout_, cfg_.n_embd, tp);
  }
  if (mp_.first_stage && mp_.last_stage && tp.size() == 1 && mp_.chunks.empty())
    LOOM_CHECK(layout_.numel() == cfg_.num_params(), "layout has ", layout_.numel(), " parameters, formula says ",
               cfg_.num_params());
}

void GPT::check_tensor_parallel() const {
  const TensorParallel& tp = mp_.tp;
  const int64_t nkv = cfg_.kv_heads();
  if (cfg_.n_head % tp.size() != 0)
    throw Error(str("model.n_head = ", cfg_.n_head, " heads do not split over ", tp.size(),
                    " tensor-parallel ranks: choose a tensor-parallel size that divides the head count"));
  if (nkv % tp.size() != 0 && tp.size() % nkv != 0)
    throw Error(str("model.n_kv_head = ", nkv, " kv heads neither split over nor are shared evenly by ", tp.size(),
                    " tensor-parallel ranks: choose parallel.tp dividing or divisible by n_kv_head"));
  if (cfg_.intermediate() % tp.size() != 0)
    throw Error(str("model.intermediate_size = ", cfg_.intermediate(), " does not split over ", tp.size(),
                    " tensor-parallel ranks: choose a tensor-parallel size that divides it"));
}

void GPT::check_grid() const {
  const TensorGrid& grid = *mp_.tp.grid;
  const int64_t q = grid.q;
  const auto require = [&](const char* key, int64_t value, int64_t parts) {
    if (value % parts != 0)
      throw Error(str(key, " = ", value, " does not split into the ", parts, " parts a ", q, "-sided ",
                      grid.cube ? "cube" : "grid", " cuts it in: choose a grid side q (parallel.tp = ",
                      grid.cube ? "q^3" : "q^2 * parallel.tp_depth", ") with ", parts == q ? "q" : "q^2",
                      " dividing it"));
  };
  require("model.n_embd", cfg_.n_embd, q);
  require("model.n_head", cfg_.n_head, q);
  require("model.n_kv_head", cfg_.kv_heads(), q);
  require("model.intermediate_size", cfg_.intermediate(), q);
  if (grid.cube) {
    // A cube cuts a layer's output rows into q^2 parts, and the heads' rows
    // must not fall into padding.
    require("model.n_embd", cfg_.n_embd, q * q);
    require("model.n_head * head_dim", cfg_.q_dim(), q * q);
    require("model.n_kv_head * head_dim", cfg_.kv_heads() * cfg_.head_dim(), q * q);
    require("model.intermediate_size", cfg_.intermediate(), q * q);
  }
  if (cfg_.lora.enabled())
    throw Error(str("lora.r = ", cfg_.lora.r, " with parallel.tp_mode = 2d/2.5d/3d: LoRA adapters run under 1D tensor ",
                    "parallelism only; use parallel.tp_mode = \"1d\""));
}

TensorParallel GPT::vocab_parallel() const {
  // The logits' vocabulary is split over the tp group (1D), or over the
  // grid's axis that splits the features inside a block, among the ranks
  // that share a token row there.
  if (!mp_.tp.grid) return mp_.tp;
  TensorParallel tp;
  tp.group = &mp_.tp.grid->group_over(mp_.tp.grid->inner_feature_axis());
  return tp;
}

void GPT::distill(Distillation d) {
  if (mp_.tp.grid)
    throw Error("distillation with parallel.tp_mode = 2d/2.5d/3d is not supported: use parallel.tp_mode = \"1d\"");
  loss_ = std::make_unique<DistillationLoss>(cfg_.vocab_size, local_vocab_, mp_.tp, d);
}

int GPT::block_group(int layer) const {
  for (const Block& b : blocks_)
    if (b.index() == layer) return b.group();
  return -1;
}

void GPT::begin(MicroBatchState& s, const int32_t* tokens, const int32_t* targets, const BatchShape& bs,
                const ForwardOptions& opts, const Tensor& loss_sum) const {
  const int64_t N = bs.N(), V = cfg_.vocab_size;
  for (int64_t i = 0; i < N; ++i) {
    if (targets[i] < -1 || targets[i] >= V)
      throw Error(str("target id ", targets[i], " at position ", i, " is outside the vocabulary [0, ", V,
                      ") (and is not -1, the ignore index)"));
  }
  if (mp_.tp.splits_tokens() && N % mp_.tp.size() != 0)
    throw Error(str("sequence parallelism splits the micro-batch's ", N, " token rows over ", mp_.tp.size(),
                    " ranks: choose micro_batch_size * seq_len divisible by parallel.tp"));
  if (mp_.tp.grid && bs.B % mp_.tp.token_parts() != 0)
    throw Error(str("a ", mp_.tp.grid->q, " x ", mp_.tp.grid->q, " x ", mp_.tp.grid->depth,
                    " tensor-parallel grid splits each micro-batch's sequences over ", mp_.tp.token_parts(),
                    " row groups, and the micro-batch has ", bs.B,
                    ": choose train.micro_batch_size divisible by q * parallel.tp_depth"));
  if (mp_.first_stage) embedding_.check_tokens(tokens, N);
  s = MicroBatchState{};
  s.bs = bs;
  s.opts = opts;
  // The kernels read the ids from the device; the host keeps only the count.
  if (mp_.first_stage) s.tokens = Tensor::from_host(tokens, {N}, DType::i32);
  if (mp_.last_stage) {
    // This rank's token rows' targets (a grid splits the head's rows as the
    // insides of a block).
    const TensorGrid* grid = mp_.tp.grid;
    const int64_t rows = grid ? mp_.tp.local_rows(N) : N;
    s.targets = Tensor::from_host(targets + (grid ? grid->inner_token_index() * rows : 0), {rows}, DType::i32);
    s.valid_targets = std::count_if(targets, targets + N, [](int32_t t) { return t != -1; });
    s.loss_sum = loss_sum.defined() ? loss_sum : Tensor::zeros({loss_->terms()}, DType::f64);
  }
  s.blocks.resize(blocks_.size());
}

Tensor GPT::forward_chunk(ParamStore& ps, MicroBatchState& s, int chunk, const Tensor& input) const {
  LOOM_CHECK(chunk >= 0 && chunk < num_chunks(), "chunk ", chunk, " of ", num_chunks());
  const int64_t N = s.bs.N(), C = cfg_.n_embd;
  Tensor x = input;
  if (chunk == 0 && mp_.first_stage) {
    TraceScope trace(TraceCategory::compute, layout_.group_name(embedding_group_), " forward");
    ps.acquire(embedding_group_);
    x = embedding_.forward(ps, s.tokens, s.bs);
    ps.release(embedding_group_);
    if (s.opts.training && cfg_.dropout > 0.0f)
      ops::dropout_forward(x.data<float>(), x.data<float>(), mp_.tp.local_rows(N), mp_.tp.local_width(C), C,
                           cfg_.dropout, stream_key(s.opts.dropout_key, kEmbeddingDropoutLayer, 0),
                           mp_.tp.first_element(s.opts.first_sequence * s.bs.T, N, C));
  }
  LOOM_CHECK(x.defined() && x.numel() == mp_.tp.local_rows(N) * mp_.tp.local_width(C), "chunk ", chunk,
             " needs its input activations");
  for (int b = chunk_first_block_[static_cast<size_t>(chunk)]; b < chunk_first_block_[static_cast<size_t>(chunk) + 1];
       ++b) {
    const Block& block = blocks_[static_cast<size_t>(b)];
    TraceScope trace(TraceCategory::compute, layout_.group_name(block.group()), " forward");
    ps.acquire(block.group());
    x = block.forward(ps, s.blocks[static_cast<size_t>(b)], x, s.bs, s.opts);
    ps.release(block.group());
  }
  if (chunk + 1 == num_chunks() && mp_.last_stage) {
    head_forward(ps, s, x);
    return Tensor();
  }
  return x;
}

void GPT::head_logits(const ParamStore& ps, float* logits, const float* h, int64_t N, int64_t V) const {
  if (const QuantizedWeight* q = ps.quantized(head_table()))
    quantized_linear_forward(logits, V, h, *q, 0, V, nullptr, N);
  else
    ops::linear_forward(logits, h, ps.param(head_table()).data<float>(), nullptr, N, cfg_.n_embd, V);
}

void GPT::head_forward(ParamStore& ps, MicroBatchState& s, const Tensor& x) const {
  const TensorParallel& tp = mp_.tp;
  const int64_t N = s.bs.N(), V = cfg_.vocab_size, Vl = local_vocab_;
  TraceScope trace(TraceCategory::compute, kHeadModule, " forward");
  s.x_final = x;
  ps.acquire(lnf_group_);
  ln_f_.forward(ps, s.ln_f, x.data<float>(), tp.local_rows(N));
  ps.release(lnf_group_);

  // logits = ln_f(x) wte^T over this rank's vocabulary rows, for every token
  // (on a grid: for its token rows, by SUMMA).
  ps.acquire(head_group());
  if (tp.grid) {
    s.logits = grid_head_.forward(ps, s.ln_f.out);
    ps.release(head_group());
    loss_->forward(s.loss, s.logits, s.targets, s.opts.teacher_logits, s.loss_sum, s.opts.dloss);
    return;
  }
  const Tensor h = TensorParallelRegion::enter_forward(tp, s.ln_f.out);
  if (tp.splits_tokens()) s.head_input = h;
  s.logits = tp.size() == 1 ? Tensor::empty({s.bs.B, s.bs.T, V}) : Tensor::empty({N, Vl});
  head_logits(ps, s.logits.data<float>(), h.data<float>(), N, Vl);
  ps.release(head_group());

  loss_->forward(s.loss, s.logits, s.targets, s.opts.teacher_logits, s.loss_sum, s.opts.dloss);
}

Tensor GPT::head_backward(ParamStore& ps, GradStore& gs, MicroBatchState& s, float dloss) const {
  LOOM_CHECK(s.logits.defined(), "head backward without a preceding forward");
  TraceScope trace(TraceCategory::compute, kHeadModule, " backward");
  const TensorParallel& tp = mp_.tp;
  const int64_t N = s.bs.N(), C = cfg_.n_embd, Vl = local_vocab_;
  const Grads g{ps, gs};

  LOOM_CHECK(!s.opts.dloss || *s.opts.dloss == dloss, "backward with dloss ", dloss, " after a forward that used ",
             s.opts.dloss.value_or(0.0f));
  loss_->backward(s.loss, s.logits, s.targets, s.opts.teacher_logits, dloss);
  s.opts.teacher_logits = Tensor();
  const float* dlogits = s.logits.data<float>();

  ps.acquire(head_group());
  ps.acquire(lnf_group_);
  Tensor dh;
  if (tp.grid) {
    dh = grid_head_.backward(g, s.logits, s.ln_f.out);
  } else {
    const Tensor& h = tp.splits_tokens() ? s.head_input : s.ln_f.out;
    dh = Tensor::empty({N, C});
    ops::linear_backward(dh.data<float>(), gs.grad(head_table()).data<float>(), nullptr, dlogits, h.data<float>(),
                         ps.param(head_table()).data<float>(), N, C, Vl, ops::GradWrite::overwrite);
  }
  s.logits = Tensor();
  s.loss = Loss::Saved{};
  s.head_input = Tensor();
  if (!tp.grid) dh = TensorParallelRegion::enter_backward(tp, dh);
  Tensor dres = Tensor::empty(s.x_final.shape());
  ln_f_.backward(g, dres.data<float>(), dh.data<float>(), s.x_final.data<float>(), s.ln_f, tp.local_rows(N),
                 /*accumulate=*/false);
  dh = Tensor();
  s.ln_f = Norm::Saved{};
  s.x_final = Tensor();
  ps.release(lnf_group_);
  gs.group_ready(lnf_group_);
  ps.release(head_group());
  if (head_group_ >= 0) gs.group_ready(head_group_);
  return dres;
}

Tensor GPT::backward_chunk(ParamStore& ps, GradStore& gs, MicroBatchState& s, int chunk, const Tensor& grad_output,
                           float dloss) const {
  LOOM_CHECK(chunk >= 0 && chunk < num_chunks(), "chunk ", chunk, " of ", num_chunks());
  const int64_t N = s.bs.N(), C = cfg_.n_embd;
  const Grads g{ps, gs};
  Tensor dres = chunk + 1 == num_chunks() && mp_.last_stage ? head_backward(ps, gs, s, dloss) : grad_output;
  LOOM_CHECK(dres.defined() && dres.numel() == mp_.tp.local_rows(N) * mp_.tp.local_width(C), "chunk ", chunk,
             " needs the gradient of its output");
  for (int b = chunk_first_block_[static_cast<size_t>(chunk) + 1]; b-- > chunk_first_block_[static_cast<size_t>(chunk)];) {
    const Block& block = blocks_[static_cast<size_t>(b)];
    TraceScope trace(TraceCategory::compute, layout_.group_name(block.group()), " backward");
    ps.acquire(block.group());
    block.backward(g, dres.data<float>(), s.blocks[static_cast<size_t>(b)], s.bs, s.opts);
    ps.release(block.group());
    gs.group_ready(block.group());
  }
  if (chunk != 0 || !mp_.first_stage) return dres;

  // The lookup's backward scatters into the gradients without reading the
  // table, so the embedding is not acquired again (under ZeRO-3 that saves
  // a third all-gather of the largest group).
  TraceScope trace(TraceCategory::compute, layout_.group_name(embedding_group_), " backward");
  Tensor demb = dres;
  if (s.opts.training && cfg_.dropout > 0.0f) {
    demb = Tensor::empty(dres.shape());
    ops::dropout_backward(demb.data<float>(), dres.data<float>(), mp_.tp.local_rows(N), mp_.tp.local_width(C), C,
                          cfg_.dropout, stream_key(s.opts.dropout_key, kEmbeddingDropoutLayer, 0),
                          mp_.tp.first_element(s.opts.first_sequence * s.bs.T, N, C), ops::GradWrite::overwrite);
  }
  embedding_.backward(g, demb, s.tokens, s.bs);
  gs.group_ready(embedding_group_);
  return Tensor();
}

void GPT::forward(ParamStore& ps, MicroBatchState& s, const int32_t* tokens, const int32_t* targets,
                  const BatchShape& bs, const ForwardOptions& opts, const Tensor& loss_sum) const {
  LOOM_CHECK(mp_.first_stage && mp_.last_stage, "GPT::forward runs the whole pipeline: use forward_chunk per stage");
  begin(s, tokens, targets, bs, opts, loss_sum);
  Tensor x;
  for (int c = 0; c < num_chunks(); ++c) x = forward_chunk(ps, s, c, x);
}

void GPT::backward(ParamStore& ps, GradStore& gs, MicroBatchState& s, float dloss) const {
  LOOM_CHECK(s.logits.defined(), "backward without a preceding forward");
  Tensor d;
  for (int c = num_chunks(); c-- > 0;) d = backward_chunk(ps, gs, s, c, d, dloss);
}

double MicroBatchState::host_loss_sum() const {
  return loss_sum.defined() ? loss_sum.clone(Tier::host).data<double>()[0] : 0.0;
}

}  // namespace loom
