#include "parallel/token_dispatcher.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

namespace capserve::parallel {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

template <typename T>
void grow(std::vector<T>& v, std::size_t n) {
  if (v.size() < n) v.resize(n);
}

std::span<std::byte> bytes_of(void* p, std::size_t n) {
  return {static_cast<std::byte*>(p), n};
}

}  // namespace

void TokenDispatcher::run(std::span<const float> h, std::int64_t tokens, std::int64_t hidden,
                          std::int64_t top_k, std::span<const std::int32_t> experts,
                          std::span<const float> weights, const LayerExperts& layer,
                          kernels::Backend& backend, std::span<float> out) {
  const int ranks = comm_.size();
  const auto nr = static_cast<std::size_t>(ranks);
  const auto row_bytes = static_cast<std::size_t>(hidden) * sizeof(float);
  const std::int64_t sent_before = comm_.bytes_sent();
  counters_ = {};
  auto start = Clock::now();

  // Pass 1: rows (once per token and destination) and entries per destination.
  send_rows_.assign(nr, 0);
  send_entries_.assign(nr, 0);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t* ids = experts.data() + t * top_k;
    for (std::int64_t s = 0; s < top_k; ++s) {
      if (ids[s] < 0) continue;
      const std::int32_t d = layer.owners[static_cast<std::size_t>(ids[s])];
      ++send_entries_[static_cast<std::size_t>(d)];
      bool first = true;
      for (std::int64_t p = 0; p < s && first; ++p)
        first = ids[p] < 0 || layer.owners[static_cast<std::size_t>(ids[p])] != d;
      if (first) ++send_rows_[static_cast<std::size_t>(d)];
    }
  }
  row_offset_.assign(nr + 1, 0);
  entry_offset_.assign(nr + 1, 0);
  for (std::size_t d = 0; d < nr; ++d) {
    row_offset_[d + 1] = row_offset_[d] + send_rows_[d];
    entry_offset_[d + 1] = entry_offset_[d] + send_entries_[d];
  }
  const std::int64_t total_rows = row_offset_[nr];
  const std::int64_t total_entries = entry_offset_[nr];

  // Pass 2: pack rows and entries, grouped by destination, tokens ascending, slots in order.
  grow(send_buf_, static_cast<std::size_t>(total_rows * hidden));
  grow(row_token_, static_cast<std::size_t>(total_rows));
  grow(send_entry_buf_, static_cast<std::size_t>(total_entries));
  std::vector<std::int64_t>& row_cursor = send_rows_;  // reused: counts are rebuilt from the offsets below
  std::vector<std::int64_t>& entry_cursor = send_entries_;
  std::copy(row_offset_.begin(), row_offset_.end() - 1, row_cursor.begin());
  std::copy(entry_offset_.begin(), entry_offset_.end() - 1, entry_cursor.begin());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t* ids = experts.data() + t * top_k;
    for (std::int64_t s = 0; s < top_k; ++s) {
      if (ids[s] < 0) continue;
      const auto d = static_cast<std::size_t>(layer.owners[static_cast<std::size_t>(ids[s])]);
      bool first = true;
      for (std::int64_t p = 0; p < s && first; ++p)
        first = ids[p] < 0 || static_cast<std::size_t>(layer.owners[static_cast<std::size_t>(ids[p])]) != d;
      if (!first) continue;
      const std::int64_t row = row_cursor[d]++;
      row_token_[static_cast<std::size_t>(row)] = static_cast<std::int32_t>(t);
      std::memcpy(send_buf_.data() + row * hidden, h.data() + t * hidden, row_bytes);
      for (std::int64_t q = s; q < top_k; ++q) {
        if (ids[q] < 0 || static_cast<std::size_t>(layer.owners[static_cast<std::size_t>(ids[q])]) != d)
          continue;
        send_entry_buf_[static_cast<std::size_t>(entry_cursor[d]++)] = {
            static_cast<std::int32_t>(row - row_offset_[d]),
            layer.local_index[static_cast<std::size_t>(ids[q])],
            weights[static_cast<std::size_t>(t * top_k + q)]};
      }
    }
  }
  for (std::size_t d = 0; d < nr; ++d) {
    send_rows_[d] = row_offset_[d + 1] - row_offset_[d];
    send_entries_[d] = entry_offset_[d + 1] - entry_offset_[d];
  }

  // Count exchange, then entries and rows.
  recv_rows_.resize(nr);
  recv_entries_.resize(nr);
  comm_.alltoall(send_rows_, recv_rows_);
  comm_.alltoall(send_entries_, recv_entries_);
  recv_row_offset_.assign(nr + 1, 0);
  std::int64_t in_entries = 0;
  for (std::size_t s = 0; s < nr; ++s) {
    recv_row_offset_[s + 1] = recv_row_offset_[s] + recv_rows_[s];
    in_entries += recv_entries_[s];
  }
  const std::int64_t in_rows = recv_row_offset_[nr];
  grow(recv_entry_buf_, static_cast<std::size_t>(in_entries));
  grow(recv_buf_, static_cast<std::size_t>(in_rows * hidden));
  byte_counts_.resize(nr);
  recv_byte_counts_.resize(nr);
  for (std::size_t d = 0; d < nr; ++d) {
    byte_counts_[d] = send_entries_[d] * static_cast<std::int64_t>(sizeof(Entry));
    recv_byte_counts_[d] = recv_entries_[d] * static_cast<std::int64_t>(sizeof(Entry));
  }
  comm_.alltoallv(bytes_of(send_entry_buf_.data(), static_cast<std::size_t>(total_entries) * sizeof(Entry)),
                  byte_counts_,
                  bytes_of(recv_entry_buf_.data(), static_cast<std::size_t>(in_entries) * sizeof(Entry)),
                  recv_byte_counts_);
  for (std::size_t d = 0; d < nr; ++d) {
    byte_counts_[d] = send_rows_[d] * static_cast<std::int64_t>(row_bytes);
    recv_byte_counts_[d] = recv_rows_[d] * static_cast<std::int64_t>(row_bytes);
  }
  comm_.alltoallv(bytes_of(send_buf_.data(), static_cast<std::size_t>(total_rows) * row_bytes), byte_counts_,
                  bytes_of(recv_buf_.data(), static_cast<std::size_t>(in_rows) * row_bytes),
                  recv_byte_counts_);
  counters_.dispatch_seconds = seconds_since(start);
  start = Clock::now();

  // Group the received entries by local expert (stable: source rank, then the source's slot order).
  const auto num_local = static_cast<std::int64_t>(layer.local.size());
  expert_offsets_.assign(static_cast<std::size_t>(num_local + 1), 0);
  for (std::int64_t i = 0; i < in_entries; ++i) {
    const std::int32_t le = recv_entry_buf_[static_cast<std::size_t>(i)].local_expert;
    if (le < 0 || le >= num_local)
      throw std::logic_error("token dispatcher: entry for an expert this rank lacks");
    ++expert_offsets_[static_cast<std::size_t>(le) + 1];
  }
  for (std::int64_t e = 0; e < num_local; ++e)
    expert_offsets_[static_cast<std::size_t>(e) + 1] += expert_offsets_[static_cast<std::size_t>(e)];
  grow(entry_position_, static_cast<std::size_t>(in_entries));
  grow(permuted_in_, static_cast<std::size_t>(in_entries * hidden));
  grow(permuted_out_, static_cast<std::size_t>(in_entries * hidden));
  {
    std::vector<std::int64_t>& cursor = expert_offsets_;  // advanced while filling, restored after
    std::int64_t i = 0;
    for (std::size_t s = 0; s < nr; ++s) {
      for (std::int64_t j = 0; j < recv_entries_[s]; ++j, ++i) {
        const Entry& en = recv_entry_buf_[static_cast<std::size_t>(i)];
        const std::int64_t pos = cursor[static_cast<std::size_t>(en.local_expert)]++;
        entry_position_[static_cast<std::size_t>(i)] = pos;
        std::memcpy(permuted_in_.data() + pos * hidden,
                    recv_buf_.data() + (recv_row_offset_[s] + en.row) * hidden, row_bytes);
      }
    }
    for (std::int64_t e = num_local; e > 0; --e)
      cursor[static_cast<std::size_t>(e)] = cursor[static_cast<std::size_t>(e) - 1];
    cursor[0] = 0;
  }
  backend.grouped_expert_ffn(
      kernels::Tensor::host(std::span(permuted_in_.data(), static_cast<std::size_t>(in_entries * hidden)),
                            {in_entries, hidden}),
      expert_offsets_, layer.local,
      kernels::Tensor::host(std::span(permuted_out_.data(), static_cast<std::size_t>(in_entries * hidden)),
                            {in_entries, hidden}));

  // One result row per received row: its experts' outputs with their gate weights, in the source's slot
  // order.
  grow(result_, static_cast<std::size_t>(in_rows * hidden));
  std::fill(result_.begin(), result_.begin() + in_rows * hidden, 0.0F);
  {
    std::int64_t i = 0;
    for (std::size_t s = 0; s < nr; ++s) {
      for (std::int64_t j = 0; j < recv_entries_[s]; ++j, ++i) {
        const Entry& en = recv_entry_buf_[static_cast<std::size_t>(i)];
        float* dst = result_.data() + (recv_row_offset_[s] + en.row) * hidden;
        const float* src = permuted_out_.data() + entry_position_[static_cast<std::size_t>(i)] * hidden;
        for (std::int64_t c = 0; c < hidden; ++c) dst[c] += en.weight * src[c];
      }
    }
  }
  counters_.expert_seconds = seconds_since(start);
  start = Clock::now();

  // Combine: the result rows go back the way their inputs came.
  grow(returned_, static_cast<std::size_t>(total_rows * hidden));
  for (std::size_t d = 0; d < nr; ++d) {
    byte_counts_[d] = recv_rows_[d] * static_cast<std::int64_t>(row_bytes);
    recv_byte_counts_[d] = send_rows_[d] * static_cast<std::int64_t>(row_bytes);
  }
  comm_.alltoallv(bytes_of(result_.data(), static_cast<std::size_t>(in_rows) * row_bytes), byte_counts_,
                  bytes_of(returned_.data(), static_cast<std::size_t>(total_rows) * row_bytes),
                  recv_byte_counts_);
  std::fill(out.begin(), out.begin() + tokens * hidden, 0.0F);
  for (std::int64_t row = 0; row < total_rows; ++row) {
    float* dst = out.data() + static_cast<std::int64_t>(row_token_[static_cast<std::size_t>(row)]) * hidden;
    const float* src = returned_.data() + row * hidden;
    for (std::int64_t c = 0; c < hidden; ++c) dst[c] += src[c];
  }
  counters_.combine_seconds = seconds_since(start);

  counters_.rows_sent = total_rows;
  counters_.rows_sent_remote = total_rows - send_rows_[static_cast<std::size_t>(comm_.rank())];
  counters_.assignments_sent = total_entries;
  counters_.rows_received = in_rows;
  counters_.wire_bytes = comm_.bytes_sent() - sent_before;
}

}  // namespace capserve::parallel
