#include "kernels/backend.h"

#include <stdexcept>
#include <string>

namespace capserve::kernels {

std::string_view host_sync_name(HostSync why) {
  switch (why) {
    case HostSync::sampled_tokens:
      return "sampled_tokens";
    case HostSync::logits:
      return "logits";
    case HostSync::count_:
      break;
  }
  return "?";
}

Tensor Backend::scratch(Buffer& slot, DType dtype, std::initializer_list<std::int64_t> shape) {
  const Tensor wanted(nullptr, dtype, device(), shape);
  if (slot.bytes() < wanted.bytes() || slot.device() != device()) slot = allocate(wanted.bytes());
  return slot.view(dtype, shape);
}

namespace {

void check_copy(const char* what, const Tensor& tensor, std::size_t host_bytes, const Device& backend) {
  if (tensor.device() != backend) {
    throw std::invalid_argument(std::string("Backend::") + what + ": a tensor on " +
                                to_string(tensor.device()) + ", the backend is on " + to_string(backend));
  }
  if (host_bytes != tensor.bytes()) {
    throw std::invalid_argument(std::string("Backend::") + what + ": " + std::to_string(host_bytes) +
                                " host bytes for a tensor of " + std::to_string(tensor.bytes()));
  }
}

}  // namespace

void Backend::to_host(const Tensor& src, std::span<std::byte> dst, HostSync why) {
  check_copy("to_host", src, dst.size(), device());
  copy_to_host(src, dst);
  ++host_syncs_[static_cast<std::size_t>(why)];
}

void Backend::from_host(std::span<const std::byte> src, const Tensor& dst) {
  check_copy("from_host", dst, src.size(), device());
  copy_from_host(src, dst);
}

}  // namespace capserve::kernels
