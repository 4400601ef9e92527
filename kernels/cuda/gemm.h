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

}  // namespace capserve::kernels::cuda
