#pragma once
// Causal attention on tensor cores over a paged bf16 cache whose keys and values a group of query heads
// shares: grouped-query attention (a group per K/V head) and multi-head latent attention in the absorbed form
// (every head one group over the latent rows, the values being the keys' first dims). Flash-style: a block
// takes a tile of query rows (one sequence's (token, head) pairs of one group) and walks the context in tiles
// of 64 keys, loaded once into shared memory for all its rows; scores and the weighted values are 16x16x16
// bf16 products with fp32 sums (WMMA), the softmax online in fp32. The queries enter as two bf16 halves (two
// products per score, near-fp32 scores: one rounding there moved tokens between near-tied experts of
// DeepSeek-V3's router downstream), the probabilities rounded once to bf16, so results agree with fp32
// attention over the same bf16 cache to about 1e-3 relative; an fp32 cache keeps the fp32 kernels
// (kernels/README.md).
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/cuda/layer_kernels.h"

namespace capserve::kernels::cuda {

// One attention call. Rows are the batch's; heads = kv_heads * group, head h reading K/V head h / group.
struct SharedKvAttention {
  const float* q = nullptr;  // [rows, heads, dk]
  std::int64_t heads = 0;
  std::int64_t group = 0;  // query heads per K/V head
  std::int64_t dk = 0;     // key (and query) dims
  std::int64_t dv = 0;     // value (and output) dims
  // Element e of K/V head k at cache slot `slot`: keys[slot * key_stride + k * key_head_stride + e], values
  // likewise (values may be the keys themselves).
  const __nv_bfloat16* keys = nullptr;
  const __nv_bfloat16* values = nullptr;
  std::int64_t key_stride = 0;
  std::int64_t value_stride = 0;
  std::int64_t key_head_stride = 0;
  std::int64_t value_head_stride = 0;
  std::int64_t block_size = 0;
  float scale = 1.0F;
  std::int64_t sliding_window = 0;  // 0: full causal attention
  float* out = nullptr;             // [rows, heads, dv]
};

// Whether flash_attention takes these shapes: dk and dv multiples of 16 (dk <= 576, dv <= 512), strides and
// head strides multiples of 8 (16-byte loads); otherwise the caller keeps its fp32 kernel.
[[nodiscard]] bool flash_attention_supports(const SharedKvAttention& a);

// The grouped-query attention of a paged K/V layer of bf16 (layer_kernels.h) as a SharedKvAttention.
[[nodiscard]] SharedKvAttention gqa_attention(const float* q, const DeviceKvLayer& cache,
                                              const AttentionParams& params, float* out);

// Where split-K decoding keeps its partial results: a batch with too few (sequence, row tile, K/V head)
// blocks to fill the device splits each context into up to 32 ranges, each block writes its range's
// unnormalised output and softmax statistics here, and a second kernel combines them. Without it (or when the
// partials of a batch would not fit) every block walks its rows' whole context.
struct FlashWorkspace {
  float* partial = nullptr;
  std::int64_t floats = 0;
  int multiprocessors = 0;  // the device's: splits are chosen to give about two blocks per multiprocessor
};

// Needs the batch's sequence arrays (seq_first_row, seq_tokens, max_seq_tokens). std::invalid_argument for
// shapes flash_attention_supports refuses.
void flash_attention(const DeviceAttentionBatch& batch, const SharedKvAttention& a,
                     const FlashWorkspace& workspace, cudaStream_t stream);

// The context splits flash_attention makes for this batch (1: none), given the blocks it would launch.
[[nodiscard]] int flash_attention_splits(const DeviceAttentionBatch& batch, const SharedKvAttention& a,
                                         const FlashWorkspace& workspace);

}  // namespace capserve::kernels::cuda
