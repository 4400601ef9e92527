#include "kernels/cuda/row_kernels.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/grid_stride.h"
#include "kernels/cuda/launch.h"
#include "kernels/sampling.h"

namespace capserve::kernels::cuda {
namespace {

template <typename W>
__global__ void embedding_kernel(const std::int32_t* ids, const W* table, std::int64_t table_rows,
                                 std::int64_t cols, float* out) {
  const std::int64_t id = ids[blockIdx.x];
  float* row = out + static_cast<std::int64_t>(blockIdx.x) * cols;
  const bool inside = id >= 0 && id < table_rows;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    row[c] = inside ? widen(table, id * cols + c) : __int_as_float(0x7FC00000);
}

__global__ void add_kernel(float* dst, const float* src, std::int64_t n) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    dst[i] += src[i];
}

__global__ void add_sigmoid_gated_kernel(float* dst, const float* src, const float* gate, std::int64_t cols) {
  const std::int64_t r = blockIdx.x;
  const float w = 1.0F / (1.0F + expf(-gate[r]));
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dst[r * cols + c] += w * src[r * cols + c];
}

__global__ void clamp_kernel(float* x, std::int64_t n, float limit) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = fminf(fmaxf(x[i], -limit), limit);
}

__global__ void gather_rows_kernel(const float* src, const std::int64_t* rows, std::int64_t cols,
                                   float* dst) {
  const float* from = src + rows[blockIdx.x] * cols;
  float* to = dst + static_cast<std::int64_t>(blockIdx.x) * cols;
  for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) to[c] = from[c];
}

__global__ void swiglu_kernel(const float* gate, const float* up, std::int64_t n, float* act) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const float g = gate[i];
    act[i] = g / (1.0F + expf(-g)) * up[i];
  }
}

// One block per row: the smallest id of a non-finite logit, by a block-wide minimum in shared memory.
__global__ void mark_non_finite_kernel(const float* logits, std::int64_t vocab, std::int32_t* tokens) {
  __shared__ std::int32_t first_bad;
  if (threadIdx.x == 0) first_bad = 0x7FFFFFFF;
  __syncthreads();
  const float* row = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const float l = row[i];  // l - l is 0 for every finite l, NaN for NaN and the infinities
    if (l - l != 0.0F) atomicMin(&first_bad, static_cast<std::int32_t>(i));
  }
  __syncthreads();
  if (threadIdx.x == 0 && first_bad != 0x7FFFFFFF) tokens[blockIdx.x] = non_finite_token(first_bad);
}

}  // namespace

void swiglu(const float* gate, const float* up, std::int64_t n, float* act, cudaStream_t stream) {
  if (n == 0) return;
  launch(swiglu_kernel, grid_stride_blocks(n), kGridStrideThreads, 0, stream, gate, up, n, act);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void mark_non_finite_rows(const float* logits, std::int64_t rows, std::int64_t vocab, std::int32_t* tokens,
                          cudaStream_t stream) {
  if (rows == 0) return;
  launch(mark_non_finite_kernel, static_cast<unsigned>(rows), kGridStrideThreads, 0, stream, logits, vocab,
         tokens);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void embedding(const std::int32_t* ids, std::int64_t rows, const void* table, DType dtype,
               std::int64_t table_rows, std::int64_t cols, float* out, cudaStream_t stream) {
  if (rows == 0) return;
  const auto grid = static_cast<unsigned>(rows);
  switch (dtype) {
    case DType::f32:
      launch(embedding_kernel<float>, grid, kGridStrideThreads, 0, stream, ids,
             static_cast<const float*>(table), table_rows, cols, out);
      CAPSERVE_CUDA_CHECK_LAUNCH();
      return;
    case DType::bf16:
      launch(embedding_kernel<__nv_bfloat16>, grid, kGridStrideThreads, 0, stream, ids,
             static_cast<const __nv_bfloat16*>(table), table_rows, cols, out);
      CAPSERVE_CUDA_CHECK_LAUNCH();
      return;
    case DType::f16:
      launch(embedding_kernel<__half>, grid, kGridStrideThreads, 0, stream, ids,
             static_cast<const __half*>(table), table_rows, cols, out);
      CAPSERVE_CUDA_CHECK_LAUNCH();
      return;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      break;
  }
  throw std::invalid_argument("cuda::embedding: a table of type " + std::string(dtype_name(dtype)));
}

void add(float* dst, const float* src, std::int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  launch(add_kernel, grid_stride_blocks(n), kGridStrideThreads, 0, stream, dst, src, n);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void add_sigmoid_gated(float* dst, const float* src, const float* gate, std::int64_t rows, std::int64_t cols,
                       cudaStream_t stream) {
  if (rows == 0) return;
  launch(add_sigmoid_gated_kernel, static_cast<unsigned>(rows), kGridStrideThreads, 0, stream, dst, src, gate,
         cols);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void clamp(float* x, std::int64_t n, float limit, cudaStream_t stream) {
  if (n == 0) return;
  launch(clamp_kernel, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n, limit);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void gather_rows(const float* src, const std::int64_t* rows, std::int64_t count, std::int64_t cols,
                 float* dst, cudaStream_t stream) {
  if (count == 0) return;
  launch(gather_rows_kernel, static_cast<unsigned>(count), kGridStrideThreads, 0, stream, src, rows, cols,
         dst);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
