// Continuous batching: the Generator's scheduling step.
#include <algorithm>
#include <iterator>
#include <numeric>

#include "loom/data.h"
#include "loom/comm.h"
#include "loom/inference.h"
#include "loom/planner.h"

namespace loom {

const char* finish_reason_name(FinishReason reason) { return reason == FinishReason::stop ? "stop" : "length"; }

Generator::Generator(const GPT& model, ParamStore& params, int64_t max_batch, const Tokenizer* tok,
                     Communicator* pipeline)
    : model_(model), params_(params), tok_(tok), pipeline_(pipeline), pool_(model, max_batch) {
  if (max_batch <= 0) throw Error(str("generation needs a batch of at least one sequence, not ", max_batch));
}

int64_t Generator::submit(GenerationRequest request) {
  if (request.max_tokens < 0)
    throw Error(str("max_tokens = ", request.max_tokens, " is negative: ask for 0 or more tokens"));
  if (!request.stop.empty() && !tok_) throw Error("stop strings need a tokenizer to decode the generated text");
  const int64_t V = model_.config().vocab_size;
  for (size_t i = 0; i < request.prompt.size(); ++i)
    if (request.prompt[i] < 0 || request.prompt[i] >= V)
      throw Error(str("prompt token ", i, " is ", request.prompt[i], ", outside the model's vocabulary [0, ", V,
                      "): the tokenizer does not match the model"));
  for (const std::string& stop : request.stop)
    if (stop.empty()) throw Error("a stop string is empty: every text contains it; remove it");
  std::lock_guard<std::mutex> lock(mutex_);
  Sequence s;
  s.id = next_id_++;
  s.request = std::move(request);
  waiting_.push_back(std::move(s));
  return waiting_.back().id;
}

std::optional<GenerationResult> Generator::take(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = results_.find(id);
  if (it == results_.end()) return std::nullopt;
  GenerationResult r = std::move(it->second);
  results_.erase(it);
  return r;
}

void Generator::cancel(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = std::find_if(waiting_.begin(), waiting_.end(), [&](const Sequence& s) { return s.id == id; });
  if (it != waiting_.end())
    waiting_.erase(it);
  else if (!results_.count(id))
    cancelled_.push_back(id);  // active, or taken already: step() tells them apart
}

void Generator::drop_cancelled() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ids.swap(cancelled_);
  }
  if (ids.empty()) return;
  std::vector<Sequence> still;
  for (Sequence& s : active_) {
    if (std::find(ids.begin(), ids.end(), s.id) != ids.end())
      pool_.release(s.slot);
    else
      still.push_back(std::move(s));
  }
  active_ = std::move(still);
}

void Generator::admit() {
  while (true) {
    Sequence s;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (waiting_.empty() || pool_.active() == pool_.capacity()) return;
      s = std::move(waiting_.front());
      waiting_.pop_front();
    }
    s.context = s.request.prompt;
    if (s.context.empty()) s.context.push_back(tok_ ? tok_->eos_id().value_or(0) : 0);
    if (s.request.max_tokens == 0) {
      finish(s, FinishReason::length);
      continue;
    }
    s.slot = pool_.allocate();
    s.pending = s.context;
    active_.push_back(std::move(s));
  }
}

void Generator::finish(Sequence& s, FinishReason reason) {
  s.result.finish = reason;
  if (s.request.on_text && s.emitted < s.result.text.size()) s.request.on_text(s.result.text.substr(s.emitted));
  if (s.slot >= 0) pool_.release(s.slot);
  s.slot = -1;
  std::lock_guard<std::mutex> lock(mutex_);
  results_[s.id] = std::move(s.result);
}

bool Generator::advance(Sequence& s, int32_t token) {
  const GenerationRequest& r = s.request;
  if (std::find(r.stop_tokens.begin(), r.stop_tokens.end(), token) != r.stop_tokens.end()) {
    finish(s, FinishReason::stop);
    return true;
  }
  s.result.tokens.push_back(token);
  if (r.on_token) r.on_token(token);
  s.context.push_back(token);
  s.pending.assign(1, token);
  if (tok_) {
    std::string& text = s.result.text;
    const size_t before = text.size();
    text += tok_->decode_piece(token);
    // A stop string that appears now ends within the new piece; the text
    // ends before the earliest.
    size_t cut = std::string::npos;
    for (const std::string& stop : r.stop)
      cut = std::min(cut, text.find(stop, before >= stop.size() ? before - stop.size() + 1 : 0));
    if (cut != std::string::npos) {
      text.resize(cut);
      finish(s, FinishReason::stop);
      return true;
    }
    size_t held = 0;
    for (const std::string& stop : r.stop) {
      // Hold back the longest tail that could begin this stop string.
      for (size_t n = std::min(stop.size() - 1, text.size()); n > held; --n)
        if (text.compare(text.size() - n, n, stop, 0, n) == 0) {
          held = n;
          break;
        }
    }
    if (r.on_text && text.size() - held > s.emitted) {
      r.on_text(text.substr(s.emitted, text.size() - held - s.emitted));
      s.emitted = text.size() - held;
    }
  }
  if (static_cast<int64_t>(s.result.tokens.size()) == r.max_tokens) {
    finish(s, FinishReason::length);
    return true;
  }
  return false;
}

bool Generator::step() {
  // Each decode step is progress for the watchdog of a launched rank (the
  // sample `loom train` prints at the end of a run).
  report_progress("sampling");
  drop_cancelled();
  admit();
  if (active_.empty()) return false;
  const int64_t block = model_.config().block_size, V = model_.config().vocab_size;
  std::vector<DecodeInput> batch;
  for (Sequence& s : active_) {
    if (pool_.length(s.slot) + static_cast<int64_t>(s.pending.size()) > block) {
      const size_t keep = std::min(static_cast<size_t>(block / 2), s.context.size());
      pool_.reset(s.slot);
      s.pending.assign(s.context.end() - static_cast<std::ptrdiff_t>(keep), s.context.end());
    }
    batch.push_back({s.slot, s.pending});
  }
  // A split vocabulary is not gathered when every sequence samples from at
  // most k candidates (greedy: one; top_k): the ranks merge their k best of
  // each row instead, from which the draws are sample_token's.
  int64_t k = 0;
  for (const Sequence& s : active_)
    k = s.request.sample.temperature <= 0.0f ? std::max<int64_t>(k, 1)
        : s.request.sample.top_k > 0         ? std::max(k, s.request.sample.top_k)
                                             : V;
  std::vector<int32_t> tokens;
  if (model_.parallel().tp.size() > 1 && k < V) {
    const std::vector<std::vector<TokenLogit>> top = model_.decode_top_k(params_, pool_, batch, k, pipeline_);
    for (size_t i = 0; i < active_.size(); ++i)
      tokens.push_back(sample_candidates(top[i], active_[i].request.sample, active_[i].result.tokens.size()));
  } else {
    const Tensor logits = model_.forward_decode(params_, pool_, batch, false, pipeline_).clone(Tier::host);
    for (size_t i = 0; i < active_.size(); ++i) {
      const Sequence& s = active_[i];
      const uint64_t draw = s.result.tokens.size();  // the sequence's own token index
      tokens.push_back(sample_token(logits.data<float>() + static_cast<int64_t>(i) * V, V, s.request.sample, draw));
    }
  }
  std::vector<Sequence> still;
  for (size_t i = 0; i < active_.size(); ++i)
    if (!advance(active_[i], tokens[i])) still.push_back(std::move(active_[i]));
  active_ = std::move(still);
  return true;
}

std::vector<GenerationResult> Generator::run(std::vector<GenerationRequest> requests) {
  std::vector<int64_t> ids;
  for (GenerationRequest& r : requests) ids.push_back(submit(std::move(r)));
  while (step()) {
  }
  std::vector<GenerationResult> results;
  for (int64_t id : ids) {
    std::optional<GenerationResult> r = take(id);
    LOOM_CHECK(r.has_value(), "request ", id, " did not finish");
    results.push_back(std::move(*r));
  }
  return results;
}

std::string generate(const GPT& model, ParamStore& params, const Tokenizer& tok, const std::string& prompt,
                     int64_t max_tokens, const SampleOptions& opts,
                     const std::function<void(const std::string&)>& on_text, Communicator* pipeline) {
  Generator gen(model, params, 1, &tok, pipeline);
  GenerationRequest r;
  r.prompt = tok.encode(prompt);
  r.max_tokens = max_tokens;
  r.sample = opts;
  r.on_text = on_text;
  return gen.run({std::move(r)}).front().text;
}

ModelParallel generation_parallel(DeviceMesh& mesh, const GPTConfig& cfg) {
  const int pp = mesh.size(MeshAxis::pp), stage = mesh.coord(MeshAxis::pp);
  const std::vector<int> layers = pipeline_stage_layers(cfg, cfg.block_size, pp, {});
  ModelParallel mp;
  mp.tp.group = &mesh.group(MeshAxis::tp);
  mp.first_stage = stage == 0;
  mp.last_stage = stage == pp - 1;
  const int first = std::accumulate(layers.begin(), layers.begin() + stage, 0);
  mp.chunks = {{first, first + layers[static_cast<size_t>(stage)]}};
  return mp;
}

}  // namespace loom
