#pragma once
// Waiting for a non-blocking MPI operation without holding a core. A blocking MPI call polls for its whole
// wait: with more busy threads than cores (ranks oversubscribed, or other work beside them) the waiting ranks
// take the cores from the ranks they wait for, and every message of a collective waits for a scheduler slice.
// Polling MPI_Test with sleeps between polls lets the others run; a rank woken from a sleep is scheduled
// promptly.
#include <mpi.h>

#include <chrono>

namespace capserve::parallel::mpi {

struct WaitPolicy {
  std::chrono::microseconds spin;       // poll without sleeping for this long first (short waits stay fast)
  std::chrono::microseconds max_sleep;  // sleeps grow (an eighth of the time waited so far) up to this
};

// Within a step: the ranks' collectives usually meet within the spin, and a late one costs at most 100 µs
// more. (test_mpi_model's qwen2_moe cases, 4 ranks on 2 cores: 1.07 s idle as with blocking collectives, 1.05
// s; with both cores saturated by other work 28 s instead of 43 s.)
inline constexpr WaitPolicy kStepWait{std::chrono::microseconds(200), std::chrono::microseconds(100)};
// Idle ranks waiting for the next step plan: nearly no CPU while the server has nothing to do.
inline constexpr WaitPolicy kIdleWait{std::chrono::microseconds(200), std::chrono::microseconds(500)};

// Completes `request` (progressing MPI through MPI_Test); throws like check(rc, who, what) on an MPI error.
void wait(MPI_Request& request, WaitPolicy policy, const char* who, const char* what);

}  // namespace capserve::parallel::mpi
