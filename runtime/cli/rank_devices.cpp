#include "runtime/cli/rank_devices.h"

#include <cstdlib>
#include <stdexcept>

#include "kernels/cpu/cpu_backend.h"
#include "parallel/mpi_communicator.h"

#if defined(CAPSERVE_CUDA_PLUGIN)
#include <dlfcn.h>
#elif CAPSERVE_WITH_CUDA
#include "runtime/cli/cuda_rank_devices.h"
#endif

namespace capserve::runtime {
namespace {

#if defined(CAPSERVE_CUDA_PLUGIN)
// The plugin's entry point, loaded once and never unloaded: the backend's code lives there.
using OpenCudaDevices = void(RankDevices*, parallel::MpiWorld*);
OpenCudaDevices* cuda_plugin() {
  static OpenCudaDevices* const open = [] {
    const char* env = std::getenv("CAPSERVE_CUDA_PLUGIN");
    const std::string path = env != nullptr && *env != '\0' ? env : CAPSERVE_CUDA_PLUGIN;
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr)
      throw std::runtime_error("--device cuda: cannot load the CUDA backend " + path + " (" + dlerror() +
                               "; CAPSERVE_CUDA_PLUGIN names another)");
    void* symbol = dlsym(handle, "capserve_open_cuda_devices");
    if (symbol == nullptr)
      throw std::runtime_error("--device cuda: " + path + " is not the CUDA backend plugin of this build");
    return reinterpret_cast<OpenCudaDevices*>(symbol);
  }();
  return open;
}
#endif

}  // namespace

RankDevices make_rank_devices(const std::string& device, int threads, parallel::MpiWorld& world) {
  RankDevices d;
  d.control = std::make_unique<parallel::MpiCommunicator>();
  if (device == "cpu") {
    d.backend = std::make_unique<kernels::cpu::CpuBackend>(threads);
    return d;
  }
  if (device != "cuda") throw std::runtime_error("unknown --device '" + device + "' (cpu or cuda)");
#if defined(CAPSERVE_CUDA_PLUGIN)
  cuda_plugin()(&d, &world);
  return d;
#elif CAPSERVE_WITH_CUDA
  capserve_open_cuda_devices(&d, &world);
  return d;
#else
  (void)world;
  throw std::runtime_error("--device cuda: this build has no CUDA backend (nvcc and NCCL were not found)");
#endif
}

}  // namespace capserve::runtime
