// `loom calibrate`: measures the rates the time model prices a step with on
// this machine. Every figure is the best (GEMMs, copies) or the median
// (collectives, whose ranks share cores) of a few repetitions after a
// warm-up, so one noisy moment on a shared machine does not set a rate.
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <exception>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <omp.h>

#include "loom/comm.h"
#include "loom/device.h"
#include "loom/kernels.h"
#include "loom/memory.h"
#include "loom/planner.h"

namespace loom {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Lines up the copies of a measurement that run at once (at_once): each
// run of the work starts when every copy is ready for it. One copy: no
// waiting.
class Aligner {
 public:
  explicit Aligner(int copies) : copies_(copies), barrier_(copies) {}
  void wait() {
    if (copies_ > 1) barrier_.arrive_and_wait();
  }

 private:
  int copies_;
  std::barrier<> barrier_;
};

// The fastest of `reps` runs of `work` after one warm-up run, every run
// lined up with the other copies'.
template <typename Work>
double best_seconds(int reps, Aligner& align, Work work) {
  align.wait();
  work();
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    align.wait();
    const auto start = std::chrono::steady_clock::now();
    work();
    best = std::min(best, seconds_since(start));
  }
  return best;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void report(const CalibrationOptions& options, const std::string& line) {
  if (options.progress) options.progress(line);
}

// The thread counts to measure at: the options', else 1, 2, 4, ... below
// the OpenMP threads, and those (each of w local ranks runs on
// max(1, threads / w)).
std::vector<int> thread_counts(const CalibrationOptions& options) {
  if (!options.threads.empty()) return options.threads;
  const int all = omp_get_max_threads();
  std::vector<int> counts;
  for (int t = 1; t < all; t *= 2) counts.push_back(t);
  counts.push_back(all);
  return counts;
}

// Runs `copies` copies of `measure(align)` at once, each on a thread of its
// own with the kernels on `threads` threads and a memory context of its
// own, and returns each copy's result: what each of `copies` local ranks
// measures while the others run the same kernels, as ranks sharing the
// machine do (two threads running two products are each slower than one
// running alone: they share caches, memory bandwidth and the clock).
template <typename Measure>
auto at_once(int copies, int threads, Measure measure) {
  Aligner align(copies);
  using Result = decltype(measure(align));
  std::vector<Result> results(static_cast<size_t>(copies));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(copies));
  std::vector<std::thread> workers;
  for (int c = 0; c < copies; ++c)
    workers.emplace_back([&, c] {
      try {
        MemoryContext ctx;
        MemoryContext::Install install(ctx);
        cpu::set_num_threads(threads);
        results[static_cast<size_t>(c)] = measure(align);
      } catch (...) {
        errors[static_cast<size_t>(c)] = std::current_exception();
      }
    });
  for (std::thread& w : workers) w.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
  return results;
}

std::vector<GemmSample> measure_gemms(const CalibrationOptions& options, int threads, Aligner& align) {
  const int64_t largest = *std::max_element(options.gemm_sizes.begin(), options.gemm_sizes.end());
  Tensor a = Tensor::empty({largest, largest}), b = Tensor::empty({largest, largest}),
         c = Tensor::empty({largest, largest});
  for (Tensor* t : {&a, &b}) ops::fill(t->data<float>(), DType::f32, t->numel(), 0.5f);
  std::vector<GemmSample> samples;
  for (int64_t m : options.gemm_sizes)
    for (int64_t n : options.gemm_sizes)
      for (int64_t k : options.gemm_sizes) {
        const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k);
        // Enough repetitions that the small products are timed over about a
        // millisecond, not one call's jitter.
        const int reps = static_cast<int>(std::clamp(1e8 / flops, 3.0, 200.0));
        const double s = best_seconds(3, align, [&] {
          for (int r = 0; r < reps; ++r)
            ops::gemm(false, false, m, n, k, 1.0f, a.data<float>(), k, b.data<float>(), n, 0.0f, c.data<float>(), n);
          ops::synchronize();
        });
        samples.push_back({m, n, k, flops * reps / s, threads});
      }
  return samples;
}

// The attention kernels over 2 sequences of 4 heads at each (seq_len,
// head_dim), per head and sequence.
std::vector<AttentionSample> measure_attention(const CalibrationOptions& options, int threads, Aligner& align) {
  constexpr int64_t B = 2, NH = 4;
  std::vector<AttentionSample> samples;
  for (int64_t T : options.attention_seq_lens)
    for (int64_t hs : options.attention_head_dims) {
      const int64_t C = NH * hs, rows = B * T;
      Tensor qkv = Tensor::empty({rows, 3 * C}), out = Tensor::empty({rows, C}), lse = Tensor::empty({B * NH * T}),
             dout = Tensor::empty({rows, C}), dqkv = Tensor::empty({rows, 3 * C});
      ops::fill(qkv.data<float>(), DType::f32, qkv.numel(), 0.01f);
      ops::fill(dout.data<float>(), DType::f32, dout.numel(), 0.01f);
      const double forward = best_seconds(3, align, [&] {
        ops::attention_forward(out.data<float>(), lse.data<float>(), qkv.data<float>(), B, T, C, NH, NH);
        ops::synchronize();
      });
      const double backward = best_seconds(3, align, [&] {
        ops::attention_backward(dqkv.data<float>(), dout.data<float>(), out.data<float>(), lse.data<float>(),
                                qkv.data<float>(), B, T, C, NH, NH, ops::GradWrite::overwrite);
        ops::synchronize();
      });
      samples.push_back({T, hs, forward / (B * NH), backward / (B * NH), threads});
    }
  return samples;
}

// The GEMM and attention samples at `threads` threads, each the mean of what
// the copies that run at once measured (every sample lists the same shapes
// in the same order).
void measure_kernels(const CalibrationOptions& options, int threads, int copies, MachineRates& rates) {
  const auto on = [&](auto measure) { return at_once(copies, threads, measure); };
  const std::vector<std::vector<GemmSample>> gemms =
      on([&](Aligner& align) { return measure_gemms(options, threads, align); });
  const std::vector<std::vector<AttentionSample>> attention =
      on([&](Aligner& align) { return measure_attention(options, threads, align); });
  const double n = static_cast<double>(copies);
  double best = 0.0;
  for (size_t i = 0; i < gemms[0].size(); ++i) {
    GemmSample g = gemms[0][i];
    g.flops_per_s = 0.0;
    for (const std::vector<GemmSample>& copy : gemms) g.flops_per_s += copy[i].flops_per_s / n;
    best = std::max(best, g.flops_per_s);
    rates.gemm.push_back(g);
  }
  for (size_t i = 0; i < attention[0].size(); ++i) {
    AttentionSample a = attention[0][i];
    a.forward_s = a.backward_s = 0.0;
    for (const std::vector<AttentionSample>& copy : attention) {
      a.forward_s += copy[i].forward_s / n;
      a.backward_s += copy[i].backward_s / n;
    }
    rates.attention.push_back(a);
  }
  const std::string on_threads = str(" on ", threads, threads == 1 ? " thread" : " threads",
                                     copies > 1 ? str(", ", copies, " at once") : std::string());
  report(options, str("gemm", on_threads, ": ", gemms[0].size(), " shapes, best ", static_cast<int64_t>(best / 1e9),
                      " GFLOP/s"));
  report(options, str("attention", on_threads, ": ", attention[0].size(), " shapes"));
}

// Bytes read plus bytes written per second by a device-to-device copy.
double measure_copy_rate(const CalibrationOptions& options) {
  const int64_t n = options.memory_bytes / 4;
  Tensor src = Tensor::empty({n}), dst = Tensor::empty({n});
  ops::fill(src.data<float>(), DType::f32, n, 1.0f);
  Aligner alone(1);
  const double s = best_seconds(5, alone, [&] {
    ops::copy(dst.data<float>(), src.data<float>(), src.nbytes());
    ops::synchronize();
  });
  const double rate = 2.0 * static_cast<double>(src.nbytes()) / s;
  report(options, str("memory: ", static_cast<int64_t>(rate / 1e9), " GB/s (read + write)"));
  return rate;
}

// alpha-beta through two points (bytes, seconds). A measurement where the
// larger message was no slower (noise) gives no latency to separate out:
// the rate of the larger one alone is kept.
LinkCost fit_link(double small_bytes, double small_s, double large_bytes, double large_s) {
  if (large_s <= small_s) return LinkCost{0.0, large_bytes / large_s};
  const double bandwidth = (large_bytes - small_bytes) / (large_s - small_s);
  return LinkCost{std::max(0.0, small_s - small_bytes / bandwidth), bandwidth};
}

// Each collective on `group` local ranks at a small and a large buffer;
// rank 0's median over repetitions, each started behind a barrier.
std::vector<CollectiveCost> measure_collectives(int group) {
  constexpr int64_t kSmall = 1 << 10, kLarge = 4 << 20;  // floats per rank's buffer
  constexpr int kReps = 7;
  std::vector<CollectiveCost> costs;
  std::mutex mutex;
  run_local(group, [&](Communicator& comm) {
    MemoryContext ctx;
    MemoryContext::Install install(ctx);
    Tensor buf = Tensor::zeros({kLarge}), out = Tensor::zeros({kLarge});
    auto timed = [&](auto op) {
      op();
      std::vector<double> times;
      for (int r = 0; r < kReps; ++r) {
        comm.barrier();
        const auto start = std::chrono::steady_clock::now();
        op();
        times.push_back(seconds_since(start));
      }
      return median(times);
    };
    auto fit = [&](Collective op, auto run) {
      const double small = timed([&] { run(kSmall); }), large = timed([&] { run(kLarge); });
      if (comm.rank() != 0) return;
      const std::lock_guard lock(mutex);
      costs.push_back({op, group, fit_link(4.0 * kSmall, small, 4.0 * kLarge, large)});
    };
    float* b = buf.data<float>();
    float* o = out.data<float>();
    fit(Collective::all_reduce, [&](int64_t n) { comm.all_reduce(b, n, DType::f32); });
    fit(Collective::reduce_scatter,
        [&](int64_t n) { comm.reduce_scatter(b, o, n / comm.size(), DType::f32); });
    fit(Collective::all_gather, [&](int64_t n) { comm.all_gather(b, o, n / comm.size(), DType::f32); });
    // Point to point: every even rank sends to the next odd one and waits
    // for its answer (half the round trip is one message), all pairs at
    // once, as a pipeline's stages exchange activations while every rank
    // of the machine is busy.
    const int peer = comm.rank() ^ 1;
    fit(Collective::send_recv, [&](int64_t n) {
      const size_t bytes = static_cast<size_t>(n) * 4;
      if (peer >= comm.size()) return;
      if (comm.rank() % 2 == 0) {
        comm.send(b, bytes, peer, 0);
        comm.recv(o, bytes, peer, 1);
      } else {
        comm.recv(o, bytes, peer, 0);
        comm.send(b, bytes, peer, 1);
      }
    });
  });
  for (CollectiveCost& c : costs)
    if (c.op == Collective::send_recv) {
      c.cost.latency_s /= 2;
      c.cost.bytes_per_s *= 2;
    }
  return costs;
}

// "Intel(R) Xeon(R) ... , 2 threads": /proc/cpuinfo's model name and the
// OpenMP threads the kernels use.
std::string cpu_description() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line, model = "unknown CPU";
  while (std::getline(cpuinfo, line))
    if (line.rfind("model name", 0) == 0 && line.find(':') != std::string::npos) {
      model = line.substr(line.find(':') + 2);
      break;
    }
  return str(model, ", ", omp_get_max_threads(), " threads");
}

// The share of the CPUs' time spent outside idle over `window`
// (/proc/stat), before this process starts its own work; nothing where
// /proc/stat cannot be read.
std::optional<double> busy_share(std::chrono::milliseconds window) {
  const auto sample = []() -> std::optional<std::pair<double, double>> {
    std::ifstream stat("/proc/stat");
    std::string cpu;
    double user, nice, system, idle, iowait, irq, softirq, steal;
    if (!(stat >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal) || cpu != "cpu")
      return std::nullopt;
    return std::pair{user + nice + system + idle + iowait + irq + softirq + steal, idle + iowait};
  };
  const auto before = sample();
  std::this_thread::sleep_for(window);
  const auto after = sample();
  if (!before || !after || after->first <= before->first) return std::nullopt;
  return 1.0 - (after->second - before->second) / (after->first - before->first);
}

std::string percent(double share) {
  char text[16];
  std::snprintf(text, sizeof text, "%.0f%%", 100.0 * share);
  return text;
}

double physical_memory_bytes() {
  return static_cast<double>(::sysconf(_SC_PHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGE_SIZE));
}

}  // namespace

MachineRates calibrate_machine(const CalibrationOptions& options) {
  LOOM_CHECK(!options.gemm_sizes.empty() && !options.groups.empty() && options.memory_bytes >= 4,
             "calibration needs GEMM sizes, rank groups and a copy buffer");
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  // Rates measured on a busy machine are too slow, often by far (OpenMP
  // threads that lose their cores wait for each other at every barrier), so
  // a calibration says how busy the machine was as it began.
  const std::optional<double> busy = busy_share(std::chrono::milliseconds(500));
  MachineRates rates;
  rates.description = str("calibrated on ", host, " (", cpu_description(), ")",
                          busy ? str(", ", percent(*busy), " busy with other work at the start") : std::string());
  if (busy && *busy > 0.25)
    report(options, str("warning: the CPUs were ", percent(*busy),
                        " busy with other work, so these rates will be too slow; calibrate again when the machine "
                        "is quiet"));
  rates.threads = omp_get_max_threads();
  // Local ranks on `threads` threads each are all / threads of them
  // (DeviceShare in step_time.cpp), so each count is measured with that
  // many copies running at once.
  for (int threads : thread_counts(options))
    measure_kernels(options, threads, std::max(1, rates.threads / threads), rates);
  for (const GemmSample& g : rates.gemm) rates.peak_flops_fp32 = std::max(rates.peak_flops_fp32, g.flops_per_s);
  rates.memory_bytes_per_s = measure_copy_rate(options);
  rates.device_memory_bytes = physical_memory_bytes();
  for (int group : options.groups) {
    for (const CollectiveCost& c : measure_collectives(group)) rates.collectives.push_back(c);
    report(options, str("collectives on ", group, " local ranks"));
  }
  // Local ranks are threads of one process: the link between them is
  // memory, priced by the measured point-to-point fit.
  rates.ranks_per_node = *std::max_element(options.groups.begin(), options.groups.end());
  rates.shared_by_local_ranks = true;
  // The link is the one pair's, with no other rank competing for the cores.
  const CollectiveCost* pair = nullptr;
  for (const CollectiveCost& c : rates.collectives)
    if (c.op == Collective::send_recv && (!pair || c.group < pair->group)) pair = &c;
  if (pair) rates.intra_node = rates.inter_node = pair->cost;
  if (!options.nvme_dir.empty()) {
    const DiskThroughput disk = measure_sequential_throughput(options.nvme_dir, options.nvme_bytes);
    rates.nvme_read_bytes_per_s = disk.read_bytes_per_s;
    rates.nvme_write_bytes_per_s = disk.write_bytes_per_s;
    report(options, str("nvme: read ", static_cast<int64_t>(disk.read_bytes_per_s / 1e6), " MB/s, write ",
                        static_cast<int64_t>(disk.write_bytes_per_s / 1e6), " MB/s"));
  }
  return rates;
}

}  // namespace loom
