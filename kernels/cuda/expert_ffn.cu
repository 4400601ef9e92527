#include <stdexcept>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/expert_ffn.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/launch.h"

namespace capserve::kernels::cuda {
namespace {

__global__ void silu_mul_kernel(const float* gate, const float* up, std::int64_t n, __nv_bfloat16* a) {
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const float g = gate[i];
    a[i] = __float2bfloat16(g / (1.0F + expf(-g)) * up[i]);
  }
}

std::int64_t align256(std::int64_t n) {
  return (n + 255) / 256 * 256;
}

}  // namespace

ExpertFfn::ExpertFfn() {
  CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle_));
}

ExpertFfn::~ExpertFfn() {
  cublasDestroy(handle_);
}

std::int64_t ExpertFfn::workspace_bytes(std::int64_t rows, std::int64_t ffn) {
  // gate and up in fp32, the activation in bf16.
  return 2 * align256(rows * ffn * 4) + align256(rows * ffn * 2);
}

void silu_mul(const float* gate, const float* up, std::int64_t n, __nv_bfloat16* a, cudaStream_t stream) {
  if (n <= 0) return;
  const std::int64_t blocks = (n + 255) / 256 < 65535 ? (n + 255) / 256 : 65535;
  launch(silu_mul_kernel, static_cast<unsigned>(blocks), 256, 0, stream, gate, up, n, a);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void ExpertFfn::run(const __nv_bfloat16* x, std::span<const std::int64_t> host_offsets,
                    std::span<const DeviceExpert> experts, std::int64_t hidden, std::int64_t ffn, float* out,
                    void* workspace, cudaStream_t stream) {
  if (host_offsets.size() != experts.size() + 1)
    throw std::invalid_argument("ExpertFfn::run: offsets must have one entry more than experts");
  const std::int64_t rows = host_offsets.back();
  if (rows == 0) return;
  auto* base = static_cast<unsigned char*>(workspace);
  auto* gate = reinterpret_cast<float*>(base);
  auto* up = reinterpret_cast<float*>(base + align256(rows * ffn * 4));
  auto* act = reinterpret_cast<__nv_bfloat16*>(base + 2 * align256(rows * ffn * 4));
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const std::int64_t first = host_offsets[e];
    const std::int64_t n = host_offsets[e + 1] - first;
    if (n == 0) continue;
    const DeviceExpert& w = experts[e];
    gemm_xwt(handle_, x + first * hidden, w.gate, CUDA_R_16BF, n, ffn, hidden, gate + first * ffn,
             CUDA_R_32F);
    gemm_xwt(handle_, x + first * hidden, w.up, CUDA_R_16BF, n, ffn, hidden, up + first * ffn, CUDA_R_32F);
  }
  silu_mul(gate, up, rows * ffn, act, stream);
  for (std::size_t e = 0; e < experts.size(); ++e) {
    const std::int64_t first = host_offsets[e];
    const std::int64_t n = host_offsets[e + 1] - first;
    if (n == 0) continue;
    gemm_xwt(handle_, act + first * ffn, experts[e].down, CUDA_R_16BF, n, hidden, ffn, out + first * hidden,
             CUDA_R_32F);
  }
}

}  // namespace capserve::kernels::cuda
