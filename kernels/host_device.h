#pragma once
// CAPSERVE_HD marks a function that host code and CUDA kernels both call: __host__ __device__ under nvcc,
// nothing for the plain C++ compiler.
#if defined(__CUDACC__)
#define CAPSERVE_HD __host__ __device__
#else
#define CAPSERVE_HD
#endif
