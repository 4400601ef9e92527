#include "parallel/mpi_world.h"

#include "parallel/mpi_call.h"
#include "parallel/mpi_wait.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <stdexcept>
#include <string>

namespace capserve::parallel {
namespace {

void check(int rc, const char* what) {
  mpi::check(rc, "MpiWorld", what);
}
using mpi::address;

const char* thread_level_name(int level) {
  switch (level) {
    case MPI_THREAD_SINGLE:
      return "MPI_THREAD_SINGLE";
    case MPI_THREAD_FUNNELED:
      return "MPI_THREAD_FUNNELED";
    case MPI_THREAD_SERIALIZED:
      return "MPI_THREAD_SERIALIZED";
    case MPI_THREAD_MULTIPLE:
      return "MPI_THREAD_MULTIPLE";
    default:
      return "an unknown thread level";
  }
}

// Broadcasts of more than this many bytes go in several MPI calls (counts are int).
constexpr std::size_t kBroadcastChunk = std::size_t{1} << 30;

}  // namespace

MpiWorld::MpiWorld(int& argc, char**& argv) : uncaught_at_start_(std::uncaught_exceptions()) {
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (initialized != 0) {
    throw std::runtime_error(
        "MpiWorld: MPI is already initialized in this process (one MpiWorld per process)");
  }
  check(MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &thread_level_), "MPI_Init_thread");
  try {
    if (thread_level_ < MPI_THREAD_SERIALIZED) {
      throw std::runtime_error(
          std::string("MpiWorld: the MPI library grants only ") + thread_level_name(thread_level_) +
          " (asked for MPI_THREAD_MULTIPLE, need at least MPI_THREAD_SERIALIZED); use an "
          "MPI built with thread support");
    }
    check(MPI_Comm_dup(MPI_COMM_WORLD, &control_), "MPI_Comm_dup");
    check(MPI_Comm_rank(control_, &rank_), "MPI_Comm_rank");
    check(MPI_Comm_size(control_, &size_), "MPI_Comm_size");
    check(MPI_Comm_split_type(control_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local_),
          "MPI_Comm_split_type");
    check(MPI_Comm_rank(local_, &local_rank_), "MPI_Comm_rank (node)");
    check(MPI_Comm_size(local_, &local_size_), "MPI_Comm_size (node)");
  } catch (...) {
    if (local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
    if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
    MPI_Finalize();
    throw;
  }
}

MpiWorld::~MpiWorld() {
  if (size_ > 1 && std::uncaught_exceptions() > uncaught_at_start_) MPI_Abort(MPI_COMM_WORLD, 1);
  if (local_ != MPI_COMM_NULL) MPI_Comm_free(&local_);
  if (control_ != MPI_COMM_NULL) MPI_Comm_free(&control_);
  MPI_Finalize();
}

void MpiWorld::check_root(int root) const {
  if (root < 0 || root >= size_) {
    throw std::invalid_argument("MpiWorld: root " + std::to_string(root) + " is not a rank of " +
                                std::to_string(size_));
  }
}

void MpiWorld::broadcast(std::vector<std::byte>& bytes, int root) {
  check_root(root);
  std::uint64_t n = rank_ == root ? bytes.size() : 0;
  // The size goes out non-blocking and the receivers wait with sleeps: a server's idle ranks wait here for
  // the next step plan, and a blocking broadcast would spin a core at 100% the whole time.
  MPI_Request request = MPI_REQUEST_NULL;
  check(MPI_Ibcast(&n, 1, MPI_UINT64_T, root, control_, &request), "MPI_Ibcast (size)");
  mpi::wait(request, mpi::kIdleWait, "MpiWorld", "MPI_Test");
  if (rank_ != root) bytes.resize(static_cast<std::size_t>(n));
  for (std::size_t off = 0; off < bytes.size(); off += kBroadcastChunk) {
    const std::size_t len = std::min(kBroadcastChunk, bytes.size() - off);
    check(MPI_Bcast(bytes.data() + off, static_cast<int>(len), MPI_BYTE, root, control_), "MPI_Bcast");
  }
}

std::vector<std::vector<std::byte>> MpiWorld::gather(std::span<const std::byte> mine, int root) {
  check_root(root);
  // Every rank learns every size, so that all of them agree on whether the total fits an int.
  std::vector<std::int64_t> sizes(static_cast<std::size_t>(size_));
  const auto my_size = static_cast<std::int64_t>(mine.size());
  check(MPI_Allgather(&my_size, 1, MPI_INT64_T, sizes.data(), 1, MPI_INT64_T, control_), "MPI_Allgather");
  std::int64_t total = 0;
  for (const std::int64_t s : sizes) total += s;
  if (total > INT_MAX) {
    throw std::length_error("MpiWorld::gather: " + std::to_string(total) +
                            " bytes in all exceed the MPI int count limit (" + std::to_string(INT_MAX) + ")");
  }
  std::vector<int> counts(sizes.begin(), sizes.end());
  std::vector<int> displs(counts.size(), 0);
  for (std::size_t r = 1; r < counts.size(); ++r) displs[r] = displs[r - 1] + counts[r - 1];
  std::vector<std::byte> all(rank_ == root ? static_cast<std::size_t>(total) : 0);
  check(MPI_Gatherv(address(mine.data()), static_cast<int>(mine.size()), MPI_BYTE, address(all.data()),
                    counts.data(), displs.data(), MPI_BYTE, root, control_),
        "MPI_Gatherv");
  std::vector<std::vector<std::byte>> result;
  if (rank_ != root) return result;
  result.reserve(counts.size());
  for (std::size_t r = 0; r < counts.size(); ++r) {
    const auto first = all.begin() + displs[r];
    result.emplace_back(first, first + counts[r]);
  }
  return result;
}

bool MpiWorld::all_agree(bool ok) {
  int value = ok ? 1 : 0;
  check(MPI_Allreduce(MPI_IN_PLACE, &value, 1, MPI_INT, MPI_LAND, control_), "MPI_Allreduce");
  return value != 0;
}

void MpiWorld::barrier() {
  check(MPI_Barrier(control_), "MPI_Barrier");
}

void MpiWorld::abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::abort();  // MPI_Abort does not return; this only tells the compiler so
}

bool start_mpi(std::optional<MpiWorld>& world, int& argc, char**& argv, const char* program) {
  try {
    world.emplace(argc, argv);
    return true;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return false;
  }
}

}  // namespace capserve::parallel
