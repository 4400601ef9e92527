#pragma once
// The Dispatch and Combine stages of an MoE layer across the expert-parallel ranks: this class only moves
// rows. The backend plans (kernels/moe/dispatch_logic.h) which rows go where: each token's hidden row once to
// every rank hosting at least one of its kept experts, whatever their number there, with one entry per kept
// slot (row, local expert, gate weight). The per-peer counts are exchanged, the rows and entries sent; after
// the Experts stage each destination sends one result row back per row it received, and the source sums its
// token's returned rows. Every rank joins every collective, with zero tokens if need be.
#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "parallel/communicator.h"
#include "parallel/placement_tables.h"

namespace capserve::parallel {

// What the last layer moved (this rank's view).
struct DispatchCounters {
  std::int64_t rows_sent = 0;         // hidden rows dispatched, to any rank
  std::int64_t rows_sent_remote = 0;  // ... to other ranks
  std::int64_t assignments_sent = 0;  // (row, expert) entries dispatched
  std::int64_t rows_received = 0;     // rows this rank's experts processed (dispatch side)
  std::int64_t wire_bytes = 0;        // bytes sent to other ranks by dispatch and combine
  double dispatch_seconds = 0;        // plan + count exchange + both exchanges
  double combine_seconds = 0;         // exchange back + sum
};

class TokenDispatcher {
 public:
  using Entry = kernels::moe::DispatchEntry;

  explicit TokenDispatcher(Communicator& comm) : comm_(comm) {}

  // Per-peer counts, int64 [4, ranks]: rows and entries this rank sends to each peer, then the rows and
  // entries it receives from each.
  [[nodiscard]] std::int64_t count_values() const { return 4 * static_cast<std::int64_t>(comm_.size()); }

  // Dispatch, part 1: the plan of experts / weights [T, k] (-1 for a dropped slot) on the backend, and the
  // count exchange into `counts` (a tensor of the backend, count_values() long), which the caller copies to
  // the host with whatever else the layer reports.
  void plan(kernels::Backend& backend, const kernels::Tensor& experts, const kernels::Tensor& weights,
            const LayerTables& tables, const kernels::Tensor& counts);

  // What this rank received, tensors of the backend valid until the next plan.
  struct Received {
    kernels::Tensor rows;         // f32 [rows, hidden]: the sources' blocks in rank order
    kernels::Tensor entries;      // u8 [entries, sizeof(Entry)]
    kernels::Tensor entry_start;  // int64 [ranks + 1]: first entry of each source
    kernels::Tensor row_start;    // int64 [ranks + 1]: first row of each source
  };
  // Dispatch, part 2, with the counts on the host: sends the planned rows of h [T, hidden] and the entries.
  Received send(kernels::Backend& backend, const kernels::Tensor& h, std::span<const std::int64_t> counts);

  // Combine: results [received rows, hidden] go back where their rows came from; out [T, hidden] is
  // overwritten with the sum of each token's returned rows (zero for a token with no kept slot).
  void combine(kernels::Backend& backend, const kernels::Tensor& results, const kernels::Tensor& out);

  [[nodiscard]] const DispatchCounters& counters() const { return counters_; }

  // Sizes the buffers whose size depends on the routing for any step of at most `tokens` tokens over all
  // ranks together (a rank sends each token's row at most min(top_k, ranks) times and receives at most one
  // row per token), so that such a step never grows them (runtime/README.md, "Step memory").
  void reserve(kernels::Backend& backend, std::int64_t tokens, std::int64_t top_k, std::int64_t hidden);

 private:
  Communicator& comm_;
  DispatchCounters counters_;
  std::int64_t sent_before_ = 0;
  // The layer's plan and host counts, between its calls.
  kernels::DispatchPlan plan_;
  std::vector<std::int64_t> counts_;  // [4, ranks]
  // Grow-only, reused by every layer and step.
  kernels::Buffer row_offsets_, row_position_, row_token_, entry_offsets_, entries_, send_rows_, recv_rows_,
      recv_entries_, starts_, returned_;
  std::vector<std::int64_t> starts_host_, byte_counts_, recv_byte_counts_;
};

}  // namespace capserve::parallel
