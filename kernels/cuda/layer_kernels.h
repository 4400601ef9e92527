#pragma once
// The dense per-layer operations on the device, fp32 activations: RMSNorm, rotary embedding, the paged KV
// cache store and causal grouped-query attention over it (prefill and decode alike), and next-token
// sampling. Pointers are device memory; work is queued on `stream`.
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/dtype.h"
#include "kernels/sampling.h"

namespace capserve::kernels::cuda {

// out[r, :] = weight * x[r, :] / sqrt(mean(x[r, :]^2) + eps); out may alias x.
// The weight [cols] is in its stored dtype.
void rms_norm(const float* x, std::int64_t rows, std::int64_t cols, const void* weight, DType weight_dtype,
              float eps, float* out, cudaStream_t stream);

// Rotary embedding in place on the layout's part of x [tokens, heads, head_dim]; cos/sin [tokens, dim / 2].
void rope(float* x, std::int64_t tokens, const RotaryLayout& layout, const float* cos, const float* sin,
          cudaStream_t stream);

// A ragged batch's rows as the attention kernels see them (device arrays).
struct DeviceAttentionBatch {
  std::int64_t rows = 0;
  const std::int32_t* row_pos = nullptr;       // [rows]: the row's position in its sequence
  const std::int32_t* row_seq = nullptr;       // [rows]: its sequence
  const std::int32_t* block_tables = nullptr;  // [sequences, max_blocks]
  std::int64_t max_blocks = 0;
  // Per sequence (what the tensor-core attention tiles by): its first row and number of rows.
  const std::int32_t* seq_first_row = nullptr;  // [sequences]
  const std::int32_t* seq_tokens = nullptr;     // [sequences]
  std::int64_t sequences = 0;
  std::int64_t max_seq_tokens = 0;  // the most rows of one sequence (a host value)
};

// The host arrays behind a DeviceAttentionBatch, built from the CPU path's sequence slices.
struct AttentionBatchArrays {
  std::vector<std::int32_t> row_pos;
  std::vector<std::int32_t> row_seq;
  std::vector<std::int32_t> block_tables;
  std::int64_t max_blocks = 0;
  std::vector<std::int32_t> seq_first_row;
  std::vector<std::int32_t> seq_tokens;
  std::int64_t max_seq_tokens = 0;
};
AttentionBatchArrays attention_batch_arrays(std::span<const SequenceSlice> seqs);
// The same into `into`, whose vectors keep their capacity: a serving step allocates nothing for them.
void attention_batch_arrays(std::span<const SequenceSlice> seqs, AttentionBatchArrays& into);

// Those arrays in device memory of their own, copied synchronously: for the start-up self-check and tests
// (a serving step stages them through the backend's page-locked ring instead).
class DeviceAttentionArrays {
 public:
  explicit DeviceAttentionArrays(std::span<const SequenceSlice> seqs);
  [[nodiscard]] const DeviceAttentionBatch& batch() const { return batch_; }

 private:
  DeviceBuffer<std::int32_t> row_pos_, row_seq_, block_tables_, seq_first_row_, seq_tokens_;
  DeviceAttentionBatch batch_;
};

// Cache layout as PagedKvLayer: [num_blocks, block_size, num_kv_heads, head_dim] of `dtype` (f32, or bf16:
// half the memory, each value rounded once when stored; attention reads it back as fp32).
struct DeviceKvLayer {
  void* k = nullptr;
  void* v = nullptr;
  DType dtype = DType::f32;
  std::int64_t block_size = 0;
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
};

// std::invalid_argument naming `op` unless a cache of `dtype` is one the kernels read and write (f32, bf16).
void check_cache_dtype(DType dtype, const char* op);

// The batch rows' k/v [rows, num_kv_heads * head_dim] into their cache slots.
void kv_store(const DeviceAttentionBatch& batch, const float* k, const float* v, const DeviceKvLayer& cache,
              cudaStream_t stream);

// Causal (optionally sliding-window) GQA of q [rows, heads * head_dim] over the cache; out likewise, in fp32.
// One block per (row, head), online softmax over the row's context. head_dim <= 512. The reference for the
// tensor-core kernel (flash_attention.h), which CudaBackend prefers for a bf16 cache.
void paged_attention(const DeviceAttentionBatch& batch, const float* q, const DeviceKvLayer& cache,
                     const AttentionParams& params, float* out, cudaStream_t stream);

// kernels::SampleInputs's arrays on the device; allowed is null when every token is allowed.
struct DeviceSampleInputs {
  const SampleControls* controls = nullptr;
  // Entries [history_offset, ...) of SampleInputs::history: the rows being adjusted stage only theirs.
  const std::int32_t* history = nullptr;
  std::int64_t history_offset = 0;
  const std::int32_t* banned = nullptr;
  const LogitBias* biases = nullptr;
  const std::int32_t* allowed = nullptr;
};

// Row b of adjusted [count, vocab]: logits row rows[b] adjusted under inputs (kernels/sampling.h: bitmask,
// banned ids, logit_bias, penalties), all on the device; counts is int32 scratch [count, vocab].
void adjust_logits(const float* logits, std::int64_t vocab, const DeviceSampleInputs& inputs,
                   const std::int32_t* rows, std::int64_t count, float* adjusted, std::int32_t* counts,
                   cudaStream_t stream);

// tokens[r] for r = row_ids[b] (or b when row_ids is null) sampled from row b of logits [rows, vocab] under
// controls[r] (kernels/sampling.h; device arrays). NaN logits are never chosen (a row of only NaN gives id
// 0), nor -inf ones (a row of only -inf gives kNoAllowedToken). Greedy takes the first maximal id, as the CPU
// sampler; otherwise temperature, min_p, then top-k (ties to the lower id), then top-p, and a draw from a
// counter-based generator: the same distribution as the CPU sampler, not the same stream. A (seed, step)
// draws the same token on every run: no sum depends on the order threads run in.
void sample(const float* logits, std::int64_t rows, std::int64_t vocab, const SampleControls* controls,
            std::int32_t* tokens, cudaStream_t stream, const std::int32_t* row_ids = nullptr);

// Backend::token_logprobs on device arrays: values [rows, 1 + top_k] (the tokens' log-probabilities, then the
// top ones'), top_ids [rows, top_k], in the sampler's order (larger logit first, ties to the lower id, NaN
// last). One block per row; top_k passes over the row.
void token_logprobs(const float* logits, std::int64_t rows, std::int64_t vocab, const std::int32_t* tokens,
                    std::int64_t top_k, float* values, std::int32_t* top_ids, cudaStream_t stream);

}  // namespace capserve::kernels::cuda
