#include <cstdlib>

#include "loom/comm.h"

namespace loom {

bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

std::string default_backend() { return launched_by_mpirun() ? "mpi" : "local"; }

void launch(std::string_view backend, int nproc, const RankFunction& fn, const CommOptions& options) {
  const std::string name = backend == "auto" ? default_backend() : std::string(backend);
  if (name == "local") {
    run_local(nproc, fn, options);
    return;
  }
  if (name == "mpi") {
    if (!mpi_available()) {
      throw Error(
          "the mpi backend is not in this build: install OpenMPI and reconfigure with -DLOOM_WITH_MPI=ON, or use "
          "the local backend");
    }
    if (!launched_by_mpirun()) {
      if (nproc > 1)
        throw Error(str("the mpi backend runs one process per rank: start ", nproc, " ranks with `mpirun -np ", nproc,
                        " ...` instead of asking for ", nproc, " here, or use the local backend"));
    } else if (nproc > 0) {
      const int started = std::atoi(std::getenv("OMPI_COMM_WORLD_SIZE"));
      if (nproc != started)
        throw Error(str("asked for ", nproc, " ranks but mpirun started ", started,
                        "; pass the number of ranks to mpirun only"));
    }
    run_mpi(fn, options);
    return;
  }
  throw Error(str("unknown communication backend '", backend, "': use local, mpi or auto"));
}

}  // namespace loom
