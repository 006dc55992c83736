// Generation through loom's Generator and Server (issue 19's benchmark), with
// random weights (loom's init; no download), fp32, greedy, on OMP_NUM_THREADS
// threads, every figure beside a baseline measured in the same run:
//
// 1. Batch-1 decode of a GPT-2-medium-shaped model (24 layers, 16 heads,
//    width 1024, vocabulary 50257: 1.4 GB of weights, far past the caches)
//    through the Generator as `loom generate` builds it (a Generator of one
//    sequence over the model's ParamStore; the CLI also decodes each token's
//    text, left out here since the random model has no tokenizer of its
//    vocabulary), as a fraction of the memory-bandwidth bound: the weight
//    bytes one token reads / the memcpy bandwidth (512 MB copies, read +
//    write, best of 5). Target >= 0.7. Also against the read-only bandwidth
//    of a parallel sum: decode only reads, which can stream faster than a
//    copy, so the memcpy bound can be passed. Decode only: the Generator's
//    on_token stamps each token, and the rate runs from the first token
//    (which ends the prefill's step) to the last; best of --reps runs after
//    a warm-up.
// 2. The same decode in PyTorch on this CPU: bench/inference_torch.py
//    (transformers' GPT2LMHeadModel of the same shape, random weights, fp32,
//    `model.generate` greedy with its KV cache, the same prompt length, new
//    tokens and threads; decode only, stamped by a streamer) run with
//    $LOOM_BENCH_PYTHON (default python3), which needs torch and
//    transformers; without them the line says so and the rest runs.
//    Printed as loom's tokens/s / PyTorch's.
// 3. Throughput of the Generator's continuous batching with 1, 8, 32
//    sequences (--batches): that many requests submitted to a Generator of
//    that batch, stepped until all are done (prefill included), tokens/s and
//    its ratio to the first batch size's. Target >= 4x at 32. Best of --reps.
// 4. loom's Server in this process on a free loopback port, over a smaller
//    model (GPT-2-small-shaped layers with the test tokenizer's vocabulary,
//    tests/fixtures/tokenizer/gpt2), under a load of --clients concurrent
//    clients, the load generator being this program's own cpp-httplib client
//    threads: each sends --requests completions one after another, every
//    other one streamed (`"stream": true`). Prints requests/s against the
//    same requests run through a Generator of the server's batch in-process,
//    p50/p99 time to first token (from sending the request to the first SSE
//    chunk with text) and p50/p99 inter-token latency (between consecutive
//    SSE chunks with text: a chunk holds one token unless the engine got
//    ahead of the client), each also as a ratio to a batch-1 decode step of
//    the same model. With more clients than --server-batch, requests wait for
//    a slot, and their time to first token includes the wait.
//
//   inference_bench [--layers 24] [--heads 16] [--width 1024] [--vocab 50257] [--context 256]
//                   [--prompt 8] [--tokens 64] [--reps 3] [--batches 1,8,32]
//                   [--server-layers 12] [--server-heads 12] [--server-width 768] [--server-batch 8]
//                   [--clients 8] [--requests 4] [--server-tokens 32]
//   e.g. OMP_NUM_THREADS=2 LOOM_BENCH_PYTHON=/path/to/venv/bin/python build/bench/inference_bench
//        build/bench/inference_bench --layers 4 --width 256 --heads 4 --vocab 4096 --tokens 16 --reps 1
//            --batches 1,4 --server-layers 2 --server-width 128 --server-heads 2 --clients 4
//            (a quick check; the bandwidth bound means little for a model inside the caches)
//
// Defaults take a few minutes on 2 cores. On a machine whose cores are
// shared, figures move from run to run: the load generator's threads also
// share the server's cores.
#include <httplib.h>

#include <cstdio>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_common.h"
#include "loom/data.h"
#include "loom/inference.h"

using namespace loom;

namespace {

struct Options {
  int64_t layers = 24, heads = 16, width = 1024, vocab = 50257, context = 256;
  int64_t prompt = 8, tokens = 64, reps = 3;
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t server_layers = 12, server_heads = 12, server_width = 768, server_batch = 8;
  int64_t clients = 8, requests = 4, server_tokens = 32;
};

Options parse_options(int argc, char** argv) {
  Options o;
  std::map<std::string, int64_t*> flags = {
      {"--layers", &o.layers},
      {"--heads", &o.heads},
      {"--width", &o.width},
      {"--vocab", &o.vocab},
      {"--context", &o.context},
      {"--prompt", &o.prompt},
      {"--tokens", &o.tokens},
      {"--reps", &o.reps},
      {"--server-layers", &o.server_layers},
      {"--server-heads", &o.server_heads},
      {"--server-width", &o.server_width},
      {"--server-batch", &o.server_batch},
      {"--clients", &o.clients},
      {"--requests", &o.requests},
      {"--server-tokens", &o.server_tokens},
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw Error(str(flag, " needs a value (see the top of bench/inference_bench.cpp)"));
    const std::string value = argv[i + 1];
    if (flag == "--batches") {
      o.batches.clear();
      for (size_t at = 0; at <= value.size();) {
        const size_t comma = std::min(value.find(',', at), value.size());
        o.batches.push_back(std::stoll(value.substr(at, comma - at)));
        at = comma + 1;
      }
    } else if (auto it = flags.find(flag); it != flags.end()) {
      *it->second = std::stoll(value);
    } else {
      throw Error(str("unknown option ", flag, " (see the top of bench/inference_bench.cpp for the options)"));
    }
  }
  if (o.tokens < 2) throw Error("--tokens must be at least 2: the decode rate runs from the first token to the last");
  for (const int64_t v : {o.reps, o.server_batch, o.clients, o.requests, o.server_tokens})
    if (v < 1) throw Error("--reps, --server-batch, --clients, --requests and --server-tokens must be at least 1");
  for (const int64_t n : o.batches)
    if (n < 1) throw Error(str("--batches ", n, ": a batch needs at least one sequence"));
  if (o.prompt < 1 || o.prompt + o.tokens > o.context)
    throw Error(str("--prompt ", o.prompt, " + --tokens ", o.tokens, " must fit the --context of ", o.context,
                    " (a longer generation would slide its context)"));
  return o;
}

GPTConfig gpt2_config(int64_t layers, int64_t heads, int64_t width, int64_t vocab, int64_t context) {
  GPTConfig c = GPTConfig::preset("gpt2");
  c.n_layer = layers;
  c.n_head = heads;
  c.n_embd = width;
  c.vocab_size = vocab;
  c.block_size = context;
  c.validate();
  return c;
}

// Bytes read per second by a parallel XOR over a buffer far larger than the
// caches (an integer reduction the compiler vectorizes; a float sum would
// wait on each add); best of 5. Decode only reads its weights, which can
// stream faster than memcpy's read + write.
double read_bandwidth(size_t bytes) {
  std::vector<uint64_t> a(bytes / sizeof(uint64_t));
  for (size_t i = 0; i < a.size(); ++i) a[i] = i;
  const int64_t n = static_cast<int64_t>(a.size());
  const uint64_t* p = a.data();
  double best = 1e30;
  uint64_t check = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = bench::now_seconds();
    uint64_t x = 0;
#pragma omp parallel for reduction(^ : x) schedule(static)
    for (int64_t i = 0; i < n; ++i) x ^= p[i];
    best = std::min(best, bench::now_seconds() - t0);
    check |= x;
  }
  // The XOR of 0 .. n-1 for n a multiple of 4 is 0; read it, so the loop stays.
  LOOM_CHECK(check == 0, "the XOR of 0 .. ", n - 1, " is ", check, ", not 0");
  return static_cast<double>(bytes) / best;
}

// A prompt of `n` tokens below `vocab`, different for each `index`.
std::vector<int32_t> prompt_tokens(int64_t n, int64_t vocab, int64_t index) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (size_t i = 0; i < p.size(); ++i)
    p[i] = static_cast<int32_t>((static_cast<int64_t>(i) * 7919 + index * 104729 + 1) % vocab);
  return p;
}

// Batch-1 greedy decode tokens/s, prefill excluded: the first token ends the
// prefill's step, so the rate runs from it to the last; best of `reps` after
// a warm-up.
double decode_rate(const GPT& model, ParamStore& params, const std::vector<int32_t>& prompt, int64_t tokens,
                   int64_t reps) {
  auto once = [&](int64_t n) {
    std::vector<double> stamps;
    GenerationRequest r;
    r.prompt = prompt;
    r.max_tokens = n;
    r.sample.temperature = 0.0f;
    r.on_token = [&](int32_t) { stamps.push_back(bench::now_seconds()); };
    Generator(model, params, 1).run({std::move(r)});
    LOOM_CHECK(static_cast<int64_t>(stamps.size()) == n, "generated ", stamps.size(), " tokens, not ", n);
    return static_cast<double>(n - 1) / (stamps.back() - stamps.front());
  };
  once(4);  // warm-up: first-touch pages, BLAS buffers, the caching allocator
  double best = 0.0;
  for (int64_t rep = 0; rep < reps; ++rep) best = std::max(best, once(tokens));
  return best;
}

// PyTorch's batch-1 decode tokens/s, or 0 when the python has no torch or
// transformers (said on stdout).
double torch_decode_rate(const Options& o, int threads) {
  const bench::PythonRun run = bench::run_python(
      LOOM_BENCH_SOURCE_DIR "/bench/inference_torch.py",
      {std::to_string(o.layers), std::to_string(o.heads), std::to_string(o.width), std::to_string(o.vocab),
       std::to_string(o.context), std::to_string(o.prompt), std::to_string(o.tokens), std::to_string(o.reps),
       std::to_string(threads)});
  if (run.status != 0 && run.output.find("ModuleNotFoundError") != std::string::npos) {
    std::printf("PyTorch side skipped: `%s` has no torch or transformers; set LOOM_BENCH_PYTHON to a python that has "
                "them (python3 -m venv VENV && VENV/bin/pip install torch transformers)\n",
                run.command.c_str());
    return 0.0;
  }
  if (run.status != 0) throw Error("bench: the PyTorch side failed (" + run.command + "):\n" + run.output);
  return bench::json_number(run.output, "decode_tokens_per_s");
}

// Greedy generations of `tokens` tokens after each prompt through a
// Generator of batch `batch`, stepped until all are done; seconds.
double batch_seconds(const GPT& model, ParamStore& params, const std::vector<std::vector<int32_t>>& prompts,
                     int64_t batch, int64_t tokens, const std::vector<int32_t>& stop_tokens = {}) {
  std::vector<GenerationRequest> requests;
  for (const std::vector<int32_t>& prompt : prompts) {
    GenerationRequest r;
    r.prompt = prompt;
    r.max_tokens = tokens;
    r.sample.temperature = 0.0f;
    r.stop_tokens = stop_tokens;
    requests.push_back(std::move(r));
  }
  const double t0 = bench::now_seconds();
  Generator(model, params, batch).run(std::move(requests));
  return bench::now_seconds() - t0;
}

// The value at quantile q of `v` (nearest rank).
double quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * static_cast<double>(v.size())))];
}

// The value of an unlabelled metric in Prometheus text.
double metric(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  throw Error("bench: the server's /metrics has no " + name);
}

// What the load generator saw.
struct Load {
  std::mutex mutex;
  std::vector<double> ttft, itl;  // seconds
  int64_t failed = 0;
  std::string first_failure;

  void fail(const httplib::Error error, const httplib::Response* res) {
    std::lock_guard<std::mutex> lock(mutex);
    if (failed++ == 0)
      first_failure = error != httplib::Error::Success ? httplib::to_string(error)
                                                       : str("HTTP ", res->status, ": ", res->body);
  }
};

// One streamed completion: TTFT and the gaps between chunks with text.
void streamed_request(httplib::Client& client, const std::string& body, Load& load) {
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = body;
  req.set_header("Content-Type", "application/json");
  std::string buffer;
  std::vector<double> stamps;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    buffer.append(data, n);
    for (size_t end; (end = buffer.find("\n\n")) != std::string::npos; buffer.erase(0, end + 2)) {
      const std::string event = buffer.substr(0, end);
      if (event.rfind("data: {", 0) != 0) continue;  // [DONE]
      const nlohmann::json chunk = nlohmann::json::parse(event.substr(6));
      if (!chunk["choices"][0]["text"].get<std::string>().empty()) stamps.push_back(bench::now_seconds());
    }
    return true;
  };
  httplib::Response res;
  httplib::Error error = httplib::Error::Success;
  const double t0 = bench::now_seconds();
  if (!client.send(req, res, error) || res.status != 200) return load.fail(error, &res);
  // No text at all: the first token was the end of text.
  if (stamps.empty()) return;
  std::lock_guard<std::mutex> lock(load.mutex);
  load.ttft.push_back(stamps.front() - t0);
  for (size_t i = 1; i < stamps.size(); ++i) load.itl.push_back(stamps[i] - stamps[i - 1]);
}

void server_load(const Options& o) {
  const Tokenizer tok = Tokenizer::load(LOOM_BENCH_SOURCE_DIR "/tests/fixtures/tokenizer/gpt2/tokenizer.json");
  const GPTConfig cfg = gpt2_config(o.server_layers, o.server_heads, o.server_width, tok.vocab_size(), o.context);
  const GPT model(cfg);
  ParamStore params(model.layout(), 2);
  const int64_t n = o.clients * o.requests;
  std::printf("\nserver: %lld layers, width %lld, %lld heads, vocab %d (tests/fixtures/tokenizer/gpt2): %.1fM "
              "parameters; max batch %lld; load generator: this bench's cpp-httplib client threads, %lld clients "
              "x %lld requests (every other one streamed) of %lld tokens, greedy\n",
              static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
              static_cast<long long>(cfg.n_head), tok.vocab_size(), static_cast<double>(cfg.num_params()) / 1e6,
              static_cast<long long>(o.server_batch), static_cast<long long>(o.clients),
              static_cast<long long>(o.requests), static_cast<long long>(o.server_tokens));

  // Client c's request r: o.prompt of the test tokenizer's words.
  const std::vector<std::string> words = {"The", " king", " said", " to", " the", " people", " of", " the",
                                          " land", " that", " he", " would"};
  const auto text_prompt = [&](int64_t c, int64_t r) {
    std::string prompt;
    for (int64_t w = 0; w < o.prompt; ++w)
      prompt += words[static_cast<size_t>((w + c + r) % static_cast<int64_t>(words.size()))];
    return prompt;
  };
  // Baselines: a batch-1 decode step, and the same requests in-process (the
  // server stops at the end-of-text token too).
  const double step = 1.0 / decode_rate(model, params, tok.encode(text_prompt(0, 0)), o.server_tokens, o.reps);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t c = 0; c < o.clients; ++c)
    for (int64_t r = 0; r < o.requests; ++r) prompts.push_back(tok.encode(text_prompt(c, r)));
  const std::vector<int32_t> eos = tok.eos_id() ? std::vector<int32_t>{*tok.eos_id()} : std::vector<int32_t>{};
  const double offline =
      static_cast<double>(n) / batch_seconds(model, params, prompts, o.server_batch, o.server_tokens, eos);

  ServeOptions so;
  so.port = 0;
  so.max_batch = o.server_batch;
  Server server(model, params, tok, so);
  std::thread serving([&] { server.run(); });
  {
    httplib::Client c("127.0.0.1", server.port());
    for (int i = 0; i < 500 && !c.Get("/health"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Load load;
  std::vector<std::thread> clients;
  const double t0 = bench::now_seconds();
  for (int64_t c = 0; c < o.clients; ++c)
    clients.emplace_back([&, c] {
      httplib::Client client("127.0.0.1", server.port());
      client.set_read_timeout(600);
      for (int64_t r = 0; r < o.requests; ++r) {
        const bool stream = (c + r) % 2 == 0;
        const std::string body = nlohmann::json{{"prompt", text_prompt(c, r)},
                                                {"max_tokens", o.server_tokens},
                                                {"temperature", 0},
                                                {"stream", stream}}
                                     .dump();
        if (stream) {
          streamed_request(client, body, load);
        } else {
          const httplib::Result res = client.Post("/v1/completions", body, "application/json");
          if (!res || res->status != 200) load.fail(res.error(), res ? &res.value() : nullptr);
        }
      }
    });
  for (std::thread& t : clients) t.join();
  const double seconds = bench::now_seconds() - t0;
  std::string metrics;
  if (httplib::Result res = httplib::Client("127.0.0.1", server.port()).Get("/metrics")) metrics = res->body;
  server.stop();
  serving.join();
  if (load.failed > 0)
    throw Error(str("bench: ", load.failed, " of ", n, " requests to the server failed; the first: ",
                    load.first_failure));

  const double tokens = metric(metrics, "loom_tokens_generated_total");
  std::printf("in-process Generator, same requests: %.2f requests/s; batch-1 decode step %.1f ms\n", offline,
              step * 1e3);
  std::printf("server: %.2f requests/s (%.2fx the in-process Generator), %.1f tokens/s, mean batch %.1f\n",
              static_cast<double>(n) / seconds, static_cast<double>(n) / seconds / offline, tokens / seconds,
              tokens / metric(metrics, "loom_decode_steps_total"));
  auto line = [&](const char* name, const std::vector<double>& v) {
    const double p50 = quantile(v, 0.5), p99 = quantile(v, 0.99);
    std::printf("%s (%zu samples): p50 %.1f ms (%.2fx a batch-1 step), p99 %.1f ms (%.2fx)\n", name, v.size(),
                p50 * 1e3, p50 / step, p99 * 1e3, p99 / step);
  };
  line("time to first token", load.ttft);
  line("inter-token latency", load.itl);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse_options(argc, argv);
    const GPTConfig cfg = gpt2_config(o.layers, o.heads, o.width, o.vocab, o.context);
    const GPT model(cfg);
    ParamStore params(model.layout(), 1);
    const int threads = cpu::num_threads();
    const double bandwidth = bench::copy_bandwidth(size_t{512} << 20), read = read_bandwidth(size_t{512} << 20);
    const double bytes = bench::weight_bytes_per_token(model, params);
    std::printf("model: %lld layers, width %lld, %lld heads, vocab %lld, context %lld: %.1fM parameters, fp32; "
                "%d threads; prompt %lld tokens, %lld new, greedy\n",
                static_cast<long long>(cfg.n_layer), static_cast<long long>(cfg.n_embd),
                static_cast<long long>(cfg.n_head), static_cast<long long>(cfg.vocab_size),
                static_cast<long long>(cfg.block_size), static_cast<double>(cfg.num_params()) / 1e6, threads,
                static_cast<long long>(o.prompt), static_cast<long long>(o.tokens));

    const std::vector<int32_t> prompt = prompt_tokens(o.prompt, cfg.vocab_size, 0);
    const double rate = decode_rate(model, params, prompt, o.tokens, o.reps), bound = bandwidth / bytes;
    std::printf("memcpy bandwidth %.2f GB/s (read + write), read-only %.2f GB/s; weights %.1f MB per token: bound "
                "%.2f tokens/s (memcpy), %.2f (read-only)\n",
                bandwidth / 1e9, read / 1e9, bytes / 1e6, bound, read / bytes);
    // Above 1 when reading alone streams faster than copying.
    std::printf("loom batch-1 decode: %.2f tokens/s = %.2f of the bandwidth bound (target >= 0.7), %.2f of the "
                "read-only bound\n",
                rate, rate / bound, rate / (read / bytes));

    if (const double torch = torch_decode_rate(o, threads); torch > 0)
      std::printf("PyTorch generate batch-1 decode: %.2f tokens/s = %.2f of the bandwidth bound; loom / PyTorch: "
                  "%.2fx\n",
                  torch, torch / bound, rate / torch);

    std::printf("\ncontinuous batching: N requests of %lld + %lld tokens through a Generator of batch N "
                "(prefill included, best of %lld)\n",
                static_cast<long long>(o.prompt), static_cast<long long>(o.tokens), static_cast<long long>(o.reps));
    double base = 0.0;
    for (int64_t n : o.batches) {
      std::vector<std::vector<int32_t>> prompts;
      for (int64_t i = 0; i < n; ++i) prompts.push_back(prompt_tokens(o.prompt, cfg.vocab_size, i));
      double best = 1e30;
      for (int64_t rep = 0; rep < o.reps; ++rep) best = std::min(best, batch_seconds(model, params, prompts, n, o.tokens));
      const double tps = static_cast<double>(n * o.tokens) / best;
      if (base == 0.0) base = tps;
      std::printf("  %3lld sequences: %8.2f tokens/s  %5.2fx batch %lld%s\n", static_cast<long long>(n), tps,
                  tps / base, static_cast<long long>(o.batches.front()), n == 32 ? " (target >= 4x)" : "");
    }

    server_load(o);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "inference_bench: %s\n", e.what());
    return 1;
  }
}
