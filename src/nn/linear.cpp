#include <cmath>

#include "loom/device.h"
#include "loom/nn.h"
#include "loom/quant.h"
#include "nn/stacked_rows.h"

namespace loom {

using nn_detail::stack_rows;
using nn_detail::unstack_rows;

namespace {
thread_local const LinearInputHook* t_linear_input_hook = nullptr;
}  // namespace

ScopedLinearInputHook::ScopedLinearInputHook(LinearInputHook hook)
    : hook_(std::move(hook)), previous_(t_linear_input_hook) {
  t_linear_input_hook = &hook_;
}

ScopedLinearInputHook::~ScopedLinearInputHook() { t_linear_input_hook = previous_; }

Linear::Linear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out, int group, float init_std,
               const ParamParallel& weight, const ParamParallel& bias, bool has_bias, const LoRAConfig& lora)
    : Linear(layout, {LinearPart{name, out, weight, bias, 0, 0, lora}}, in, group, init_std, has_bias) {}

Linear::Linear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in, int group, float init_std,
               bool has_bias)
    : has_bias_(has_bias) {
  for (const LinearPart& p : parts) {
    Part part;
    part.weight = layout.add(p.name + ".weight", {p.out, in}, ParamInit::normal_(init_std), true, group, p.weight);
    layout.set_linear_weight(part.weight);
    if (has_bias)
      part.bias = layout.add(p.name + ".bias", {p.out}, ParamInit::constant(0.0f), false, group, p.bias);
    const int64_t local_rows = layout.param(part.weight).shape[0];
    part.first_row = p.first_row;
    part.rows = p.rows > 0 ? p.rows : local_rows;
    LOOM_CHECK(part.first_row >= 0 && part.first_row + part.rows <= local_rows, "rows [", part.first_row, ", ",
               part.first_row + part.rows, ") of ", p.name, "'s ", local_rows);
    out_ += part.rows;
    in_ = layout.param(part.weight).shape[1];
    if (p.lora.enabled()) add_adapter(layout, p, part, group);
    parts_.push_back(part);
  }
}

void Linear::add_adapter(ParamLayout& layout, const LinearPart& p, Part& part, int group) {
  // Under tensor parallelism the factor on the split side of W is split
  // with it and the other is replicated, its gradient a partial sum over the
  // ranks. Column-parallel (W split by output rows): B by rows like W, A
  // whole, dA = dh^T x summed over the ranks' dh. Row-parallel (W split by
  // input columns): A by columns, B whole; each rank's x_r A_r^T B^T is added
  // into its partial output, which the layer already sums, and dB = dy^T h_r
  // is summed likewise. A replicated W whose gradient is a partial sum (k and
  // v over more ranks than kv heads) has both factors replicated and partial.
  const TpAxes split = p.weight.split.parts > 1 ? p.weight.split_axes : TpAxes{0};
  ParamParallel a, b;
  a.partial_grad = b.partial_grad = p.weight.partial_grad;
  if (p.weight.split.dim == 0) {
    b.split = p.weight.split;
    b.split_axes = split;
    a.partial_grad |= split;
  } else {
    a.split = p.weight.split;
    a.split_axes = split;
    b.partial_grad |= split;
  }
  layout.set_trainable(part.weight, false);
  if (part.bias >= 0) layout.set_trainable(part.bias, false);
  part.rank = p.lora.r;
  part.scale = p.lora.alpha / static_cast<float>(p.lora.r);
  // PEFT's kaiming_uniform_(a = sqrt(5)) over fan_in = in: a bound of
  // sqrt(6 / ((1 + a^2) in)) = 1 / sqrt(in). B starts at zero.
  const int64_t in = layout.param(part.weight).global_shape[1];
  part.lora_a = layout.add(p.name + ".lora_A.weight", {p.lora.r, in},
                           ParamInit::uniform(1.0f / std::sqrt(static_cast<float>(in))), true, group, a);
  part.lora_b = layout.add(p.name + ".lora_B.weight", {p.out, p.lora.r}, ParamInit::constant(0.0f), true, group, b);
  layout.set_trainable(part.lora_a, true);
  layout.set_trainable(part.lora_b, true);
  // The mask is indexed by the global input element, whatever this rank
  // holds of it: a row-parallel rank's columns are one contiguous range of
  // each row.
  LOOM_CHECK(p.weight.split.dim == 0 || p.weight.split.blocks == 1, p.name,
             "'s input columns are split in blocks: no one column range per rank for its adapter's dropout");
  part.dropout = p.lora.dropout;
  part.dropout_stream = stream_key(0, layout.param(part.lora_a).name);
  part.in_stride = in;
  part.first_col = p.weight.split.dim == 1 ? p.weight.split.index * layout.param(part.weight).shape[1] : 0;
}

int Linear::weight_id() const {
  LOOM_CHECK(parts_.size() == 1, "a linear layer of ", parts_.size(), " parts has no single weight");
  return parts_[0].weight;
}

int Linear::bias_id() const {
  LOOM_CHECK(parts_.size() == 1 && has_bias_, "a linear layer of ", parts_.size(), " parts has no single bias");
  return parts_[0].bias;
}

int Linear::lora_a_id() const {
  LOOM_CHECK(parts_.size() == 1, "a linear layer of ", parts_.size(), " parts has no single adapter");
  return parts_[0].lora_a;
}

int Linear::lora_b_id() const {
  LOOM_CHECK(parts_.size() == 1, "a linear layer of ", parts_.size(), " parts has no single adapter");
  return parts_[0].lora_b;
}

namespace {

// Rows [first, first + rows) of a [*, cols] tensor, in place.
Tensor row_slice(const Tensor& t, int64_t first, int64_t rows, int64_t cols) {
  if (first == 0 && rows * cols == t.numel()) return t;
  return Tensor::borrow(t.data<float>() + first * cols, {rows, cols}, DType::f32, Tier::device);
}

}  // namespace

std::vector<Tensor> Linear::pieces(const ParamStore& ps, bool bias) const {
  std::vector<Tensor> out;
  for (const Part& p : parts_)
    out.push_back(row_slice(ps.param(bias ? p.bias : p.weight), p.first_row, p.rows, bias ? 1 : in_));
  return out;
}

std::vector<Tensor> Linear::grad_pieces(const GradStore& gs, bool bias) const {
  std::vector<Tensor> out;
  bool any = false;
  for (const Part& p : parts_) {
    const Tensor g = gs.grad(bias ? p.bias : p.weight);
    any = any || g.defined();
    // A frozen part has no gradient (FrozenGradStore): its rows of a stacked
    // gradient go to scratch.
    out.push_back(g.defined() ? row_slice(g, p.first_row, p.rows, bias ? 1 : in_)
                              : Tensor::zeros({p.rows, bias ? 1 : in_}));
  }
  // No part trains: no gradient at all.
  if (!any) out.clear();
  return out;
}

void Linear::forward(const ParamStore& ps, float* out, const float* in, int64_t N, bool bias,
                     const AdapterDropout& drop) const {
  if (t_linear_input_hook) {
    std::vector<int> weights;
    for (const Part& p : parts_) weights.push_back(p.weight);
    (*t_linear_input_hook)(weights, in, N, in_);
  }
  const bool with_bias = bias && has_bias_;
  if (ps.quantized(parts_[0].weight) != nullptr) {
    // Quantized weights (what the store holds): each part's kernel writes
    // its band of the stacked output's columns.
    int64_t first_out = 0;
    for (const Part& p : parts_) {
      const QuantizedWeight* q = ps.quantized(p.weight);
      LOOM_CHECK(q != nullptr, "a linear layer with some parts quantized and some not");
      const Tensor b = with_bias ? ps.param(p.bias) : Tensor();
      quantized_linear_forward(out + first_out, out_, in, *q, p.first_row, p.rows,
                               b.defined() ? b.data<float>() + p.first_row : nullptr, N);
      first_out += p.rows;
    }
  } else {
    const Tensor w = stack_rows(pieces(ps, false), out_, in_);
    const Tensor b = with_bias ? stack_rows(pieces(ps, true), out_, 1) : Tensor();
    ops::linear_forward(out, in, w.data<float>(), b.defined() ? b.data<float>() : nullptr, N, in_, out_);
  }
  lora_forward(ps, out, in, N, drop);
}

void Linear::backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N, bool bias,
                      const AdapterDropout& drop) const {
  const Tensor w = stack_rows(pieces(g.params, false), out_, in_);
  const bool with_bias = bias && has_bias_;
  // Several parts' gradients are stacked, accumulated into by one GEMM and
  // copied back: the same sums as accumulating into each part in place.
  const std::vector<Tensor> dws = grad_pieces(g.grads, false);
  const std::vector<Tensor> dbs = with_bias ? grad_pieces(g.grads, true) : std::vector<Tensor>{};
  Tensor dw = dws.empty() ? Tensor() : stack_rows(dws, out_, in_);
  Tensor db = dbs.empty() ? Tensor() : stack_rows(dbs, out_, 1);
  ops::linear_backward(din, dw.defined() ? dw.data<float>() : nullptr, db.defined() ? db.data<float>() : nullptr,
                       dout, in, w.data<float>(), N, in_, out_, ops::GradWrite::overwrite);
  if (dw.defined()) unstack_rows(dw, dws);
  if (db.defined()) unstack_rows(db, dbs);
  lora_backward(g, din, dout, in, N, drop);
}

// The stream of a part's adapter-input mask in this micro-batch, and the
// global index of this rank's first input element.
uint64_t Linear::Part::mask_key(const AdapterDropout& drop) const { return stream_key(drop.key, dropout_stream, 0); }

uint64_t Linear::Part::mask_first(const AdapterDropout& drop) const {
  return static_cast<uint64_t>(drop.first_row * in_stride + first_col);
}

Tensor Linear::adapter_input(const Part& p, const float* in, int64_t N, const AdapterDropout& drop) const {
  if (!drop.training || p.dropout == 0.0f) return Tensor();
  Tensor x = Tensor::empty({N, in_});
  ops::dropout_forward(x.data<float>(), in, N, in_, p.in_stride, p.dropout, p.mask_key(drop), p.mask_first(drop));
  return x;
}

// A part's adapter works on the part's band of the stacked output's columns
// (first_out, p.rows wide, out_ apart) in place, through GEMMs with leading
// dimensions: no zero-padded B, no [N, out] delta to add back.
void Linear::lora_forward(const ParamStore& ps, float* out, const float* in, int64_t N,
                          const AdapterDropout& drop) const {
  int64_t first_out = 0;
  for (const Part& p : parts_) {
    if (p.lora_a >= 0) {
      // h = drop(in) A^T (r columns, small), then out += scale h B^T.
      Tensor h = Tensor::empty({N, p.rank});
      {
        const Tensor dropped = adapter_input(p, in, N, drop);
        ops::gemm(false, true, N, p.rank, in_, 1.0f, dropped.defined() ? dropped.data<float>() : in, in_,
                  ps.param(p.lora_a).data<float>(), in_, 0.0f, h.data<float>(), p.rank);
      }
      const Tensor b = row_slice(ps.param(p.lora_b), p.first_row, p.rows, p.rank);
      ops::gemm(false, true, N, p.rows, p.rank, p.scale, h.data<float>(), p.rank, b.data<float>(), p.rank, 1.0f,
                out + first_out, out_);
    }
    first_out += p.rows;
  }
}

void Linear::lora_backward(const Grads& g, float* din, const float* dout, const float* in, int64_t N,
                           const AdapterDropout& drop) const {
  int64_t first_out = 0;
  for (const Part& p : parts_) {
    if (p.lora_a >= 0) {
      // h is recomputed rather than kept: N x r, a small fraction of the
      // layer; so is the dropped input, drawn again from its mask.
      const Tensor dropped = adapter_input(p, in, N, drop);
      const float* x = dropped.defined() ? dropped.data<float>() : in;
      const float* a = g.params.param(p.lora_a).data<float>();
      Tensor h = Tensor::empty({N, p.rank});
      ops::gemm(false, true, N, p.rank, in_, 1.0f, x, in_, a, in_, 0.0f, h.data<float>(), p.rank);
      // Over the part's band of dout: dB += scale dout^T h; dh = scale dout B;
      // then dA += dh^T drop(in) and din += drop's backward of dh A.
      const float* dband = dout + first_out;
      const Tensor b = row_slice(g.params.param(p.lora_b), p.first_row, p.rows, p.rank);
      const Tensor db = row_slice(g.grads.grad(p.lora_b), p.first_row, p.rows, p.rank);
      ops::gemm(true, false, p.rows, p.rank, N, p.scale, dband, out_, h.data<float>(), p.rank, 1.0f, db.data<float>(),
                p.rank);
      h = Tensor();
      Tensor dh = Tensor::empty({N, p.rank});
      ops::gemm(false, false, N, p.rank, p.rows, p.scale, dband, out_, b.data<float>(), p.rank, 0.0f,
                dh.data<float>(), p.rank);
      ops::gemm(true, false, p.rank, in_, N, 1.0f, dh.data<float>(), p.rank, x, in_, 1.0f,
                g.grads.grad(p.lora_a).data<float>(), in_);
      if (din && !dropped.defined()) {
        ops::gemm(false, false, N, in_, p.rank, 1.0f, dh.data<float>(), p.rank, a, in_, 1.0f, din, in_);
      } else if (din) {
        Tensor dx = Tensor::empty({N, in_});
        ops::gemm(false, false, N, in_, p.rank, 1.0f, dh.data<float>(), p.rank, a, in_, 0.0f, dx.data<float>(), in_);
        ops::dropout_backward(din, dx.data<float>(), N, in_, p.in_stride, p.dropout, p.mask_key(drop),
                              p.mask_first(drop), ops::GradWrite::accumulate);
      }
    }
    first_out += p.rows;
  }
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                           int group, float init_std, const TensorParallel& tp, int64_t blocks,
                                           const LoRAConfig& lora)
    : tp_(tp) {
  const ParamParallel split = tp.cut(0, blocks);
  linear_ = Linear(layout, name, in, out, group, init_std, split, split, true, lora);
}

ColumnParallelLinear::ColumnParallelLinear(ParamLayout& layout, const std::vector<LinearPart>& parts, int64_t in,
                                           int group, float init_std, const TensorParallel& tp, bool has_bias)
    : tp_(tp), linear_(layout, parts, in, group, init_std, has_bias) {}

Tensor ColumnParallelLinear::forward(const ParamStore& ps, const Tensor& x, const AdapterDropout& drop) const {
  const Tensor full = TensorParallelRegion::enter_forward(tp_, x);
  const int64_t N = full.numel() / linear_.in_features();
  Tensor y = Tensor::empty({N, linear_.out_features()});
  linear_.forward(ps, y.data<float>(), full.data<float>(), N, true, drop);
  return y;
}

Tensor ColumnParallelLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x,
                                      const AdapterDropout& drop) const {
  // Under sequence parallelism the gathered input was not kept: gather it
  // again (Korthikanti et al.), trading an all-gather for [N, in] of memory.
  const Tensor full = TensorParallelRegion::enter_forward(tp_, x);
  const int64_t N = full.numel() / linear_.in_features();
  Tensor dx = Tensor::empty({N, linear_.in_features()});
  linear_.backward(g, dx.data<float>(), dy.data<float>(), full.data<float>(), N, true, drop);
  return TensorParallelRegion::enter_backward(tp_, dx);
}

RowParallelLinear::RowParallelLinear(ParamLayout& layout, const std::string& name, int64_t in, int64_t out,
                                     int group, float init_std, const TensorParallel& tp, bool has_bias,
                                     const LoRAConfig& lora)
    : tp_(tp) {
  const ParamParallel weight = tp.cut(1);
  ParamParallel bias;
  bias.partial_grad = tp.splits_tokens() ? kTpAll : 0;
  linear_ = Linear(layout, name, in, out, group, init_std, weight, bias, has_bias, lora);
}

Tensor RowParallelLinear::forward(const ParamStore& ps, const Tensor& x, const AdapterDropout& drop) const {
  const int64_t N = x.numel() / linear_.in_features();
  const bool split = tp_.size() > 1;
  Tensor partial = Tensor::empty({N, linear_.out_features()});
  // Without tensor parallelism this is a plain linear layer, bias included,
  // which keeps the single-rank path the reference's exact arithmetic.
  linear_.forward(ps, partial.data<float>(), x.data<float>(), N, !split, drop);
  if (!split) return partial;
  Tensor y = TensorParallelRegion::leave_forward(tp_, partial);
  partial = Tensor();
  if (linear_.has_bias())
    ops::add_bias(y.data<float>(), ps.param(linear_.bias_id()).data<float>(), y.numel() / linear_.out_features(),
                  linear_.out_features());
  return y;
}

Tensor RowParallelLinear::backward(const Grads& g, const Tensor& dy, const Tensor& x,
                                   const AdapterDropout& drop) const {
  const int64_t N = x.numel() / linear_.in_features();
  const bool split = tp_.size() > 1;
  if (split && linear_.has_bias())
    ops::linear_backward(nullptr, nullptr, g.grads.grad(linear_.bias_id()).data<float>(), dy.data<float>(), nullptr,
                         nullptr, dy.numel() / linear_.out_features(), linear_.in_features(), linear_.out_features());
  const Tensor full = TensorParallelRegion::leave_backward(tp_, dy);
  Tensor dx = Tensor::empty({N, linear_.in_features()});
  linear_.backward(g, dx.data<float>(), full.data<float>(), x.data<float>(), N, !split, drop);
  return dx;
}

}  // namespace loom
