#pragma once
// The layout of an alltoallv buffer (one block per rank, consecutive, in rank order) and the argument checks
// every Communicator backend makes before it moves a byte, so that all of them reject the same calls
// with the same messages.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace capserve::parallel {

class BlockLayout {
 public:
  // counts: one byte count per rank. Throws std::invalid_argument (wrong number of counts, a negative count)
  // or std::length_error (a total beyond int64), naming `who` and `what`.
  void assign(std::span<const std::int64_t> counts, int ranks, const char* who, const char* what) {
    if (counts.size() != static_cast<std::size_t>(ranks)) {
      throw std::invalid_argument(std::string(who) + ": " + what + " has " + std::to_string(counts.size()) +
                                  " entries, expected " + std::to_string(ranks));
    }
    offsets_.assign(counts.size() + 1, 0);
    for (std::size_t r = 0; r < counts.size(); ++r) {
      const std::int64_t c = counts[r];
      if (c < 0) {
        throw std::invalid_argument(std::string(who) + ": " + what + "[" + std::to_string(r) +
                                    "] is negative (" + std::to_string(c) + ")");
      }
      if (c > std::numeric_limits<std::int64_t>::max() - offsets_[r]) {
        throw std::length_error(std::string(who) + ": " + what + " add up to more than int64 bytes");
      }
      offsets_[r + 1] = offsets_[r] + c;
    }
  }

  [[nodiscard]] std::int64_t offset(int r) const { return offsets_[static_cast<std::size_t>(r)]; }
  [[nodiscard]] std::int64_t count(int r) const { return offset(r + 1) - offset(r); }
  [[nodiscard]] std::int64_t total() const { return offsets_.back(); }

  // Block r of `buffer` (which the caller has checked holds total() bytes).
  template <typename Byte>
  [[nodiscard]] std::span<Byte> block(std::span<Byte> buffer, int r) const {
    return buffer.subspan(static_cast<std::size_t>(offset(r)), static_cast<std::size_t>(count(r)));
  }

 private:
  std::vector<std::int64_t> offsets_{0};
};

// The checks shared by every alltoallv: both layouts fit their buffers, and this rank's block to itself has
// the same size on both sides (the one pairwise agreement a rank can check alone).
inline void check_alltoallv(const BlockLayout& send, std::size_t send_bytes, const BlockLayout& recv,
                            std::size_t recv_bytes, int rank, const char* who) {
  if (static_cast<std::uint64_t>(send.total()) > send_bytes ||
      static_cast<std::uint64_t>(recv.total()) > recv_bytes) {
    throw std::invalid_argument(std::string(who) + ": the counts add up to " + std::to_string(send.total()) +
                                " bytes to send and " + std::to_string(recv.total()) +
                                " to receive, but send has " + std::to_string(send_bytes) + " and recv " +
                                std::to_string(recv_bytes));
  }
  if (send.count(rank) != recv.count(rank)) {
    throw std::invalid_argument(std::string(who) + ": rank " + std::to_string(rank) + " sends itself " +
                                std::to_string(send.count(rank)) + " bytes but expects to receive " +
                                std::to_string(recv.count(rank)) + " (send_counts and recv_counts disagree)");
  }
}

// Throws std::invalid_argument unless got == want (span sizes of the fixed-size collectives).
inline void check_entries(std::size_t got, std::size_t want, const char* who, const char* what) {
  if (got != want) {
    throw std::invalid_argument(std::string(who) + ": " + what + " has " + std::to_string(got) +
                                " entries, expected " + std::to_string(want));
  }
}

}  // namespace capserve::parallel
