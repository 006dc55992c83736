#include "supervise.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <optional>

#include <nlohmann/json.hpp>

#include "loom/io.h"

namespace loom {

namespace {

// The child the supervisor waits for, which its signal handler passes
// SIGTERM and SIGINT to; 0 while none runs.
volatile sig_atomic_t g_child = 0;

void forward_signal(int signal) {
  if (g_child > 0) ::kill(static_cast<pid_t>(g_child), signal);
}

// The child: one attempt of the run, its outcome as an exit status.
[[noreturn]] void run_child(const Config& cfg, const RunOptions& run) {
  int status = 0;
  try {
    status = run_training(cfg, run).stop_signal != 0 ? kPreemptedExitStatus : 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    status = 1;
  }
  std::fflush(nullptr);
  // Not exit(): the parent's atexit handlers and static destructors are
  // the supervisor's, not this attempt's.
  ::_exit(status);
}

// "exited with status 1", "killed by SIGKILL".
std::string describe(int wait_status) {
  if (WIFEXITED(wait_status)) return str("exited with status ", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    const char* name = sigabbrev_np(WTERMSIG(wait_status));
    return str("killed by ", name ? str("SIG", name) : str("signal ", WTERMSIG(wait_status)));
  }
  return str("ended with wait status ", wait_status);
}

// `cfg` on the largest number of data-parallel ranks below its own that
// plan_training accepts, or nothing when it runs on one.
std::optional<Config> on_fewer_ranks(const Config& cfg) {
  for (int64_t dp = cfg.get<int64_t>("parallel.dp") - 1; dp >= 1; --dp) {
    Config fewer = cfg;
    fewer.set_override(str("parallel.dp=", dp));
    if (fewer.get<int64_t>("parallel.nproc") != 0) fewer.set_override("parallel.nproc=0");
    try {
      plan_training(fewer);
      return fewer;
    } catch (const ConfigError&) {
    }
  }
  return std::nullopt;
}

}  // namespace

int run_training_with_restarts(const Config& cfg, const RunOptions& run, int max_restarts, bool elastic) {
  if (max_restarts < 0) throw Error("--max-restarts must be 0 or more");
  const TrainPlan plan = plan_training(cfg);
  if (plan.backend != "local")
    throw Error(str("--max-restarts restarts the local backend's ranks; under parallel.backend = \"", plan.backend,
                    "\" each process is one rank: restart mpirun itself (e.g. in the job script) with --resume"));
  const ScopedTerminationHandler forwarding(forward_signal, SA_RESTART);
  RunOptions attempt = run;
  Config current = cfg;
  for (int restarts = 0;; ++restarts) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw Error(str("--max-restarts: cannot start the run's process: ", std::strerror(errno)));
    if (pid == 0) run_child(current, attempt);
    g_child = pid;
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_child = 0;
    if (WIFEXITED(status) && (WEXITSTATUS(status) == 0 || WEXITSTATUS(status) == kPreemptedExitStatus))
      return WEXITSTATUS(status);
    const std::string cause = describe(status);
    if (restarts == max_restarts) {
      std::fprintf(stderr, "error: the run %s; giving up after %d restart%s (--max-restarts %d)\n", cause.c_str(),
                   restarts, restarts == 1 ? "" : "s", max_restarts);
      return 1;
    }
    // The next attempt continues the newest complete checkpoint, or, before
    // the first one, starts the run afresh.
    const std::vector<CheckpointEntry> checkpoints = list_checkpoints(plan.out_dir);
    attempt.resume = !checkpoints.empty();
    attempt.overwrite = false;
    const int64_t from = checkpoints.empty() ? 0 : checkpoints.back().step;
    std::string ranks;
    if (elastic)
      if (std::optional<Config> fewer = on_fewer_ranks(current)) {
        current = *fewer;
        ranks = str(" on ", current.get<int64_t>("parallel.dp"), " data-parallel ranks");
      }
    std::printf("\nthe run %s; restart %d of %d from %s%s\n", cause.c_str(), restarts + 1, max_restarts,
                checkpoints.empty() ? "the beginning" : str("step ", from).c_str(), ranks.c_str());
    std::error_code ec;
    if (std::filesystem::is_directory(plan.out_dir, ec)) {
      std::ofstream metrics(plan.out_dir / "metrics.jsonl", std::ios::app);
      metrics << nlohmann::json{{"restart", restarts + 1},
                                {"cause", cause},
                                {"resume_step", from},
                                {"dp", current.get<int64_t>("parallel.dp")}}
                     .dump()
              << "\n";
    }
  }
}

}  // namespace loom
