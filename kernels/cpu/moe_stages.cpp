// CpuBackend's MoE stages: the index work through the host executor (kernels/moe), the row work in loops.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/argument_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/moe/host_executor.h"

namespace capserve::kernels::cpu {
namespace {

template <class Message>
void require(bool ok, const char* op, const Message& what) {
  require_argument(ok, "CpuBackend", op, what);
}

// An optional tensor's elements: empty when the tensor is.
template <class T>
std::span<T> optional_span(const Tensor& t) {
  return t.empty() ? std::span<T>{} : t.host_span<T>();
}

template <class T>
T* grown(std::vector<T>& v, std::int64_t n) {
  if (v.size() < static_cast<std::size_t>(n)) v.resize(static_cast<std::size_t>(n));
  return v.data();
}

// A permute of `slots` [tokens, k] into `groups`, every value its own group (no owners).
moe::PermuteView permute_view(std::int64_t tokens, std::int64_t top_k, std::int64_t groups,
                              const std::int32_t* slots, std::vector<std::int64_t>& chunks) {
  moe::PermuteView v;
  v.p.tokens = tokens;
  v.p.top_k = top_k;
  v.p.num_groups = groups;
  v.experts = slots;
  v.chunk_base = grown(chunks, groups * moe::permute_chunks(v.p) + 1);
  return v;
}

}  // namespace

void CpuBackend::route(const moe::RouterParams& params, const Tensor& logits, const Tensor& bias,
                       const Tensor& probs, const Tensor& experts, const Tensor& weights) {
  moe::route_on_host(params, logits.host_span<const float>(), optional_span<const float>(bias),
                     probs.host_span<float>(), experts.host_span<std::int32_t>(), weights.host_span<float>());
}

void CpuBackend::schedule_capacity(const CapacityCall& call) {
  moe::CapacityInputs in;
  in.params = call.params;
  in.probs = call.probs.host_span<const float>();
  in.exempt = optional_span<const std::uint8_t>(call.exempt);
  in.owners = optional_span<const std::int32_t>(call.owners);
  in.bin_experts = optional_span<const std::int32_t>(call.bin_experts);
  in.local_list = optional_span<const std::int32_t>(call.local_list);
  if (call.allreduce_sum) {
    in.allreduce_sum = [&call](std::span<std::int64_t> values) {
      call.allreduce_sum(Tensor::host(values, {static_cast<std::int64_t>(values.size())}));
    };
  }
  in.workspace = &capacity_workspace_;
  const moe::CapacityTotals totals =
      moe::schedule_capacity_on_host(in, call.experts.host_span<std::int32_t>(),
                                     call.weights.host_span<float>(), call.status.host_span<std::uint8_t>());
  const std::span<std::int64_t> out = call.totals.host_span<std::int64_t>();
  require(out.size() == 2, "schedule_capacity", "totals must hold 2 values");
  out[0] = totals.dropped;
  out[1] = totals.rerouted;
}

void CpuBackend::count_experts(const Tensor& experts, const Tensor& counts) {
  const std::span<const std::int32_t> e = experts.host_span<const std::int32_t>();
  const std::span<std::int64_t> c = counts.host_span<std::int64_t>();
  for (const std::int32_t x : e)
    require(x < static_cast<std::int64_t>(c.size()), "count_experts", "expert id past the counts");
  moe::for_each_on_host(static_cast<std::int64_t>(e.size()), moe::CountExperts{e.data(), c.data()});
}

void CpuBackend::assign_copies(const Tensor& experts, const Tensor& first_copy, std::int64_t salt,
                               const Tensor& copies) {
  require(copies.numel() == experts.numel(), "assign_copies", "one copy per entry of the experts");
  const std::span<const std::int32_t> e = experts.host_span<const std::int32_t>();
  const std::span<const std::int32_t> first = first_copy.host_span<const std::int32_t>();
  for (const std::int32_t x : e)
    require(x < static_cast<std::int64_t>(first.size()) - 1, "assign_copies", "expert id past the copies");
  if (e.empty()) return;
  moe::for_each_on_host(static_cast<std::int64_t>(e.size()),
                        moe::AssignCopies{experts.row_numel(), salt, e.data(), first.data(),
                                          copies.host_span<std::int32_t>().data()});
}

void CpuBackend::count_slot_states(const Tensor& status, const Tensor& dropped, const Tensor& rerouted) {
  const std::int64_t tokens = status.dims() == 0 ? 0 : status.dim(0);
  require(dropped.numel() == tokens && rerouted.numel() == tokens, "count_slot_states",
          [&] { return "one count per token of " + status.shape_text(); });
  if (tokens == 0) return;
  moe::for_each_on_host(
      tokens, moe::CountSlotStates{status.row_numel(), status.host_span<const std::uint8_t>().data(),
                                   dropped.host_span<std::int64_t>().data(),
                                   rerouted.host_span<std::int64_t>().data()});
}

void CpuBackend::plan_dispatch(const Tensor& experts, const Tensor& weights, const Tensor& owners,
                               const Tensor& local_index, const DispatchPlan& plan) {
  const auto [tokens, top_k, ranks] = dispatch_shape(experts, weights, plan);
  const std::int64_t slots = tokens * top_k;
  const std::span<const std::int32_t> own = owners.host_span<const std::int32_t>();
  for (const std::int32_t e : optional_span<const std::int32_t>(experts))
    require(e < static_cast<std::int64_t>(own.size()), "plan_dispatch", "expert id past the owners");
  for (const std::int32_t r : own) require(r >= 0 && r < ranks, "plan_dispatch", "owner outside the ranks");

  moe::DispatchPlanView v;
  v.tokens = tokens;
  v.top_k = top_k;
  v.experts = slots > 0 ? experts.host_span<const std::int32_t>().data() : nullptr;
  v.weights = slots > 0 ? weights.host_span<const float>().data() : nullptr;
  v.owners = own.data();
  v.local_index = local_index.host_span<const std::int32_t>().data();
  v.dest = grown(dest_, slots);
  v.first_dest = grown(first_dest_, slots);
  v.rows = permute_view(tokens, top_k, ranks, v.first_dest, row_chunks_);
  v.rows.offsets = plan.row_offsets.host_span<std::int64_t>().data();
  v.rows.position = optional_span<std::int64_t>(plan.row_position).data();
  v.rows.row_token = optional_span<std::int32_t>(plan.row_token).data();
  v.entry_slots = permute_view(tokens, top_k, ranks, v.dest, entry_chunks_);
  v.entry_slots.offsets = plan.entry_offsets.host_span<std::int64_t>().data();
  v.entry_slots.position = grown(entry_position_, slots);
  v.entry_slots.row_token = grown(entry_token_, slots);
  v.entries = static_cast<moe::DispatchEntry*>(plan.entries.host_data());
  v.counts = plan.counts.host_span<std::int64_t>().data();
  moe::plan_dispatch_on_host(v);
}

void CpuBackend::group_received(const ReceivedGroups& g) {
  if (!g.entry_counts.empty()) {
    group_received_blocks(g);
    return;
  }
  const std::int64_t rows = g.experts.dims() == 0 ? 0 : g.experts.dim(0);
  const std::int64_t top_k = g.experts.row_numel();
  const std::int64_t ranks = g.entry_start.numel() - 1;
  const std::int64_t groups = g.offsets.numel() - 1;
  const auto entries = static_cast<std::int64_t>(g.entries.bytes() / sizeof(moe::DispatchEntry));
  require(ranks >= 1 && g.row_start.numel() == ranks + 1 && groups >= 0, "group_received",
          "entry_start and row_start of ranks + 1, offsets of groups + 1");
  const std::span<const std::int64_t> entry_start = g.entry_start.host_span<const std::int64_t>();
  const std::span<const std::int64_t> row_start = g.row_start.host_span<const std::int64_t>();
  require(entry_start[static_cast<std::size_t>(ranks)] == entries &&
              row_start[static_cast<std::size_t>(ranks)] == rows,
          "group_received", "the starts do not end at the entries and rows received");
  require(g.weights.numel() == rows * top_k && g.position.numel() == rows * top_k &&
              g.row_source.numel() >= rows * top_k,
          "group_received", [&] { return "output tensors smaller than experts " + g.experts.shape_text(); });
  const auto* in = entries > 0 ? static_cast<const moe::DispatchEntry*>(g.entries.host_data()) : nullptr;
  for (std::int64_t s = 0; s < ranks; ++s) {
    for (std::int64_t i = entry_start[static_cast<std::size_t>(s)];
         i < entry_start[static_cast<std::size_t>(s) + 1]; ++i) {
      const moe::DispatchEntry& en = in[i];
      require(en.local_expert >= 0 && en.local_expert < groups, "group_received", [&] {
        return "an entry for expert " + std::to_string(en.local_expert) + " of " + std::to_string(groups) +
               " local experts";
      });
      require(en.row >= 0 && en.row < row_start[static_cast<std::size_t>(s) + 1] -
                                          row_start[static_cast<std::size_t>(s)],
              "group_received", "an entry for a row its source did not send");
    }
  }
  moe::ReceivedView v;
  v.entries = entries;
  v.ranks = ranks;
  v.unpack = {top_k,
              ranks,
              in,
              entry_start.data(),
              row_start.data(),
              optional_span<std::int32_t>(g.experts).data(),
              optional_span<float>(g.weights).data()};
  v.group = permute_view(rows, top_k, groups, v.unpack.experts, group_chunks_);
  v.group.offsets = g.offsets.host_span<std::int64_t>().data();
  v.group.position = v.unpack.experts != nullptr ? g.position.host_span<std::int64_t>().data() : nullptr;
  v.group.row_token = v.unpack.experts != nullptr ? g.row_source.host_span<std::int32_t>().data() : nullptr;
  moe::group_received_on_host(v);
}

void CpuBackend::group_received_blocks(const ReceivedGroups& g) {
  const std::int64_t rows = g.experts.dims() == 0 ? 0 : g.experts.dim(0);
  const std::int64_t top_k = g.experts.row_numel();
  const std::int64_t ranks = g.entry_counts.numel();
  const std::int64_t groups = g.offsets.numel() - 1;
  const auto places = static_cast<std::int64_t>(g.entries.bytes() / sizeof(moe::DispatchEntry));
  require(ranks >= 1 && g.entry_block >= 0 && g.row_block >= 0 && places == ranks * g.entry_block &&
              rows == ranks * g.row_block && groups >= 0,
          "group_received", "the block layout's entries and rows are not ranks x their blocks");
  require(g.weights.numel() == rows * top_k && g.position.numel() == rows * top_k &&
              g.row_source.numel() >= rows * top_k,
          "group_received", [&] { return "output tensors smaller than experts " + g.experts.shape_text(); });
  const std::span<const std::int64_t> counts = g.entry_counts.host_span<const std::int64_t>();
  const auto* in = static_cast<const moe::DispatchEntry*>(g.entries.host_data());
  for (std::int64_t s = 0; s < ranks; ++s) {
    const std::int64_t n = counts[static_cast<std::size_t>(s)];
    require(n >= 0 && n <= g.entry_block, "group_received", "a source's entry count outside its block");
    // An entry for a row past the block is one its source could not fit (counted there as overflow): skipped.
    for (std::int64_t i = s * g.entry_block; i < s * g.entry_block + n; ++i) {
      require(in[i].local_expert >= 0 && in[i].local_expert < groups && in[i].row >= 0, "group_received",
              "an entry outside the local experts");
    }
  }
  moe::ReceivedBlocksView v;
  v.places = places;
  v.unpack = {top_k,
              g.entry_block,
              g.row_block,
              in,
              counts.data(),
              g.experts.host_span<std::int32_t>().data(),
              g.weights.host_span<float>().data()};
  v.group = permute_view(rows, top_k, groups, v.unpack.experts, group_chunks_);
  v.group.offsets = g.offsets.host_span<std::int64_t>().data();
  v.group.position = g.position.host_span<std::int64_t>().data();
  v.group.row_token = g.row_source.host_span<std::int32_t>().data();
  moe::group_received_blocks_on_host(v);
}

void CpuBackend::block_index(const Tensor& offsets, const Tensor& source, std::int64_t block,
                             const Tensor& index, const Tensor& overflow) {
  const std::int64_t groups = offsets.numel() - 1;
  require(groups >= 0 && block >= 0 && index.numel() == groups * block && overflow.numel() == 1,
          "block_index", [&] {
            return "index " + index.shape_text() + " for " + std::to_string(groups) + " blocks of " +
                   std::to_string(block);
          });
  moe::for_each_on_host(groups * block, moe::BlockIndex{block, offsets.host_span<const std::int64_t>().data(),
                                                        optional_span<const std::int32_t>(source).data(),
                                                        index.host_span<std::int32_t>().data(),
                                                        overflow.host_span<std::int64_t>().data()});
}

void CpuBackend::block_positions(const Tensor& position, const Tensor& offsets, std::int64_t block,
                                 const Tensor& out) {
  const std::int64_t groups = offsets.numel() - 1;
  require(groups >= 1 && out.numel() == position.numel(), "block_positions",
          [&] { return "position " + position.shape_text() + " into " + out.shape_text(); });
  moe::for_each_on_host(position.numel(),
                        moe::BlockPositions{groups, block, offsets.host_span<const std::int64_t>().data(),
                                            position.host_span<const std::int64_t>().data(),
                                            out.host_span<std::int64_t>().data()});
}

void CpuBackend::take_rows(const Tensor& src, const Tensor& index, const Tensor& dst) {
  const std::int64_t n = dst.dims() == 0 ? 0 : dst.dim(0);
  const std::int64_t width = src.row_numel();
  require(dst.row_numel() == width && index.numel() >= n, "take_rows",
          [&] { return std::to_string(n) + " rows of " + src.shape_text() + " into " + dst.shape_text(); });
  if (n == 0) return;
  const std::span<const std::int32_t> rows = index.host_span<const std::int32_t>();
  const std::span<const float> s = src.host_span<const float>();
  const std::span<float> d = dst.host_span<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int32_t r = rows[static_cast<std::size_t>(i)];
    if (r < 0) {
      std::fill(d.data() + i * width, d.data() + (i + 1) * width, 0.0F);
      continue;
    }
    if (r >= src.dim(0))
      throw std::out_of_range("CpuBackend::take_rows: row " + std::to_string(r) + " of " + src.shape_text());
    std::memcpy(d.data() + i * width, s.data() + static_cast<std::int64_t>(r) * width,
                static_cast<std::size_t>(width) * sizeof(float));
  }
}

void CpuBackend::combine(const Tensor& y, const Tensor& position, const Tensor& weights, const Tensor& out) {
  const std::int64_t tokens = out.dims() == 0 ? 0 : out.dim(0);
  const std::int64_t hidden = out.row_numel();
  const std::int64_t top_k = position.row_numel();
  require(position.dims() == 2 && position.dim(0) == tokens &&
              (weights.empty() || weights.numel() == tokens * top_k) &&
              (y.dims() == 0 || y.row_numel() == hidden),
          "combine", [&] {
            return "position " + position.shape_text() + ", weights " + weights.shape_text() + ", y " +
                   y.shape_text() + " for out " + out.shape_text();
          });
  if (tokens == 0) return;
  const std::int64_t* pos = position.host_span<const std::int64_t>().data();
  const float* w = weights.empty() ? nullptr : weights.host_span<const float>().data();
  const float* src = y.empty() ? nullptr : y.host_span<const float>().data();
  const std::int64_t y_rows = y.dims() == 0 ? 0 : y.dim(0);
  float* o = out.host_span<float>().data();
  // One pass: each token's row is zeroed and summed while it is in cache, its slots in order.
  for (std::int64_t t = 0; t < tokens; ++t) {
    float* dst = o + t * hidden;
    std::fill(dst, dst + hidden, 0.0F);
    for (std::int64_t s = 0; s < top_k; ++s) {
      const std::int64_t row = pos[t * top_k + s];
      if (row < 0) continue;
      if (row >= y_rows)
        throw std::out_of_range("CpuBackend::combine: row " + std::to_string(row) + " of " + y.shape_text());
      const float* in = src + row * hidden;
      if (w == nullptr) {
        for (std::int64_t c = 0; c < hidden; ++c) dst[c] += in[c];
      } else {
        const float g = w[t * top_k + s];
        for (std::int64_t c = 0; c < hidden; ++c) dst[c] += g * in[c];
      }
    }
  }
}

}  // namespace capserve::kernels::cpu
