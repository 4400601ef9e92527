// The CUDA backend's sampling controls (adjust_logits_kernel, the sample kernel's min_p) against their
// references (tests/unit/kernels/sampling_controls_checks.h), on a device or under the emulation.
#include "kernels/cuda/cuda_backend.h"
#include "tests/gpu/gpu_test_support.h"
#include "tests/unit/kernels/sampling_controls_checks.h"

namespace capserve::test {
namespace {

TEST(CudaSamplingControls, AdjustmentsMatchTheReference) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  kernels::cuda::CudaBackend backend(0);
  check_adjustments_against_reference(backend);
}

TEST(CudaSamplingControls, MinPKeepsTheReferenceSet) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  kernels::cuda::CudaBackend backend(0);
  check_min_p_against_reference(backend);
}

TEST(CudaSamplingControls, RowsWithoutAnAllowedToken) {
  CAPSERVE_REQUIRE_CUDA_DEVICE();
  kernels::cuda::CudaBackend backend(0);
  check_rows_without_a_token(backend);
}

}  // namespace
}  // namespace capserve::test
