#include "kernels/cuda/host_staging.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/stream_wait.h"

namespace capserve::kernels::cuda {
namespace {

// Each staged array starts aligned for every element type a kernel reads.
constexpr std::size_t kAlign = 256;

std::size_t round_up(std::size_t n) {
  return (n + kAlign - 1) / kAlign * kAlign;
}

}  // namespace

HostStaging::HostStaging(Buffer device, int chunks)
    : device_(std::move(device)),
      chunk_bytes_(device_.bytes() / static_cast<std::size_t>(chunks) / kAlign * kAlign),
      read_(static_cast<std::size_t>(chunks), nullptr),
      pending_(static_cast<std::size_t>(chunks), 0) {
  if (chunks < 2 || chunk_bytes_ == 0)
    throw std::invalid_argument("HostStaging: " + std::to_string(device_.bytes()) + " bytes in " +
                                std::to_string(chunks) + " chunks");
  void* host = nullptr;
  CAPSERVE_CUDA_CHECK(cudaMallocHost(&host, chunk_bytes_ * read_.size()));
  host_.reset(static_cast<std::byte*>(host));
  mirror_ =
      static_cast<std::byte*>(device_.view(DType::u8, {static_cast<std::int64_t>(device_.bytes())}).data());
  for (cudaEvent_t& e : read_) CAPSERVE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
}

HostStaging::~HostStaging() {
  // The owner has synchronised its stream: no copy still reads the ring.
  for (cudaEvent_t e : read_) cudaEventDestroy(e);
}

std::size_t HostStaging::take(std::size_t bytes, cudaStream_t stream) {
  if (used_ != 0 && used_ + bytes <= chunk_bytes_) {
    const std::size_t at = current_ * chunk_bytes_ + used_;
    used_ += round_up(bytes);
    return at;
  }
  // Into the next chunk: close the one left behind, then wait for the device to have read the one entered,
  // if it has not yet.
  if (used_ != 0) {
    CAPSERVE_CUDA_CHECK(cudaEventRecord(read_[current_], stream));
    pending_[current_] = 1;
    current_ = (current_ + 1) % read_.size();
  }
  if (pending_[current_] != 0) {
    const cudaError_t done = cudaEventQuery(read_[current_]);
    if (done == cudaErrorNotReady) {
      cudaGetLastError();  // not an error: the copies are still queued
      wait_for_event(read_[current_], wait_check_);
    } else {
      CAPSERVE_CUDA_CHECK(done);
    }
    pending_[current_] = 0;
  }
  used_ = round_up(bytes);
  return current_ * chunk_bytes_;
}

void HostStaging::copy(std::span<const std::byte> src, void* dst, cudaStream_t stream) {
  auto* out = static_cast<std::byte*>(dst);
  while (!src.empty()) {
    const std::size_t n = std::min(src.size(), chunk_bytes_);
    const std::size_t at = take(n, stream);
    std::memcpy(host_.get() + at, src.data(), n);
    CAPSERVE_CUDA_CHECK(cudaMemcpyAsync(out, host_.get() + at, n, cudaMemcpyHostToDevice, stream));
    src = src.subspan(n);
    out += n;
  }
}

void* HostStaging::stage(std::span<const std::byte> src, cudaStream_t stream) {
  if (src.size() > chunk_bytes_)
    throw std::length_error("CudaBackend: " + std::to_string(src.size()) +
                            " bytes of step metadata in one array (block tables, positions, rows or sampling "
                            "controls) exceed the " +
                            std::to_string(chunk_bytes_) + "-byte staging chunk");
  const std::size_t at = take(std::max<std::size_t>(src.size(), 1), stream);
  if (!src.empty()) {
    std::memcpy(host_.get() + at, src.data(), src.size());
    CAPSERVE_CUDA_CHECK(
        cudaMemcpyAsync(mirror_ + at, host_.get() + at, src.size(), cudaMemcpyHostToDevice, stream));
  }
  return mirror_ + at;
}

}  // namespace capserve::kernels::cuda
