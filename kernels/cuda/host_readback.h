#pragma once
// Device-to-host copies the host does not wait for (Backend::to_host_later): a copy into pageable memory
// makes the host wait, so each one lands in page-locked memory owned here, queued on the stream, and reaches
// its destination when the host next waits for the stream anyway (deliver). Grow-only, so a warm step
// allocates nothing; sealed, a copy that does not fit is an error, never an allocation inside a step.
#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

namespace capserve::kernels::cuda {

class HostReadback {
 public:
  // Each copy's room: it starts aligned for any element type.
  [[nodiscard]] static std::size_t room(std::size_t bytes) { return (bytes + 15) / 16 * 16; }
  // Whether a copy of `bytes` fits beside the copies queued since the last deliver.
  [[nodiscard]] bool fits(std::size_t bytes) const { return used_ + room(bytes) <= capacity_; }
  [[nodiscard]] std::size_t used() const { return used_; }
  [[nodiscard]] bool outstanding() const { return !copies_.empty(); }
  // Room for `bytes` in all, with no copy outstanding (the caller delivered them first).
  void grow(std::size_t bytes);
  // Queues the copy of `bytes` device bytes at `src` on `stream`, for `dst` (of the same size). It must fit.
  void queue(const void* src, std::span<std::byte> dst, cudaStream_t stream);
  // After the host waited for the stream: every queued copy into its destination.
  void deliver();

 private:
  struct PinnedFree {
    void operator()(std::byte* p) const noexcept { cudaFreeHost(p); }
  };
  struct Copy {
    std::size_t offset;
    std::span<std::byte> dst;
  };

  std::unique_ptr<std::byte, PinnedFree> pinned_;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  std::vector<Copy> copies_;
};

}  // namespace capserve::kernels::cuda
