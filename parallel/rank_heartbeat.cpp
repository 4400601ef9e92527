#include "parallel/rank_heartbeat.h"

#include <stdexcept>

#include "parallel/mpi_call.h"

namespace capserve::parallel {
namespace {

constexpr int kTag = 1;
constexpr int kAlive = 0;
constexpr int kLast = 1;

void check(int rc, const char* what) {
  mpi::check(rc, "RankHeartbeat", what);
}

}  // namespace

RankHeartbeat::RankHeartbeat(const MpiWorld& world, std::chrono::milliseconds interval)
    : rank_(world.rank()), interval_(interval) {
  if (world.thread_level() != MPI_THREAD_MULTIPLE)
    throw std::runtime_error("RankHeartbeat: needs MPI_THREAD_MULTIPLE");
  check(MPI_Comm_dup(MPI_COMM_WORLD, &comm_), "MPI_Comm_dup");
  if (rank_ == 0) {
    last_heard_.assign(static_cast<std::size_t>(world.size()), Clock::now());
    finished_.assign(static_cast<std::size_t>(world.size()), false);
    finished_[0] = true;
    post_receive();
  } else {
    sender_ = std::thread([this] { beat(); });
  }
}

RankHeartbeat::~RankHeartbeat() {
  if (rank_ == 0) {
    const Clock::time_point give_up = Clock::now() + 4 * interval_;
    auto all_finished = [&] {
      for (const bool f : finished_)
        if (!f) return false;
      return true;
    };
    while (!all_finished() && Clock::now() < give_up) {
      poll();
      std::this_thread::sleep_for(interval_ / 8);
    }
    MPI_Cancel(&receive_);
    MPI_Wait(&receive_, MPI_STATUS_IGNORE);
  } else {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_one();
    sender_.join();
    MPI_Send(&kLast, 1, MPI_INT, 0, kTag, comm_);
  }
  MPI_Comm_free(&comm_);
}

void RankHeartbeat::beat() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    lock.unlock();
    // Small enough to go eagerly: the send returns at once, whatever rank 0 is doing.
    MPI_Send(&kAlive, 1, MPI_INT, 0, kTag, comm_);
    lock.lock();
    wake_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

void RankHeartbeat::post_receive() {
  check(MPI_Irecv(&message_, 1, MPI_INT, MPI_ANY_SOURCE, kTag, comm_, &receive_), "MPI_Irecv");
}

void RankHeartbeat::poll() {
  for (;;) {
    int done = 0;
    MPI_Status status;
    check(MPI_Test(&receive_, &done, &status), "MPI_Test");
    if (done == 0) return;
    const auto from = static_cast<std::size_t>(status.MPI_SOURCE);
    last_heard_[from] = Clock::now();
    if (message_ == kLast) finished_[from] = true;
    post_receive();
  }
}

std::vector<int> RankHeartbeat::silent_ranks(Clock::duration silence) const {
  std::vector<int> silent;
  const Clock::time_point now = Clock::now();
  for (std::size_t r = 1; r < last_heard_.size(); ++r)
    if (!finished_[r] && now - last_heard_[r] >= silence) silent.push_back(static_cast<int>(r));
  return silent;
}

}  // namespace capserve::parallel
