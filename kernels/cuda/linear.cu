#include "kernels/cuda/linear.h"

#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grid_stride.h"
#include "kernels/cuda/launch.h"

namespace capserve::kernels::cuda {
namespace {

template <typename T>
__global__ void narrow_kernel(const float* x, std::int64_t n, T* out) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    narrow(x[i], out + i);
}

template <typename T>
__global__ void split_kernel(const float* x, std::int64_t n, T* hi, T* lo) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    narrow(x[i], hi + i);
    narrow(x[i] - widen(hi, i), lo + i);
  }
}

template <typename B>
__global__ void add_bias_kernel(float* y, std::int64_t rows, std::int64_t n, const B* bias) {
  const std::int64_t total = rows * n;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride)
    y[i] += widen(bias, i % n);
}

void add_bias(float* y, std::int64_t m, std::int64_t n, const void* bias, DType dtype, cudaStream_t stream) {
  const unsigned grid = grid_stride_blocks(m * n);
  switch (dtype) {
    case DType::f32:
      launch(add_bias_kernel<float>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const float*>(bias));
      break;
    case DType::bf16:
      launch(add_bias_kernel<__nv_bfloat16>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const __nv_bfloat16*>(bias));
      break;
    case DType::f16:
      launch(add_bias_kernel<__half>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const __half*>(bias));
      break;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      throw std::invalid_argument("cuda::Linear: a bias of type " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Linear::Linear() {
  CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle_));
}

Linear::~Linear() {
  cublasDestroy(handle_);
}

std::int64_t Linear::workspace_bytes(std::int64_t m, std::int64_t k, DType weight_dtype) {
  return weight_dtype == DType::f32 ? 0 : m * k * static_cast<std::int64_t>(dtype_size(weight_dtype));
}

void Linear::run(const float* x, std::int64_t m, std::int64_t k, const void* w, DType weight_dtype,
                 std::int64_t n, const void* bias, DType bias_dtype, float* y, void* workspace,
                 cudaStream_t stream) {
  if (m == 0) return;
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  switch (weight_dtype) {
    case DType::f32:
      gemm_xwt(handle_, x, w, CUDA_R_32F, m, n, k, y, CUDA_R_32F);
      break;
    case DType::bf16:
      narrow_to(x, m * k, DType::bf16, workspace, stream);
      gemm_xwt(handle_, workspace, w, CUDA_R_16BF, m, n, k, y, CUDA_R_32F);
      break;
    case DType::f16:
      narrow_to(x, m * k, DType::f16, workspace, stream);
      gemm_xwt(handle_, workspace, w, CUDA_R_16F, m, n, k, y, CUDA_R_32F);
      break;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      throw std::invalid_argument("cuda::Linear: a weight of type " + std::string(dtype_name(weight_dtype)));
  }
  if (bias != nullptr) add_bias(y, m, n, bias, bias_dtype, stream);
}

void narrow_to(const float* x, std::int64_t n, DType dtype, void* out, cudaStream_t stream) {
  if (n <= 0) return;
  if (dtype == DType::bf16) {
    launch(narrow_kernel<__nv_bfloat16>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__nv_bfloat16*>(out));
  } else if (dtype == DType::f16) {
    launch(narrow_kernel<__half>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__half*>(out));
  } else {
    throw std::invalid_argument("cuda::narrow_to: to " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void split_to(const float* x, std::int64_t n, DType dtype, void* hi, void* lo, cudaStream_t stream) {
  if (n <= 0) return;
  if (dtype == DType::bf16) {
    launch(split_kernel<__nv_bfloat16>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__nv_bfloat16*>(hi), static_cast<__nv_bfloat16*>(lo));
  } else if (dtype == DType::f16) {
    launch(split_kernel<__half>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__half*>(hi), static_cast<__half*>(lo));
  } else {
    throw std::invalid_argument("cuda::split_to: to " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
