// Shared by the benchmarks: a wall clock and the median of timings; the copy bandwidth and weight
// bytes per token the decode benchmarks' memory-bandwidth bound is made of; running the PyTorch side
// of a comparison; a directory for the NVMe tier. The GEMM baseline every ratio is quoted against is
// cpu::measure_sgemm_gflops (loom/kernels.h).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "loom/core.h"
#include "loom/kernels.h"
#include "loom/nn.h"
#include "loom/quant.h"

namespace loom::bench {

inline double now_seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// Bytes moved per second by memcpy of a buffer far larger than the caches
// (read + write), in parallel chunks; best of 5.
inline double copy_bandwidth(size_t bytes) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  double best = 1e30;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now_seconds();
    const int64_t chunks = 64;
    const size_t chunk = bytes / chunks;
#pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; ++c) std::memcpy(b.data() + c * chunk, a.data() + c * chunk, chunk);
    best = std::min(best, now_seconds() - t0);
  }
  return 2.0 * static_cast<double>(bytes) / best;
}

// The weight bytes one decoded token reads: every parameter (the position
// table, of which a token reads one row, counted whole: block_size rows, a
// small share).
inline double weight_bytes_per_token(const GPT& model, const ParamStore& params) {
  double bytes = 0.0;
  const ParamLayout& layout = model.layout();
  for (size_t i = 0; i < layout.params().size(); ++i) {
    const QuantizedWeight* q = params.quantized(static_cast<int>(i));
    bytes += q != nullptr ? static_cast<double>(q->nbytes()) : 4.0 * static_cast<double>(layout.params()[i].numel());
  }
  return bytes;
}

// The PyTorch side of a comparison: `script` run by $LOOM_BENCH_PYTHON
// (default python3) with `args`, its stdout and stderr together.
struct PythonRun {
  std::string command, output;
  int status = 0;  // pclose's: 0 when the script succeeded
};
inline PythonRun run_python(const std::string& script, const std::vector<std::string>& args) {
  const char* env = std::getenv("LOOM_BENCH_PYTHON");
  PythonRun run;
  run.command = std::string(env && *env ? env : "python3") + " '" + script + "'";
  for (const std::string& a : args) run.command += " " + a;
  FILE* pipe = ::popen((run.command + " 2>&1").c_str(), "r");
  if (!pipe) throw Error("bench: cannot run " + run.command);
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, pipe)) run.output.append(buf, n);
  run.status = ::pclose(pipe);
  return run;
}

// The number after "key": in the JSON line a PyTorch side printed.
inline double json_number(const std::string& output, const std::string& key) {
  const size_t at = output.find("\"" + key + "\": ");
  if (at == std::string::npos) throw Error("bench: no " + key + " in the PyTorch side's output:\n" + output);
  return std::strtod(output.c_str() + at + key.size() + 4, nullptr);
}

// The directory the NVMe tier uses: `arg`, which must exist, or for "-" a
// fresh ./loom-nvme-bench-<pid>, removed with everything in it at the end.
class NvmeDir {
 public:
  explicit NvmeDir(const std::string& arg) {
    if (arg != "-") {
      path_ = arg;
      if (!std::filesystem::is_directory(path_))
        throw Error(str("NVMe directory ", path_, " does not exist; create it or pass - for ./loom-nvme-bench-<pid>"));
      return;
    }
    path_ = std::filesystem::current_path() / str("loom-nvme-bench-", ::getpid());
    std::filesystem::create_directory(path_);
    owned_ = true;
  }
  ~NvmeDir() {
    std::error_code ec;
    if (owned_) std::filesystem::remove_all(path_, ec);
  }
  NvmeDir(const NvmeDir&) = delete;
  NvmeDir& operator=(const NvmeDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  bool owned_ = false;
};

}  // namespace loom::bench
