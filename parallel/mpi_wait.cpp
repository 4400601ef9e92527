#include "parallel/mpi_wait.h"

#include "parallel/mpi_call.h"

#include <algorithm>
#include <thread>

namespace capserve::parallel::mpi {

void wait(MPI_Request& request, WaitPolicy policy, const char* who, const char* what) {
  const auto started = std::chrono::steady_clock::now();
  for (int done = 0;;) {
    check(MPI_Test(&request, &done, MPI_STATUS_IGNORE), who, what);
    if (done != 0) return;
    const auto waited = std::chrono::steady_clock::now() - started;
    if (waited > policy.spin) {
      std::this_thread::sleep_for(
          std::min<std::chrono::steady_clock::duration>(waited / 8, policy.max_sleep));
    }
  }
}

}  // namespace capserve::parallel::mpi
