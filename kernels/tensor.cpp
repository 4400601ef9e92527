#include "kernels/tensor.h"

namespace capserve::kernels {

std::string to_string(const Device& device) {
  return device.kind == DeviceKind::cpu ? std::string("cpu") : "cuda:" + std::to_string(device.index);
}

Tensor::Tensor(void* data, DType dtype, Device device, std::span<const std::int64_t> shape)
    : data_(data), dtype_(dtype), device_(device), dims_(static_cast<int>(shape.size())) {
  if (shape.size() > kMaxDims) {
    throw std::invalid_argument("Tensor: " + std::to_string(shape.size()) + " dims, at most " +
                                std::to_string(kMaxDims));
  }
  for (std::size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) throw std::invalid_argument("Tensor: negative extent in dim " + std::to_string(i));
    shape_[i] = shape[i];
  }
}

std::int64_t Tensor::dim(int i) const {
  if (i < 0 || i >= dims_) {
    throw std::out_of_range("Tensor::dim(" + std::to_string(i) + ") of a " + std::to_string(dims_) +
                            "-dim tensor");
  }
  return shape_[static_cast<std::size_t>(i)];
}

std::int64_t Tensor::numel() const {
  if (dims_ == 0) return 0;
  std::int64_t n = 1;
  for (int i = 0; i < dims_; ++i) n *= shape_[static_cast<std::size_t>(i)];
  return n;
}

std::int64_t Tensor::row_numel() const {
  std::int64_t n = 1;
  for (int i = 1; i < dims_; ++i) n *= shape_[static_cast<std::size_t>(i)];
  return n;
}

std::string Tensor::shape_text() const {
  std::string text = "[";
  for (int i = 0; i < dims_; ++i) {
    if (i > 0) text += ", ";
    text += std::to_string(shape_[static_cast<std::size_t>(i)]);
  }
  return text + "]";
}

Tensor Tensor::with_block_scales(const BlockScales& scales) const {
  if (dtype_ != DType::f8_e4m3 || dims_ != 2 || scales.data == nullptr || scales.block_rows <= 0 ||
      scales.block_cols <= 0) {
    throw std::invalid_argument("Tensor::with_block_scales: " + std::to_string(scales.block_rows) + "x" +
                                std::to_string(scales.block_cols) + " blocks for a " +
                                std::string(dtype_name(dtype_)) + " tensor " + shape_text());
  }
  Tensor t = *this;
  t.scales_ = scales;
  return t;
}

void Tensor::check_unscaled(const char* what) const {
  if (!scales_.empty())
    throw std::logic_error(std::string("Tensor::") + what + " of the block-scaled weight " + shape_text());
}

Tensor Tensor::rows(std::int64_t first, std::int64_t count) const {
  check_unscaled("rows");
  if (dims_ == 0 || first < 0 || count < 0 || first + count > shape_[0]) {
    throw std::out_of_range("Tensor::rows(" + std::to_string(first) + ", " + std::to_string(count) + ") of " +
                            shape_text());
  }
  Tensor t = *this;
  t.data_ =
      static_cast<std::byte*>(data_) + static_cast<std::size_t>(first * row_numel()) * dtype_size(dtype_);
  t.shape_[0] = count;
  return t;
}

Tensor Tensor::reshaped(std::initializer_list<std::int64_t> shape) const {
  check_unscaled("reshaped");
  Tensor t(data_, dtype_, device_, shape);
  if (t.numel() != numel()) {
    throw std::invalid_argument("Tensor::reshaped: " + t.shape_text() + " from " + shape_text() +
                                " changes the element count");
  }
  return t;
}

void Tensor::check_dtype(DType wanted) const {
  if (dtype_ != wanted) {
    throw std::invalid_argument("Tensor: element type " + std::string(dtype_name(dtype_)) + ", accessed as " +
                                std::string(dtype_name(wanted)));
  }
}

void Tensor::check_host() const {
  if (device_.kind != DeviceKind::cpu) {
    throw std::logic_error("Tensor: host access to a tensor on " + to_string(device_) +
                           " (copy it with the backend's to_host)");
  }
}

}  // namespace capserve::kernels
