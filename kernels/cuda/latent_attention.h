#pragma once
// Multi-head latent attention (DeepSeek-V2) on the device over the paged latent cache: the store of each new
// token's latent row and rope key, and attention in the absorbed form — kv_b_proj's key half folded into the
// queries and its value half applied after the softmax, so attention runs on the cached latents themselves
// and the context is never expanded. The CPU backend's expanded form gives the same result; the device always
// absorbs. fp32 activations, the cache in f32 or bf16 (each value rounded once when stored), kv_b in its
// stored dtype; work is queued on `stream`.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda/layer_kernels.h"

namespace capserve::kernels::cuda {

// Cache layout as PagedLatentLayer: rows [num_blocks, block_size, kv_lora_rank + rope_dim] of `dtype`.
struct DeviceLatentLayer {
  void* rows = nullptr;
  DType dtype = DType::f32;
  std::int64_t block_size = 0;
  std::int64_t kv_lora_rank = 0;
  std::int64_t rope_dim = 0;
};

// The batch rows' latents [rows, kv_lora_rank] and rope keys [rows, rope_dim] into their cache slots.
void latent_store(const DeviceAttentionBatch& batch, const float* latent, const float* rope_key,
                  const DeviceLatentLayer& cache, cudaStream_t stream);

// Causal attention of q [rows, heads, qk_nope_head_dim + qk_rope_head_dim] (rope part rotated) over the
// cached latents; kv_b [heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank] in `kv_b_dtype`; out [rows,
// heads * v_head_dim]. One block per (row, head). kv_lora_rank <= 512, qk_rope_head_dim <= 128.
void latent_attention(const DeviceAttentionBatch& batch, const float* q, const DeviceLatentLayer& cache,
                      const void* kv_b, DType kv_b_dtype, const LatentAttentionParams& params, float* out,
                      cudaStream_t stream);

}  // namespace capserve::kernels::cuda
