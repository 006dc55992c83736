#include "supervise.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "loom/comm.h"
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

// The child under the mpi backend: mpirun running this program's `train`
// on every rank, with the supervisor's command line, the layout `cfg` has
// now (elastic restarts change parallel.dp) and the attempt's options.
[[noreturn]] void exec_mpirun(const Config& cfg, const TrainCommand& command, const RunOptions& run, int nproc) {
  std::vector<std::string> args;
  const char* mpirun = std::getenv("LOOM_MPIRUN");
  std::istringstream words(mpirun && *mpirun ? mpirun : "mpirun");
  for (std::string w; words >> w;) args.push_back(w);
  std::error_code ec;
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe", ec);
  args.insert(args.end(), {"-np", std::to_string(nproc), self.string(), "train", "--config", command.config_path});
  std::vector<std::string> overrides = command.overrides;
  overrides.push_back(str("parallel.dp=", cfg.get<int64_t>("parallel.dp")));
  overrides.push_back(str("parallel.nproc=", cfg.get<int64_t>("parallel.nproc")));
  for (const std::string& o : overrides) args.insert(args.end(), {"--set", o});
  if (run.resume) args.push_back("--resume");
  if (run.overwrite) args.push_back("--overwrite");
  if (run.stop_after > 0) args.insert(args.end(), {"--stop-after", std::to_string(run.stop_after)});
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "error: --max-restarts cannot start %s: %s (set LOOM_MPIRUN to the mpirun command)\n",
               argv[0], std::strerror(errno));
  std::fflush(nullptr);
  ::_exit(127);
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

bool on_mpi(const Config& cfg) { return cfg.get<std::string>("parallel.backend") == "mpi"; }

// plan_training of an attempt, whose ranks the supervisor starts (under the
// mpi backend, through the mpirun it starts outside any mpirun).
TrainPlan plan_attempt(const Config& cfg) { return plan_training(cfg, Launch::supervisor); }

// `cfg` on the largest number of data-parallel ranks below its own that
// plan_training accepts, or nothing when it runs on one.
std::optional<Config> on_fewer_ranks(const Config& cfg) {
  for (int64_t dp = cfg.get<int64_t>("parallel.dp") - 1; dp >= 1; --dp) {
    Config fewer = cfg;
    fewer.set_override(str("parallel.dp=", dp));
    if (fewer.get<int64_t>("parallel.nproc") != 0) fewer.set_override("parallel.nproc=0");
    try {
      plan_attempt(fewer);
      return fewer;
    } catch (const ConfigError&) {
    }
  }
  return std::nullopt;
}

}  // namespace

int run_training_with_restarts(const Config& cfg, const TrainCommand& command, const RunOptions& run,
                               int max_restarts, bool elastic) {
  if (max_restarts < 0) throw Error("--max-restarts must be 0 or more");
  const TrainPlan plan = plan_attempt(cfg);
  const bool mpi = on_mpi(cfg);
  if (launched_by_mpirun())
    throw Error("--max-restarts starts the run's ranks itself (mpirun under parallel.backend = \"mpi\"): run `loom "
                "train --max-restarts N` outside mpirun, with LOOM_MPIRUN naming the mpirun command if it needs flags");
  const ScopedTerminationHandler forwarding(forward_signal, SA_RESTART);
  RunOptions attempt = run;
  Config current = cfg;
  for (int restarts = 0;; ++restarts) {
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) throw Error(str("--max-restarts: cannot start the run's process: ", std::strerror(errno)));
    if (pid == 0) {
      if (mpi) exec_mpirun(current, command, attempt, plan_attempt(current).nproc);
      run_child(current, attempt);
    }
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
