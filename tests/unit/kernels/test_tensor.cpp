// Tensors, buffers and the backend's memory and host-copy contract, and the CPU backend's element-wise
// operations.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/tensor.h"

namespace capserve::kernels {
namespace {

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no exception)";
}

TEST(Tensor, ShapeRowsAndReshape) {
  std::vector<float> v(24);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const Tensor t = Tensor::host(std::span(v), {4, 3, 2});
  EXPECT_EQ(t.dims(), 3);
  EXPECT_EQ(t.numel(), 24);
  EXPECT_EQ(t.row_numel(), 6);
  EXPECT_EQ(t.bytes(), 96U);
  EXPECT_EQ(t.shape_text(), "[4, 3, 2]");
  const Tensor middle = t.rows(1, 2);
  EXPECT_EQ(middle.shape_text(), "[2, 3, 2]");
  EXPECT_EQ(middle.host_span<float>().front(), 6.0F);
  EXPECT_EQ(middle.host_span<float>().back(), 17.0F);
  EXPECT_EQ(t.reshaped({6, 4}).dim(1), 4);
  EXPECT_TRUE(t.rows(4, 0).empty());
  EXPECT_TRUE(Tensor().empty());
}

TEST(Tensor, MisuseIsAnErrorNamingIt) {
  std::vector<float> v(6);
  const Tensor t = Tensor::host(std::span(v), {2, 3});
  EXPECT_NE(error_of([&] { (void)t.rows(1, 2); }).find("rows(1, 2) of [2, 3]"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)t.reshaped({4, 2}); }).find("changes the element count"), std::string::npos);
  EXPECT_NE(error_of([&] { (void)t.host_span<std::int32_t>(); }).find("element type F32, accessed as I32"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              (void)Tensor::host(std::span(v), {4, 2});
            }).find("6 values for shape [4, 2]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { (void)t.dim(2); }).find("dim(2) of a 2-dim tensor"), std::string::npos);
  const Tensor on_gpu(v.data(), DType::f32, Device{DeviceKind::cuda, 1}, {6});
  EXPECT_NE(error_of([&] { (void)on_gpu.host_span<float>(); }).find("host access to a tensor on cuda:1"),
            std::string::npos);
  EXPECT_NO_THROW((void)on_gpu.ptr<float>());
}

TEST(Backend, ScratchGrowsOnlyWhenTooSmall) {
  cpu::CpuBackend backend(1);
  Buffer slot;
  const Tensor a = backend.scratch(slot, DType::f32, {4, 8});
  EXPECT_EQ(slot.bytes(), 128U);
  const Tensor b = backend.scratch(slot, DType::i32, {2, 8});
  EXPECT_EQ(b.data(), a.data());  // fits: the same memory
  const Tensor c = backend.scratch(slot, DType::i64, {5, 8});
  EXPECT_EQ(slot.bytes(), 320U);
  EXPECT_EQ(c.device(), kCpu);
  EXPECT_NE(error_of([&] { (void)slot.view(DType::f32, {100}); }).find("needs 400 bytes, the buffer has 320"),
            std::string::npos);
}

TEST(Backend, HostCopiesAreCheckedAndSynchronisationsCounted) {
  cpu::CpuBackend backend(1);
  Buffer slot;
  const Tensor t = backend.scratch(slot, DType::i32, {3});
  const std::vector<std::int32_t> in = {7, -1, 42};
  backend.from_host(std::as_bytes(std::span(in)), t);
  std::vector<std::int32_t> out(3);
  EXPECT_EQ(backend.host_syncs(HostSync::logits), 0);
  backend.to_host(t, std::as_writable_bytes(std::span(out)), HostSync::logits);
  EXPECT_EQ(out, in);
  EXPECT_EQ(backend.host_syncs(HostSync::logits), 1);
  std::vector<std::int32_t> small(2);
  EXPECT_NE(error_of([&] {
              backend.to_host(t, std::as_writable_bytes(std::span(small)), HostSync::logits);
            }).find("8 host bytes for a tensor of 12"),
            std::string::npos);
  EXPECT_EQ(backend.host_syncs(HostSync::logits), 1);  // a refused copy is no synchronisation
  const Tensor foreign(out.data(), DType::i32, Device{DeviceKind::cuda, 0}, {3});
  EXPECT_NE(error_of([&] {
              backend.from_host(std::as_bytes(std::span(in)), foreign);
            }).find("a tensor on cuda:0, the backend is on cpu"),
            std::string::npos);
}

TEST(CpuKernels, ElementwiseOperations) {
  cpu::CpuBackend backend(1);
  std::vector<float> dst = {1, 2, 3, 4, 5, 6};
  std::vector<float> src = {10, 20, 30, 40, 50, 60};
  const Tensor d = Tensor::host(std::span(dst), {2, 3});
  const Tensor s = Tensor::host(std::span(src), {2, 3});
  backend.add(d, s);
  EXPECT_EQ(dst, (std::vector<float>{11, 22, 33, 44, 55, 66}));

  std::vector<float> gate = {0.0F, -std::log(3.0F)};  // sigmoid: 1/2 and 1/4
  backend.add_sigmoid_gated(d, s, Tensor::host(std::span(gate), {2}));
  EXPECT_EQ(dst, (std::vector<float>{16, 32, 48, 54, 67.5, 81}));

  backend.clamp(d, 50.0F);
  EXPECT_EQ(dst, (std::vector<float>{16, 32, 48, 50, 50, 50}));

  std::vector<float> picked(6);
  const std::int64_t rows[] = {1, 0};
  backend.gather_rows(d, rows, Tensor::host(std::span(picked), {2, 3}));
  EXPECT_EQ(picked, (std::vector<float>{50, 50, 50, 16, 32, 48}));
  const std::int64_t outside[] = {2, 0};
  EXPECT_NE(error_of([&] {
              backend.gather_rows(d, outside, Tensor::host(std::span(picked), {2, 3}));
            }).find("row 2 of [2, 3]"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              backend.add(d, Tensor::host(std::span(picked).first(3), {3}));
            }).find("dst [2, 3] and src [3]"),
            std::string::npos);
}

}  // namespace
}  // namespace capserve::kernels
