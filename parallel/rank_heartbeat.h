#pragma once
// Liveness of the ranks of one job, for rank 0's step watchdog. Every other rank sends rank 0 a tiny message
// every `interval` from a thread of its own, on a private duplicate of MPI_COMM_WORLD; rank 0 takes them in
// with poll() and tells which ranks have gone silent. The thread keeps beating while its rank's step loop is
// busy or blocked in a collective, so silence means the process itself does not run (SIGSTOP, a frozen or
// swapping machine): it names the culprit when every rank's step loop is only waiting for it.
// Needs MPI_THREAD_MULTIPLE (the beats travel while the step loop uses MPI).
#include <mpi.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

#include "parallel/mpi_world.h"

namespace capserve::parallel {

class RankHeartbeat {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective: every rank constructs it at the same point. Throws std::runtime_error when MPI does not
  // grant MPI_THREAD_MULTIPLE.
  RankHeartbeat(const MpiWorld& world, std::chrono::milliseconds interval);
  // Other ranks: stop beating and send a last message. Rank 0: take every rank's last message (or give up
  // after a few intervals, e.g. when a rank is gone), so that nothing is left unmatched at MPI_Finalize.
  ~RankHeartbeat();
  RankHeartbeat(const RankHeartbeat&) = delete;
  RankHeartbeat& operator=(const RankHeartbeat&) = delete;

  // Rank 0, one thread at a time: takes in the beats that arrived.
  void poll();
  // Rank 0: the ranks (never 0) not heard from for at least `silence` as of the last poll(), ascending.
  [[nodiscard]] std::vector<int> silent_ranks(Clock::duration silence) const;

 private:
  void beat();
  void post_receive();

  int rank_ = 0;
  std::chrono::milliseconds interval_;
  MPI_Comm comm_ = MPI_COMM_NULL;
  // Rank 0.
  MPI_Request receive_ = MPI_REQUEST_NULL;
  int message_ = 0;
  std::vector<Clock::time_point> last_heard_;
  std::vector<bool> finished_;
  // Other ranks.
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread sender_;
};

}  // namespace capserve::parallel
