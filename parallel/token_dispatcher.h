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

// What the last layer moved (this rank's view). The row and entry counts are the counted exchange's (the host
// reads them there); the fixed-size exchange reports its rows through plan's `rows_sent` on the device and
// leaves them 0 here.
struct DispatchCounters {
  std::int64_t rows_sent = 0;         // hidden rows dispatched, to any rank
  std::int64_t rows_sent_remote = 0;  // ... to other ranks
  std::int64_t assignments_sent = 0;  // (row, expert) entries dispatched
  std::int64_t rows_received = 0;     // rows this rank's experts processed (dispatch side)
  std::int64_t wire_bytes = 0;        // bytes sent to other ranks by dispatch and combine
  double dispatch_seconds = 0;        // plan + count exchange + both exchanges
  double combine_seconds = 0;         // exchange back + sum
};

// The block sizes of a fixed-size exchange (TokenDispatcher::send_blocks).
struct DispatchBlocks {
  std::int64_t rows = 0;
  std::int64_t entries = 0;
};

class TokenDispatcher {
 public:
  using Entry = kernels::moe::DispatchEntry;

  explicit TokenDispatcher(Communicator& comm) : comm_(comm) {}

  // Per-peer counts, int64 [4, ranks]: rows and entries this rank sends to each peer, then the rows and
  // entries it receives from each.
  [[nodiscard]] std::int64_t count_values() const { return 4 * static_cast<std::int64_t>(comm_.size()); }

  // Dispatch, part 1: the plan of experts / weights [T, k] (-1 for a dropped slot) on the backend, and the
  // count exchange into `counts` (a tensor of the backend, count_values() long) on the device; `rows_sent`
  // (int64 [1] of the backend) gets the hidden rows this rank dispatches.
  void plan(kernels::Backend& backend, const kernels::Tensor& experts, const kernels::Tensor& weights,
            const LayerTables& tables, const kernels::Tensor& counts, const kernels::Tensor& rows_sent);

  // What this rank received, tensors of the backend valid until the next plan.
  struct Received {
    kernels::Tensor rows;         // f32 [rows, hidden]: the sources' blocks in rank order
    kernels::Tensor entries;      // u8 [entries, sizeof(Entry)]
    kernels::Tensor entry_start;  // int64 [ranks + 1]: first entry of each source
    kernels::Tensor row_start;    // int64 [ranks + 1]: first row of each source
  };
  // Dispatch, part 2, with the counts on the host (the copy of plan's `counts`): sends the planned rows of
  // h [T, hidden] and the entries.
  Received send(kernels::Backend& backend, const kernels::Tensor& h, std::span<const std::int64_t> counts);

  // Combine: results [received rows, hidden] go back where their rows came from; out [T, hidden] is
  // overwritten with the sum of each token's returned rows (zero for a token with no kept slot).
  void combine(kernels::Backend& backend, const kernels::Tensor& results, const kernels::Tensor& out);

  // The capacity-bounded exchange instead (communicator.h, alltoall_fixed): every peer gets one block of
  // `rows` hidden rows and one of `entries` entries, whatever the routing, so nothing waits for the host.
  using Blocks = DispatchBlocks;
  // What this rank received in the block layout: source s's rows from s * blocks.rows, its entries from
  // s * blocks.entries, entry_counts[s] of them valid.
  struct ReceivedBlocks {
    kernels::Tensor rows;          // f32 [ranks * blocks.rows, hidden]
    kernels::Tensor entries;       // u8 [ranks * blocks.entries, sizeof(Entry)]
    kernels::Tensor entry_counts;  // int64 [ranks], on the device
  };
  // Dispatch, part 2 without the host, after plan (whose `counts` it reads on the device). A source's rows
  // or entries beyond their block (the bound broken) are left out and added to overflow (int64 [1]).
  ReceivedBlocks send_blocks(kernels::Backend& backend, const kernels::Tensor& h,
                             const kernels::Tensor& counts, Blocks blocks, const kernels::Tensor& overflow);
  // Combine of send_blocks' rows: results [ranks * blocks.rows, hidden] back in blocks, summed into out.
  void combine_blocks(kernels::Backend& backend, const kernels::Tensor& results, Blocks blocks,
                      const kernels::Tensor& out);

  [[nodiscard]] const DispatchCounters& counters() const { return counters_; }

  // Sizes the buffers whose size depends on the routing for any step of at most `tokens` tokens over all
  // ranks together (a rank sends each token's row at most min(top_k, ranks) times and receives at most one
  // row per token), and for the block exchange at `blocks` (all zero: none), so that such a step never grows
  // them (runtime/README.md, "Step memory").
  void reserve(kernels::Backend& backend, std::int64_t tokens, std::int64_t top_k, std::int64_t hidden,
               Blocks blocks = {});

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
  // The block layout's own: send indices and entries, the returned rows' positions.
  kernels::Buffer block_rows_, block_entries_, send_entries_, block_position_;
  std::vector<std::int64_t> starts_host_, byte_counts_, recv_byte_counts_;
};

}  // namespace capserve::parallel
