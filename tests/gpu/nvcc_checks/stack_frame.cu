// Must not compile under CAPSERVE_CUDA_DEVICE_CHECKS: a dynamically indexed local array lives in local memory
// (a 1 KiB stack frame), which ptxas reports and the checks turn into an error.
__global__ void uses_a_stack_frame(float* out, const int* index, int stride) {
  float local[256];
  for (int i = 0; i < 256; ++i) local[(i * 7 + index[i]) & 255] = out[i * stride];
  out[threadIdx.x] = local[index[threadIdx.x] & 255];
}
