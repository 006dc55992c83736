// loom inference: sampling, and batched generation with continuous batching.
//
// A Generator holds up to max_batch active sequences, each in its own slot of
// a KVCachePool (nn.h). Every step admits waiting requests into free slots
// (their prompts prefilled in the same packed forward as the others' next
// token), decodes one token for every active sequence, and retires the
// sequences that finished (a stop token, a stop string or max_tokens), whose
// slots the next waiting requests take. A sequence's tokens do not depend on
// what else is in the batch: its rows are computed alone by every kernel, and
// its draws are indexed by its own token count. A sequence that outgrows the
// model's context slides, as sampling always has: its cache restarts from the
// last block_size / 2 tokens of its context (a prompt longer than the context
// is cut to those before its prefill).
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "loom/nn.h"

namespace loom {

class Tokenizer;

// Sampling settings: temperature 0 is greedy; top_k 0 and top_p 1 are off.
struct SampleOptions {
  float temperature = 0.8f;
  int64_t top_k = 0;
  float top_p = 1.0f;
  uint64_t seed = 1337;
};
// Draws a token from one row of logits; the draw is a pure function of
// (seed, draw index), so a seeded generation is reproducible.
int32_t sample_token(const float* logits, int64_t V, const SampleOptions& opts, uint64_t draw);
// The same draw from a row's candidates as sample_token orders them
// (descending logit, the lower id first among equals), at least the top_k
// best (the whole row when top_k is 0): what a vocabulary split over ranks
// gathers instead of its logits (GPT::decode_top_k).
int32_t sample_candidates(std::span<const TokenLogit> sorted, const SampleOptions& opts, uint64_t draw);

enum class FinishReason { stop, length };
// "stop" or "length", as the results file spells them.
const char* finish_reason_name(FinishReason reason);

struct GenerationRequest {
  // Token ids; empty starts from the tokenizer's eos id (0 without one).
  std::vector<int32_t> prompt;
  int64_t max_tokens = 200;
  SampleOptions sample;
  // Generation stops when one of these is sampled (it is not kept).
  std::vector<int32_t> stop_tokens;
  // Generation stops when the text contains one of these; the text ends
  // before it. Needs the Generator's tokenizer.
  std::vector<std::string> stop;
  // Each piece of text as it is final (held back while it may begin a stop
  // string). Called on the thread that runs step().
  std::function<void(const std::string&)> on_text;
  // Each kept token as it is sampled (on the thread that runs step()).
  std::function<void(int32_t)> on_token;
};

struct GenerationResult {
  std::vector<int32_t> tokens;  // generated, without the prompt and a stop token
  std::string text;             // their text (with a tokenizer), cut before a stop string
  FinishReason finish = FinishReason::length;
};

class Generator {
 public:
  // max_batch: sequences decoded together, each with a KV cache slot of the
  // model's whole context. tok (may be null) decodes text for on_text, the
  // results and stop strings. The model is whole on this rank, or this
  // rank's part of it, split over a tensor-parallel group (ModelParallel::tp)
  // and over pipeline stages of one chunk each, `pipeline` their group (rank
  // = stage): then every rank runs its own Generator over its part, with the
  // same submissions and cancellations in the same order between the same
  // steps (step() called in step), and all
  // draw the same tokens (they sample from the same whole logits,
  // GPT::forward_decode).
  Generator(const GPT& model, ParamStore& params, int64_t max_batch, const Tokenizer* tok = nullptr,
            Communicator* pipeline = nullptr);

  // Queues a request and returns its id (0, 1, ... in submission order). May
  // be called from any thread. Throws Error for prompt tokens outside the
  // vocabulary, stop strings without a tokenizer or a negative max_tokens.
  int64_t submit(GenerationRequest request);
  // One step (call it from one thread, in a loop): admits waiting requests
  // into free slots, runs one forward over every active sequence and samples
  // one token for each. Returns false when there was nothing to do.
  bool step();
  // The result of a finished request, handed out once; may be called from
  // any thread.
  std::optional<GenerationResult> take(int64_t id);
  // Drops a request that has not finished (from any thread): a waiting one
  // at once, an active one at the start of the next step, which frees its KV
  // cache slot. It leaves no result (a finished one's result stays).
  void cancel(int64_t id);
  // Submits the requests, steps until all are done and returns their results
  // in order.
  std::vector<GenerationResult> run(std::vector<GenerationRequest> requests);

  int64_t active() const { return static_cast<int64_t>(active_.size()); }
  int64_t max_batch() const { return pool_.capacity(); }
  // The KV cache pool of the active sequences.
  const KVCachePool& pool() const { return pool_; }

 private:
  struct Sequence {
    int64_t id = 0;
    GenerationRequest request;
    int slot = -1;
    std::vector<int32_t> context;  // prompt and generated tokens
    std::vector<int32_t> pending;  // fed in the next forward
    GenerationResult result;
    size_t emitted = 0;  // bytes of result.text handed to on_text
  };
  void admit();
  // Retires the active sequences cancel() named.
  void drop_cancelled();
  // Adds a sampled token; returns whether the sequence is finished.
  bool advance(Sequence& s, int32_t token);
  void finish(Sequence& s, FinishReason reason);

  const GPT& model_;
  ParamStore& params_;
  const Tokenizer* tok_;
  Communicator* pipeline_;
  KVCachePool pool_;
  std::vector<Sequence> active_;
  std::mutex mutex_;  // guards waiting_, results_, cancelled_ and next_id_
  std::deque<Sequence> waiting_;
  std::vector<int64_t> cancelled_;  // active requests to drop
  std::map<int64_t, GenerationResult> results_;
  int64_t next_id_ = 0;
};

// Generates up to `max_tokens` tokens after `prompt` (never stopping early),
// calling on_text with each decoded piece as it is produced, through a
// Generator of one sequence. Returns the generated text (without the prompt).
// pipeline: as the Generator takes it.
std::string generate(const GPT& model, ParamStore& params, const Tokenizer& tok, const std::string& prompt,
                     int64_t max_tokens, const SampleOptions& opts,
                     const std::function<void(const std::string&)>& on_text = {}, Communicator* pipeline = nullptr);

// This rank's part of a model that generates split over `mesh`'s tp and pp
// axes (the others of size 1): its tensor-parallel group, and the layers of
// its pipeline stage, one chunk (pipeline_stage_layers' balance). The mesh's
// pp group is the Generator's pipeline.
ModelParallel generation_parallel(DeviceMesh& mesh, const GPTConfig& cfg);

// One prompt of a prompts file, with its generation settings.
struct PromptSpec {
  std::string prompt;
  int64_t max_tokens = 200;
  SampleOptions sample;
};
// Reads a prompts file: one prompt per line, or, when its first non-empty
// line starts with '{', one JSON object per line with "prompt" and optionally
// "max_tokens", "temperature", "top_p", "top_k", "seed" (the rest from
// `defaults`). Empty lines are skipped. Throws Error naming the file, the line
// and the field for a line that is not such an object.
std::vector<PromptSpec> read_prompts(const std::filesystem::path& path, const PromptSpec& defaults);
// One line of a results file (no newline): {"index", "prompt", "text",
// "tokens", "finish_reason"}.
std::string result_json_line(int64_t index, const std::string& prompt, const GenerationResult& result);

// `loom serve`: an HTTP server over one Generator (docs/inference.md).
// Handler threads submit requests and wait for, or stream, their text; one
// engine thread steps the Generator, so concurrent requests share batches.
// Endpoints: POST /v1/completions (OpenAI's completions API), GET /health,
// GET /metrics (Prometheus text).
struct ServeOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: a free port the OS chooses
  int64_t max_batch = 8;
  std::string model = "loom";  // the name responses echo when a request names none
};

struct ServerStats {
  int64_t in_flight = 0;         // requests waiting or being generated
  size_t kv_bytes_in_use = 0;    // the Generator's KV cache pool, after its last step
  int64_t tokens_generated = 0;  // all requests'
};

class Server {
 public:
  // Binds the address (throws Error when it cannot) and starts the engine
  // thread; the model and tokenizer must outlive the server.
  Server(const GPT& model, ParamStore& params, const Tokenizer& tok, ServeOptions opts);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const;
  // Serves until stop().
  void run();
  // Serves until stop() or SIGTERM/SIGINT, whose handlers it installs while
  // it runs.
  void run_until_signal();
  // Stops accepting, cancels the requests in flight (a stream ends, a
  // waiting request gets 503) and makes run() return. Any thread.
  void stop();
  ServerStats stats() const;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace loom
