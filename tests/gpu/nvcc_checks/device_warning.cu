// Must not compile under CAPSERVE_CUDA_DEVICE_CHECKS: a device-code warning (a variable never used) is an
// error.
__global__ void warns(float* out) {
  int never_used = 3;
  out[threadIdx.x] = 1.0F;
}
