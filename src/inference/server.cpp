// `loom serve`: OpenAI-compatible completions over HTTP (cpp-httplib), one
// engine thread stepping a Generator for every handler thread.
#include <httplib.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstring>
#include <ctime>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "loom/data.h"
#include "loom/inference.h"

namespace loom {

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

// A request the client got wrong: 400 with OpenAI's error shape.
struct BadRequest {
  std::string message;
  std::string param;  // the field, or empty
  std::string code;   // OpenAI's code, or empty
};

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::string error_body(const std::string& message, const std::string& type, const std::string& param,
                       const std::string& code) {
  return dump({{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? json(nullptr) : json(param)},
                 {"code", code.empty() ? json(nullptr) : json(code)}}}});
}

// Prometheus histogram of durations in seconds.
struct Histogram {
  static constexpr double kBounds[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  int64_t counts[std::size(kBounds)] = {};
  int64_t count = 0;
  double sum = 0;

  void observe(double seconds) {
    for (size_t i = 0; i < std::size(kBounds); ++i)
      if (seconds <= kBounds[i]) ++counts[i];
    ++count;
    sum += seconds;
  }
  void write(std::ostream& out, const char* name, const char* help) const {
    out << "# HELP " << name << ' ' << help << "\n# TYPE " << name << " histogram\n";
    for (size_t i = 0; i < std::size(kBounds); ++i)
      out << name << "_bucket{le=\"" << kBounds[i] << "\"} " << counts[i] << '\n';
    out << name << "_bucket{le=\"+Inf\"} " << count << '\n'
        << name << "_sum " << sum << '\n'
        << name << "_count " << count << '\n';
  }
};

// One request in flight, shared by its handler and the engine thread's
// callbacks; guarded by Impl::mutex.
struct Pending {
  int64_t id = -1;
  std::string text;  // streamed text not yet sent
  std::optional<GenerationResult> result;
  Clock::time_point start = Clock::now(), last_token;
  bool first_token = true;
};

struct Parsed {
  GenerationRequest request;
  std::string model;
  bool stream = false;
};

const char* const kFields = "model, prompt, max_tokens, temperature, top_p, top_k, stop, seed, stream";

Parsed parse_completion(const std::string& body, const Tokenizer& tok, int64_t context, const std::string& model) {
  json obj;
  try {
    obj = json::parse(body);
  } catch (const json::parse_error& e) {
    throw BadRequest{str("the body is not valid JSON (", e.what(), ")"), "", ""};
  }
  if (!obj.is_object()) throw BadRequest{"the body must be a JSON object", "", ""};
  auto wrong = [](const std::string& key, const char* want, const json& v) {
    return BadRequest{str("'", key, "' must be ", want, ", not ", dump(v)), key, ""};
  };
  Parsed p;
  p.model = model;
  p.request.max_tokens = 16;  // OpenAI's defaults
  p.request.sample.temperature = 1.0f;
  bool has_prompt = false;
  for (const auto& [key, v] : obj.items()) {
    if (v.is_null() && key != "prompt") continue;  // null: the default
    if (key == "model") {
      if (!v.is_string()) throw wrong(key, "a string", v);
      p.model = v.get<std::string>();
    } else if (key == "prompt") {
      if (!v.is_string()) throw wrong(key, "a string", v);
      p.request.prompt = tok.encode(v.get<std::string>());
      has_prompt = true;
    } else if (key == "max_tokens") {
      if (!v.is_number_integer()) throw wrong(key, "an integer", v);
      p.request.max_tokens = v.get<int64_t>();
      if (p.request.max_tokens < 0) throw BadRequest{str("'max_tokens' must be 0 or more, not ", dump(v)), key, ""};
    } else if (key == "temperature") {
      if (!v.is_number()) throw wrong(key, "a number", v);
      p.request.sample.temperature = v.get<float>();
      if (!(p.request.sample.temperature >= 0))
        throw BadRequest{str("'temperature' must be 0 (greedy) or more, not ", dump(v)), key, ""};
    } else if (key == "top_p") {
      if (!v.is_number()) throw wrong(key, "a number", v);
      p.request.sample.top_p = v.get<float>();
      if (!(p.request.sample.top_p > 0 && p.request.sample.top_p <= 1))
        throw BadRequest{str("'top_p' must be in (0, 1], not ", dump(v)), key, ""};
    } else if (key == "top_k") {
      if (!v.is_number_integer() || v.get<int64_t>() < 0) throw wrong(key, "an integer, 0 (all) or more", v);
      p.request.sample.top_k = v.get<int64_t>();
    } else if (key == "stop") {
      std::vector<std::string> stops;
      if (v.is_string()) {
        stops.push_back(v.get<std::string>());
      } else if (v.is_array()) {
        for (const json& s : v) {
          if (!s.is_string()) throw wrong(key, "a string or a list of strings", v);
          stops.push_back(s.get<std::string>());
        }
      } else {
        throw wrong(key, "a string or a list of strings", v);
      }
      for (const std::string& s : stops)
        if (s.empty()) throw BadRequest{"'stop' holds an empty string, which every text contains", key, ""};
      p.request.stop = std::move(stops);
    } else if (key == "seed") {
      if (!v.is_number_unsigned()) throw wrong(key, "a non-negative integer", v);
      p.request.sample.seed = v.get<uint64_t>();
    } else if (key == "stream") {
      if (!v.is_boolean()) throw wrong(key, "true or false", v);
      p.stream = v.get<bool>();
    } else {
      throw BadRequest{str("unknown field '", key, "' (the fields are ", kFields, ")"), key, ""};
    }
  }
  if (!has_prompt) throw BadRequest{"'prompt' is required", "prompt", ""};
  if (static_cast<int64_t>(p.request.prompt.size()) > context)
    throw BadRequest{str("the prompt is ", p.request.prompt.size(), " tokens, longer than the model's context of ",
                         context, " tokens: shorten it"),
                     "prompt", "context_length_exceeded"};
  if (const std::optional<int32_t> eos = tok.eos_id()) p.request.stop_tokens.push_back(*eos);
  return p;
}

// The length of text's longest prefix that does not end inside a UTF-8
// character, so that a streamed piece never splits one (JSON would replace
// each half).
size_t complete_utf8(const std::string& text) {
  for (size_t back = 1; back <= std::min<size_t>(3, text.size()); ++back) {
    const auto c = static_cast<unsigned char>(text[text.size() - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? text.size() - back : text.size();
  }
  return text.size();
}

// cpp-httplib listens with a backlog of 5 connections (CPPHTTPLIB_LISTEN_BACKLOG,
// compiled into Debian's libcpp-httplib.so, so defining it here would change
// nothing). More clients than that connecting at once overflow the accept
// queue: the kernel drops their handshakes and they retry a second later, a
// time to first token of over a second (bench/inference_bench with 8 clients).
// Listening again on the bound socket sets the backlog anew.
class HttpServer : public httplib::Server {
 public:
  bool widen_backlog() { return ::listen(svr_sock_, SOMAXCONN) == 0; }
};

volatile std::sig_atomic_t g_signal = 0;
void on_signal(int sig) { g_signal = sig; }

}  // namespace

struct Server::Impl {
  const Tokenizer& tok;
  ServeOptions opts;
  int64_t context;
  Generator gen;
  HttpServer http;
  int port = 0;

  mutable std::mutex mutex;  // guards everything below
  std::condition_variable progress;  // a request got text or finished, or the server stops
  std::condition_variable work;      // the engine has something to do
  bool has_work = false, stopping = false, quit = false;
  std::map<int64_t, std::shared_ptr<Pending>> pending;
  std::map<int, int64_t> requests_by_status;
  int64_t tokens_generated = 0, steps = 0;
  size_t kv_bytes = 0;
  Histogram ttft, itl;
  std::thread engine;

  Impl(const GPT& model, ParamStore& params, const Tokenizer& t, ServeOptions o)
      : tok(t), opts(std::move(o)), context(model.config().block_size), gen(model, params, opts.max_batch, &t) {}

  // The engine thread: steps while there is work, then hands out results.
  void run_engine() {
    std::unique_lock<std::mutex> lock(mutex);
    while (true) {
      work.wait(lock, [&] { return has_work || quit; });
      if (quit) return;
      has_work = false;
      lock.unlock();
      bool more = true;
      while (more) {
        more = gen.step();
        lock.lock();
        steps += more;
        kv_bytes = gen.pool().bytes_in_use();
        for (auto& [id, p] : pending)
          if (!p->result) p->result = gen.take(id);
        progress.notify_all();
        if (more) lock.unlock();
      }
    }
  }

  std::shared_ptr<Pending> submit(GenerationRequest request) {
    auto p = std::make_shared<Pending>();
    request.on_token = [this, p](int32_t) {
      std::lock_guard<std::mutex> lock(mutex);
      const Clock::time_point now = Clock::now();
      (p->first_token ? ttft : itl).observe(std::chrono::duration<double>(now - (p->first_token ? p->start : p->last_token)).count());
      p->first_token = false;
      p->last_token = now;
      ++tokens_generated;
    };
    request.on_text = [this, p](const std::string& piece) {
      std::lock_guard<std::mutex> lock(mutex);
      p->text += piece;
      progress.notify_all();
    };
    // Under the lock, so the engine cannot finish it before it is listed.
    std::lock_guard<std::mutex> lock(mutex);
    p->id = gen.submit(std::move(request));
    pending[p->id] = p;
    has_work = true;
    work.notify_one();
    return p;
  }

  // The request leaves: cancelled if it has not finished.
  void retire(const Pending& p) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!p.result) {
      gen.cancel(p.id);
      has_work = true;  // the engine frees its slot
      work.notify_one();
    }
    pending.erase(p.id);
  }

  json choice(const std::string& text, const std::optional<GenerationResult>& r) const {
    return {{"text", text},
            {"index", 0},
            {"logprobs", nullptr},
            {"finish_reason", r ? json(finish_reason_name(r->finish)) : json(nullptr)}};
  }

  void completions(const httplib::Request& req, httplib::Response& res) {
    Parsed parsed;
    try {
      parsed = parse_completion(req.body, tok, context, opts.model);
    } catch (const BadRequest& e) {
      res.status = 400;
      res.set_content(error_body(e.message, "invalid_request_error", e.param, e.code), "application/json");
      return;
    }
    const int64_t prompt_tokens = static_cast<int64_t>(parsed.request.prompt.size());
    const std::shared_ptr<Pending> p = submit(std::move(parsed.request));
    const std::string id = str("cmpl-", p->id);
    const int64_t created = static_cast<int64_t>(std::time(nullptr));
    json head{{"id", id}, {"object", "text_completion"}, {"created", created}, {"model", parsed.model}};
    if (!parsed.stream) {
      std::unique_lock<std::mutex> lock(mutex);
      progress.wait(lock, [&] { return p->result || stopping; });
      lock.unlock();
      if (!p->result) {
        retire(*p);
        res.status = 503;
        res.set_content(error_body("the server is shutting down", "server_error", "", ""), "application/json");
        return;
      }
      retire(*p);
      const int64_t completion_tokens = static_cast<int64_t>(p->result->tokens.size());
      head["choices"] = json::array({choice(p->result->text, p->result)});
      head["usage"] = {{"prompt_tokens", prompt_tokens},
                       {"completion_tokens", completion_tokens},
                       {"total_tokens", prompt_tokens + completion_tokens}};
      res.set_content(dump(head), "application/json");
      return;
    }
    res.set_header("Cache-Control", "no-cache");
    res.set_chunked_content_provider(
        "text/event-stream",
        [this, p, head](size_t, httplib::DataSink& sink) mutable {
          auto send = [&](const std::string& text, const std::optional<GenerationResult>& r) {
            head["choices"] = json::array({choice(text, r)});
            const std::string event = "data: " + dump(head) + "\n\n";
            return sink.write(event.data(), event.size());
          };
          while (true) {
            std::unique_lock<std::mutex> lock(mutex);
            // Wakes now and then to notice a client that went away.
            progress.wait_for(lock, std::chrono::milliseconds(50),
                              [&] { return complete_utf8(p->text) > 0 || p->result || stopping; });
            const bool finished = p->result.has_value(), stop = stopping;
            const size_t n = finished ? p->text.size() : complete_utf8(p->text);
            const std::string text = p->text.substr(0, n);
            p->text.erase(0, n);
            lock.unlock();
            if (!text.empty() && !send(text, std::nullopt)) return false;
            if (finished) {
              // The end: the finish reason, then OpenAI's terminator.
              if (!send("", p->result)) return false;
              const std::string done = "data: [DONE]\n\n";
              sink.write(done.data(), done.size());
              sink.done();
              return true;
            }
            if (stop) {
              sink.done();
              return true;
            }
            if (!sink.is_writable()) return false;
          }
        },
        [this, p](bool) { retire(*p); });
  }

  std::string metrics() const {
    std::lock_guard<std::mutex> lock(mutex);
    std::ostringstream out;
    out << "# HELP loom_requests_total Completion requests answered, by HTTP status.\n"
           "# TYPE loom_requests_total counter\n";
    for (const auto& [status, n] : requests_by_status)
      out << "loom_requests_total{status=\"" << status << "\"} " << n << '\n';
    out << "# HELP loom_tokens_generated_total Tokens generated for all requests.\n"
           "# TYPE loom_tokens_generated_total counter\n"
        << "loom_tokens_generated_total " << tokens_generated << '\n'
        << "# HELP loom_decode_steps_total Batched forward passes (tokens generated over these: the mean batch).\n"
           "# TYPE loom_decode_steps_total counter\n"
        << "loom_decode_steps_total " << steps << '\n'
        << "# HELP loom_queue_length Requests waiting or being generated.\n"
           "# TYPE loom_queue_length gauge\n"
        << "loom_queue_length " << pending.size() << '\n'
        << "# HELP loom_kv_cache_bytes_in_use Bytes of KV cache the active sequences hold.\n"
           "# TYPE loom_kv_cache_bytes_in_use gauge\n"
        << "loom_kv_cache_bytes_in_use " << kv_bytes << '\n';
    ttft.write(out, "loom_time_to_first_token_seconds", "Time from a request's arrival to its first token.");
    itl.write(out, "loom_inter_token_latency_seconds", "Time between a request's consecutive tokens.");
    return out.str();
  }

  void routes() {
    http.Post("/v1/completions", [this](const httplib::Request& req, httplib::Response& res) {
      completions(req, res);
      // Counted before the response goes out, so a client sees its own;
      // httplib makes an unset status 200 after the handler.
      std::lock_guard<std::mutex> lock(mutex);
      ++requests_by_status[res.status > 0 ? res.status : 200];
    });
    http.Get("/health", [](const httplib::Request&, httplib::Response& res) {
      res.set_content("{\"status\":\"ok\"}", "application/json");
    });
    http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
      res.set_content(metrics(), "text/plain; version=0.0.4");
    });
    http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
      if (res.status == 404)
        res.set_content(error_body(str("no endpoint ", req.method, " ", req.path,
                                       " (there are POST /v1/completions, GET /health, GET /metrics)"),
                                   "invalid_request_error", "", ""),
                        "application/json");
    });
    http.set_exception_handler([](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
      std::string what = "unknown error";
      try {
        std::rethrow_exception(ep);
      } catch (const std::exception& e) {
        what = e.what();
      } catch (...) {
      }
      res.status = 500;
      res.set_content(error_body(what, "server_error", "", ""), "application/json");
    });
    // Every waiting or streaming request holds a handler thread.
    const size_t threads = static_cast<size_t>(std::max<int64_t>(8, 2 * opts.max_batch + 2));
    http.new_task_queue = [threads] { return new httplib::ThreadPool(threads); };
    // A kept-alive idle connection holds its thread: bounded, so stop() is prompt.
    http.set_keep_alive_timeout(1);
  }
};

Server::Server(const GPT& model, ParamStore& params, const Tokenizer& tok, ServeOptions opts)
    : impl_(std::make_unique<Impl>(model, params, tok, std::move(opts))) {
  Impl& s = *impl_;
  s.routes();
  s.port = s.opts.port == 0 ? s.http.bind_to_any_port(s.opts.host) : s.opts.port;
  if (s.port <= 0 || (s.opts.port != 0 && !s.http.bind_to_port(s.opts.host, s.opts.port)))
    throw Error(str("cannot listen on ", s.opts.host, ":", s.opts.port,
                    ": is the port in use or the host not this machine's? (choose another with --host/--port)"));
  LOOM_CHECK(s.http.widen_backlog(), "listen() on the bound socket failed: ", std::strerror(errno));
  s.engine = std::thread([&s] { s.run_engine(); });
}

Server::~Server() {
  stop();
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->quit = true;
    impl_->work.notify_one();
  }
  impl_->engine.join();
}

int Server::port() const { return impl_->port; }

void Server::run() {
  // A client that goes away mid-stream must fail a write, not kill the process.
  std::signal(SIGPIPE, SIG_IGN);
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->stopping) return;
  }
  impl_->http.listen_after_bind();
}

void Server::run_until_signal() {
  g_signal = 0;
  const ScopedTerminationHandler handler(on_signal, 0);
  std::atomic<bool> done{false};
  // A signal handler may only set a flag; this thread turns it into stop().
  std::thread watcher([&] {
    while (!done) {
      if (g_signal != 0) {
        stop();
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  run();
  done = true;
  watcher.join();
}

void Server::stop() {
  {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    impl_->stopping = true;
    impl_->progress.notify_all();
  }
  impl_->http.stop();
}

ServerStats Server::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mutex);
  return {static_cast<int64_t>(impl_->pending.size()), impl_->kv_bytes, impl_->tokens_generated};
}

}  // namespace loom
