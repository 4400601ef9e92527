// Must not compile under CAPSERVE_CUDA_DEVICE_CHECKS: 64 values stay live across a loop while the launch
// bounds leave 32 registers per thread, so ptxas spills.
__global__ void __launch_bounds__(1024, 2) spills_registers(float* out, const float* in, int rounds) {
  float v[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) v[i] = in[threadIdx.x + i * blockDim.x];
  for (int r = 0; r < rounds; ++r) {
#pragma unroll
    for (int i = 0; i < 64; ++i) v[i] = v[i] * v[(i + 1) & 63] + 1.0F;
  }
  float sum = 0.0F;
#pragma unroll
  for (int i = 0; i < 64; ++i) sum += v[i];
  out[threadIdx.x] = sum;
}
