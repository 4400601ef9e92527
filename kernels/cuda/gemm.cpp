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

// Column-major, y_b^T [n, m] = op(w_b)^T [n, k] * x_b^T [k, m]: a row-major [k, n] w is a column-major
// [n, k] (no transpose), a row-major [n, k] one needs the transpose.
void gemm_batched(cublasHandle_t handle, cudaDataType_t ab_type, std::int64_t m, std::int64_t n,
                  std::int64_t k, const BatchedMatrix& x, const BatchedMatrix& w, bool w_rows_are_n,
                  const BatchedMatrix& y, cudaDataType_t y_type, std::int64_t batch, bool accumulate) {
  const float alpha = 1.0F;
  const float beta = accumulate ? 1.0F : 0.0F;
  CAPSERVE_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle, w_rows_are_n ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, static_cast<int>(n), static_cast<int>(m),
      static_cast<int>(k), &alpha, w.data, ab_type, static_cast<int>(w.ld), w.stride, x.data, ab_type,
      static_cast<int>(x.ld), x.stride, &beta, const_cast<void*>(y.data), y_type, static_cast<int>(y.ld),
      y.stride, static_cast<int>(batch), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace capserve::kernels::cuda
