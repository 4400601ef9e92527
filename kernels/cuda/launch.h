#pragma once
// How the .cu files start a kernel: launch(kernel, grid, block, dynamic shared bytes, stream, args...)
// instead of kernel<<<grid, block, bytes, stream>>>(args...). Under nvcc it is exactly that launch; built by
// the plain C++ compiler for the tests, the CUDA emulation (tests/cuda_emu, on the include path of emulated
// builds only) runs the kernel on the host. Either way the caller checks the launch with
// CAPSERVE_CUDA_CHECK_LAUNCH().
#include <cuda_runtime_api.h>

#include <cstddef>
#include <utility>

#if !defined(__CUDACC__)
#include "capserve_cuda_emu.h"
#endif

namespace capserve::kernels::cuda {

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
            Args&&... args) {
#if defined(__CUDACC__)
  kernel<<<grid, block, shared_bytes, stream>>>(std::forward<Args>(args)...);
#else
  ::capserve::cuda_emu::launch(kernel, grid, block, shared_bytes, stream, std::forward<Args>(args)...);
#endif
}

}  // namespace capserve::kernels::cuda

// Dynamic shared memory (the launch's shared_bytes) as an array `name` of T.
#if defined(__CUDACC__)
#define CAPSERVE_DYNAMIC_SHARED(T, name) extern __shared__ T name[]
#else
#define CAPSERVE_DYNAMIC_SHARED(T, name) T* const name = capserve_dynamic_shared<T>()
#endif
