// CudaBackend's MoE stages: kernels/moe's index logic through the CUDA executor (moe_kernels.cu), on the
// backend's stream. Nothing here reads device memory on the host, so only shapes are checked.
#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/argument_check.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/moe_kernels.h"

namespace capserve::kernels::cuda {
namespace {

template <class Message>
void require(bool ok, const char* op, const Message& what) {
  require_argument(ok, "CudaBackend", op, what);
}

template <class T>
T* optional_ptr(const Tensor& t) {
  return t.empty() ? nullptr : t.ptr<T>();
}

std::int64_t rows_of(const Tensor& t) {
  return t.dims() == 0 ? 0 : t.dim(0);
}

}  // namespace

void CudaBackend::route(const moe::RouterParams& params, const Tensor& logits, const Tensor& bias,
                        const Tensor& probs, const Tensor& experts, const Tensor& weights) {
  enter({&logits, &bias, &probs, &experts, &weights});
  require(logits.numel() >= params.tokens * params.num_experts &&
              probs.numel() >= params.tokens * params.num_experts &&
              experts.numel() >= params.tokens * params.top_k &&
              weights.numel() >= params.tokens * params.top_k &&
              (bias.empty() || bias.numel() == params.num_experts),
          "route", "buffers smaller than the shapes, or a bias not of one value per expert");
  cuda::route(params, logits.ptr<const float>(), bias.empty() ? nullptr : bias.ptr<const float>(),
              probs.ptr<float>(), experts.ptr<std::int32_t>(), weights.ptr<float>(), stream_);
}

void CudaBackend::schedule_capacity(const CapacityCall& call) {
  enter({&call.probs, &call.exempt, &call.owners, &call.bin_experts, &call.local_list, &call.experts,
         &call.weights, &call.status, &call.totals});
  const moe::CapacityParams& p = call.params;
  require(call.experts.numel() >= p.tokens * p.top_k && call.weights.numel() >= p.tokens * p.top_k &&
              call.status.numel() >= p.tokens * p.top_k && call.probs.numel() >= p.tokens * p.num_experts &&
              call.totals.numel() == 2,
          "schedule_capacity", "buffers smaller than the shapes");
  moe::CapacityView v;
  v.p = p;
  v.probs = call.probs.ptr<const float>();
  v.exempt = optional_ptr<const std::uint8_t>(call.exempt);
  v.owners = optional_ptr<const std::int32_t>(call.owners);
  v.bin_experts = optional_ptr<const std::int32_t>(call.bin_experts);
  v.local_list = optional_ptr<const std::int32_t>(call.local_list);
  v.num_local = call.local_list.numel();
  v.experts = call.experts.ptr<std::int32_t>();
  v.weights = call.weights.ptr<float>();
  v.status = call.status.ptr<std::uint8_t>();
  const Tensor workspace =
      scratch(capacity_workspace_, DType::u8, {std::max<std::int64_t>(1, capacity_workspace_bytes(p))});
  DeviceReduce reduce;
  if (call.allreduce_sum) {
    reduce = [&call, this](std::int64_t* data, std::int64_t n, cudaStream_t /*stream*/) {
      call.allreduce_sum(Tensor(data, DType::i64, device(), {n}));
    };
  }
  cuda::schedule_capacity(v, workspace.data(), call.totals.ptr<std::int64_t>(), stream_, reduce);
}

void CudaBackend::count_experts(const Tensor& experts, const Tensor& counts) {
  enter({&experts, &counts});
  cuda::count_experts(optional_ptr<const std::int32_t>(experts), experts.numel(), counts.ptr<std::int64_t>(),
                      stream_);
}

void CudaBackend::assign_copies(const Tensor& experts, const Tensor& first_copy, std::int64_t salt,
                                const Tensor& copies) {
  enter({&experts, &first_copy, &copies});
  require(copies.numel() == experts.numel(), "assign_copies", "one copy per entry of the experts");
  if (experts.numel() == 0) return;
  cuda::assign_copies(moe::AssignCopies{experts.row_numel(), salt, experts.ptr<const std::int32_t>(),
                                        first_copy.ptr<const std::int32_t>(), copies.ptr<std::int32_t>()},
                      experts.numel(), stream_);
}

void CudaBackend::count_slot_states(const Tensor& status, const Tensor& dropped, const Tensor& rerouted) {
  enter({&status, &dropped, &rerouted});
  const std::int64_t tokens = rows_of(status);
  require(dropped.numel() == tokens && rerouted.numel() == tokens, "count_slot_states",
          [&] { return "one count per token of " + status.shape_text(); });
  if (tokens == 0) return;
  cuda::count_slot_states(moe::CountSlotStates{status.row_numel(), status.ptr<const std::uint8_t>(),
                                               dropped.ptr<std::int64_t>(), rerouted.ptr<std::int64_t>()},
                          tokens, stream_);
}

void CudaBackend::plan_dispatch(const Tensor& experts, const Tensor& weights, const Tensor& owners,
                                const Tensor& local_index, const DispatchPlan& plan) {
  enter({&experts, &weights, &owners, &local_index, &plan.row_offsets, &plan.row_position, &plan.row_token,
         &plan.entry_offsets, &plan.entries, &plan.counts});
  const auto [tokens, top_k, ranks] = dispatch_shape(experts, weights, plan);
  const std::int64_t slots = tokens * top_k;
  const auto slot_tensor = [&](Buffer& slot, DType dtype) {
    return scratch(slot, dtype, {std::max<std::int64_t>(1, slots)});
  };
  const auto permute_of = [&](const std::int32_t* values, Buffer& chunks) {
    moe::PermuteView v;
    v.p.tokens = tokens;
    v.p.top_k = top_k;
    v.p.num_groups = ranks;
    v.experts = values;
    v.chunk_base = scratch(chunks, DType::i64, {permute_workspace_elements(v.p)}).ptr<std::int64_t>();
    return v;
  };
  moe::DispatchPlanView v;
  v.tokens = tokens;
  v.top_k = top_k;
  v.experts = optional_ptr<const std::int32_t>(experts);
  v.weights = optional_ptr<const float>(weights);
  v.owners = owners.ptr<const std::int32_t>();
  v.local_index = local_index.ptr<const std::int32_t>();
  v.dest = slot_tensor(dest_, DType::i32).ptr<std::int32_t>();
  v.first_dest = slot_tensor(first_dest_, DType::i32).ptr<std::int32_t>();
  v.rows = permute_of(v.first_dest, row_chunks_);
  v.rows.offsets = plan.row_offsets.ptr<std::int64_t>();
  v.rows.position = optional_ptr<std::int64_t>(plan.row_position);
  v.rows.row_token = optional_ptr<std::int32_t>(plan.row_token);
  v.entry_slots = permute_of(v.dest, entry_chunks_);
  v.entry_slots.offsets = plan.entry_offsets.ptr<std::int64_t>();
  v.entry_slots.position = slot_tensor(entry_position_, DType::i64).ptr<std::int64_t>();
  v.entry_slots.row_token = slot_tensor(entry_token_, DType::i32).ptr<std::int32_t>();
  v.entries = static_cast<moe::DispatchEntry*>(plan.entries.data());
  v.counts = plan.counts.ptr<std::int64_t>();
  cuda::plan_dispatch(v, stream_);
}

void CudaBackend::group_received(const ReceivedGroups& g) {
  enter({&g.entries, &g.entry_start, &g.row_start, &g.entry_counts, &g.experts, &g.weights, &g.offsets,
         &g.position, &g.row_source});
  const std::int64_t rows = rows_of(g.experts);
  const std::int64_t top_k = g.experts.row_numel();
  if (!g.entry_counts.empty()) {
    const std::int64_t ranks = g.entry_counts.numel();
    const std::int64_t places = static_cast<std::int64_t>(g.entries.bytes() / sizeof(moe::DispatchEntry));
    require(g.entry_block >= 0 && g.row_block >= 0 && places == ranks * g.entry_block &&
                rows == ranks * g.row_block && g.offsets.numel() >= 1 && g.weights.numel() == rows * top_k &&
                g.position.numel() == rows * top_k && g.row_source.numel() >= rows * top_k,
            "group_received", "the block layout's entries and rows are not ranks x their blocks");
    moe::ReceivedBlocksView v;
    v.places = places;
    v.unpack = {top_k,
                g.entry_block,
                g.row_block,
                static_cast<const moe::DispatchEntry*>(g.entries.data()),
                g.entry_counts.ptr<const std::int64_t>(),
                g.experts.ptr<std::int32_t>(),
                g.weights.ptr<float>()};
    v.group.p.tokens = rows;
    v.group.p.top_k = top_k;
    v.group.p.num_groups = g.offsets.numel() - 1;
    v.group.experts = v.unpack.experts;
    v.group.chunk_base =
        scratch(group_chunks_, DType::i64, {permute_workspace_elements(v.group.p)}).ptr<std::int64_t>();
    v.group.offsets = g.offsets.ptr<std::int64_t>();
    v.group.position = g.position.ptr<std::int64_t>();
    v.group.row_token = g.row_source.ptr<std::int32_t>();
    cuda::group_received_blocks(v, stream_);
    return;
  }
  const std::int64_t ranks = g.entry_start.numel() - 1;
  const std::int64_t groups = g.offsets.numel() - 1;
  require(ranks >= 1 && g.row_start.numel() == ranks + 1 && groups >= 0, "group_received",
          "entry_start and row_start of ranks + 1, offsets of groups + 1");
  require(g.weights.numel() == rows * top_k && g.position.numel() == rows * top_k &&
              g.row_source.numel() >= rows * top_k,
          "group_received", [&] { return "output tensors smaller than experts " + g.experts.shape_text(); });
  moe::ReceivedView v;
  v.entries = static_cast<std::int64_t>(g.entries.bytes() / sizeof(moe::DispatchEntry));
  v.ranks = ranks;
  v.unpack = {top_k,
              ranks,
              static_cast<const moe::DispatchEntry*>(g.entries.empty() ? nullptr : g.entries.data()),
              g.entry_start.ptr<const std::int64_t>(),
              g.row_start.ptr<const std::int64_t>(),
              optional_ptr<std::int32_t>(g.experts),
              optional_ptr<float>(g.weights)};
  v.group.p.tokens = rows;
  v.group.p.top_k = top_k;
  v.group.p.num_groups = groups;
  v.group.experts = v.unpack.experts;
  v.group.chunk_base =
      scratch(group_chunks_, DType::i64, {permute_workspace_elements(v.group.p)}).ptr<std::int64_t>();
  v.group.offsets = g.offsets.ptr<std::int64_t>();
  v.group.position = optional_ptr<std::int64_t>(g.position);
  v.group.row_token = optional_ptr<std::int32_t>(g.row_source);
  cuda::group_received(v, stream_);
}

void CudaBackend::take_rows(const Tensor& src, const Tensor& index, const Tensor& dst) {
  enter({&src, &index, &dst});
  const std::int64_t n = rows_of(dst);
  require(dst.row_numel() == src.row_numel() && index.numel() >= n, "take_rows",
          [&] { return std::to_string(n) + " rows of " + src.shape_text() + " into " + dst.shape_text(); });
  if (n == 0) return;
  cuda::take_rows(src.ptr<const float>(), src.row_numel(), index.ptr<const std::int32_t>(), n,
                  dst.ptr<float>(), stream_);
}

void CudaBackend::block_index(const Tensor& offsets, const Tensor& source, std::int64_t block,
                              const Tensor& index, const Tensor& overflow) {
  enter({&offsets, &source, &index, &overflow});
  const std::int64_t groups = offsets.numel() - 1;
  require(groups >= 0 && block >= 0 && index.numel() == groups * block && overflow.numel() == 1,
          "block_index",
          [&] { return "index " + index.shape_text() + " for " + std::to_string(groups) + " blocks"; });
  if (groups * block == 0) return;
  cuda::block_index(
      moe::BlockIndex{block, offsets.ptr<const std::int64_t>(), optional_ptr<const std::int32_t>(source),
                      index.ptr<std::int32_t>(), overflow.ptr<std::int64_t>()},
      groups * block, stream_);
}

void CudaBackend::block_positions(const Tensor& position, const Tensor& offsets, std::int64_t block,
                                  const Tensor& out) {
  enter({&position, &offsets, &out});
  const std::int64_t groups = offsets.numel() - 1;
  require(groups >= 1 && out.numel() == position.numel(), "block_positions",
          [&] { return "position " + position.shape_text() + " into " + out.shape_text(); });
  if (position.numel() == 0) return;
  cuda::block_positions(moe::BlockPositions{groups, block, offsets.ptr<const std::int64_t>(),
                                            position.ptr<const std::int64_t>(), out.ptr<std::int64_t>()},
                        position.numel(), stream_);
}

void CudaBackend::combine(const Tensor& y, const Tensor& position, const Tensor& weights, const Tensor& out) {
  enter({&y, &position, &weights, &out});
  const std::int64_t tokens = rows_of(out);
  const std::int64_t top_k = position.row_numel();
  require(position.dims() == 2 && position.dim(0) == tokens &&
              (weights.empty() || weights.numel() == tokens * top_k) &&
              (y.dims() == 0 || y.row_numel() == out.row_numel()),
          "combine", [&] {
            return "position " + position.shape_text() + ", weights " + weights.shape_text() + ", y " +
                   y.shape_text() + " for out " + out.shape_text();
          });
  cuda::combine(optional_ptr<const float>(y), out.row_numel(), position.ptr<const std::int64_t>(),
                optional_ptr<const float>(weights), tokens, top_k, out.ptr<float>(), stream_);
}

}  // namespace capserve::kernels::cuda
