#include "runtime/cli/rank_devices.h"

#include <stdexcept>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_communicator.h"

#if CAPSERVE_WITH_CUDA
#include "kernels/cuda/cuda_backend.h"
#include "parallel/nccl_communicator.h"
#endif

namespace capserve::runtime {

RankDevices make_rank_devices(const std::string& device, int threads, parallel::MpiWorld& world) {
  RankDevices d;
  d.control = std::make_unique<parallel::MpiCommunicator>();
  if (device == "cpu") {
    d.backend = std::make_unique<kernels::cpu::CpuBackend>(threads);
    return d;
  }
  if (device != "cuda") throw std::runtime_error("unknown --device '" + device + "' (cpu or cuda)");
#if CAPSERVE_WITH_CUDA
  auto nccl = std::make_unique<parallel::NcclCommunicator>(world);
  d.backend = std::make_unique<kernels::cuda::CudaBackend>(nccl->device().index);
  d.data = std::move(nccl);
  return d;
#else
  (void)world;
  throw std::runtime_error("--device cuda: this build has no CUDA backend (nvcc and NCCL were not found)");
#endif
}

}  // namespace capserve::runtime
