#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <csignal>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "loom/data.h"
#include "loom/inference.h"

namespace loom {
namespace {

using nlohmann::json;

// A tiny random model behind a server on a port the OS chose.
struct Served {
  Tokenizer tok =
      Tokenizer::load(std::filesystem::path(LOOM_SOURCE_DIR) / "tests/fixtures/tokenizer/gpt2/tokenizer.json");
  int64_t context;
  GPT model{config(tok, context)};
  ParamStore ps{model.layout(), 7};
  std::unique_ptr<Server> server;
  std::thread thread;

  static GPTConfig config(const Tokenizer& tok, int64_t context) {
    GPTConfig c = GPTConfig::preset("tiny");
    c.block_size = context;
    c.vocab_size = tok.vocab_size();
    return c;
  }
  explicit Served(bool until_signal = false, int64_t context = 32) : context(context) {
    ServeOptions o;
    o.port = 0;
    o.max_batch = 3;
    server = std::make_unique<Server>(model, ps, tok, o);
    thread = std::thread([this, until_signal] { until_signal ? server->run_until_signal() : server->run(); });
    httplib::Client c = client();
    for (int i = 0; i < 200 && !c.Get("/health"); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ~Served() {
    server->stop();
    thread.join();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", server->port());
    c.set_read_timeout(20);
    return c;
  }
  // What the Generator alone gives for a request.
  GenerationResult alone(const std::string& prompt, int64_t max_tokens, float temperature, uint64_t seed,
                         const std::vector<std::string>& stop = {}) {
    GenerationRequest r;
    r.prompt = tok.encode(prompt);
    r.max_tokens = max_tokens;
    r.sample.temperature = temperature;
    r.sample.seed = seed;
    r.stop = stop;
    r.stop_tokens = {*tok.eos_id()};
    return Generator(model, ps, 1, &tok).run({r}).front();
  }
};

struct Streamed {
  std::string text, finish_reason;
  int chunks = 0;
  bool done = false;
};

Streamed parse_events(const std::string& body) {
  Streamed s;
  size_t pos = 0;
  for (size_t end; (end = body.find("\n\n", pos)) != std::string::npos; pos = end + 2) {
    const std::string event = body.substr(pos, end - pos);
    EXPECT_EQ(event.rfind("data: ", 0), 0u) << event;
    const std::string data = event.substr(6);
    if (data == "[DONE]") {
      s.done = true;
      continue;
    }
    const json chunk = json::parse(data);
    EXPECT_EQ(chunk["object"], "text_completion");
    s.text += chunk["choices"][0]["text"].get<std::string>();
    if (!chunk["choices"][0]["finish_reason"].is_null()) s.finish_reason = chunk["choices"][0]["finish_reason"];
    ++s.chunks;
  }
  EXPECT_EQ(pos, body.size()) << "a partial event";
  return s;
}

// Text as it comes back through JSON: bytes that are not UTF-8 replaced.
std::string through_json(const std::string& text) {
  return json::parse(json(text).dump(-1, ' ', false, json::error_handler_t::replace)).get<std::string>();
}

// The value of an unlabelled (or fully labelled) metric line, -1 if absent.
double metric(const std::string& text, const std::string& name) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  return -1;
}

TEST(Server, ConcurrentClientsGetWhatTheGeneratorGivesAlone) {
  Served s;
  const std::vector<std::string> prompts = {"To be, or not", "Hello", "The king", "", "a b c d", "Once upon"};
  std::vector<std::string> texts(prompts.size()), finishes(prompts.size());
  std::vector<json> usages(prompts.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < prompts.size(); ++i)
    clients.emplace_back([&, i] {
      const bool stream = i % 2 == 1;
      const json body{{"model", "tiny"},   {"prompt", prompts[i]},      {"max_tokens", 20 + i},
                      {"temperature", i % 3 ? 0.9 : 0.0}, {"seed", 40 + i}, {"stream", stream}};
      httplib::Client c = s.client();
      const httplib::Result res = c.Post("/v1/completions", body.dump(), "application/json");
      ASSERT_TRUE(res);
      ASSERT_EQ(res->status, 200) << res->body;
      if (stream) {
        EXPECT_EQ(res->get_header_value("Content-Type"), "text/event-stream");
        const Streamed ev = parse_events(res->body);
        EXPECT_TRUE(ev.done);
        texts[i] = ev.text;
        finishes[i] = ev.finish_reason;
      } else {
        const json j = json::parse(res->body);
        EXPECT_EQ(j["object"], "text_completion");
        EXPECT_EQ(j["model"], "tiny");
        EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
        texts[i] = j["choices"][0]["text"];
        finishes[i] = j["choices"][0]["finish_reason"];
        usages[i] = j["usage"];
      }
    });
  for (std::thread& t : clients) t.join();
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const GenerationResult r = s.alone(prompts[i], 20 + static_cast<int64_t>(i), i % 3 ? 0.9f : 0.0f, 40 + i);
    EXPECT_EQ(texts[i], through_json(r.text));
    EXPECT_EQ(finishes[i], finish_reason_name(r.finish));
    if (i % 2 == 0) {
      const int64_t prompt_tokens = static_cast<int64_t>(s.tok.encode(prompts[i]).size());
      EXPECT_EQ(usages[i]["prompt_tokens"], prompt_tokens);
      EXPECT_EQ(usages[i]["completion_tokens"], r.tokens.size());
      EXPECT_EQ(usages[i]["total_tokens"], prompt_tokens + static_cast<int64_t>(r.tokens.size()));
    }
  }
  EXPECT_EQ(s.server->stats().in_flight, 0);
  // The requests shared batches: fewer forward passes than tokens.
  const std::string m = s.client().Get("/metrics")->body;
  EXPECT_LT(metric(m, "loom_decode_steps_total"), metric(m, "loom_tokens_generated_total"));
}

TEST(Server, StopStringsEndTheTextAsTheyDoAlone) {
  Served s;
  const GenerationResult full = s.alone("To be, or not", 20, 0.0f, 1);
  ASSERT_GT(full.text.size(), 8u);
  const std::string stop = full.text.substr(full.text.size() / 2, 2);
  const json body{{"prompt", "To be, or not"}, {"max_tokens", 20}, {"temperature", 0}, {"stop", {stop}}};
  const httplib::Result res = s.client().Post("/v1/completions", body.dump(), "application/json");
  ASSERT_TRUE(res);
  const json j = json::parse(res->body);
  EXPECT_EQ(j["choices"][0]["text"], through_json(s.alone("To be, or not", 20, 0.0f, 1, {stop}).text));
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
}

TEST(Server, BadRequestsGet400InOpenAIsErrorShape) {
  Served s;
  const std::string long_prompt(400, 'x');
  // body, the param the error names ("" for none)
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{not json", ""},
      {"[1, 2]", ""},
      {R"({"max_tokens": 3})", "prompt"},
      {R"({"prompt": "a", "temp": 1})", "temp"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": "a", "max_tokens": "3"})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 2.5})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": -1})", "max_tokens"},
      {R"({"prompt": "a", "temperature": -0.5})", "temperature"},
      {R"({"prompt": "a", "top_p": 0})", "top_p"},
      {R"({"prompt": "a", "top_p": 1.5})", "top_p"},
      {R"({"prompt": "a", "top_k": -2})", "top_k"},
      {R"({"prompt": "a", "stop": [1]})", "stop"},
      {R"({"prompt": "a", "stop": ""})", "stop"},
      {R"({"prompt": "a", "seed": -3})", "seed"},
      {R"({"prompt": "a", "stream": "yes"})", "stream"},
      {json{{"prompt", long_prompt}}.dump(), "prompt"},
  };
  httplib::Client c = s.client();
  for (const auto& [body, param] : bad) {
    SCOPED_TRACE(body.substr(0, 60));
    const httplib::Result res = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(res);
    EXPECT_EQ(res->status, 400);
    const json j = json::parse(res->body);
    ASSERT_TRUE(j.contains("error"));
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_FALSE(j["error"]["message"].get<std::string>().empty());
    ASSERT_TRUE(j["error"].contains("param") && j["error"].contains("code"));
    if (param.empty())
      EXPECT_TRUE(j["error"]["param"].is_null());
    else
      EXPECT_EQ(j["error"]["param"], param);
  }
  const httplib::Result missing = c.Get("/v1/nothing");
  ASSERT_TRUE(missing);
  EXPECT_EQ(missing->status, 404);
  EXPECT_EQ(json::parse(missing->body)["error"]["type"], "invalid_request_error");
  // It still serves.
  const httplib::Result ok = c.Post("/v1/completions", R"({"prompt": "a", "max_tokens": 3})", "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  const std::string m = c.Get("/metrics")->body;
  EXPECT_EQ(metric(m, "loom_requests_total{status=\"400\"}"), static_cast<double>(bad.size()));
  EXPECT_EQ(metric(m, "loom_requests_total{status=\"200\"}"), 1.0);
}

TEST(Server, HealthAndMetricsMove) {
  Served s;
  httplib::Client c = s.client();
  const httplib::Result health = c.Get("/health");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);
  const std::string before = c.Get("/metrics")->body;
  EXPECT_EQ(metric(before, "loom_tokens_generated_total"), 0.0);
  EXPECT_EQ(metric(before, "loom_queue_length"), 0.0);
  EXPECT_EQ(metric(before, "loom_time_to_first_token_seconds_count"), 0.0);
  const httplib::Result res =
      c.Post("/v1/completions", R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0})", "application/json");
  ASSERT_TRUE(res);
  const int64_t tokens = json::parse(res->body)["usage"]["completion_tokens"];
  ASSERT_GT(tokens, 1);
  const std::string after = c.Get("/metrics")->body;
  EXPECT_EQ(metric(after, "loom_tokens_generated_total"), static_cast<double>(tokens));
  EXPECT_EQ(metric(after, "loom_decode_steps_total"), static_cast<double>(tokens));  // alone: one per token
  EXPECT_EQ(metric(after, "loom_time_to_first_token_seconds_count"), 1.0);
  EXPECT_EQ(metric(after, "loom_inter_token_latency_seconds_count"), static_cast<double>(tokens - 1));
  EXPECT_EQ(metric(after, "loom_inter_token_latency_seconds_bucket{le=\"+Inf\"}"), static_cast<double>(tokens - 1));
  EXPECT_EQ(metric(after, "loom_requests_total{status=\"200\"}"), 1.0);
  EXPECT_EQ(metric(after, "loom_kv_cache_bytes_in_use"), 0.0);
}

// Waits up to a few seconds for the server to have nothing in flight.
bool drains(const Server& server) {
  for (int i = 0; i < 500; ++i) {
    const ServerStats st = server.stats();
    if (st.in_flight == 0 && st.kv_bytes_in_use == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(Server, ADisconnectMidStreamFreesTheSlot) {
  Served s;
  httplib::Client c = s.client();
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "Hello", "max_tokens": 1000000, "temperature": 1.5, "stream": true})";
  req.set_header("Content-Type", "application/json");
  size_t held = 0;
  int64_t generated = 0;
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    // The engine publishes the pool's bytes after the step that sent this.
    for (int i = 0; i < 100 && held == 0; ++i) {
      held = s.server->stats().kv_bytes_in_use;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    generated = s.server->stats().tokens_generated;
    return false;  // hang up after the first chunk
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  EXPECT_FALSE(c.send(req, res, err));
  EXPECT_GT(held, 0u);
  EXPECT_GT(generated, 0);
  EXPECT_TRUE(drains(*s.server));
}

// A stream in flight when the server stops.
void stream_until_stopped(Served& s, bool& ended, Streamed& events) {
  httplib::Client c = s.client();
  // Greedy: the same tokens every run, none of them the end of text.
  const httplib::Result res =
      c.Post("/v1/completions", R"({"prompt": "Hello", "max_tokens": 1000000, "temperature": 0, "stream": true})",
             "application/json");
  ended = true;
  if (res) events = parse_events(res->body);
}

TEST(Server, SigtermStopsItCleanly) {
  // A context long enough that the stream cannot end on its own before the
  // signal is acted on (the server looks for it every 20 ms): with 32
  // positions it sometimes finished first.
  Served s(true, 4096);
  bool ended = false;
  Streamed events;
  std::thread client([&] { stream_until_stopped(s, ended, events); });
  while (s.server->stats().tokens_generated == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  const auto t0 = std::chrono::steady_clock::now();
  std::raise(SIGTERM);
  s.thread.join();
  client.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(ended);
  EXPECT_GT(events.chunks, 0);
  EXPECT_FALSE(events.done);  // cut off, not finished
  EXPECT_TRUE(drains(*s.server));
  // The handlers are back: a second SIGTERM would end the process.
  struct sigaction now {};
  sigaction(SIGTERM, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_DFL);
  s.thread = std::thread([] {});  // ~Served joins it
}

}  // namespace
}  // namespace loom
