#pragma once
// The CUDA half of --device (rank_devices.h): CudaBackend on the rank's GPU with NCCL for the data plane.
// Product builds make it a plugin, libcapserve_cuda_devices.so, that make_rank_devices loads only for
// --device cuda, so a CPU run never maps the CUDA libraries (cuBLAS alone adds ~150 MB resident memory, as
// llama.cpp's GGML_BACKEND_DL plugins avoid for the same reason); the emulation tests link it in directly.
#include "parallel/mpi_world.h"
#include "runtime/cli/rank_devices.h"

// Fills `devices`' backend and data plane for this rank (a collective: NCCL's set-up); throws
// std::runtime_error naming the device on failure.
extern "C" __attribute__((visibility("default"))) void capserve_open_cuda_devices(
    capserve::runtime::RankDevices* devices, capserve::parallel::MpiWorld* world);
