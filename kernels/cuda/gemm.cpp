#include "kernels/cuda/gemm.h"

#include "kernels/cuda/cuda_check.h"

namespace capserve::kernels::cuda {

// In cuBLAS's column-major view the row-major product is y^T = w^T(op T) * x^T.
void gemm_xwt(cublasHandle_t handle, const void* x, const void* w, cudaDataType_t ab_type, std::int64_t m,
              std::int64_t n, std::int64_t k, void* y, cudaDataType_t y_type) {
  const float alpha = 1.0F;
  const float beta = 0.0F;
  CAPSERVE_CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
                                     static_cast<int>(m), static_cast<int>(k), &alpha, w, ab_type,
                                     static_cast<int>(k), x, ab_type, static_cast<int>(k), &beta, y, y_type,
                                     static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace capserve::kernels::cuda
