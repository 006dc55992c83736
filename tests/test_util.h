// Helpers shared by loom's tests.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "loom/core.h"
#include "loom/device.h"

// Passes when `needle` occurs in `haystack`; on failure prints both.
#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_PRED_FORMAT2(::testing::IsSubstring, std::string(needle), std::string(haystack))

namespace loom::testing {

// Runs the body with the given CPU stream mode on a MemoryContext of its own
// (streams take the mode they are created with).
template <typename Fn>
void with_cpu_stream_mode(CpuStreamMode mode, Fn fn) {
  const CpuStreamMode before = cpu_stream_mode();
  set_cpu_stream_mode(mode);
  {
    MemoryContext memory;
    MemoryContext::Install install(memory);
    fn();
  }
  set_cpu_stream_mode(before);
}

// The message of the loom::Error that `fn` throws; fails the test if it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected loom::Error";
  return "";
}

// An environment variable set for the scope of a test, then restored.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const std::string& value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    ::setenv(name, value.c_str(), 1);
  }
  ~ScopedEnv() {
    if (old_)
      ::setenv(name_, old_->c_str(), 1);
    else
      ::unsetenv(name_);
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
  std::optional<std::string> old_;
};

// A fresh directory under the system temp dir, removed with its contents at
// the end of the test.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = std::filesystem::temp_directory_path() /
            ("loom-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(std::string_view name) const { return path_ / name; }

  // Writes `content` to <dir>/<name> and returns the path.
  std::filesystem::path write(std::string_view name, std::string_view content) const {
    std::filesystem::path p = path_ / name;
    std::filesystem::create_directories(p.parent_path());
    std::ofstream(p, std::ios::binary) << content;
    return p;
  }

 private:
  std::filesystem::path path_;
};

// Flips one bit of the byte `offset` bytes from `from` (the start or the end)
// of the file: a corruption that a checksum must catch.
inline void flip_bit(const std::filesystem::path& path, std::streamoff offset,
                     std::ios_base::seekdir from = std::ios_base::beg) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset, from);
  const char c = static_cast<char>(f.get());
  f.seekp(offset, from);
  f.put(static_cast<char>(c ^ 0x40));
}

// Every file under `dir` by its relative path, with its bytes: equal before
// and after an operation that must leave the directory as it was.
inline std::map<std::string, std::string> tree_contents(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    std::ifstream in(e.path(), std::ios::binary);
    out[std::filesystem::relative(e.path(), dir).string()] =
        std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return out;
}

// Deterministic token ids in [0, vocab).
inline std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    t[static_cast<size_t>(i)] = static_cast<int32_t>(Philox::block(seed, 0, static_cast<uint64_t>(i))[0] %
                                                     static_cast<uint32_t>(vocab));
  return t;
}

// Byte-equal tensors. Both bit_equal forms skip memcmp for empty buffers:
// memcmp may not be given a null pointer, even for no bytes.
inline bool bit_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && (a.nbytes() == 0 || std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0);
}

// memcmp-equal: bit for bit, where == would call -0 and +0 (or two NaNs) equal
// or not.
template <typename T>
bool bit_equal(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

// max |a - b| / max(|b|, floor) over the elements.
inline double max_rel_diff(const float* a, const float* b, int64_t n, double floor = 1e-30) {
  double worst = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    double d = std::fabs(static_cast<double>(a[i]) - b[i]) / std::max(std::fabs(static_cast<double>(b[i])), floor);
    worst = std::max(worst, d);
  }
  return worst;
}

// Watchdog death tests. The stalled rank starts a StallClock as it stops; the
// ranks that see the failure report it on stderr through reporting_failure
// ("rank K failed after S s: MESSAGE", S on that clock) before the process
// ends; on the dead process's stderr, rank_failures_match checks that each of
// `ranks` reported
// once with min_s <= S < max_s and a MESSAGE containing every one of `parts`,
// and that the whole output contains every one of `output_parts`.
class StallClock {
 public:
  void start() { since_ = std::chrono::steady_clock::now().time_since_epoch().count(); }
  double seconds() const {
    const std::chrono::steady_clock::time_point since{std::chrono::steady_clock::duration(since_.load())};
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
  }

 private:
  std::atomic<std::chrono::steady_clock::rep> since_{0};
};

// Runs `fn`; an Error it throws is reported for `rank` and rethrown.
template <typename Fn>
void reporting_failure(int rank, const StallClock& stall, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    std::fprintf(stderr, "rank %d failed after %.3f s: %s\n", rank, stall.seconds(), e.what());
    throw;
  }
}

class RankFailuresMatcher : public ::testing::MatcherInterface<const std::string&> {
 public:
  RankFailuresMatcher(std::vector<int> ranks, double min_s, double max_s, std::vector<std::string> parts,
                      std::vector<std::string> output_parts)
      : ranks_(std::move(ranks)),
        min_s_(min_s),
        max_s_(max_s),
        parts_(std::move(parts)),
        output_parts_(std::move(output_parts)) {}

  bool MatchAndExplain(const std::string& out, ::testing::MatchResultListener* listener) const override {
    for (const std::string& part : output_parts_)
      if (out.find(part) == std::string::npos) {
        *listener << "the output lacks '" << part << "'";
        return false;
      }
    for (int rank : ranks_) {
      const std::string head = "rank " + std::to_string(rank) + " failed after ";
      const size_t at = out.find(head);
      if (at == std::string::npos || out.find(head, at + 1) != std::string::npos) {
        *listener << "rank " << rank << " did not report its failure exactly once";
        return false;
      }
      char* end = nullptr;
      const double seconds = std::strtod(out.c_str() + at + head.size(), &end);
      const std::string line = out.substr(at, out.find('\n', at) - at);
      if (!(seconds >= min_s_ && seconds < max_s_)) {
        *listener << "rank " << rank << " failed after " << seconds << " s, outside [" << min_s_ << ", " << max_s_
                  << "): " << line;
        return false;
      }
      for (const std::string& part : parts_)
        if (line.find(part) == std::string::npos) {
          *listener << "rank " << rank << "'s message lacks '" << part << "': " << line;
          return false;
        }
    }
    return true;
  }
  void DescribeTo(std::ostream* os) const override {
    *os << "a failure report of each of the ranks within [" << min_s_ << ", " << max_s_ << ") s";
  }

 private:
  std::vector<int> ranks_;
  double min_s_, max_s_;
  std::vector<std::string> parts_, output_parts_;
};

inline ::testing::Matcher<const std::string&> rank_failures_match(std::vector<int> ranks, double min_s, double max_s,
                                                                  std::vector<std::string> parts,
                                                                  std::vector<std::string> output_parts = {}) {
  return ::testing::MakeMatcher(
      new RankFailuresMatcher(std::move(ranks), min_s, max_s, std::move(parts), std::move(output_parts)));
}

}  // namespace loom::testing
