#include "kernels/cuda/cuda_check.h"

#include <string>

namespace capserve::kernels::cuda {

void throw_cuda_error(cudaError_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                  " failed: " + cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

void throw_cublas_error(cublasStatus_t status, const char* call, const char* file, int line) {
  throw CudaError(std::string(file) + ":" + std::to_string(line) + ": " + call +
                  " failed: " + cublasGetStatusName(status) + ": " + cublasGetStatusString(status));
}

}  // namespace capserve::kernels::cuda
