#pragma once
// Multi-head latent attention (DeepSeek-V2) on the device over the paged latent cache: the store of each new
// token's latent row and rope key, and attention in the absorbed form — kv_b_proj's key half folded into the
// queries and its value half applied after the softmax, so attention runs on the cached latents themselves
// and the context is never expanded. The CPU backend's expanded form gives the same result; the device always
// absorbs. fp32 activations, the cache in f32 or bf16 (each value rounded once when stored), kv_b in its
// stored dtype; work is queued on `stream`.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/backend.h"
#include "kernels/cuda/flash_attention.h"
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

// The attention core on absorbed queries: o_lat [rows, heads, kv_lora_rank] from q_abs [rows, heads,
// kv_lora_rank + rope_dim] over the cached latent rows (keys: the whole row; values: its latent part).
// A non-owning reference to the caller's callable (a std::function would allocate for a capturing lambda on
// every call, once per layer and step); the callable must outlive the call it is passed to.
class LatentCore {
 public:
  template <class F>
  explicit LatentCore(const F& f)
      : target_(&f), call_([](const void* t, const float* q_abs, float* o_lat) {
          (*static_cast<const F*>(t))(q_abs, o_lat);
        }) {}
  void operator()(const float* q_abs, float* o_lat) const { call_(target_, q_abs, o_lat); }

 private:
  const void* target_;
  void (*call_)(const void*, const float*, float*);
};

// The core in fp32, one block per (row, head), online softmax over the row's context: every cache dtype, and
// the reference for the tensor-core kernel. kv_lora_rank <= 512, rope_dim <= 128.
void latent_attention_core(const DeviceAttentionBatch& batch, const float* q_abs,
                           const DeviceLatentLayer& cache, std::int64_t heads, float scale, float* o_lat,
                           cudaStream_t stream);

// The core as a problem of the tensor-core kernel (flash_attention.h; a bf16 cache): every head one group
// over the latent rows, whose first kv_lora_rank dims are the values.
[[nodiscard]] SharedKvAttention latent_attention_problem(const float* q_abs, const DeviceLatentLayer& cache,
                                                         std::int64_t heads, float scale, float* o_lat);

// Multi-head latent attention in the absorbed form, in three stages: the queries into latent space
// (q_abs = q_nope W_uk per head, a strided batched GEMM over the heads, and the rope part copied beside it),
// the core, and back (out = o_lat W_uv^T per head, likewise). kv_b [heads * (dn + dv), kv_lora_rank] in its
// stored dtype: bf16 and f16 weights meet the activations as two 16-bit halves (split_to), two GEMMs summed
// in fp32, for near-fp32 precision; f32 weights take fp32 GEMMs.
class LatentAttention {
 public:
  LatentAttention();
  ~LatentAttention();
  LatentAttention(const LatentAttention&) = delete;
  LatentAttention& operator=(const LatentAttention&) = delete;

  // Workspace bytes for `rows` rows.
  [[nodiscard]] static std::int64_t workspace_bytes(std::int64_t rows, const LatentAttentionParams& p,
                                                    std::int64_t kv_lora_rank);

  // q [rows, heads, dn + dr] (rope part rotated) -> out [rows, heads * dv].
  void run(std::int64_t rows, const float* q, std::int64_t kv_lora_rank, const void* kv_b, DType kv_b_dtype,
           const LatentAttentionParams& p, const LatentCore& core, float* out, void* workspace,
           cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
};

}  // namespace capserve::kernels::cuda
