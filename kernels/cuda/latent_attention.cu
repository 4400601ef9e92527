#include "kernels/cuda/latent_attention.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/block_reduce.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/paged_cache_slot.h"

namespace capserve::kernels::cuda {
namespace {

constexpr int kThreads = 128;
constexpr int kRankPerThread = 4;  // latent dims per thread: kv_lora_rank <= 512
constexpr std::int64_t kMaxRank = static_cast<std::int64_t>(kThreads) * kRankPerThread;

template <typename C>
__global__ void latent_store_kernel(DeviceAttentionBatch batch, const float* latent, const float* rope_key,
                                    DeviceLatentLayer cache) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t r = cache.kv_lora_rank;
  const std::int64_t dr = cache.rope_dim;
  C* dst =
      static_cast<C*>(cache.rows) + cache_slot(batch, cache.block_size, row, batch.row_pos[row]) * (r + dr);
  for (std::int64_t i = threadIdx.x; i < r; i += blockDim.x) narrow(latent[row * r + i], dst + i);
  for (std::int64_t i = threadIdx.x; i < dr; i += blockDim.x) narrow(rope_key[row * dr + i], dst + r + i);
}

// W: kv_b's element type; C: the cache's.
template <typename W, typename C>
__global__ void __launch_bounds__(kThreads)
    latent_attention_kernel(DeviceAttentionBatch batch, const float* q, DeviceLatentLayer cache,
                            const W* kv_b, LatentAttentionParams p, float* out) {
  __shared__ float scratch[kThreads / kWarp];
  __shared__ float o_lat[kMaxRank];
  const std::int64_t row = blockIdx.x;
  const std::int64_t head = blockIdx.y;
  const std::int64_t dn = p.qk_nope_head_dim;
  const std::int64_t dr = p.qk_rope_head_dim;
  const std::int64_t dv = p.v_head_dim;
  const std::int64_t r = cache.kv_lora_rank;
  const float* qh = q + (row * p.num_heads + head) * (dn + dr);
  const W* w_uk = kv_b + head * (dn + dv) * r;  // [dn, r]
  const W* w_uv = w_uk + dn * r;                // [dv, r]

  // The query in latent space: q_lat = W_uk^T q_nope, this thread's dims of it.
  float q_lat[kRankPerThread];
  float acc[kRankPerThread];
#pragma unroll
  for (int i = 0; i < kRankPerThread; ++i) {
    const std::int64_t e = threadIdx.x + i * kThreads;
    float sum = 0.0F;
    if (e < r) {
      for (std::int64_t j = 0; j < dn; ++j) sum += qh[j] * widen(w_uk, j * r + e);
    }
    q_lat[i] = sum;
    acc[i] = 0.0F;
  }
  const float q_rope = threadIdx.x < dr ? qh[dn + threadIdx.x] : 0.0F;

  // Online softmax over the causal context, on the cached latents and rope keys.
  const std::int64_t pos = batch.row_pos[row];
  float m = -INFINITY;
  float l = 0.0F;
  for (std::int64_t t = 0; t <= pos; ++t) {
    const C* c = static_cast<const C*>(cache.rows) + cache_slot(batch, cache.block_size, row, t) * (r + dr);
    float partial = threadIdx.x < dr ? q_rope * widen(c, r + threadIdx.x) : 0.0F;
    float c_lat[kRankPerThread];
#pragma unroll
    for (int i = 0; i < kRankPerThread; ++i) {
      const std::int64_t e = threadIdx.x + i * kThreads;
      c_lat[i] = e < r ? widen(c, e) : 0.0F;
      partial += q_lat[i] * c_lat[i];
    }
    const float s = block_sum(partial, scratch) * p.scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);
    const float weight = expf(s - m_new);
    l = l * correction + weight;
#pragma unroll
    for (int i = 0; i < kRankPerThread; ++i) {
      const std::int64_t e = threadIdx.x + i * kThreads;
      if (e < r) acc[i] = acc[i] * correction + weight * c_lat[i];
    }
    m = m_new;
  }
#pragma unroll
  for (int i = 0; i < kRankPerThread; ++i) {
    const std::int64_t e = threadIdx.x + i * kThreads;
    if (e < r) o_lat[e] = acc[i] / l;
  }
  __syncthreads();
  // Back from latent space: out = W_uv o_lat.
  float* o = out + (row * p.num_heads + head) * dv;
  for (std::int64_t v = threadIdx.x; v < dv; v += blockDim.x) {
    float sum = 0.0F;
    for (std::int64_t e = 0; e < r; ++e) sum += widen(w_uv, v * r + e) * o_lat[e];
    o[v] = sum;
  }
}

// The kernel for kv_b's stored type, over a cache of C.
template <typename C>
void launch_latent_attention(const DeviceAttentionBatch& batch, const float* q,
                             const DeviceLatentLayer& cache, const void* kv_b, DType kv_b_dtype,
                             const LatentAttentionParams& params, float* out, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(batch.rows), static_cast<unsigned>(params.num_heads));
  switch (kv_b_dtype) {
    case DType::f32:
      launch(latent_attention_kernel<float, C>, grid, kThreads, 0, stream, batch, q, cache,
             static_cast<const float*>(kv_b), params, out);
      return;
    case DType::bf16:
      launch(latent_attention_kernel<__nv_bfloat16, C>, grid, kThreads, 0, stream, batch, q, cache,
             static_cast<const __nv_bfloat16*>(kv_b), params, out);
      return;
    case DType::f16:
      launch(latent_attention_kernel<__half, C>, grid, kThreads, 0, stream, batch, q, cache,
             static_cast<const __half*>(kv_b), params, out);
      return;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      break;
  }
  throw std::invalid_argument("cuda::latent_attention: kv_b of type " + std::string(dtype_name(kv_b_dtype)));
}

}  // namespace

void latent_store(const DeviceAttentionBatch& batch, const float* latent, const float* rope_key,
                  const DeviceLatentLayer& cache, cudaStream_t stream) {
  check_cache_dtype(cache.dtype, "latent_store");
  if (batch.rows <= 0) return;
  if (cache.dtype == DType::bf16) {
    launch(latent_store_kernel<__nv_bfloat16>, static_cast<unsigned>(batch.rows), 256, 0, stream, batch,
           latent, rope_key, cache);
  } else {
    launch(latent_store_kernel<float>, static_cast<unsigned>(batch.rows), 256, 0, stream, batch, latent,
           rope_key, cache);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void latent_attention(const DeviceAttentionBatch& batch, const float* q, const DeviceLatentLayer& cache,
                      const void* kv_b, DType kv_b_dtype, const LatentAttentionParams& params, float* out,
                      cudaStream_t stream) {
  if (cache.kv_lora_rank > kMaxRank || params.qk_rope_head_dim > kThreads ||
      params.qk_rope_head_dim != cache.rope_dim) {
    throw std::invalid_argument("cuda::latent_attention: kv_lora_rank " + std::to_string(cache.kv_lora_rank) +
                                " (at most 512) and rope dims " + std::to_string(params.qk_rope_head_dim) +
                                "/" + std::to_string(cache.rope_dim) + " (equal, at most 128)");
  }
  check_cache_dtype(cache.dtype, "latent_attention");
  if (batch.rows <= 0) return;
  if (cache.dtype == DType::bf16) {
    launch_latent_attention<__nv_bfloat16>(batch, q, cache, kv_b, kv_b_dtype, params, out, stream);
  } else {
    launch_latent_attention<float>(batch, q, cache, kv_b, kv_b_dtype, params, out, stream);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
