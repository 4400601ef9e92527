#pragma once
// CUDA emulation, test side: the schedule of emulated threads and the counters tests assert on. (Device side
// and execution model: capserve_cuda_emu.h.)
//
// Environment, read once per process:
//   CAPSERVE_CUDA_EMU_SCHEDULE=shuffled:SEED   start with the shuffled schedule
//   CAPSERVE_CUDA_EMU_DEVICES=N                emulate N devices (default 1), e.g. one per rank for NCCL
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

struct CUstream_st;  // cudaStream_t points to one

namespace capserve::cuda_emu {

namespace detail {
struct StreamHang;
}

// What the host asked of the emulated device since the last reset.
struct Counters {
  std::int64_t host_syncs = 0;          // cudaDeviceSynchronize, cudaStreamSynchronize, cudaEventSynchronize,
                                        // cudaMemcpy (which waits for the copy), and a cudaStreamQuery that
                                        // finds the work complete (the end of a polled wait)
  std::int64_t device_allocations = 0;  // cudaMalloc
  std::int64_t device_frees = 0;        // cudaFree
  std::int64_t host_allocations = 0;    // cudaMallocHost
  std::int64_t kernel_launches = 0;
  std::int64_t copies = 0;  // cudaMemcpy and cudaMemcpyAsync
  // cudaMemcpyAsync host-to-device from pageable memory (not cudaMallocHost): on a GPU the host waits for
  // such a copy (the runtime stages the bytes itself), so a step that promises not to wait must make none.
  std::int64_t pageable_async_copies = 0;
};

[[nodiscard]] Counters counters();
void reset_counters();

// Whether this host thread is inside an emulated CUDA runtime or cuBLAS call that allocates host memory of
// its own (the copies' and GEMMs' checks and temporaries): no product code's allocations, which tests that
// count a step's host allocations leave out.
[[nodiscard]] bool inside_emulation();

enum class Schedule : std::uint8_t {
  in_order,  // threads by index between barriers
  shuffled,  // each block's threads in a seeded random order, drawn anew after every barrier
};

// For this host thread's launches from now on.
void set_schedule(Schedule schedule, std::uint64_t seed = 0);

// The schedule in force while it lives, the previous one restored after.
class ScopedSchedule {
 public:
  explicit ScopedSchedule(Schedule schedule, std::uint64_t seed = 0);
  ~ScopedSchedule();
  ScopedSchedule(const ScopedSchedule&) = delete;
  ScopedSchedule& operator=(const ScopedSchedule&) = delete;

 private:
  Schedule previous_;
  std::uint64_t previous_seed_;
};

// NCCL stand-in (nccl_emu.cpp, linked with capserve_nccl_emu): the next ncclCommInitRank or
// ncclCommInitRankConfig of this process joins the other ranks only `delay` after it is called, as a rank
// that hangs after the id broadcast would (blocking mode sleeps first; non-blocking mode stays
// ncclInProgress).
void delay_next_nccl_init(std::chrono::steady_clock::duration delay);

// NCCL stand-in: the next grouped exchange (ncclGroupEnd of sends and receives, or a lone send or receive) of
// this process dies as a crashed process would, once every peer it receives from has posted its send: the
// call fails here (ncclSystemError), and those peers' sends and receives with this rank never complete (their
// streams hang, as an NCCL kernel waits forever on a GPU) until they ncclCommAbort; they see ncclRemoteError,
// naming this rank, at their next poll of ncclCommGetAsyncError after the exchange was enqueued.
void crash_at_next_nccl_exchange();

// While it lives, work on `stream` never completes, as behind an NCCL kernel whose peer died (the NCCL
// stand-in makes such hangs itself): host waits on the stream block, and cudaStreamQuery of it and
// cudaEventQuery of an event recorded on it meanwhile say cudaErrorNotReady. Its end releases them, as
// ncclCommAbort does.
class ScopedStreamHang {
 public:
  ScopedStreamHang(CUstream_st* stream, std::string why);
  ~ScopedStreamHang();
  ScopedStreamHang(const ScopedStreamHang&) = delete;
  ScopedStreamHang& operator=(const ScopedStreamHang&) = delete;

 private:
  std::shared_ptr<detail::StreamHang> hang_;
};

}  // namespace capserve::cuda_emu
