#pragma once
// The operations of a forward pass behind one backend-neutral interface, on tensors of the backend's device
// (kernels/tensor.h). Activations are float32 row-major tensors whose shapes say the sizes; weights are
// tensors in their stored dtype, uploaded once through upload() (on the CPU the mmapped checkpoint itself).
// One virtual call per operation per layer: every method works on a whole batch of tokens. Memory comes from
// the backend (allocate / scratch), and the host sees device data only through to_host, each call naming why
// the step needs it, so that a step's host synchronisations are few, named and counted.
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/buffer.h"
#include "kernels/dtype.h"
#include "kernels/moe/dispatch_logic.h"
#include "kernels/sampling.h"
#include "kernels/tensor.h"

namespace capserve::kernels {

// One expert's SwiGLU weights: out = down(silu(gate(x)) * up(x)); gate/up are [ffn, hidden], down is [hidden,
// ffn].
struct ExpertWeights {
  Tensor gate;
  Tensor up;
  Tensor down;
};

// One paged KV-cache layer: k and v are [num_blocks, block_size, num_kv_heads, head_dim].
struct PagedKvLayer {
  Tensor k;
  Tensor v;
  std::int64_t block_size = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
};

// One paged latent-cache layer of multi-head latent attention: rows [num_blocks, block_size, kv_lora_rank +
// rope_dim], each a token's normalized KV latent followed by its rotated rope key (shared by all heads).
struct PagedLatentLayer {
  Tensor rows;
  std::int64_t block_size = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t rope_dim = 0;
};

// The new tokens of one sequence inside a ragged batch: rows [first_row, first_row + num_tokens) of the
// batch, at positions [start_pos, start_pos + num_tokens); its cache blocks in order.
struct SequenceSlice {
  std::int64_t first_row = 0;
  std::int64_t num_tokens = 0;
  std::int64_t start_pos = 0;
  std::span<const std::int32_t> block_table;
};

struct AttentionParams {
  std::int64_t num_heads = 0;
  float scale = 1.0F;
  std::int64_t sliding_window = 0;  // 0: full causal attention
};

// Which dims of each head a rotary embedding turns: x is [tokens, heads, head_dim] and the rotated part of a
// head is [offset, offset + dim). Pairs are (i, i + dim / 2) (rotate-half, most models) or (2i, 2i + 1)
// (interleaved: DeepSeek-V2's complex form).
struct RotaryLayout {
  std::int64_t heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t offset = 0;
  std::int64_t dim = 0;
  bool interleaved = false;
};

// The two ways to compute multi-head latent attention; both give the same result. Expanded: kv_b_proj turns
// every context latent into per-head keys and values, then ordinary attention. Absorbed: kv_b_proj's key
// half is folded into the queries and its value half applied after the softmax, so attention runs on the
// latents themselves — the context is never expanded, which wins when few queries meet a long context
// (decode).
enum class LatentForm : std::uint8_t { cheaper, absorbed, expanded };

struct LatentAttentionParams {
  std::int64_t num_heads = 0;
  std::int64_t qk_nope_head_dim = 0;
  std::int64_t qk_rope_head_dim = 0;
  std::int64_t v_head_dim = 0;
  float scale = 1.0F;
  // cheaper: per sequence, whichever form needs fewer multiply-adds for its new tokens and context.
  LatentForm form = LatentForm::cheaper;
};

// One layer's capacity scheduling (kernels/moe/index_logic.h), in place on experts and weights.
struct CapacityCall {
  moe::CapacityParams params;
  Tensor probs;        // f32 [T, E]: router probabilities
  Tensor exempt;       // u8 [T] or empty: 1 = never dropped
  Tensor owners;       // int32 [E] (device granularity) or empty
  Tensor bin_experts;  // int32 [nbins] (device granularity) or empty
  Tensor local_list;   // int32: this rank's experts, ascending (expanded reroute)
  Tensor experts;      // int32 [T, k]: in: the router's choice; out: -1 where dropped
  Tensor weights;      // f32 [T, k]: gate weights; 0 where dropped
  Tensor status;       // u8 [T, k]: out, moe::SlotState
  Tensor totals;       // int64 [2]: out, dropped and rerouted slots
  // Global scope: sums an int64 tensor of the backend over the ranks, in place; empty in local scope.
  std::function<void(const Tensor&)> allreduce_sum;
};

// The sender's side of one MoE layer's dispatch (kernels/moe/dispatch_logic.h): each token's row once per
// destination rank hosting any of its kept experts, and one entry per kept slot, both grouped by destination
// in (token, slot) order. Tensors of the backend, sized by the caller for T tokens, top_k and the ranks.
struct DispatchPlan {
  Tensor row_offsets;    // int64 [ranks + 1]: the send rows of destination d are [row_offsets[d], [d + 1])
  Tensor row_position;   // int64 [T, k]: send row of each token's first slot per destination, else -1
  Tensor row_token;      // int32 [T * k]: token of each send row
  Tensor entry_offsets;  // int64 [ranks + 1]
  Tensor entries;        // u8 [T * k, sizeof(moe::DispatchEntry)]
  Tensor counts;         // int64 [2, ranks]: rows, then entries, sent to each destination
};

// T, k and the ranks of a plan_dispatch call, after checking that the plan's tensors fit them
// (std::invalid_argument naming the shapes otherwise): the checks every backend makes alike.
struct DispatchShape {
  std::int64_t tokens = 0;
  std::int64_t top_k = 0;
  std::int64_t ranks = 0;
};
DispatchShape dispatch_shape(const Tensor& experts, const Tensor& weights, const DispatchPlan& plan);

// rows, vocab and k of a token_logprobs call, after checking that its tensors fit them (std::invalid_argument
// naming the shapes otherwise): the checks every backend makes alike.
struct LogprobShape {
  std::int64_t rows = 0;
  std::int64_t vocab = 0;
  std::int64_t top_k = 0;
};
LogprobShape logprob_shape(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                           const Tensor& top_ids);

// The receiver's side: the entries from every source grouped by local expert. The sources' entries and rows
// come back to back (entry_start / row_start), or in the block layout of a capacity-bounded exchange
// (entry_counts: source s's entries are [s * entry_block, + entry_counts[s]), its rows from s * row_block).
struct ReceivedGroups {
  Tensor entries;       // u8 [n, sizeof(moe::DispatchEntry)]: the sources' blocks in rank order
  Tensor entry_start;   // int64 [ranks + 1]: first entry of each source; empty in the block layout
  Tensor row_start;     // int64 [ranks + 1]: first received row of each source; empty in the block layout
  Tensor entry_counts;  // int64 [ranks]: block layout only, the entries each source sent
  std::int64_t entry_block = 0;
  std::int64_t row_block = 0;
  Tensor experts;     // int32 [rows, k]: out, local expert of each row's slots (-1 past its entries)
  Tensor weights;     // f32 [rows, k]: out, their gate weights
  Tensor offsets;     // int64 [local experts + 1]: out, grouped rows of each local expert
  Tensor position;    // int64 [rows, k]: out, grouped row of each slot, -1 for none
  Tensor row_source;  // int32 [rows * k]: out, received row of each grouped row
};

// The loaded model's attention, for the start-up check of a backend's fast kernels.
struct AttentionShapes {
  std::int64_t num_heads = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t block_size = 0;
  std::int64_t sliding_window = 0;  // 0: full causal attention
  DType cache_dtype = DType::f32;
  // Multi-head latent attention instead when kv_lora_rank > 0 (num_kv_heads and head_dim unused).
  std::int64_t kv_lora_rank = 0;
  std::int64_t rope_dim = 0;
};

// One fast kernel compared with its reference on this device: the start-up log's line, and whether the
// backend uses it from now on.
struct FastKernelCheck {
  std::string summary;
  bool in_use = false;
};

// Why a step copies device data to the host: every synchronisation point of a step has a name, and the
// backend counts them, so tests can assert how many a step makes.
enum class HostSync : std::uint8_t {
  sampled_tokens,  // per step: the sampled next tokens, which the scheduler needs
  moe_dispatch,    // per MoE layer: the row and entry counts of each peer (exchange sizes) and the layer's
                   // statistics, in one copy
  moe_groups,      // per MoE layer: the rows of each local expert (the grouped expert FFN's host offsets)
  moe_stats,       // the step's MoE statistics read before any other synchronisation of the step completed
                   // their copy (tests and tools that read statistics without sampling)
  logits,          // the logits themselves: only for scoring and dumps, never on the serving path
  dry_run,         // the router dry run's expert counts (batch selection on rank 0), outside the step
  logprobs,        // the log-probabilities of sampled or scored tokens, for requests that ask
  count_           // the number of reasons
};

std::string_view host_sync_name(HostSync why);

class Backend {
 public:
  virtual ~Backend() = default;
  Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  [[nodiscard]] virtual Device device() const = 0;
  // The stream the backend's work is ordered on (null on the CPU), for collectives between its operations.
  [[nodiscard]] virtual Stream stream() const = 0;

  // A checkpoint weight (host memory) as a tensor on this backend's device [rows, cols]. The CPU backend
  // returns a view of the host memory itself (zero copy: it must outlive the tensor) and leaves `storage`
  // empty; a device backend copies it into `storage`, which the caller keeps as long as the tensor.
  // A block-quantized weight (f8_e4m3 with its scales) only to a backend that keeps_fp8(): its tensor then
  // carries the scales (f32, on the device) beside the FP8 bytes, both in `storage`.
  [[nodiscard]] virtual Tensor upload(const WeightView& host, Buffer& storage) = 0;
  // Whether block-quantized FP8 weights stay FP8 on this backend (upload, linear and grouped_expert_ffn take
  // them): half the bytes of bf16, which decides whether a model fits a device. Otherwise the checkpoint
  // hands this backend bf16 dequantizations (the CPU: its GEMMs widen every weight anyway).
  [[nodiscard]] virtual bool keeps_fp8() const { return false; }

  // At least `bytes` of device memory, aligned for every element type.
  Buffer allocate(std::size_t bytes) {
    Buffer b = allocate_memory(bytes);
    allocated_bytes_ += b.bytes();
    return b;
  }
  // Bytes allocate() has handed out since construction (weights on a device, KV pools, scratch), freed or
  // not: what the start-up report calls a rank's device memory.
  [[nodiscard]] std::size_t allocated_bytes() const { return allocated_bytes_; }
  // std::invalid_argument naming --kv-cache-dtype unless this backend keeps KV (and latent) caches of `dtype`
  // (the CPU: f32; a GPU: f32 or bf16). KvCache asks when it is built, so a bad choice fails at start.
  virtual void check_kv_dtype(DType dtype) const = 0;
  // Runs the fast kernels this backend would use for the model's attention against their reference kernels
  // on random inputs of its shapes, on this device, and from then on uses only those that agree (the engine
  // asks at start-up and logs the lines). The CPU backend has one kernel per operation: nothing to check.
  virtual std::vector<FastKernelCheck> check_fast_kernels(const AttentionShapes& /*shapes*/) { return {}; }
  // A tensor of `shape` over `slot`, which is reallocated when too small: grow-only, so a warm step
  // allocates nothing. The contents are undefined. Once sealed (below), a slot too small is an error.
  Tensor scratch(Buffer& slot, DType dtype, std::initializer_list<std::int64_t> shape);
  // Sealed, scratch() never reallocates: a slot too small throws std::length_error naming the sizes. The
  // engine seals its backend after sizing every slot for its largest step at start-up
  // (EngineOptions::max_step_tokens), so that no step allocates or frees device memory (a device-wide wait;
  // impossible under graph capture).
  void seal_scratch(bool sealed) { scratch_sealed_ = sealed; }

  // Copies a tensor of this backend into host memory of its size; the host waits for it (a synchronisation
  // point, counted under `why`).
  void to_host(const Tensor& src, std::span<std::byte> dst, HostSync why);
  // Queues the copy of a tensor of this backend into host memory of its size without waiting: `dst` holds
  // the bytes once the next to_host or finish_host_copies returns, so what a step reports beside its one
  // synchronisation (the MoE statistics) rides on it. `dst` must stay valid until then.
  void to_host_later(const Tensor& src, std::span<std::byte> dst);
  // The copies queued by to_host_later, waited for if any is still outstanding (one synchronisation, counted
  // under `why`); nothing when none is.
  void finish_host_copies(HostSync why);
  // Copies host memory into a tensor of this backend, of its size. The host does not wait; `src` must stay
  // valid until the backend's next to_host.
  void from_host(std::span<const std::byte> src, const Tensor& dst);
  // to_host calls since construction, per reason.
  [[nodiscard]] std::int64_t host_syncs(HostSync why) const {
    return host_syncs_[static_cast<std::size_t>(why)];
  }

  // y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when bias is not empty); w may be block-quantized FP8 where
  // keeps_fp8().
  virtual void linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) = 0;

  // out[i, :] = table[ids[i], :]; ids is int32 [rows].
  virtual void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) = 0;

  // Row-wise RMSNorm of x [rows, cols] with a learned scale [cols]; out may alias x.
  virtual void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) = 0;

  // Rotary embedding in place on the `layout` part of x [tokens, heads * head_dim]; cos/sin are [tokens,
  // layout.dim / 2] for each token's position.
  virtual void rope(const Tensor& x, const RotaryLayout& layout, const Tensor& cos, const Tensor& sin) = 0;

  // dst += src, element-wise (the residual stream).
  virtual void add(const Tensor& dst, const Tensor& src) = 0;
  // dst[r, :] += sigmoid(gate[r]) * src[r, :]; gate is [rows] (a sigmoid-gated shared expert).
  virtual void add_sigmoid_gated(const Tensor& dst, const Tensor& src, const Tensor& gate) = 0;
  // dst = src, byte for byte (the same number of bytes; any element types).
  virtual void copy(const Tensor& src, const Tensor& dst) = 0;
  // Every byte of t set to zero (0.0F, 0, and SlotState::kept alike).
  virtual void zero(const Tensor& t) = 0;
  // x = clamp(x, -limit, limit), element-wise.
  virtual void clamp(const Tensor& x, float limit) = 0;
  // dst[i, :] = src[rows[i], :]; rows are host indices (step metadata).
  virtual void gather_rows(const Tensor& src, std::span<const std::int64_t> rows, const Tensor& dst) = 0;

  // Writes the new tokens' k/v rows [rows, num_kv_heads * head_dim] into their cache slots.
  virtual void kv_store(std::span<const SequenceSlice> seqs, const Tensor& k, const Tensor& v,
                        const PagedKvLayer& cache) = 0;

  // Causal (optionally sliding-window) grouped-query attention of each sequence's new queries
  // q [rows, num_heads * head_dim] over its cached keys/values; out [rows, num_heads * head_dim].
  virtual void paged_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                               const PagedKvLayer& cache, const AttentionParams& params,
                               const Tensor& out) = 0;

  // Writes the new tokens' latent rows [rows, kv_lora_rank] and rope keys [rows, rope_dim] into their cache
  // slots.
  virtual void latent_store(std::span<const SequenceSlice> seqs, const Tensor& latent, const Tensor& rope_key,
                            const PagedLatentLayer& cache) = 0;

  // Causal multi-head latent attention of each sequence's new queries q [rows, num_heads * (qk_nope_head_dim
  // + qk_rope_head_dim)] (rope part already rotated) over its cached latents; kv_b is kv_b_proj [num_heads *
  // (qk_nope_head_dim + v_head_dim), kv_lora_rank], per head its key rows then its value rows. out [rows,
  // num_heads * v_head_dim].
  virtual void latent_attention(std::span<const SequenceSlice> seqs, const Tensor& q,
                                const PagedLatentLayer& cache, const Tensor& kv_b,
                                const LatentAttentionParams& params, const Tensor& out) = 0;

  // SwiGLU experts over rows already grouped by expert: rows [offsets[e], offsets[e+1]) go through
  // experts[e]. x and out are [offsets.back(), hidden]; offsets are host values.
  virtual void grouped_expert_ffn(const Tensor& x, std::span<const std::int64_t> offsets,
                                  std::span<const ExpertWeights> experts, const Tensor& out) = 0;

  // tokens[r] (int32 [rows]) drawn from logits [rows, vocab] under inputs.controls[r] (host values; the
  // adjustments and their order: kernels/sampling.h): greedy takes the first maximal adjusted logit;
  // otherwise temperature, min_p, top-k (ties to the lower id), top-p, then one draw determined by (seed,
  // step). A row with a NaN or infinite raw logit gets non_finite_token(its first such id); a row whose
  // adjustments leave every logit -inf gets kNoAllowedToken.
  virtual void sample(const Tensor& logits, const SampleInputs& inputs, const Tensor& tokens) = 0;
  // adjusted [rows, vocab] (f32, this backend's): logits adjusted under inputs as `sample` adjusts them
  // before its draw (kernels/sampling.h), all on this backend's device.
  virtual void adjust_logits(const Tensor& logits, const SampleInputs& inputs, const Tensor& adjusted) = 0;
  // The same with controls alone (no bitmask, bias, banned ids or penalty history).
  void sample(const Tensor& logits, std::span<const SampleControls> controls, const Tensor& tokens) {
    sample(logits, SampleInputs{.controls = controls}, tokens);
  }

  // Log-probabilities (log_softmax: max-subtracted, summed in at least f32) of logits [rows, vocab] without
  // the rows leaving the device: values[r, 0] is that of tokens[r] (int32 [rows]), and for j < k =
  // top_ids.dim(1), top_ids[r, j] and values[r, 1 + j] are the row's (j+1)-th most likely token and its
  // log-probability (larger logit first, ties to the lower id, NaN last). values is f32 [rows, 1 + k]. A
  // token outside [0, vocab) gets NaN; a row with a NaN or infinite logit gets NaN or infinite values.
  virtual void token_logprobs(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                              const Tensor& top_ids) = 0;

  // ---- The MoE layer's stages. The index work is kernels/moe's one logic, run by each backend's executor.

  // Router: logits f32 [T, E] -> probs f32 [T, E], experts int32 [T, k], weights f32 [T, k]. bias: f32 [E],
  // added to the scores only to choose groups and experts (DeepSeek-V3's e_score_correction_bias), or empty.
  virtual void route(const moe::RouterParams& params, const Tensor& logits, const Tensor& bias,
                     const Tensor& probs, const Tensor& experts, const Tensor& weights) = 0;
  virtual void schedule_capacity(const CapacityCall& call) = 0;
  // counts int64 [E] += the slots of experts int32 [T, k] per expert (dropped slots, -1, skipped).
  virtual void count_experts(const Tensor& experts, const Tensor& counts) = 0;
  // copies int32 [T, k] = each entry of experts int32 [T, k] replaced by one of its copies (first_copy int32
  // [E + 1]; moe::AssignCopies), dropped entries (-1) kept.
  virtual void assign_copies(const Tensor& experts, const Tensor& first_copy, std::int64_t salt,
                             const Tensor& copies) = 0;
  // Per token, its dropped and rerouted slots (int64 [T] each, added to) from status u8 [T, k].
  virtual void count_slot_states(const Tensor& status, const Tensor& dropped, const Tensor& rerouted) = 0;
  // The dispatch plan of experts int32 [T, k] (-1 dropped) with gate weights [T, k]; owners and local_index
  // are int32 [E]: each expert's rank and its index there.
  virtual void plan_dispatch(const Tensor& experts, const Tensor& weights, const Tensor& owners,
                             const Tensor& local_index, const DispatchPlan& plan) = 0;
  // Groups received entries by local expert (groups.offsets has one more element than there are experts).
  virtual void group_received(const ReceivedGroups& groups) = 0;
  // dst[i, :] = src[index[i], :], zeros where index[i] < 0; index is int32 [dst rows], a tensor of the
  // backend.
  virtual void take_rows(const Tensor& src, const Tensor& index, const Tensor& dst) = 0;
  // The block layout of a capacity-bounded exchange (moe::BlockIndex): index int32 [groups * block] from
  // offsets int64 [groups + 1] and an optional source int32; the excess of groups larger than `block` is
  // added to overflow int64 [1].
  virtual void block_index(const Tensor& offsets, const Tensor& source, std::int64_t block,
                           const Tensor& index, const Tensor& overflow) = 0;
  // position int64 [T, k] of the grouped layout of `offsets` into out int64 [T, k] of the block layout
  // (moe::BlockPositions).
  virtual void block_positions(const Tensor& position, const Tensor& offsets, std::int64_t block,
                               const Tensor& out) = 0;
  // out[t, :] = sum over t's slots s with position[t, s] >= 0, in slot order, of weights[t, s] *
  // y[position[t, s], :] (weight 1 when weights is empty); position is int64 [T, k]. A token without such
  // slots gets zeros.
  virtual void combine(const Tensor& y, const Tensor& position, const Tensor& weights, const Tensor& out) = 0;

  // Thread count for the backend's own parallel loops and its BLAS.
  virtual void set_num_threads(int n) = 0;

 protected:
  // The memory of allocate().
  [[nodiscard]] virtual Buffer allocate_memory(std::size_t bytes) = 0;
  // The copies of to_host and from_host, after their checks. copy_to_host waits for the device, and then
  // every copy queued by copy_to_host_later has reached its destination too.
  virtual void copy_to_host(const Tensor& src, std::span<std::byte> dst) = 0;
  virtual void copy_from_host(std::span<const std::byte> src, const Tensor& dst) = 0;
  // to_host_later's copy: queued (true), or done at once (false: memory the host reads itself); and the wait
  // that completes every queued one.
  virtual bool copy_to_host_later(const Tensor& src, std::span<std::byte> dst) = 0;
  virtual void finish_copies_to_host() = 0;
  // Whether scratch slots are sealed (a backend's own grow-only host buffers follow the same rule).
  [[nodiscard]] bool scratch_sealed() const { return scratch_sealed_; }

 private:
  std::array<std::int64_t, static_cast<std::size_t>(HostSync::count_)> host_syncs_{};
  std::size_t allocated_bytes_ = 0;
  bool scratch_sealed_ = false;
  bool copies_outstanding_ = false;  // to_host_later since the last wait
};

// std::invalid_argument unless every range of c lies within its array of `inputs`.
void check_sample_ranges(const SampleControls& c, const SampleInputs& inputs);
// Whether row r's logits need adjusting before its draw (a bitmask, banned ids, a bias or a penalty).
[[nodiscard]] bool adjusts_row(const SampleInputs& inputs, std::size_t r);

}  // namespace capserve::kernels
