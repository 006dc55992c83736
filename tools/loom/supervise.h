// `loom train --max-restarts N`: the run in a child process, started again
// from its newest complete checkpoint when it fails.
#pragma once

#include <string>
#include <vector>

#include "loom/config.h"
#include "loom/train.h"

namespace loom {

// The `loom train` command line a run was given: under the mpi backend each
// attempt runs it again, one process per rank, through mpirun.
struct TrainCommand {
  std::string config_path;
  std::vector<std::string> overrides;
};

// Validates `cfg` (plan_training: a config error fails here, once, and is
// never retried), then runs run_training in a child process. When the child
// fails (an Error, a rank that died or was killed, the watchdog), the run
// starts again in a new child, resuming from train.out_dir's newest complete
// checkpoint (from the beginning when there is none yet), up to
// `max_restarts` times. Each restart and its cause are printed and appended
// to metrics.jsonl. SIGTERM and SIGINT are passed to the child, which stops
// with a checkpoint (kPreemptedExitStatus) and is not restarted. Returns the
// process's exit status: 0, kPreemptedExitStatus, or 1 once the restarts
// are spent.
//
// Under parallel.backend = "mpi" the supervisor runs outside mpirun and each
// attempt is `$LOOM_MPIRUN -np N loom train` with `command` (LOOM_MPIRUN:
// the mpirun command and its flags, default "mpirun"): when a rank dies,
// mpirun ends the others and the supervisor starts mpirun again.
//
// With `elastic`, each restart runs on fewer data-parallel ranks, as if the
// failed rank's machine were gone: the largest parallel.dp below the last
// that divides the batch (train.batch_size stays, so more gradient
// accumulation keeps the trajectory: the same sequences make each step).
int run_training_with_restarts(const Config& cfg, const TrainCommand& command, const RunOptions& run,
                               int max_restarts, bool elastic = false);

}  // namespace loom
