#include "kernels/cuda/latent_attention.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/cuda/block_reduce.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/linear.h"
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

// One block per (row, head) over the absorbed query; C: the cache's element type.
template <typename C>
__global__ void __launch_bounds__(kThreads)
    latent_core_kernel(DeviceAttentionBatch batch, const float* q_abs, DeviceLatentLayer cache,
                       std::int64_t heads, float scale, float* o_lat) {
  __shared__ float scratch[kThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  const std::int64_t head = blockIdx.y;
  const std::int64_t r = cache.kv_lora_rank;
  const std::int64_t dr = cache.rope_dim;
  const float* qh = q_abs + (row * heads + head) * (r + dr);
  float q_lat[kRankPerThread];
  float acc[kRankPerThread];
#pragma unroll
  for (int i = 0; i < kRankPerThread; ++i) {
    const std::int64_t e = threadIdx.x + i * kThreads;
    q_lat[i] = e < r ? qh[e] : 0.0F;
    acc[i] = 0.0F;
  }
  const float q_rope = threadIdx.x < dr ? qh[r + threadIdx.x] : 0.0F;

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
    const float s = block_sum(partial, scratch) * scale;
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
  float* o = o_lat + (row * heads + head) * r;
#pragma unroll
  for (int i = 0; i < kRankPerThread; ++i) {
    const std::int64_t e = threadIdx.x + i * kThreads;
    if (e < r) o[e] = acc[i] / l;
  }
}

// q_abs[row, head, r:] = the query's rope part, and (T not float) the nope part split into two values of T
// (linear.h, split_to) for the absorbing GEMMs: hi [rows, heads, dn], then lo likewise. A block per row.
template <typename T>
__global__ void split_query_kernel(const float* q, std::int64_t rows, std::int64_t heads, std::int64_t dn,
                                   std::int64_t dr, std::int64_t r, T* qn, float* q_abs) {
  const std::int64_t row = blockIdx.x;
  const auto width = static_cast<int>(dn + dr);  // 32-bit division: a 64-bit one is a call that spills
  for (int i = static_cast<int>(threadIdx.x); i < static_cast<int>(heads) * width;
       i += static_cast<int>(blockDim.x)) {
    const std::int64_t h = i / width;
    const std::int64_t j = i % width;
    const float v = q[row * heads * width + i];
    if (j >= dn) {
      q_abs[(row * heads + h) * (r + dr) + r + (j - dn)] = v;
    } else if (qn != nullptr) {
      T* hi = qn + (row * heads + h) * dn + j;
      narrow(v, hi);
      narrow(v - widen(hi, 0), hi + rows * heads * dn);
    }
  }
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

void latent_attention_core(const DeviceAttentionBatch& batch, const float* q_abs,
                           const DeviceLatentLayer& cache, std::int64_t heads, float scale, float* o_lat,
                           cudaStream_t stream) {
  if (cache.kv_lora_rank > kMaxRank || cache.rope_dim > kThreads) {
    throw std::invalid_argument("cuda::latent_attention_core: kv_lora_rank " +
                                std::to_string(cache.kv_lora_rank) + " (at most 512) and rope dims " +
                                std::to_string(cache.rope_dim) + " (at most 128)");
  }
  check_cache_dtype(cache.dtype, "latent_attention");
  if (batch.rows <= 0) return;
  const dim3 grid(static_cast<unsigned>(batch.rows), static_cast<unsigned>(heads));
  if (cache.dtype == DType::bf16) {
    launch(latent_core_kernel<__nv_bfloat16>, grid, kThreads, 0, stream, batch, q_abs, cache, heads, scale,
           o_lat);
  } else {
    launch(latent_core_kernel<float>, grid, kThreads, 0, stream, batch, q_abs, cache, heads, scale, o_lat);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

SharedKvAttention latent_attention_problem(const float* q_abs, const DeviceLatentLayer& cache,
                                           std::int64_t heads, float scale, float* o_lat) {
  const auto* rows = static_cast<const __nv_bfloat16*>(cache.rows);
  const std::int64_t width = cache.kv_lora_rank + cache.rope_dim;
  return {q_abs, heads, heads, width, cache.kv_lora_rank, rows, rows, width, width, 0, 0, cache.block_size,
          scale, 0,     o_lat};
}

namespace {

// Where run() keeps its stages' values in the workspace.
struct LatentWorkspace {
  float* q_abs;  // [rows, heads, r + dr]
  float* o_lat;  // [rows, heads, r]
  void* narrow;  // [rows, heads, max(dn, r)] in kv_b's 16-bit type
};

std::int64_t align_up(std::int64_t n) {
  return (n + 255) / 256 * 256;
}

LatentWorkspace latent_workspace(void* base, std::int64_t rows, const LatentAttentionParams& p,
                                 std::int64_t r) {
  auto* bytes = static_cast<unsigned char*>(base);
  const std::int64_t q_bytes = align_up(rows * p.num_heads * (r + p.qk_rope_head_dim) * 4);
  const std::int64_t o_bytes = align_up(rows * p.num_heads * r * 4);
  return {reinterpret_cast<float*>(bytes), reinterpret_cast<float*>(bytes + q_bytes),
          bytes + q_bytes + o_bytes};
}

cudaDataType_t gemm_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      break;
  }
  throw std::invalid_argument("cuda::LatentAttention: kv_b of type " + std::string(dtype_name(dtype)));
}

}  // namespace

LatentAttention::LatentAttention() {
  CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle_));
}

LatentAttention::~LatentAttention() {
  cublasDestroy(handle_);
}

std::int64_t LatentAttention::workspace_bytes(std::int64_t rows, const LatentAttentionParams& p,
                                              std::int64_t kv_lora_rank) {
  const std::int64_t r = kv_lora_rank;
  return align_up(rows * p.num_heads * (r + p.qk_rope_head_dim) * 4) + align_up(rows * p.num_heads * r * 4) +
         2 * rows * p.num_heads * std::max(p.qk_nope_head_dim, r) * 2;
}

// With 16-bit weights each GEMM runs twice, over the activations' two halves (split_to), the second adding
// into the first's result: the absorbed queries and outputs keep near-fp32 precision, so a device run makes
// the CPU's routing decisions downstream (rounding the activations once moved tokens between near-tied
// experts of DeepSeek-V3's router). These GEMMs are small beside the attention between them.
void LatentAttention::run(std::int64_t rows, const float* q, std::int64_t kv_lora_rank, const void* kv_b,
                          DType kv_b_dtype, const LatentAttentionParams& p, const LatentCore& core,
                          float* out, void* workspace, cudaStream_t stream) {
  const cudaDataType_t ab = gemm_type(kv_b_dtype);
  if (rows <= 0) return;
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  const std::int64_t h = p.num_heads;
  const std::int64_t dn = p.qk_nope_head_dim;
  const std::int64_t dr = p.qk_rope_head_dim;
  const std::int64_t dv = p.v_head_dim;
  const std::int64_t r = kv_lora_rank;
  const LatentWorkspace ws = latent_workspace(workspace, rows, p, r);
  const bool split = kv_b_dtype != DType::f32;
  const std::int64_t per_head = (dn + dv) * r;  // kv_b's rows of one head
  const std::int64_t w_bytes = static_cast<std::int64_t>(dtype_size(kv_b_dtype));
  const auto* w = static_cast<const unsigned char*>(kv_b);
  // The second half of a split operand of `n` elements.
  const auto lo = [&](std::int64_t n) {
    return static_cast<const void*>(static_cast<unsigned char*>(ws.narrow) + n * w_bytes);
  };

  // Into latent space: q_abs[:, h, :r] = q_nope_h W_uk_h, W_uk_h = kv_b rows [h (dn + dv), + dn) as [dn, r].
  switch (kv_b_dtype) {
    case DType::bf16:
      launch(split_query_kernel<__nv_bfloat16>, static_cast<unsigned>(rows), 256, 0, stream, q, rows, h, dn,
             dr, r, static_cast<__nv_bfloat16*>(ws.narrow), ws.q_abs);
      break;
    case DType::f16:
      launch(split_query_kernel<__half>, static_cast<unsigned>(rows), 256, 0, stream, q, rows, h, dn, dr, r,
             static_cast<__half*>(ws.narrow), ws.q_abs);
      break;
    default:
      launch(split_query_kernel<float>, static_cast<unsigned>(rows), 256, 0, stream, q, rows, h, dn, dr, r,
             static_cast<float*>(nullptr), ws.q_abs);
      break;
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
  const BatchedMatrix w_uk{w, r, per_head};
  const BatchedMatrix q_abs{ws.q_abs, h * (r + dr), r + dr};
  if (split) {
    gemm_batched(handle_, ab, rows, r, dn, {ws.narrow, h * dn, dn}, w_uk, false, q_abs, CUDA_R_32F, h);
    gemm_batched(handle_, ab, rows, r, dn, {lo(rows * h * dn), h * dn, dn}, w_uk, false, q_abs, CUDA_R_32F, h,
                 true);
  } else {
    gemm_batched(handle_, ab, rows, r, dn, {q, h * (dn + dr), dn + dr}, w_uk, false, q_abs, CUDA_R_32F, h);
  }

  core(ws.q_abs, ws.o_lat);

  // Back: out[:, h, :] = o_lat_h W_uv_h^T, W_uv_h = kv_b rows [h (dn + dv) + dn, + dv) as [dv, r].
  const BatchedMatrix w_uv{w + dn * r * w_bytes, r, per_head};
  const BatchedMatrix y{out, h * dv, dv};
  if (split) {
    split_to(ws.o_lat, rows * h * r, kv_b_dtype, ws.narrow, const_cast<void*>(lo(rows * h * r)), stream);
    gemm_batched(handle_, ab, rows, dv, r, {ws.narrow, h * r, r}, w_uv, true, y, CUDA_R_32F, h);
    gemm_batched(handle_, ab, rows, dv, r, {lo(rows * h * r), h * r, r}, w_uv, true, y, CUDA_R_32F, h, true);
  } else {
    gemm_batched(handle_, ab, rows, dv, r, {ws.o_lat, h * r, r}, w_uv, true, y, CUDA_R_32F, h);
  }
}

}  // namespace capserve::kernels::cuda
