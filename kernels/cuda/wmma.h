#pragma once
// The warp matrix functions (tensor cores) for the kernels: nvcuda::wmma from <mma.h> under nvcc, and under
// the CUDA emulation its host twin (tests/cuda_emu/wmma_emu.h, which launch.h brings in).
#if defined(__CUDACC__)
#include <mma.h>
#endif

#include "kernels/cuda/launch.h"

namespace capserve::kernels::cuda {
namespace wmma = nvcuda::wmma;
}  // namespace capserve::kernels::cuda
