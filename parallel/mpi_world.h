#pragma once
// The MPI process group of one CapServe job and its control plane (step plans broadcast from rank 0, results
// gathered to it, "did every rank succeed?"). One MpiWorld per process, created first in main and destroyed
// last: it owns MPI_Init_thread / MPI_Finalize. Works under `mpirun -np N` and as an Open MPI singleton
// (started without mpirun: one rank). Control-plane calls are collectives on a private duplicate of
// MPI_COMM_WORLD, so they never match messages of the data plane (MpiCommunicator has its own duplicate);
// every rank must call them in the same order, from one thread at a time.
#include <mpi.h>

#include <cstddef>
#include <optional>
#include <span>
#include <vector>

namespace capserve::parallel {

class MpiWorld {
 public:
  // Calls MPI_Init_thread asking for MPI_THREAD_MULTIPLE; throws std::runtime_error when MPI is already
  // initialized in this process or the library grants less than MPI_THREAD_SERIALIZED.
  MpiWorld(int& argc, char**& argv);
  // Frees the communicators, then MPI_Finalize. When destroyed by an exception unwinding on one rank of
  // several, calls MPI_Abort instead: the other ranks may be waiting for this one in a collective, and
  // MPI_Finalize would wait for them.
  ~MpiWorld();
  MpiWorld(const MpiWorld&) = delete;
  MpiWorld& operator=(const MpiWorld&) = delete;
  MpiWorld(MpiWorld&&) = delete;
  MpiWorld& operator=(MpiWorld&&) = delete;

  [[nodiscard]] int rank() const { return rank_; }
  [[nodiscard]] int size() const { return size_; }
  // Rank and size among the processes of this node (MPI_COMM_TYPE_SHARED), e.g. to pick a GPU.
  [[nodiscard]] int local_rank() const { return local_rank_; }
  [[nodiscard]] int local_size() const { return local_size_; }
  // The thread level MPI granted: MPI_THREAD_SERIALIZED or MPI_THREAD_MULTIPLE.
  [[nodiscard]] int thread_level() const { return thread_level_; }

  // Root's bytes to every rank: on the others `bytes` is resized and overwritten. Any size (sent in chunks).
  // The receivers wait without spinning a core (polling with short sleeps).
  void broadcast(std::vector<std::byte>& bytes, int root);
  // Every rank's bytes (sizes may differ, may be empty) to root: result[r] is rank r's `mine` on root, and
  // empty on the other ranks. Throws std::length_error on every rank when the total exceeds INT_MAX bytes.
  std::vector<std::vector<std::byte>> gather(std::span<const std::byte> mine, int root);
  // Logical AND of `ok` over all ranks.
  [[nodiscard]] bool all_agree(bool ok);
  void barrier();
  // Ends every rank of the job (MPI_Abort on MPI_COMM_WORLD) with `code`.
  [[noreturn]] void abort(int code);

 private:
  void check_root(int root) const;

  int uncaught_at_start_ = 0;
  int thread_level_ = 0;
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
  int local_size_ = 1;
  MPI_Comm control_ = MPI_COMM_NULL;
  MPI_Comm local_ = MPI_COMM_NULL;
};

// The first thing a program's main does: starts MPI into `world`, or prints "<program>: <why>" to stderr and
// returns false (the program then exits 1).
bool start_mpi(std::optional<MpiWorld>& world, int& argc, char**& argv, const char* program);

}  // namespace capserve::parallel
