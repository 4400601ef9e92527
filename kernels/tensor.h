#pragma once
// Tensors that know where they live. A Tensor is a non-owning view: data pointer, element type, device and
// shape (up to four dims, row-major and contiguous: the stride of dim i is the product of the later dims, so
// views are only ever whole-row ranges or reshapes, which is all the forward pass takes). Memory comes from a
// Buffer the backend allocated (kernels/buffer.h) or, on the CPU device, from any host memory (Tensor::host).
//
// Host code may read or write a tensor's elements only through host_span(), which refuses a tensor on another
// device; moving data between host and device is the backend's to_host / from_host, the named
// synchronisation points of a step (kernels/backend.h).
#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/dtype.h"

// The CUDA runtime's stream type (cudaStream_t is CUstream_st*), named without CUDA headers: device work is
// ordered on a stream; host code passes null.
struct CUstream_st;

namespace capserve::kernels {

enum class DeviceKind : std::uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // the GPU's ordinal for cuda; 0 for cpu

  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr Device kCpu{};

using Stream = CUstream_st*;

std::string to_string(const Device& device);

// The element type of a C++ type, for typed access.
template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::f32;
}
template <>
constexpr DType dtype_of<std::int32_t>() {
  return DType::i32;
}
template <>
constexpr DType dtype_of<std::int64_t>() {
  return DType::i64;
}
template <>
constexpr DType dtype_of<std::uint8_t>() {
  return DType::u8;
}

class Tensor {
 public:
  static constexpr int kMaxDims = 4;

  Tensor() = default;
  Tensor(void* data, DType dtype, Device device, std::span<const std::int64_t> shape);
  Tensor(void* data, DType dtype, Device device, std::initializer_list<std::int64_t> shape)
      : Tensor(data, dtype, device, std::span<const std::int64_t>(shape.begin(), shape.size())) {}

  // Host memory as a CPU tensor; `values` must hold exactly the shape's elements.
  template <typename T>
  static Tensor host(std::span<T> values, std::initializer_list<std::int64_t> shape) {
    Tensor t(const_cast<std::remove_const_t<T>*>(values.data()), dtype_of<std::remove_const_t<T>>(), kCpu,
             shape);
    if (static_cast<std::size_t>(t.numel()) != values.size()) {
      throw std::invalid_argument("Tensor::host: " + std::to_string(values.size()) + " values for shape " +
                                  t.shape_text());
    }
    return t;
  }

  [[nodiscard]] void* data() const { return data_; }
  [[nodiscard]] DType dtype() const { return dtype_; }
  [[nodiscard]] const Device& device() const { return device_; }
  // A block-quantized weight's scales on the tensor's device (f32); empty for every other tensor.
  [[nodiscard]] const BlockScales& block_scales() const { return scales_; }
  // This tensor, an f8_e4m3 matrix, with its scales.
  [[nodiscard]] Tensor with_block_scales(const BlockScales& scales) const;
  [[nodiscard]] int dims() const { return dims_; }
  [[nodiscard]] std::int64_t dim(int i) const;
  [[nodiscard]] std::int64_t numel() const;
  [[nodiscard]] std::size_t bytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }
  [[nodiscard]] bool empty() const { return numel() == 0; }
  // Elements per index of dim 0 (the product of the other dims).
  [[nodiscard]] std::int64_t row_numel() const;
  [[nodiscard]] std::string shape_text() const;

  // Rows [first, first + count) of dim 0. Not of a block-scaled weight (std::logic_error): no operation takes
  // a part of one.
  [[nodiscard]] Tensor rows(std::int64_t first, std::int64_t count) const;
  // The same elements in another shape of equal size (not a block-scaled weight's, as rows()).
  [[nodiscard]] Tensor reshaped(std::initializer_list<std::int64_t> shape) const;

  // The typed pointer, on any device (a device pointer must not be dereferenced on the host).
  template <typename T>
  [[nodiscard]] T* ptr() const {
    check_dtype(dtype_of<std::remove_const_t<T>>());
    return static_cast<T*>(data_);
  }
  // The raw bytes on the host, whatever the element type: only for a tensor on the CPU device.
  [[nodiscard]] void* host_data() const {
    check_host();
    return data_;
  }
  // The elements on the host: only for a tensor on the CPU device.
  template <typename T>
  [[nodiscard]] std::span<T> host_span() const {
    check_host();
    return {ptr<T>(), static_cast<std::size_t>(numel())};
  }

 private:
  void check_dtype(DType wanted) const;
  void check_host() const;
  void check_unscaled(const char* what) const;

  void* data_ = nullptr;
  DType dtype_ = DType::f32;
  Device device_{};
  BlockScales scales_;
  std::array<std::int64_t, kMaxDims> shape_{};
  int dims_ = 0;
};

// A weight in host memory (e.g. the mmapped checkpoint) as a CPU tensor [rows, cols], without a copy.
inline Tensor weight_tensor(const WeightView& w) {
  const Tensor t(const_cast<std::byte*>(w.data), w.dtype, kCpu, {w.rows, w.cols});
  return w.scales.empty() ? t : t.with_block_scales(w.scales);
}

}  // namespace capserve::kernels
