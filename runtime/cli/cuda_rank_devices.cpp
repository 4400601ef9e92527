#include "runtime/cli/cuda_rank_devices.h"

#include "kernels/cuda/cuda_backend.h"
#include "parallel/nccl_communicator.h"

void capserve_open_cuda_devices(capserve::runtime::RankDevices* devices,
                                capserve::parallel::MpiWorld* world) {
  auto nccl = std::make_unique<capserve::parallel::NcclCommunicator>(*world);
  auto backend = std::make_unique<capserve::kernels::cuda::CudaBackend>(nccl->device().index);
  // The collectives run on the backend's stream: its host waits poll NCCL, so that a dead peer ends them with
  // an error instead of at the step watchdog. RankDevices destroys the data plane before the backend, and
  // nothing waits on the backend in between.
  backend->set_wait_check([comm = nccl.get()] { comm->check_async_error(); });
  devices->backend = std::move(backend);
  devices->data = std::move(nccl);
}
