// Collective bandwidth: all_reduce, reduce_scatter and all_gather on f32 for
// 1 MiB to 256 MiB, as nccl-tests define it:
//   algbw = S / t, with S the full buffer (all_reduce), the full send buffer
//           (reduce_scatter) or the full receive buffer (all_gather)
//   busbw = algbw * 2(n-1)/n for all_reduce, algbw * (n-1)/n for the others
// Each busbw is printed as a ratio to single-thread memcpy bandwidth at the
// same size, measured in the same run. Times are medians over repetitions of
// the slowest rank's time, which keeps the figures steady on a shared machine.
//
//   comm_bench [max MiB]                    local backend, 2, 4 and 8 ranks
//   mpirun -np N comm_bench [max MiB]       mpi backend, N ranks; also prints
//                                           the bandwidth ratio to
//                                           MPI_Allreduce, timed in alternation
//                                           with loom's, on the median and on
//                                           the best repetition of each
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "loom/comm.h"

#ifdef LOOM_WITH_MPI
#include <mpi.h>
#endif

namespace {

using loom::Communicator;
using loom::DType;

constexpr int64_t kMiB = int64_t{1} << 20;

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// Enough repetitions to move about 512 MiB, at least 5, at most 40.
int repetitions(int64_t bytes) { return static_cast<int>(std::clamp<int64_t>(512 * kMiB / bytes, 5, 40)); }

struct Times {
  double median;
  double best;
};

Times summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {v[v.size() / 2], v.front()};
}

// Single-thread memcpy bandwidth in bytes/s over `bytes`.
double memcpy_bandwidth(int64_t bytes) {
  std::vector<char> src(static_cast<size_t>(bytes), 1), dst(static_cast<size_t>(bytes), 0);
  std::memcpy(dst.data(), src.data(), src.size());
  std::vector<double> times;
  for (int r = 0; r < repetitions(bytes); ++r) {
    const double t0 = now();
    std::memcpy(dst.data(), src.data(), src.size());
    times.push_back(now() - t0);
  }
  return static_cast<double>(bytes) / summarize(times).median;
}

enum class Op { all_reduce, reduce_scatter, all_gather };
const char* op_name(Op op) {
  return op == Op::all_reduce ? "all_reduce" : op == Op::reduce_scatter ? "reduce_scatter" : "all_gather";
}

// Seconds per call of each of `calls`, timed in alternation: the slowest
// rank's time for one call, every rank starting after a barrier.
std::vector<Times> time_calls(Communicator& comm, int64_t bytes, const std::vector<std::function<void()>>& calls) {
  for (const auto& call : calls) call();  // warm-up: page faults, scratch buffers
  std::vector<std::vector<double>> times(calls.size());
  for (int r = 0; r < repetitions(bytes); ++r) {
    for (size_t c = 0; c < calls.size(); ++c) {
      comm.barrier();
      const double t0 = now();
      calls[c]();
      float seconds = static_cast<float>(now() - t0);
      comm.all_reduce(&seconds, 1, DType::f32, loom::ReduceOp::max);
      times[c].push_back(seconds);
    }
  }
  std::vector<Times> out;
  for (auto& t : times) out.push_back(summarize(t));
  return out;
}

// Times `op` on a buffer of `bytes` (S above); with `raw_mpi`, also
// MPI_Allreduce on the same buffer.
std::vector<Times> time_collective(Communicator& comm, Op op, int64_t bytes, bool raw_mpi) {
  const int n = comm.size();
  const int64_t count = bytes / 4;
  const int64_t block = count / n;
  std::vector<float> a(static_cast<size_t>(op == Op::all_reduce ? count : op == Op::all_gather ? block : n * block));
  std::vector<float> b(static_cast<size_t>(op == Op::all_reduce ? 0 : op == Op::all_gather ? n * block : block));
  std::vector<std::function<void()>> calls;
  switch (op) {
    case Op::all_reduce: calls.push_back([&] { comm.all_reduce(a.data(), count, DType::f32); }); break;
    case Op::reduce_scatter:
      calls.push_back([&] { comm.reduce_scatter(a.data(), b.data(), block, DType::f32); });
      break;
    case Op::all_gather: calls.push_back([&] { comm.all_gather(a.data(), b.data(), block, DType::f32); }); break;
  }
#ifdef LOOM_WITH_MPI
  if (raw_mpi)
    calls.push_back([&] {
      MPI_Allreduce(MPI_IN_PLACE, a.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    });
#else
  (void)raw_mpi;
#endif
  return time_calls(comm, bytes, calls);
}

void print_memcpy(const std::vector<int64_t>& sizes, const std::vector<double>& bandwidth) {
  std::printf("single-thread memcpy:");
  for (size_t i = 0; i < sizes.size(); ++i)
    std::printf(" %lld MiB %.2f GB/s;", static_cast<long long>(sizes[i] / kMiB), bandwidth[i] / 1e9);
  std::printf("\n");
}

void print_header(bool with_mpi) {
  std::printf("%-8s %5s %-15s %8s %10s %11s %11s %13s%s\n", "backend", "ranks", "collective", "size", "time",
              "algbw GB/s", "busbw GB/s", "busbw/memcpy", with_mpi ? "  vs MPI_Allreduce (median, best)" : "");
}

void print_row(const char* backend, int n, Op op, int64_t bytes, const std::vector<Times>& seconds,
               double memcpy_bw) {
  const double algbw = static_cast<double>(bytes) / seconds[0].median;
  const double factor = op == Op::all_reduce ? 2.0 * (n - 1) / n : static_cast<double>(n - 1) / n;
  const double busbw = algbw * factor;
  std::printf("%-8s %5d %-15s %4lld MiB %8.2f ms %11.2f %11.2f %12.2fx", backend, n, op_name(op),
              static_cast<long long>(bytes / kMiB), seconds[0].median * 1e3, algbw / 1e9, busbw / 1e9,
              busbw / memcpy_bw);
  // Bandwidth relative to MPI_Allreduce: its time over ours.
  if (seconds.size() > 1)
    std::printf("  %15.2fx %6.2fx", seconds[1].median / seconds[0].median, seconds[1].best / seconds[0].best);
  std::printf("\n");
  std::fflush(stdout);
}

std::vector<int64_t> sizes_up_to(int64_t max_mib) {
  std::vector<int64_t> sizes;
  for (int64_t mib = 1; mib <= max_mib; mib *= 4) sizes.push_back(mib * kMiB);
  return sizes;
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t max_mib = argc > 1 ? std::atoll(argv[1]) : 256;
  const std::vector<int64_t> sizes = sizes_up_to(max_mib);
  constexpr Op kOps[] = {Op::all_reduce, Op::reduce_scatter, Op::all_gather};

  if (loom::launched_by_mpirun()) {
#ifdef LOOM_WITH_MPI
    loom::MpiRuntime mpi;
    Communicator& world = mpi.world();
    std::vector<double> memcpy_bw;
    if (world.rank() == 0) {
      for (int64_t bytes : sizes) memcpy_bw.push_back(memcpy_bandwidth(bytes));
      print_memcpy(sizes, memcpy_bw);
      print_header(true);
    }
    world.barrier();
    for (Op op : kOps) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        const std::vector<Times> seconds = time_collective(world, op, sizes[i], op == Op::all_reduce);
        if (world.rank() == 0) print_row("mpi", world.size(), op, sizes[i], seconds, memcpy_bw[i]);
      }
    }
    return 0;
#endif
  }

  std::vector<double> memcpy_bw;
  for (int64_t bytes : sizes) memcpy_bw.push_back(memcpy_bandwidth(bytes));
  print_memcpy(sizes, memcpy_bw);
  print_header(false);
  for (int n : {2, 4, 8}) {
    for (Op op : kOps) {
      for (size_t i = 0; i < sizes.size(); ++i) {
        loom::run_local(n, [&](Communicator& comm) {
          const std::vector<Times> seconds = time_collective(comm, op, sizes[i], false);
          if (comm.rank() == 0) print_row("local", n, op, sizes[i], seconds, memcpy_bw[i]);
        });
      }
    }
  }
  return 0;
}
