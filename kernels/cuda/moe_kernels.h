#pragma once
// The MoE block's index work on the device: router (softmax or sigmoid, top-k), local-scope capacity
// scheduling, permute to rows grouped by expert, and the gate-weighted combine back. Every pointer is device
// memory; work is queued on `stream` with no allocation and no host synchronization. The decisions are those
// of the thread bodies in kernels/moe/index_logic.h, which the CPU path runs through the host executor.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>

#include "kernels/moe/pipeline.h"

namespace capserve::kernels::cuda {

// logits [T, E] -> probs [T, E], experts and weights [T, k]. Throws std::invalid_argument unless n_group
// divides E (at most 64 groups) and topk_group is in [1, n_group] with at least top_k experts in that many
// groups.
void route(const moe::RouterParams& p, const float* logits, const float* bias, float* probs,
           std::int32_t* experts, float* weights, cudaStream_t stream);

// Workspace bytes for schedule_capacity with these parameters.
std::int64_t capacity_workspace_bytes(const moe::CapacityParams& p);

// Global scope: sums n device int64 values over the ranks in place, ordered on the stream (an NCCL allreduce
// or a host-staged MPI one). Empty: local scope.
using DeviceReduce = std::function<void(std::int64_t* data, std::int64_t n, cudaStream_t stream)>;

// Capacity scheduling of one layer in place on view.experts / view.weights, status into view.status. The
// view's input and in/out pointers must be set; its workspace pointers are bound to `workspace` (256-byte
// aligned, capacity_workspace_bytes long). Afterwards `totals` (device, [2]) holds dropped and rerouted.
// Global scope: `reduce` set, view.p.total_tokens / token_offset the step's count and this rank's offset.
void schedule_capacity(moe::CapacityView view, void* workspace, std::int64_t* totals, cudaStream_t stream,
                       const DeviceReduce& reduce = {});

// Workspace bytes (int64 elements) for permute with these parameters.
std::int64_t permute_workspace_elements(const moe::PermuteParams& p);

// Groups the slots of experts [T, k] by local expert: offsets [groups + 1], position [T, k] (row of each
// slot, -1 when not here), row_token [T * k] (token of each row).
void permute(const moe::PermuteParams& p, const std::int32_t* experts, const std::int32_t* owners,
             const std::int32_t* local_index, std::int64_t* workspace, std::int64_t* offsets,
             std::int64_t* position, std::int32_t* row_token, cudaStream_t stream);

// x[row, :] = bf16(h[row_token[row], :]) for row < *rows (device: permute's offsets[groups]); max_rows bounds
// *rows (tokens * top_k will do), so the launch needs no count from the device.
void gather_rows(const float* h, std::int64_t hidden, const std::int32_t* row_token, const std::int64_t* rows,
                 std::int64_t max_rows, __nv_bfloat16* x, cudaStream_t stream);

// out[t, :] = sum over the token's slots with a row (slot order) of weights[t, s] * y[position[t, s], :];
// weight 1 when weights is null.
void combine(const float* y, std::int64_t hidden, const std::int64_t* position, const float* weights,
             std::int64_t tokens, std::int64_t top_k, float* out, cudaStream_t stream);

// The dispatch plan and the receiver's grouping (pipeline.h), every pointer of the views set (device memory).
void plan_dispatch(const moe::DispatchPlanView& v, cudaStream_t stream);
void group_received(const moe::ReceivedView& v, cudaStream_t stream);
void group_received_blocks(const moe::ReceivedBlocksView& v, cudaStream_t stream);
// The block layout's index and positions (dispatch_logic.h), one thread per place and per slot.
void block_index(const moe::BlockIndex& body, std::int64_t places, cudaStream_t stream);
void block_positions(const moe::BlockPositions& body, std::int64_t slots, cudaStream_t stream);

// counts[e] += slots of experts [slots] per expert.
void count_experts(const std::int32_t* experts, std::int64_t slots, std::int64_t* counts,
                   cudaStream_t stream);
// Each entry's expert replaced by one of its copies, one thread per entry.
void assign_copies(const moe::AssignCopies& body, std::int64_t entries, cudaStream_t stream);
// Per token, its dropped and rerouted slots, added to its counts.
void count_slot_states(const moe::CountSlotStates& body, std::int64_t tokens, cudaStream_t stream);

// dst[i, :] = src[index[i], :] for i < n, rows of `width` floats; zeros where index[i] < 0.
void take_rows(const float* src, std::int64_t width, const std::int32_t* index, std::int64_t n, float* dst,
               cudaStream_t stream);

}  // namespace capserve::kernels::cuda
