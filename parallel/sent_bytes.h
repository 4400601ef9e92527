#pragma once
// Bytes a rank has sent to its peers through all-to-all exchanges: the wire-traffic figure that both
// communicator interfaces (host and device memory) report.
#include <cstddef>
#include <cstdint>
#include <span>

namespace capserve::parallel {

class SentBytes {
 public:
  [[nodiscard]] std::int64_t total() const { return total_; }

  // Adds one exchange's per-destination byte counts, except the block to `own_rank`, which never leaves.
  void add(std::span<const std::int64_t> send_counts, int own_rank) {
    for (std::size_t d = 0; d < send_counts.size(); ++d) {
      if (static_cast<int>(d) != own_rank) total_ += send_counts[d];
    }
  }

 private:
  std::int64_t total_ = 0;
};

}  // namespace capserve::parallel
