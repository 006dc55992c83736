// Failure handling of the mpi backend, which ends processes: each case runs
// mpi_failure_helper under mpiexec and checks its exit status, its messages
// and how long the job took.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <string>

namespace {

struct JobResult {
  int exit_code;
  std::string output;
  double seconds;
};

JobResult run_job(const std::string& mode, int ranks) {
  // `timeout` guarantees the test ends even if the job hangs.
  const std::string command = "timeout --kill-after=5 60 " + std::string(LOOM_MPIEXEC) +
                              " --allow-run-as-root --oversubscribe -np " +
                              std::to_string(ranks) + " " + LOOM_MPI_HELPER + " " + mode + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen(command.c_str(), "r");
  if (!pipe) return {-1, "popen failed: " + command, 0};
  std::string output;
  std::array<char, 4096> chunk;
  while (size_t n = std::fread(chunk.data(), 1, chunk.size(), pipe)) output.append(chunk.data(), n);
  const int status = pclose(pipe);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), output, seconds};
}

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(MpiLaunch, NormalRunExitsCleanly) {
  const JobResult job = run_job("ok", 2);
  EXPECT_EQ(job.exit_code, 0) << job.output;
  EXPECT_TRUE(contains(job.output, "helper finished on 2 ranks")) << job.output;
}

TEST(MpiLaunch, ExceptionOnOneRankEndsEveryRankNamingIt) {
  const JobResult job = run_job("throw", 3);
  EXPECT_NE(job.exit_code, 0) << job.output;
  EXPECT_TRUE(contains(job.output, "loom: rank 1 failed: injected failure")) << job.output;
  EXPECT_LT(job.seconds, 10.0) << job.output;
}

TEST(MpiLaunch, TimeoutEndsEveryRankNamingOperationAndMissingRank) {
  const JobResult job = run_job("timeout", 3);
  EXPECT_NE(job.exit_code, 0) << job.output;
  EXPECT_TRUE(contains(job.output, "all_reduce #2 (1 x f32, sum) on world ranks [0-2] timed out after 1.0 s "
                                   "waiting for world rank(s) [1]"))
      << job.output;
  EXPECT_LT(job.seconds, 10.0) << job.output;
}

TEST(MpiLaunch, StalledRankEndsEveryRankNamingItsPhase) {
  const JobResult job = run_job("hang", 3);
  EXPECT_NE(job.exit_code, 0) << job.output;
  EXPECT_TRUE(contains(job.output, "loom: rank 1 failed: made no progress for ")) << job.output;
  EXPECT_TRUE(contains(job.output, " while in 'forward step 2 micro-batch 0' (watchdog timeout 1.0 s)"))
      << job.output;
  EXPECT_LT(job.seconds, 10.0) << job.output;
}

}  // namespace
