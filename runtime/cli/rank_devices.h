#pragma once
// What one rank of a binary runs on, chosen by --device: the backend and the two communicators a Model takes
// (runtime/README.md). "cpu": CpuBackend and one MpiCommunicator for both planes. "cuda": the GPU of the
// rank's local rank (local rank % GPUs on the node), CudaBackend, NCCL for the data plane and MPI for the
// control plane; only in builds with CUDA (nvcc found), else a clear error.
#include <memory>
#include <string>

#include <CLI/CLI.hpp>

#include "kernels/backend.h"
#include "parallel/communicator.h"
#include "parallel/mpi_world.h"
#include "runtime/model.h"

namespace capserve::runtime {

struct RankDevices {
  std::unique_ptr<kernels::Backend> backend;
  std::unique_ptr<parallel::Communicator> control;  // host memory, MPI
  std::unique_ptr<parallel::Communicator> data;     // the backend's device; null: `control` serves both

  [[nodiscard]] parallel::Communicator& data_plane() const { return data ? *data : *control; }
  // Model::load over these.
  [[nodiscard]] std::unique_ptr<Model> load(const std::filesystem::path& dir,
                                            const ParallelOptions& options) const {
    return Model::load(dir, *backend, data_plane(), *control, options);
  }
};

// Every rank calls it (NCCL's set-up is a collective); std::runtime_error naming the device on failure.
RankDevices make_rank_devices(const std::string& device, int threads, parallel::MpiWorld& world);

inline void add_device_flag(CLI::App& app, std::string& device) {
  app.add_option("--device", device, "what each rank computes on: cpu, or cuda (one GPU per rank, NCCL)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
}

// --kv-cache-dtype: auto (bf16 on a GPU, f32 on the CPU), f32 or bf16.
inline void add_kv_dtype_flag(CLI::App& app, std::string& kv_dtype) {
  app.add_option("--kv-cache-dtype", kv_dtype,
                 "K/V cache elements: auto (bf16 on cuda, f32 on cpu), f32, bf16")
      ->check(CLI::IsMember({"auto", "f32", "bf16"}));
}
inline kernels::DType kv_dtype_for(const std::string& flag, const kernels::Device& device) {
  if (flag == "f32") return kernels::DType::f32;
  if (flag == "bf16") return kernels::DType::bf16;
  return device.kind == kernels::DeviceKind::cuda ? kernels::DType::bf16 : kernels::DType::f32;
}

}  // namespace capserve::runtime
