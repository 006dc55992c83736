// Encoding speed of the Hugging Face tokenizer.json backend (the GPT-2- and
// LLaMA-3-style fixtures of tests/fixtures/tokenizer) as a ratio to loom's
// sentencepiece tokenizer, trained in the same run on the same text:
//   text   tinyshakespeare (1.1 MB), words that repeat (the pre-token cache)
//   word   one 1 MB pre-token of letters (the merge loop on a long word:
//          quadratic merging would take minutes here)
// Single-threaded; medians of 5 runs.
//
//   tokenizer_bench [repo root, default the source tree]
#include <cstdio>
#include <filesystem>
#include <string>

#include "bench_common.h"
#include "loom/data.h"
#include "loom/io.h"

namespace {

double mb_per_s(const loom::Tokenizer& tok, const std::string& text) {
  std::vector<double> times;
  size_t tokens = 0;
  for (int rep = 0; rep < 5; ++rep) {
    double t0 = loom::bench::now_seconds();
    tokens = tok.encode(text).size();
    times.push_back(loom::bench::now_seconds() - t0);
  }
  if (tokens == 0) std::printf("(no tokens)\n");
  return static_cast<double>(text.size()) / 1e6 / loom::bench::median(times);
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  const fs::path root = argc > 1 ? fs::path(argv[1]) : fs::path(LOOM_BENCH_SOURCE_DIR);
  const std::string text = loom::read_file(root / "data/tinyshakespeare.txt");
  std::string word;
  for (size_t i = 0; word.size() < text.size(); ++i) word += "thequickbrownfoxjumpsoverthelazydog"[i % 35];

  const fs::path tmp = fs::temp_directory_path() / "loom_tokenizer_bench.model";
  const loom::Tokenizer sp = loom::Tokenizer::train(text, tmp, {.vocab_size = 2048});
  fs::remove(tmp);
  const double base_text = mb_per_s(sp, text), base_word = mb_per_s(sp, word);
  std::printf("sentencepiece (vocab 2048): text %.2f MB/s, word %.2f MB/s (the baseline)\n", base_text, base_word);
  for (const char* style : {"gpt2", "llama3"}) {
    const loom::Tokenizer hf = loom::Tokenizer::load(root / "tests/fixtures/tokenizer" / style);
    const double t = mb_per_s(hf, text), w = mb_per_s(hf, word);
    std::printf("tokenizer.json %-6s (vocab %d): text %.2f MB/s = %.2fx sentencepiece, word %.2f MB/s = %.2fx\n",
                style, hf.vocab_size(), t, t / base_text, w, w / base_word);
  }
  return 0;
}
