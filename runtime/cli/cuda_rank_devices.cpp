#include "runtime/cli/cuda_rank_devices.h"

#include "kernels/cuda/cuda_backend.h"
#include "parallel/nccl_communicator.h"

void capserve_open_cuda_devices(capserve::runtime::RankDevices* devices,
                                capserve::parallel::MpiWorld* world) {
  auto nccl = std::make_unique<capserve::parallel::NcclCommunicator>(*world);
  devices->backend = std::make_unique<capserve::kernels::cuda::CudaBackend>(nccl->device().index);
  devices->data = std::move(nccl);
}
