#include "parallel/token_dispatcher.h"

#include <algorithm>
#include <chrono>
#include <numeric>

namespace capserve::parallel {
namespace {

using Clock = std::chrono::steady_clock;
using kernels::DType;
using kernels::Tensor;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// A tensor's memory as the raw span the communicator's fixed exchange takes.
std::span<std::byte> bytes(const Tensor& t) {
  return {static_cast<std::byte*>(t.data()), t.bytes()};
}

std::int64_t sum(std::span<const std::int64_t> v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

}  // namespace

void TokenDispatcher::plan(kernels::Backend& backend, const Tensor& experts, const Tensor& weights,
                           const LayerTables& tables, const Tensor& counts, const Tensor& rows_sent) {
  const auto start = Clock::now();
  const std::int64_t ranks = comm_.size();
  const std::int64_t tokens = experts.dims() == 0 ? 0 : experts.dim(0);
  const std::int64_t top_k = experts.row_numel();
  counters_ = {};
  sent_before_ = comm_.bytes_sent();
  plan_.row_offsets = backend.scratch(row_offsets_, DType::i64, {ranks + 1});
  plan_.row_position = backend.scratch(row_position_, DType::i64, {tokens, top_k});
  plan_.row_token = backend.scratch(row_token_, DType::i32, {tokens * top_k});
  plan_.entry_offsets = backend.scratch(entry_offsets_, DType::i64, {ranks + 1});
  plan_.entries =
      backend.scratch(entries_, DType::u8, {tokens * top_k, static_cast<std::int64_t>(sizeof(Entry))});
  plan_.counts = counts.rows(0, 2 * ranks);
  backend.plan_dispatch(experts, weights, tables.owners, tables.local_index, plan_);
  backend.copy(plan_.row_offsets.rows(ranks, 1), rows_sent);  // the offsets start at 0
  comm_.alltoall(counts.rows(0, ranks), counts.rows(2 * ranks, ranks), backend.stream());
  comm_.alltoall(counts.rows(ranks, ranks), counts.rows(3 * ranks, ranks), backend.stream());
  counters_.dispatch_seconds = seconds_since(start);
}

void TokenDispatcher::reserve(kernels::Backend& backend, std::int64_t tokens, std::int64_t top_k,
                              std::int64_t hidden, Blocks blocks) {
  const std::int64_t ranks = comm_.size();
  const std::int64_t sent = std::max(tokens * std::min<std::int64_t>(top_k, ranks), ranks * blocks.rows);
  const std::int64_t received = std::max(tokens, ranks * blocks.rows);
  const std::int64_t entries = std::max(tokens * top_k, ranks * blocks.entries);
  (void)backend.scratch(send_rows_, DType::f32, {sent, hidden});
  (void)backend.scratch(returned_, DType::f32, {sent, hidden});
  (void)backend.scratch(recv_rows_, DType::f32, {received, hidden});
  (void)backend.scratch(recv_entries_, DType::u8, {entries, static_cast<std::int64_t>(sizeof(Entry))});
  if (blocks.rows == 0 && blocks.entries == 0) return;
  (void)backend.scratch(block_rows_, DType::i32, {ranks * blocks.rows});
  (void)backend.scratch(block_entries_, DType::i32, {ranks * blocks.entries});
  (void)backend.scratch(send_entries_, DType::f32,
                        {ranks * blocks.entries, static_cast<std::int64_t>(sizeof(Entry) / sizeof(float))});
  (void)backend.scratch(block_position_, DType::i64, {tokens, top_k});
}

TokenDispatcher::Received TokenDispatcher::send(kernels::Backend& backend, const Tensor& h,
                                                std::span<const std::int64_t> counts) {
  const auto start = Clock::now();
  const auto r = static_cast<std::size_t>(comm_.size());
  counts_.assign(counts.begin(), counts.end());
  const std::span<const std::int64_t> rows_to(counts_.data(), r);
  const std::span<const std::int64_t> entries_to(counts_.data() + r, r);
  const std::span<const std::int64_t> rows_from(counts_.data() + 2 * r, r);
  const std::span<const std::int64_t> entries_from(counts_.data() + 3 * r, r);
  const std::int64_t hidden = h.row_numel();
  const auto row_bytes = hidden * static_cast<std::int64_t>(sizeof(float));
  const auto entry_bytes = static_cast<std::int64_t>(sizeof(Entry));
  const std::int64_t out_rows = sum(rows_to);
  const std::int64_t in_rows = sum(rows_from);
  const std::int64_t in_entries = sum(entries_from);

  const Tensor rows_out = backend.scratch(send_rows_, DType::f32, {out_rows, hidden});
  backend.take_rows(h, plan_.row_token, rows_out);
  Received in;
  in.rows = backend.scratch(recv_rows_, DType::f32, {in_rows, hidden});
  in.entries = backend.scratch(recv_entries_, DType::u8, {in_entries, entry_bytes});

  byte_counts_.resize(r);
  recv_byte_counts_.resize(r);
  for (std::size_t d = 0; d < r; ++d) {
    byte_counts_[d] = entries_to[d] * entry_bytes;
    recv_byte_counts_[d] = entries_from[d] * entry_bytes;
  }
  comm_.alltoallv(plan_.entries.rows(0, sum(entries_to)), byte_counts_, in.entries, recv_byte_counts_,
                  backend.stream());
  for (std::size_t d = 0; d < r; ++d) {
    byte_counts_[d] = rows_to[d] * row_bytes;
    recv_byte_counts_[d] = rows_from[d] * row_bytes;
  }
  comm_.alltoallv(rows_out, byte_counts_, in.rows, recv_byte_counts_, backend.stream());

  // Where each source's entries and rows start: host metadata for the receiver's grouping.
  starts_host_.assign(2 * (r + 1), 0);
  for (std::size_t s = 0; s < r; ++s) {
    starts_host_[s + 1] = starts_host_[s] + entries_from[s];
    starts_host_[r + 1 + s + 1] = starts_host_[r + 1 + s] + rows_from[s];
  }
  const Tensor starts = backend.scratch(starts_, DType::i64, {static_cast<std::int64_t>(2 * (r + 1))});
  backend.from_host(std::as_bytes(std::span<const std::int64_t>(starts_host_)), starts);
  in.entry_start = starts.rows(0, static_cast<std::int64_t>(r + 1));
  in.row_start = starts.rows(static_cast<std::int64_t>(r + 1), static_cast<std::int64_t>(r + 1));

  counters_.rows_sent = out_rows;
  counters_.rows_sent_remote = out_rows - rows_to[static_cast<std::size_t>(comm_.rank())];
  counters_.assignments_sent = sum(entries_to);
  counters_.rows_received = in_rows;
  counters_.dispatch_seconds += seconds_since(start);
  return in;
}

TokenDispatcher::ReceivedBlocks TokenDispatcher::send_blocks(kernels::Backend& backend, const Tensor& h,
                                                             const Tensor& counts, Blocks blocks,
                                                             const Tensor& overflow) {
  const auto start = Clock::now();
  const std::int64_t ranks = comm_.size();
  const std::int64_t hidden = h.row_numel();
  const auto entry_bytes = static_cast<std::int64_t>(sizeof(Entry));
  constexpr std::int64_t kEntryWords = sizeof(Entry) / sizeof(float);
  static_assert(sizeof(Entry) % sizeof(float) == 0, "entries move as rows of 4-byte words");

  const Tensor row_index = backend.scratch(block_rows_, DType::i32, {ranks * blocks.rows});
  backend.block_index(plan_.row_offsets, plan_.row_token, blocks.rows, row_index, overflow);
  const Tensor rows_out = backend.scratch(send_rows_, DType::f32, {ranks * blocks.rows, hidden});
  backend.take_rows(h, row_index, rows_out);
  // Entries move as rows of words (take_rows copies bits), zeros past a destination's count.
  const Tensor entry_index = backend.scratch(block_entries_, DType::i32, {ranks * blocks.entries});
  backend.block_index(plan_.entry_offsets, {}, blocks.entries, entry_index, overflow);
  const Tensor planned(plan_.entries.data(), DType::f32, backend.device(),
                       {plan_.entries.dim(0), kEntryWords});
  const Tensor entries_out =
      backend.scratch(send_entries_, DType::f32, {ranks * blocks.entries, kEntryWords});
  backend.take_rows(planned, entry_index, entries_out);

  ReceivedBlocks in;
  in.rows = backend.scratch(recv_rows_, DType::f32, {ranks * blocks.rows, hidden});
  in.entries = backend.scratch(recv_entries_, DType::u8, {ranks * blocks.entries, entry_bytes});
  in.entry_counts = counts.rows(3 * ranks, ranks);
  comm_.alltoall_fixed(bytes(entries_out), bytes(in.entries), blocks.entries * entry_bytes, backend.stream());
  comm_.alltoall_fixed(bytes(rows_out), bytes(in.rows),
                       blocks.rows * hidden * static_cast<std::int64_t>(sizeof(float)), backend.stream());
  counters_.dispatch_seconds += seconds_since(start);
  return in;
}

void TokenDispatcher::combine_blocks(kernels::Backend& backend, const Tensor& results, Blocks blocks,
                                     const Tensor& out) {
  const auto start = Clock::now();
  const std::int64_t ranks = comm_.size();
  const std::int64_t hidden = out.row_numel();
  const Tensor returned = backend.scratch(returned_, DType::f32, {ranks * blocks.rows, hidden});
  comm_.alltoall_fixed(bytes(results), bytes(returned),
                       blocks.rows * hidden * static_cast<std::int64_t>(sizeof(float)), backend.stream());
  const Tensor position = backend.scratch(block_position_, DType::i64,
                                          {plan_.row_position.dim(0), plan_.row_position.row_numel()});
  backend.block_positions(plan_.row_position, plan_.row_offsets, blocks.rows, position);
  backend.combine(returned, position, {}, out);
  counters_.combine_seconds = seconds_since(start);
  counters_.wire_bytes = comm_.bytes_sent() - sent_before_;
}

void TokenDispatcher::combine(kernels::Backend& backend, const Tensor& results, const Tensor& out) {
  const auto start = Clock::now();
  const auto r = static_cast<std::size_t>(comm_.size());
  const std::int64_t hidden = out.row_numel();
  const auto row_bytes = hidden * static_cast<std::int64_t>(sizeof(float));
  const Tensor returned = backend.scratch(returned_, DType::f32, {counters_.rows_sent, hidden});
  for (std::size_t d = 0; d < r; ++d) {
    byte_counts_[d] = counts_[2 * r + d] * row_bytes;
    recv_byte_counts_[d] = counts_[d] * row_bytes;
  }
  comm_.alltoallv(results, byte_counts_, returned, recv_byte_counts_, backend.stream());
  backend.combine(returned, plan_.row_position, {}, out);
  counters_.combine_seconds = seconds_since(start);
  counters_.wire_bytes = comm_.bytes_sent() - sent_before_;
}

}  // namespace capserve::parallel
