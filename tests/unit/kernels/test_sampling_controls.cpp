// The CPU backend's sampling controls against their references (sampling_controls_checks.h).
#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/kernels/sampling_controls_checks.h"

namespace capserve::test {
namespace {

TEST(CpuSamplingControls, AdjustmentsMatchTheReference) {
  kernels::cpu::CpuBackend backend(1);
  check_adjustments_against_reference(backend);
}

TEST(CpuSamplingControls, MinPKeepsTheReferenceSet) {
  kernels::cpu::CpuBackend backend(1);
  check_min_p_against_reference(backend);
}

TEST(CpuSamplingControls, RowsWithoutAnAllowedToken) {
  kernels::cpu::CpuBackend backend(1);
  check_rows_without_a_token(backend);
}

}  // namespace
}  // namespace capserve::test
