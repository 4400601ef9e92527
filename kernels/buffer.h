#pragma once
// Memory a backend allocated on its device, owned: freed when the Buffer goes. Move-only. The release
// function travels with the memory, so a Buffer never refers back to the backend object that made it.
#include <cstddef>
#include <initializer_list>

#include "kernels/tensor.h"

namespace capserve::kernels {

class Buffer {
 public:
  using Release = void (*)(void* data, Device device) noexcept;

  Buffer() = default;
  Buffer(void* data, std::size_t bytes, Device device, Release release)
      : data_(data), bytes_(bytes), device_(device), release_(release) {}
  ~Buffer() { reset(); }
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      reset();
      data_ = other.data_;
      bytes_ = other.bytes_;
      device_ = other.device_;
      release_ = other.release_;
      other.data_ = nullptr;
      other.bytes_ = 0;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  [[nodiscard]] std::size_t bytes() const { return bytes_; }
  [[nodiscard]] const Device& device() const { return device_; }

  // A tensor over the start of the buffer; it must fit.
  [[nodiscard]] Tensor view(DType dtype, std::initializer_list<std::int64_t> shape) const {
    Tensor t(data_, dtype, device_, shape);
    if (t.bytes() > bytes_) {
      throw std::out_of_range("Buffer::view: " + t.shape_text() + " " + std::string(dtype_name(dtype)) +
                              " needs " + std::to_string(t.bytes()) + " bytes, the buffer has " +
                              std::to_string(bytes_));
    }
    return t;
  }

 private:
  void reset() noexcept {
    if (data_ != nullptr) release_(data_, device_);
    data_ = nullptr;
    bytes_ = 0;
  }

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  Device device_{};
  Release release_ = nullptr;
};

}  // namespace capserve::kernels
