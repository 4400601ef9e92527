#pragma once
// An in-process group of N ranks, one std::thread each, for unit tests of collective code without MPI:
//
//   capserve::test::run_ranks(4, [](capserve::parallel::Communicator& comm) { ... comm.alltoallv(...) ... });
//
// Every collective is a rendezvous through shared slots, with a mutex + condition variable barrier (sync):
//  1. each rank publishes views of its inputs in its slot and syncs;
//  2. each rank checks that all ranks called the same collective with matching sizes (every rank checks every
//     slot, so all reach the same verdict), then reads the others' inputs into its own scratch;
//  3. all sync again, after which nobody reads inputs any more; each rank then copies its scratch into its
//     output, or, when the check failed, all of them throw.
// Inputs are only read between the two waits and outputs only written after the second, so there are no data
// races, and aliasing inputs and outputs is harmless. Sums run in rank order: results are bit-reproducible.
// A rank that throws or returns leaves the group (run_ranks does this); the others' collectives then throw
// RankLeftError instead of waiting forever, and run_ranks rethrows the first exception.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "parallel/communicator.h"

namespace capserve::test {

// Thrown by a collective when another rank of the group left it (threw or returned) instead of joining.
class RankLeftError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : expected_(n), left_(static_cast<std::size_t>(n), false) {
    if (n < 1) throw std::invalid_argument("ThreadGroup: needs at least one rank, got " + std::to_string(n));
    slots_.resize(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) members_.push_back(std::make_unique<Member>(*this, r));
  }
  ThreadGroup(const ThreadGroup&) = delete;
  ThreadGroup& operator=(const ThreadGroup&) = delete;

  [[nodiscard]] int size() const { return static_cast<int>(members_.size()); }
  // The communicator of rank r; use it from one thread only.
  [[nodiscard]] parallel::Communicator& rank(int r) { return *members_.at(static_cast<std::size_t>(r)); }

  // Rank r will call no more collectives (it finished or failed). Idempotent.
  void leave(int r) {
    const std::lock_guard lock(mutex_);
    if (left_.at(static_cast<std::size_t>(r))) return;
    left_[static_cast<std::size_t>(r)] = true;
    ++departed_;
    --expected_;
    if (expected_ > 0 && arrived_ == expected_) complete_phase();
  }

 private:
  enum class Op { kAlltoall, kAlltoallv, kAllreduceSum, kAllreduceMax, kAllgather };

  static const char* name(Op op) {
    switch (op) {
      case Op::kAlltoall:
        return "alltoall";
      case Op::kAlltoallv:
        return "alltoallv";
      case Op::kAllreduceSum:
        return "allreduce_sum";
      case Op::kAllreduceMax:
        return "allreduce_max";
      case Op::kAllgather:
        return "allgather";
    }
    return "?";
  }

  // What one rank published for the current collective: views of its own inputs.
  struct Slot {
    Op op = Op::kAlltoall;
    std::span<const std::byte> bytes;
    std::span<const std::int64_t> ints;
    std::span<const double> doubles;
    std::span<const std::int64_t> send_counts;
    std::span<const std::int64_t> recv_counts;
  };

  class Member final : public parallel::Communicator {
   public:
    Member(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
    [[nodiscard]] int rank() const override { return rank_; }
    [[nodiscard]] int size() const override { return group_.size(); }
    [[nodiscard]] kernels::Device device() const override { return kernels::kCpu; }

   protected:
    void do_alltoall(std::span<const std::int64_t> send, std::span<std::int64_t> recv,
                     parallel::Stream /*stream*/) override {
      const auto n = static_cast<std::size_t>(size());
      check_size(send.size(), n, "alltoall", "send");
      check_size(recv.size(), n, "alltoall", "recv");
      const auto& slots = enter(slot(Op::kAlltoall, [&](Slot& x) { x.ints = send; }));
      ints_.resize(n);
      for (std::size_t s = 0; s < n; ++s) ints_[s] = slots[s].ints[static_cast<std::size_t>(rank_)];
      leave_collective(Op::kAlltoall);
      std::copy(ints_.begin(), ints_.end(), recv.begin());
    }

    void do_alltoallv(std::span<const std::byte> send, std::span<const std::int64_t> send_counts,
                      std::span<std::byte> recv, std::span<const std::int64_t> recv_counts,
                      parallel::Stream /*stream*/) override {
      const auto n = static_cast<std::size_t>(size());
      check_size(send_counts.size(), n, "alltoallv", "send_counts");
      check_size(recv_counts.size(), n, "alltoallv", "recv_counts");
      const std::int64_t send_total = total(send_counts, "send_counts");
      const std::int64_t recv_total = total(recv_counts, "recv_counts");
      if (static_cast<std::uint64_t>(send_total) > send.size() ||
          static_cast<std::uint64_t>(recv_total) > recv.size()) {
        throw std::invalid_argument("ThreadGroup::alltoallv: the counts add up to " +
                                    std::to_string(send_total) + " bytes to send and " +
                                    std::to_string(recv_total) + " to receive, but send has " +
                                    std::to_string(send.size()) + " and recv " + std::to_string(recv.size()));
      }
      const auto& slots = enter(slot(Op::kAlltoallv, [&](Slot& x) {
        x.bytes = send;
        x.send_counts = send_counts;
        x.recv_counts = recv_counts;
      }));
      // Every rank checks every pair, so all of them agree on whether to throw.
      for (std::size_t s = 0; s < n; ++s) {
        for (std::size_t d = 0; d < n; ++d) {
          if (slots[s].send_counts[d] != slots[d].recv_counts[s]) {
            fail_together<std::invalid_argument>(
                Op::kAlltoallv, "ThreadGroup::alltoallv: rank " + std::to_string(s) + " sends " +
                                    std::to_string(slots[s].send_counts[d]) + " bytes to rank " +
                                    std::to_string(d) + ", which expects " +
                                    std::to_string(slots[d].recv_counts[s]));
          }
        }
      }
      bytes_.resize(static_cast<std::size_t>(recv_total));
      std::size_t out = 0;
      for (std::size_t s = 0; s < n; ++s) {
        std::size_t in = 0;  // offset of rank s's block for this rank
        for (std::size_t d = 0; d < static_cast<std::size_t>(rank_); ++d) {
          in += static_cast<std::size_t>(slots[s].send_counts[d]);
        }
        const auto len = static_cast<std::size_t>(slots[s].send_counts[static_cast<std::size_t>(rank_)]);
        if (len > 0) std::memcpy(bytes_.data() + out, slots[s].bytes.data() + in, len);
        out += len;
      }
      leave_collective(Op::kAlltoallv);
      if (!bytes_.empty()) std::memcpy(recv.data(), bytes_.data(), bytes_.size());
      count_sent(send_counts);
    }

    void do_allreduce_sum(std::span<std::int64_t> values, parallel::Stream /*stream*/) override {
      const auto& slots = enter(slot(Op::kAllreduceSum, [&](Slot& x) { x.ints = values; }));
      check_same_length(slots, values.size(), Op::kAllreduceSum);
      ints_.assign(values.size(), 0);
      for (std::size_t s = 0; s < slots.size(); ++s) {
        for (std::size_t i = 0; i < values.size(); ++i) {
          // Wrapping addition, in rank order (signed overflow would be undefined).
          ints_[i] = static_cast<std::int64_t>(static_cast<std::uint64_t>(ints_[i]) +
                                               static_cast<std::uint64_t>(slots[s].ints[i]));
        }
      }
      leave_collective(Op::kAllreduceSum);
      std::copy(ints_.begin(), ints_.end(), values.begin());
    }

    void do_allreduce_max(std::span<double> values, parallel::Stream /*stream*/) override {
      const auto& slots = enter(slot(Op::kAllreduceMax, [&](Slot& x) { x.doubles = values; }));
      check_same_length(slots, values.size(), Op::kAllreduceMax);
      doubles_.assign(slots[0].doubles.begin(), slots[0].doubles.end());
      for (std::size_t s = 1; s < slots.size(); ++s) {
        for (std::size_t i = 0; i < values.size(); ++i) {
          const double v = slots[s].doubles[i];
          if (std::isnan(v) || v > doubles_[i]) doubles_[i] = v;  // a NaN anywhere wins
        }
      }
      leave_collective(Op::kAllreduceMax);
      std::copy(doubles_.begin(), doubles_.end(), values.begin());
    }

    void do_allgather(std::span<const std::int64_t> mine, std::span<std::int64_t> all,
                      parallel::Stream /*stream*/) override {
      check_size(all.size(), mine.size() * static_cast<std::size_t>(size()), "allgather", "all");
      const auto& slots = enter(slot(Op::kAllgather, [&](Slot& x) { x.ints = mine; }));
      check_same_length(slots, mine.size(), Op::kAllgather);
      ints_.clear();
      for (const Slot& slot : slots) ints_.insert(ints_.end(), slot.ints.begin(), slot.ints.end());
      leave_collective(Op::kAllgather);
      std::copy(ints_.begin(), ints_.end(), all.begin());
    }

   private:
    template <typename Fill>
    static Slot slot(Op op, Fill fill) {
      Slot x;
      x.op = op;
      fill(x);
      return x;
    }

    // Publishes this rank's inputs and waits for all ranks; afterwards every slot may be read until
    // leave_collective. Throws std::logic_error (on every rank alike) when ranks called different
    // collectives.
    const std::vector<Slot>& enter(const Slot& mine) {
      group_.slots_[static_cast<std::size_t>(rank_)] = mine;
      group_.sync(name(mine.op));
      const std::vector<Slot>& slots = group_.slots_;
      for (std::size_t s = 0; s < slots.size(); ++s) {
        if (slots[s].op != slots[0].op) {
          fail_together<std::logic_error>(mine.op, std::string("ThreadGroup: rank 0 called ") +
                                                       name(slots[0].op) + " while rank " +
                                                       std::to_string(s) + " called " + name(slots[s].op));
        }
      }
      return slots;
    }

    // Waits until every rank is done reading the inputs.
    void leave_collective(Op op) { group_.sync(name(op)); }

    // A check between enter and leave_collective failed, on every rank alike: wait until all are done reading
    // (a rank that threw at once would free inputs that others still read), then throw.
    template <typename Error>
    [[noreturn]] void fail_together(Op op, const std::string& message) {
      leave_collective(op);
      throw Error(message);
    }

    void check_same_length(const std::vector<Slot>& slots, std::size_t n, Op op) {
      for (std::size_t s = 0; s < slots.size(); ++s) {
        const std::size_t len = slots[s].ints.size() + slots[s].doubles.size();  // one of them is empty
        if (len != n) {
          fail_together<std::invalid_argument>(op, std::string("ThreadGroup::") + name(op) + ": rank " +
                                                       std::to_string(s) + " passed " + std::to_string(len) +
                                                       " values, this rank " + std::to_string(n));
        }
      }
    }

    static void check_size(std::size_t got, std::size_t want, const char* op, const char* what) {
      if (got != want) {
        throw std::invalid_argument(std::string("ThreadGroup::") + op + ": " + what + " has " +
                                    std::to_string(got) + " entries, expected " + std::to_string(want));
      }
    }

    static std::int64_t total(std::span<const std::int64_t> counts, const char* what) {
      std::int64_t sum = 0;
      for (std::size_t r = 0; r < counts.size(); ++r) {
        if (counts[r] < 0) {
          throw std::invalid_argument(std::string("ThreadGroup::alltoallv: ") + what + "[" +
                                      std::to_string(r) + "] is negative (" + std::to_string(counts[r]) +
                                      ")");
        }
        sum += counts[r];
      }
      return sum;
    }

    ThreadGroup& group_;
    int rank_;
    std::vector<std::byte>
        bytes_;  // scratch: this rank's result, written to its output after the second sync
    std::vector<std::int64_t> ints_;
    std::vector<double> doubles_;
  };

  // Waits until every rank still in the group has arrived; throws RankLeftError when one left.
  void sync(const char* op) {
    std::unique_lock lock(mutex_);
    const std::uint64_t generation = generation_;
    if (++arrived_ == expected_) {
      complete_phase();
    } else {
      cv_.wait(lock, [&] { return generation_ != generation; });
    }
    if (departed_at_completion_ > 0) {
      throw RankLeftError(std::string("ThreadGroup::") + op +
                          ": another rank left the group (it threw, or returned before calling the same "
                          "collectives as this rank)");
    }
  }

  void complete_phase() {  // mutex_ held
    arrived_ = 0;
    departed_at_completion_ = departed_;
    ++generation_;
    cv_.notify_all();
  }

  std::mutex mutex_;
  std::condition_variable cv_;
  int expected_;                    // ranks still in the group
  int arrived_ = 0;                 // of them, waiting in the current phase
  int departed_ = 0;                // ranks that left
  int departed_at_completion_ = 0;  // departed_ when the last phase completed
  std::uint64_t generation_ = 0;
  std::vector<bool> left_;
  std::vector<Slot> slots_;  // slots_[r] written by rank r before a sync, read by all between two syncs
  std::vector<std::unique_ptr<Member>> members_;
};

// Runs fn(comm) on n threads, one per rank of a fresh ThreadGroup; waits for all and rethrows the first
// exception.
inline void run_ranks(int n, const std::function<void(parallel::Communicator&)>& fn) {
  ThreadGroup group(n);
  std::mutex mutex;
  std::exception_ptr first;
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(group.rank(r));
      } catch (...) {
        const std::lock_guard lock(mutex);
        if (!first) first = std::current_exception();
      }
      group.leave(r);
    });
  }
  for (std::thread& t : threads) t.join();
  if (first) std::rethrow_exception(first);
}

}  // namespace capserve::test
