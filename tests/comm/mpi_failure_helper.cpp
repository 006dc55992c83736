// Launched by mpi_launch_test under mpiexec: a rank function that fails in
// the way named on the command line, run through loom::launch like the
// trainer does.
//   throw    rank 1 throws while the others wait for it in an all_reduce
//   timeout  rank 1 never joins an all_reduce (timeout 1 s)
//   hang     rank 1 stops inside a step, forever (watchdog timeout 1 s)
//   ok       every rank all-reduces and returns normally
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "loom/comm.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  loom::CommOptions options;
  if (mode == "timeout") options.timeout = std::chrono::seconds(1);
  if (mode == "hang") options.watchdog_timeout = std::chrono::seconds(1);
  loom::launch("auto", 0, [&](loom::Communicator& comm) {
    comm.barrier();
    float x = 1.0f;
    if (comm.rank() == 1 && mode == "throw") throw loom::Error("injected failure");
    if (comm.rank() == 1 && mode == "timeout") std::this_thread::sleep_for(std::chrono::seconds(60));
    loom::report_progress("forward", 2, "micro-batch", 0);
    if (comm.rank() == 1 && mode == "hang")
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    comm.all_reduce(&x, 1, loom::DType::f32);
    if (x != static_cast<float>(comm.size())) throw loom::Error("wrong all_reduce result");
    if (comm.rank() == 0) std::printf("helper finished on %d ranks\n", comm.size());
  }, options);
  return 0;
}
