#pragma once
// Grouped SwiGLU expert FFN in bf16 on the device: rows [offsets[e], offsets[e+1]) of x go through expert e,
// out = down(silu(gate(x)) * up(x)), fp32 accumulation. cuBLAS GEMMs, one per non-empty expert and matrix,
// all on one stream; silu(gate) * up is one fused kernel.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

namespace capserve::kernels::cuda {

// One expert's bf16 weights in Hugging Face layout: gate and up [ffn, hidden], down [hidden, ffn].
struct DeviceExpert {
  const __nv_bfloat16* gate = nullptr;
  const __nv_bfloat16* up = nullptr;
  const __nv_bfloat16* down = nullptr;
};

class ExpertFfn {
 public:
  ExpertFfn();
  ~ExpertFfn();
  ExpertFfn(const ExpertFfn&) = delete;
  ExpertFfn& operator=(const ExpertFfn&) = delete;

  // Workspace bytes for `rows` rows of FFN width `ffn`.
  [[nodiscard]] static std::int64_t workspace_bytes(std::int64_t rows, std::int64_t ffn);

  // x [rows, hidden] bf16 -> out [rows, hidden] fp32. host_offsets (host memory) has experts.size() + 1
  // entries; rows are offsets.back().
  void run(const __nv_bfloat16* x, std::span<const std::int64_t> host_offsets,
           std::span<const DeviceExpert> experts, std::int64_t hidden, std::int64_t ffn, float* out,
           void* workspace, cudaStream_t stream);

 private:
  cublasHandle_t handle_ = nullptr;
};

// a[i] = bf16(silu(gate[i]) * up[i]) for i < n.
void silu_mul(const float* gate, const float* up, std::int64_t n, __nv_bfloat16* a, cudaStream_t stream);

}  // namespace capserve::kernels::cuda
