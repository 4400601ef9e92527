#pragma once
// Dispatch and combine of one MoE layer across the expert-parallel ranks. Each token's hidden row goes once
// to every rank that hosts at least one of its experts, whatever their number there; the destination runs its
// experts on the rows grouped by expert, sums each row's expert outputs with the gate weights (in slot
// order), and sends one row back; the source adds the rows of its destinations. Every rank joins every
// collective, with zero tokens if need be.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "parallel/communicator.h"

namespace capserve::parallel {

// Where a layer's experts live, seen from one rank.
struct LayerExperts {
  std::span<const std::int32_t> owners;           // [num_experts]: owning rank
  std::span<const std::int32_t> local_index;      // [num_experts]: index within the owner's experts
  std::span<const kernels::ExpertWeights> local;  // this rank's experts, by local index
};

// What the last run moved (this rank's view).
struct DispatchCounters {
  std::int64_t rows_sent = 0;         // hidden rows dispatched, to any rank
  std::int64_t rows_sent_remote = 0;  // ... to other ranks
  std::int64_t assignments_sent = 0;  // (row, expert) entries dispatched
  std::int64_t rows_received = 0;     // rows this rank's experts processed (dispatch side)
  std::int64_t wire_bytes = 0;        // bytes sent to other ranks by dispatch and combine
  double dispatch_seconds = 0;        // pack + count exchange + both exchanges
  double expert_seconds = 0;          // grouping by expert + grouped FFN + weighted sums
  double combine_seconds = 0;         // exchange back + accumulation
};

class TokenDispatcher {
 public:
  explicit TokenDispatcher(Communicator& comm) : comm_(comm) {}

  // h and out are [tokens, hidden]; experts/weights are [tokens, top_k] with -1 for a dropped slot. out is
  // overwritten: the gate-weighted sum of each token's experts (zero for a token with none).
  void run(std::span<const float> h, std::int64_t tokens, std::int64_t hidden, std::int64_t top_k,
           std::span<const std::int32_t> experts, std::span<const float> weights, const LayerExperts& layer,
           kernels::Backend& backend, std::span<float> out);

  [[nodiscard]] const DispatchCounters& counters() const { return counters_; }

  // One dispatched (row, expert) pair on the wire.
  struct Entry {
    std::int32_t row;           // row within the block sent to this destination
    std::int32_t local_expert;  // index among the destination's experts
    float weight;
  };

 private:
  Communicator& comm_;
  DispatchCounters counters_;
  // Grow-only buffers, reused by every layer and step.
  std::vector<std::int64_t> send_rows_, recv_rows_, send_entries_, recv_entries_;  // per rank
  std::vector<std::int64_t> row_offset_, entry_offset_, byte_counts_, recv_byte_counts_;
  std::vector<std::int32_t> row_token_;  // send row -> token
  std::vector<Entry> send_entry_buf_, recv_entry_buf_;
  std::vector<float> send_buf_, recv_buf_, permuted_in_, permuted_out_, result_, returned_;
  std::vector<std::int64_t> expert_offsets_, entry_position_, recv_row_offset_;
};

}  // namespace capserve::parallel
