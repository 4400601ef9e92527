#pragma once
// Error checks for CUDA runtime and cuBLAS calls (every call, and the last error after each launch), and an
// owning device buffer.
#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <stdexcept>

namespace capserve::kernels::cuda {

class CudaError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Throw CudaError naming the call, file:line and the runtime's own message.
[[noreturn]] void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line);

inline void check_cuda(cudaError_t status, const char* call, const char* file, int line) {
  if (status != cudaSuccess) throw_cuda_error(status, call, file, line);
}
inline void check_cublas(cublasStatus_t status, const char* call, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS) throw_cublas_error(status, call, file, line);
}

}  // namespace capserve::kernels::cuda

#define CAPSERVE_CUDA_CHECK(call) ::capserve::kernels::cuda::check_cuda((call), #call, __FILE__, __LINE__)
#define CAPSERVE_CUBLAS_CHECK(call) ::capserve::kernels::cuda::check_cublas((call), #call, __FILE__, __LINE__)
// After a kernel launch: launch-configuration errors surface here, not at the next call.
#define CAPSERVE_CUDA_CHECK_LAUNCH() CAPSERVE_CUDA_CHECK(cudaGetLastError())

namespace capserve::kernels::cuda {

struct CudaFree {
  void operator()(void* p) const noexcept { cudaFree(p); }
};

// `count` elements of T in device memory, freed with the buffer.
template <class T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t count) : count_(count) {
    if (count == 0) return;
    void* p = nullptr;
    CAPSERVE_CUDA_CHECK(cudaMalloc(&p, count * sizeof(T)));
    data_.reset(p);
  }
  [[nodiscard]] T* data() const { return static_cast<T*>(data_.get()); }
  [[nodiscard]] std::size_t size() const { return count_; }
  [[nodiscard]] std::size_t bytes() const { return count_ * sizeof(T); }

 private:
  std::unique_ptr<void, CudaFree> data_;
  std::size_t count_ = 0;
};

}  // namespace capserve::kernels::cuda
