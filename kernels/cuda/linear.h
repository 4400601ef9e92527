#pragma once
// A dense layer on the device: y[m, n] = x[m, k] * w[n, k]^T (+ bias[n]), fp32 activations, the weight in its
// stored dtype. bf16 and f16 weights meet x rounded to their type (the GEMM accumulates in fp32, as every
// bf16 inference engine does); f32 weights take an fp32 GEMM, which equals the CPU backend's product to
// rounding. Block-quantized FP8 weights (f8_e4m3 with f32 block scales, kernels/dtype.h) stay FP8 in device
// memory: a tiled tensor-core kernel dequantizes each weight tile into bf16 in shared memory (exactly as the
// checkpoint's dequantization would) and meets x rounded to bf16, so its result is the bf16 path's on the
// dequantized weight up to the order of the fp32 sums, reading half the bytes. The bias is widened and added
// after the GEMM.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/dtype.h"

namespace capserve::kernels::cuda {

class Linear {
 public:
  Linear();
  ~Linear();
  Linear(const Linear&) = delete;
  Linear& operator=(const Linear&) = delete;

  // Workspace bytes for m rows of width k (x in the weight's type; none for f32 weights).
  [[nodiscard]] static std::int64_t workspace_bytes(std::int64_t m, std::int64_t k, DType weight_dtype);

  // bias may be null (no bias); it has n elements of bias_dtype. `scales` are an f8_e4m3 weight's (on the
  // device), empty for the others.
  void run(const float* x, std::int64_t m, std::int64_t k, const void* w, DType weight_dtype,
           const BlockScales& scales, std::int64_t n, const void* bias, DType bias_dtype, float* y,
           void* workspace, cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
};

// out[i] = x[i] rounded to `dtype` (bf16 or f16) for i < n: activations meeting weights of that type.
void narrow_to(const float* x, std::int64_t n, DType dtype, void* out, cudaStream_t stream);

// x[i] as the sum of two values of `dtype` (bf16 or f16): hi[i] = x[i] rounded, lo[i] = the rest rounded. Two
// products with the halves, summed in fp32, carry about twice the type's mantissa: near-fp32 activations
// against 16-bit weights at twice a small GEMM's cost.
void split_to(const float* x, std::int64_t n, DType dtype, void* hi, void* lo, cudaStream_t stream);

}  // namespace capserve::kernels::cuda
