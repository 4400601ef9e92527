#pragma once
// The one GEMM shape the forward pass needs, on cuBLAS: row-major y[m, n] = x[m, k] * w[n, k]^T (Hugging
// Face's [out_features, in_features] weights), fp32 accumulation.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

namespace capserve::kernels::cuda {

// x and w are of `ab_type` (CUDA_R_16BF, CUDA_R_16F or CUDA_R_32F), y of `y_type` (fp32, or ab_type). Queued
// on the handle's stream.
void gemm_xwt(cublasHandle_t handle, const void* x, const void* w, cudaDataType_t ab_type, std::int64_t m,
              std::int64_t n, std::int64_t k, void* y, cudaDataType_t y_type);

// A row-major operand of each item of a batched product: element (i, j) of item b at
// data[b * stride + i * ld + j].
struct BatchedMatrix {
  const void* data = nullptr;
  std::int64_t ld = 0;
  std::int64_t stride = 0;
};

// For each of `batch` items: y_b[m, n] = x_b[m, k] * w_b (+ y_b's own values when `accumulate`), where w_b is
// [k, n], or [n, k] transposed when `w_rows_are_n` (Hugging Face's layout). x and w of `ab_type`, y of
// `y_type`; fp32 accumulation.
void gemm_batched(cublasHandle_t handle, cudaDataType_t ab_type, std::int64_t m, std::int64_t n,
                  std::int64_t k, const BatchedMatrix& x, const BatchedMatrix& w, bool w_rows_are_n,
                  const BatchedMatrix& y, cudaDataType_t y_type, std::int64_t batch, bool accumulate = false);

}  // namespace capserve::kernels::cuda
