// CUDA emulation: the cuBLAS calls CapServe makes (handle, stream, cublasGemmEx), declared by the real
// cublas_v2.h. Column-major as documented: C = alpha * op(A) * op(B) + beta * C with op(A) m x k, op(B) k x
// n, C m x n; argument errors are rejected as cuBLAS rejects them (cuBLAS API reference, cublasGemmEx:
// invalid operations, negative sizes and leading dimensions below the rows of the stored matrix give
// CUBLAS_STATUS_INVALID_VALUE; type combinations outside its table CUBLAS_STATUS_NOT_SUPPORTED). The product
// is OpenBLAS's sgemm on the operands widened to fp32: fp32 accumulation as on the device, in another order.
#include <cblas.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "emu_state.h"
#include "handle_registry.h"

namespace capserve::cuda_emu::detail {
namespace {

struct EmuBlas {
  cudaStream_t stream = nullptr;
  int device = 0;  // current at cublasCreate: the handle works only there
};

thread_local cublasStatus_t detailed_status = CUBLAS_STATUS_SUCCESS;
thread_local std::string status_detail;
thread_local std::string status_text;

cublasStatus_t blas_fail(cublasStatus_t status, std::string detail) {
  detailed_status = status;
  status_detail = std::move(detail);
  return status;
}

EmuBlas* find_handle(cublasHandle_t h) {
  return handles<EmuBlas>().find(h);
}

bool valid_op(cublasOperation_t op) {
  return op == CUBLAS_OP_N || op == CUBLAS_OP_T || op == CUBLAS_OP_C;
}

std::size_t element_bytes(cudaDataType t) {
  switch (t) {
    case CUDA_R_16BF:
    case CUDA_R_16F:
      return 2;
    case CUDA_R_32F:
      return 4;
    default:
      return 0;
  }
}

// cublasGemmEx's table for the fp32 compute types: A and B alike, C alike or fp32 (16-bit inputs) or fp32.
bool supported(cudaDataType a, cudaDataType b, cudaDataType c, cublasComputeType_t compute) {
  const bool fp32_compute = compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_PEDANTIC ||
                            compute == CUBLAS_COMPUTE_32F_FAST_16F ||
                            compute == CUBLAS_COMPUTE_32F_FAST_16BF ||
                            compute == CUBLAS_COMPUTE_32F_FAST_TF32;
  if (!fp32_compute || a != b) return false;
  if (a == CUDA_R_16BF || a == CUDA_R_16F) return c == a || c == CUDA_R_32F;
  return a == CUDA_R_32F && c == CUDA_R_32F;
}

float load(const void* base, cudaDataType t, std::size_t i) {
  switch (t) {
    case CUDA_R_16BF:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    case CUDA_R_16F:
      return __half2float(static_cast<const __half*>(base)[i]);
    default:
      return static_cast<const float*>(base)[i];
  }
}

void store(void* base, cudaDataType t, std::size_t i, float v) {
  switch (t) {
    case CUDA_R_16BF:
      static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16(v);
      break;
    case CUDA_R_16F:
      static_cast<__half*>(base)[i] = __float2half(v);
      break;
    default:
      static_cast<float*>(base)[i] = v;
  }
}

// A column-major rows x cols matrix with leading dimension ld, widened to fp32 (same layout).
std::vector<float> widen(const void* p, cudaDataType t, int rows, int cols, int ld) {
  std::vector<float> out(static_cast<std::size_t>(ld) * static_cast<std::size_t>(cols));
  for (int j = 0; j < cols; ++j) {
    for (int i = 0; i < rows; ++i) {
      const std::size_t at =
          static_cast<std::size_t>(j) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(i);
      out[at] = load(p, t, at);
    }
  }
  return out;
}

// Empty when the stored rows x cols matrix (leading dimension ld) lies in one device allocation.
std::string check_matrix(const char* name, const void* p, cudaDataType t, int rows, int cols, int ld) {
  if (rows == 0 || cols == 0) return {};
  const std::size_t elements =
      static_cast<std::size_t>(cols - 1) * static_cast<std::size_t>(ld) + static_cast<std::size_t>(rows);
  return check_range(p, elements * element_bytes(t), MemoryKind::device, name);
}

}  // namespace
}  // namespace capserve::cuda_emu::detail

namespace d = capserve::cuda_emu::detail;

const char* cublasGetStatusName(cublasStatus_t status) {
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
      return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
      return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_EXECUTION_FAILED:
      return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED:
      return "CUBLAS_STATUS_NOT_SUPPORTED";
    default:
      return "CUBLAS_STATUS_INTERNAL_ERROR";
  }
}

const char* cublasGetStatusString(cublasStatus_t status) {
  const char* text = "unknown error";
  switch (status) {
    case CUBLAS_STATUS_SUCCESS:
      text = "success";
      break;
    case CUBLAS_STATUS_NOT_INITIALIZED:
      text = "the library was not initialized";
      break;
    case CUBLAS_STATUS_ALLOC_FAILED:
      text = "the resource allocation failed";
      break;
    case CUBLAS_STATUS_INVALID_VALUE:
      text = "an invalid numeric value was used as an argument";
      break;
    case CUBLAS_STATUS_EXECUTION_FAILED:
      text = "the GPU program failed to execute";
      break;
    case CUBLAS_STATUS_NOT_SUPPORTED:
      text = "the functionality requested is not supported";
      break;
    default:
      break;
  }
  if (status != d::detailed_status || d::status_detail.empty()) return text;
  d::status_text = std::string(text) + " [CUDA emulation: " + d::status_detail + "]";
  return d::status_text.c_str();
}

cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
  if (handle == nullptr)
    return d::blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasCreate: null pointer to the result");
  *handle = reinterpret_cast<cublasHandle_t>(
      d::handles<d::EmuBlas>().add(std::make_unique<d::EmuBlas>(d::EmuBlas{nullptr, d::current_device()})));
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
  if (!d::handles<d::EmuBlas>().remove(handle))
    return d::blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasDestroy: not a live handle");
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, cudaStream_t stream) {
  d::EmuBlas* h = d::find_handle(handle);
  if (h == nullptr) return d::blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, "cublasSetStream: not a live handle");
  if (std::string why = d::check_launch_stream(stream); !why.empty())
    return d::blas_fail(CUBLAS_STATUS_INVALID_VALUE, "cublasSetStream: " + why);
  h->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

namespace capserve::cuda_emu::detail {
namespace {

// cublasGemmEx and cublasGemmStridedBatchedEx: the same checks (named after `api`), then each of `batch`
// products at its strides.
cublasStatus_t gemm(const char* api, cublasHandle_t handle, cublasOperation_t transa,
                    cublasOperation_t transb, int m, int n, int k, const void* alpha, const void* A,
                    cudaDataType Atype, int lda, long long stride_a, const void* B, cudaDataType Btype,
                    int ldb, long long stride_b, const void* beta, void* C, cudaDataType Ctype, int ldc,
                    long long stride_c, int batch, cublasComputeType_t computeType) {
  const std::string name(api);
  const EmuBlas* h = find_handle(handle);
  if (h == nullptr) return blas_fail(CUBLAS_STATUS_NOT_INITIALIZED, name + ": not a live handle");
  const auto arg = [](const char* what, long long v) {
    return std::string(what) + " = " + std::to_string(v);
  };
  if (!valid_op(transa) || !valid_op(transb))
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE, name + ": transa/transb must be N, T or C");
  if (m < 0 || n < 0 || k < 0 || batch < 0)
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE, name + ": negative size (" + arg("m", m) + ", " +
                                                      arg("n", n) + ", " + arg("k", k) + ", " +
                                                      arg("batchCount", batch) + ")");
  // Stored shapes: A is m x k (N) or k x m (T/C), B k x n or n x k, C m x n.
  const int a_rows = transa == CUBLAS_OP_N ? m : k;
  const int a_cols = transa == CUBLAS_OP_N ? k : m;
  const int b_rows = transb == CUBLAS_OP_N ? k : n;
  const int b_cols = transb == CUBLAS_OP_N ? n : k;
  if (lda < std::max(1, a_rows))
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE, name + ": " + arg("lda", lda) + " below the " +
                                                      std::to_string(a_rows) + " rows of the stored A");
  if (ldb < std::max(1, b_rows))
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE, name + ": " + arg("ldb", ldb) + " below the " +
                                                      std::to_string(b_rows) + " rows of the stored B");
  if (ldc < std::max(1, m))
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE,
                     name + ": " + arg("ldc", ldc) + " below the " + std::to_string(m) + " rows of C");
  if (!supported(Atype, Btype, Ctype, computeType))
    return blas_fail(CUBLAS_STATUS_NOT_SUPPORTED,
                     name + ": types A " + std::to_string(Atype) + ", B " + std::to_string(Btype) + ", C " +
                         std::to_string(Ctype) + " with compute type " + std::to_string(computeType) +
                         " (the emulation has the fp32 compute types over bf16, fp16 and fp32)");
  if (alpha == nullptr || beta == nullptr)
    return blas_fail(CUBLAS_STATUS_INVALID_VALUE, name + ": null alpha or beta");
  // A handle is bound to the device current at cublasCreate; its kernels cannot be queued on another
  // device's stream (on a GPU the launch fails and cuBLAS reports the execution failure).
  if (const int on = stream_device(h->stream); on != h->device)
    return blas_fail(CUBLAS_STATUS_EXECUTION_FAILED,
                     name + ": the handle was created with device " + std::to_string(h->device) +
                         " current, but its stream belongs to device " + std::to_string(on) +
                         " (a cuBLAS handle works only on the device current at cublasCreate: "
                         "cudaSetDevice before cublasCreate)");
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const float a_scale = *static_cast<const float*>(alpha);
  const float b_scale = *static_cast<const float*>(beta);
  for (int item = 0; item < batch; ++item) {
    const auto at = [item](const void* base, cudaDataType t, long long stride) {
      return static_cast<const char*>(base) +
             static_cast<long long>(item) * stride * static_cast<long long>(element_bytes(t));
    };
    const void* a_item = at(A, Atype, stride_a);
    const void* b_item = at(B, Btype, stride_b);
    void* c_item = const_cast<char*>(at(C, Ctype, stride_c));
    for (const std::string& why : {check_matrix("A", a_item, Atype, a_rows, a_cols, lda),
                                   check_matrix("B", b_item, Btype, b_rows, b_cols, ldb),
                                   check_matrix("C", c_item, Ctype, m, n, ldc)}) {
      // A device would fault on the access and fail the kernel.
      if (!why.empty())
        return blas_fail(CUBLAS_STATUS_EXECUTION_FAILED,
                         name + ": " + (batch > 1 ? "batch item " + std::to_string(item) + ": " : "") + why);
    }
    const std::vector<float> a = widen(a_item, Atype, a_rows, a_cols, lda);
    const std::vector<float> b = widen(b_item, Btype, b_rows, b_cols, ldb);
    // beta == 0: C is not read (it may hold anything, NaN included), as cuBLAS documents.
    std::vector<float> c =
        b_scale == 0.0F
            ? std::vector<float>(static_cast<std::size_t>(ldc) * static_cast<std::size_t>(n), 0.0F)
            : widen(c_item, Ctype, m, n, ldc);
    if (k > 0) {
      cblas_sgemm(CblasColMajor, transa == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                  transb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, a_scale, a.data(), lda,
                  b.data(), ldb, b_scale, c.data(), ldc);
    } else {
      for (float& v : c) v *= b_scale;
    }
    for (int j = 0; j < n; ++j) {
      for (int i = 0; i < m; ++i) {
        const std::size_t idx =
            static_cast<std::size_t>(j) * static_cast<std::size_t>(ldc) + static_cast<std::size_t>(i);
        store(c_item, Ctype, idx, c[idx]);
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace capserve::cuda_emu::detail

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m,
                            int n, int k, const void* alpha, const void* A, cudaDataType Atype, int lda,
                            const void* B, cudaDataType Btype, int ldb, const void* beta, void* C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType, cublasGemmAlgo_t) {
  const d::EmulationScope emulation;
  return d::gemm("cublasGemmEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B, Btype, ldb, 0,
                 beta, C, Ctype, ldc, 0, 1, computeType);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k, const void* alpha,
                                          const void* A, cudaDataType Atype, int lda, long long int strideA,
                                          const void* B, cudaDataType Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t) {
  const d::EmulationScope emulation;
  return d::gemm("cublasGemmStridedBatchedEx", handle, transa, transb, m, n, k, alpha, A, Atype, lda, strideA,
                 B, Btype, ldb, strideB, beta, C, Ctype, ldc, strideC, batchCount, computeType);
}
