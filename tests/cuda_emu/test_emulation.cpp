// The CUDA emulation itself (label cuda-emu): warp collectives and barriers behave as documented, and what it
// claims to catch fails with a clear message — a missing __syncthreads (shuffled schedule), launches over the
// limits, freed and host pointers, a wrong cuBLAS leading dimension, a stream of another device (for a kernel
// or a cuBLAS handle).
#include <cublas_v2.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/layer_kernels.h"
#include "kernels/cuda/wmma.h"

namespace capserve {
namespace {

using kernels::cuda::CudaError;
using kernels::cuda::DeviceBuffer;
using kernels::cuda::launch;

template <class T>
DeviceBuffer<T> upload(const std::vector<T>& host) {
  DeviceBuffer<T> d(host.size());
  CAPSERVE_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

template <class T>
std::vector<T> download(const DeviceBuffer<T>& d) {
  std::vector<T> host(d.size());
  CAPSERVE_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

// The message of the CudaError `f` throws (the last error cleared), or a failure.
template <class F>
std::string cuda_error_of(F&& f) {
  try {
    f();
  } catch (const CudaError& e) {
    (void)cudaGetLastError();  // a failed call is also the thread's last error, as with the real runtime
    return e.what();
  }
  ADD_FAILURE() << "no CudaError";
  return {};
}

constexpr int kShiftThreads = 128;

// out[i] = in[i - 1] through shared memory; `synced` false leaves out the barrier between the writes and the
// reads of the neighbours' slots. Threads in index order happen to write before their right neighbour reads.
__global__ void shift_kernel(const int* in, int* out, bool synced) {
  __shared__ int values[kShiftThreads];
  const int i = static_cast<int>(threadIdx.x);
  values[i] = in[i];
  if (synced) __syncthreads();
  out[i] = i > 0 ? values[i - 1] : 0;
}

std::vector<int> run_shift(bool synced, int first) {
  std::vector<int> in(kShiftThreads);
  std::iota(in.begin(), in.end(), first);  // new values every run: shared memory keeps the last block's
  const auto d_in = upload(in);
  DeviceBuffer<int> d_out(in.size());
  launch(shift_kernel, 1, kShiftThreads, 0, nullptr, d_in.data(), d_out.data(), synced);
  CAPSERVE_CUDA_CHECK_LAUNCH();
  return download(d_out);
}

std::vector<int> shift_reference(int first) {
  std::vector<int> want(kShiftThreads);
  std::iota(want.begin() + 1, want.end(), first);
  return want;
}

TEST(CudaEmulation, MissingSyncthreadsGivesAWrongResultUnderTheShuffledSchedule) {
  // In index order the race goes unseen; that is what the shuffled schedule is for.
  EXPECT_EQ(run_shift(false, 1), shift_reference(1));
  for (int seed = 1; seed <= 3; ++seed) {
    const cuda_emu::ScopedSchedule shuffled(cuda_emu::Schedule::shuffled, static_cast<std::uint64_t>(seed));
    EXPECT_EQ(run_shift(true, 1000 * seed), shift_reference(1000 * seed)) << "seed " << seed;
    EXPECT_NE(run_shift(false, 1000 * seed + 500), shift_reference(1000 * seed + 500))
        << "seed " << seed << ": the missing __syncthreads went unseen";
  }
}

// Every warp collective against its definition, on a block whose last warp is partial.
__global__ void collectives_kernel(int* out, int n) {
  const int t = static_cast<int>(threadIdx.x);
  const int lane = t % 32;
  const unsigned full = __activemask();
  int* o = out + t * 8;
  o[0] = __shfl_sync(full, t, 3);
  o[1] = __shfl_xor_sync(full, t, 1);
  o[2] = __shfl_up_sync(full, t, 2, 8);
  o[3] = __shfl_down_sync(full, t, 2, 8);
  o[4] = static_cast<int>(__ballot_sync(full, lane % 3 == 0));
  o[5] = __all_sync(full, t < n) + 2 * __any_sync(full, lane == 5);
  // Two halves of the warp in separate collectives of their own masks.
  const unsigned half = lane < 16 ? 0x0000FFFFU & full : 0xFFFF0000U & full;
  o[6] = half == 0 ? -1 : __shfl_sync(half, t, lane < 16 ? 0 : 16);
  o[7] = __syncthreads_count(lane == 0);
}

// c[16, 16] += a[16, 16] * b (b stored row-major, or column-major when `b_col`), the accumulator loaded from
// c, updated and stored back in place by the warp, as the tensor-core attention keeps its output.
__global__ void wmma_update_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, bool b_col, float* c) {
  namespace wmma = kernels::cuda::wmma;
  wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
  wmma::load_matrix_sync(fa, a, 16);
  wmma::load_matrix_sync(acc, c, 16, wmma::mem_row_major);
  if (b_col) {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb;
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
  } else {
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
    wmma::load_matrix_sync(fb, b, 16);
    wmma::mma_sync(acc, fa, fb, acc);
  }
  for (int i = 0; i < acc.num_elements; ++i) acc.x[i] *= 2.0F;  // element-wise, as the API allows
  wmma::store_matrix_sync(c, acc, 16, wmma::mem_row_major);
}

TEST(CudaEmulation, WarpMatrixFunctionsComputeTheProductOfTheirLayouts) {
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> small(-4, 4);  // exact in bf16 and in every sum
  std::vector<__nv_bfloat16> a(256);
  std::vector<__nv_bfloat16> b(256);
  std::vector<float> c(256);
  for (auto& v : a) v = __float2bfloat16(static_cast<float>(small(rng)));
  for (auto& v : b) v = __float2bfloat16(static_cast<float>(small(rng)));
  for (float& v : c) v = static_cast<float>(small(rng));
  for (const bool b_col : {false, true}) {
    std::vector<float> want(256);
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 16; ++j) {
        float sum = c[static_cast<std::size_t>(i * 16 + j)];
        for (int k = 0; k < 16; ++k) {
          const __nv_bfloat16 bk =
              b_col ? b[static_cast<std::size_t>(j * 16 + k)] : b[static_cast<std::size_t>(k * 16 + j)];
          sum += __bfloat162float(a[static_cast<std::size_t>(i * 16 + k)]) * __bfloat162float(bk);
        }
        want[static_cast<std::size_t>(i * 16 + j)] = 2.0F * sum;
      }
    }
    const auto d_a = upload(a);
    const auto d_b = upload(b);
    auto d_c = upload(c);
    launch(wmma_update_kernel, 1, 32, 0, nullptr, d_a.data(), d_b.data(), b_col, d_c.data());
    CAPSERVE_CUDA_CHECK_LAUNCH();
    EXPECT_EQ(download(d_c), want) << (b_col ? "b column-major" : "b row-major");
  }
}

TEST(CudaEmulation, WarpCollectivesFollowTheirDefinitions) {
  const int n = 48;  // one full warp and one of 16 lanes
  DeviceBuffer<int> d_out(static_cast<std::size_t>(n) * 8);
  launch(collectives_kernel, 1, n, 0, nullptr, d_out.data(), n);
  CAPSERVE_CUDA_CHECK_LAUNCH();
  const std::vector<int> out = download(d_out);
  for (int t = 0; t < n; ++t) {
    const int lane = t % 32;
    const int base = t - lane;
    const unsigned lanes = t < 32 ? 0xFFFFFFFFU : 0xFFFFU;
    unsigned ballot = 0;
    for (int l = 0; l < 32; ++l) ballot |= ((lanes >> l) & 1U) != 0 && l % 3 == 0 ? 1U << l : 0U;
    const int* o = out.data() + t * 8;
    SCOPED_TRACE("thread " + std::to_string(t));
    EXPECT_EQ(o[0], base + 3);
    EXPECT_EQ(o[1], t ^ 1);
    EXPECT_EQ(o[2], lane % 8 >= 2 ? t - 2 : t);
    EXPECT_EQ(o[3], lane % 8 + 2 < 8 ? t + 2 : t);
    EXPECT_EQ(static_cast<unsigned>(o[4]), ballot);
    EXPECT_EQ(o[5], 1 + 2);
    EXPECT_EQ(o[6], lane < 16 ? base : (t < 32 ? base + 16 : -1));
    EXPECT_EQ(o[7], 2);
  }
}

__global__ void early_exit_kernel(int* out) {
  if (threadIdx.x == 7) return;
  out[threadIdx.x] = __shfl_xor_sync(0xFFFFFFFFU, static_cast<int>(threadIdx.x), 1);
}

TEST(CudaEmulation, ALaneThatExitsBeforeAWarpCollectiveFailsTheLaunch) {
  DeviceBuffer<int> d_out(32);
  const std::string message = cuda_error_of([&] {
    launch(early_exit_kernel, 1, 32, 0, nullptr, d_out.data());
    CAPSERVE_CUDA_CHECK_LAUNCH();
  });
  EXPECT_NE(message.find("cudaErrorLaunchFailure"), std::string::npos) << message;
  EXPECT_NE(message.find("__shfl_xor_sync"), std::string::npos) << message;
}

__global__ void fill_kernel(int* out, int value) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}

__global__ void dynamic_shared_kernel(int* out) {
  CAPSERVE_DYNAMIC_SHARED(int, scratch);
  scratch[threadIdx.x] = static_cast<int>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = scratch[blockDim.x - 1 - threadIdx.x];
}

TEST(CudaEmulation, LaunchesOverTheLimitsFail) {
  DeviceBuffer<int> d_out(2048);
  const auto message_of = [&](dim3 grid, dim3 block) {
    return cuda_error_of([&] {
      launch(fill_kernel, grid, block, 0, nullptr, d_out.data(), 1);
      CAPSERVE_CUDA_CHECK_LAUNCH();
    });
  };
  EXPECT_NE(message_of(1, 1025).find("cudaErrorInvalidConfiguration"), std::string::npos);
  EXPECT_NE(message_of(1, dim3(32, 32, 2)).find("1024 threads"), std::string::npos);
  EXPECT_NE(message_of(dim3(1, 65536), 1).find("65535"), std::string::npos);

  // Dynamic shared memory above 48 KB only after the opt-in.
  const std::size_t big = 64 * 1024;
  const std::string message = cuda_error_of([&] {
    launch(dynamic_shared_kernel, 1, 64, big, nullptr, d_out.data());
    CAPSERVE_CUDA_CHECK_LAUNCH();
  });
  EXPECT_NE(message.find("cudaFuncAttributeMaxDynamicSharedMemorySize"), std::string::npos) << message;
  CAPSERVE_CUDA_CHECK(cudaFuncSetAttribute(reinterpret_cast<const void*>(dynamic_shared_kernel),
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(big)));
  launch(dynamic_shared_kernel, 1, 64, big, nullptr, d_out.data());
  CAPSERVE_CUDA_CHECK_LAUNCH();
  const std::vector<int> out = download(d_out);
  for (int t = 0; t < 64; ++t) EXPECT_EQ(out[static_cast<std::size_t>(t)], 63 - t);
}

TEST(CudaEmulation, FreedAndHostPointersFailTheLaunch) {
  int* freed = nullptr;
  CAPSERVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&freed), 256 * sizeof(int)));
  CAPSERVE_CUDA_CHECK(cudaFree(freed));
  std::string message = cuda_error_of([&] {
    launch(fill_kernel, 1, 256, 0, nullptr, freed, 1);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  });
  EXPECT_NE(message.find("cudaErrorIllegalAddress"), std::string::npos) << message;
  EXPECT_NE(message.find("freed by cudaFree"), std::string::npos) << message;

  std::vector<int> host(256);
  message = cuda_error_of([&] {
    launch(fill_kernel, 1, 256, 0, nullptr, host.data(), 1);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  });
  EXPECT_NE(message.find("neither cudaMalloc nor cudaMallocHost"), std::string::npos) << message;

  message = cuda_error_of([&] { CAPSERVE_CUDA_CHECK(cudaFree(freed)); });
  EXPECT_NE(message.find("already freed"), std::string::npos) << message;
  message =
      cuda_error_of([&] { CAPSERVE_CUDA_CHECK(cudaMemcpy(host.data(), freed, 16, cudaMemcpyDeviceToHost)); });
  EXPECT_NE(message.find("freed by cudaFree"), std::string::npos) << message;
}

struct Indirect {
  const int* values;
};

__global__ void read_indirect_kernel(Indirect in, int* out) {
  out[threadIdx.x] = in.values[threadIdx.x];
}

TEST(CudaEmulationDeathTest, AKernelReadingFreedMemoryDiesNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const auto read_freed = [] {
    int* values = nullptr;
    CAPSERVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&values), 64 * sizeof(int)));
    DeviceBuffer<int> out(64);
    CAPSERVE_CUDA_CHECK(cudaFree(values));
    launch(read_indirect_kernel, 1, 64, 0, nullptr, Indirect{values}, out.data());
  };
  EXPECT_DEATH(read_freed(), "access to device memory freed by cudaFree");
}

__global__ void read_at_kernel(Indirect in, int offset, int* out) {
  out[threadIdx.x] = in.values[offset];
}

// The pointer hides in a struct, so only the guard pages can catch these reads.
void read_outside_allocation(int offset) {
  int* values = nullptr;
  CAPSERVE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&values), 1024 * sizeof(int)));  // one whole page
  DeviceBuffer<int> out(1);
  launch(read_at_kernel, 1, 1, 0, nullptr, Indirect{values}, offset, out.data());
}

TEST(CudaEmulationDeathTest, AKernelReadingPastEitherEndOfAnAllocationDiesNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(read_outside_allocation(1024), "access 0 bytes past the end of a 4096-byte allocation");
  EXPECT_DEATH(read_outside_allocation(-1), "access 4 bytes before the start of a 4096-byte allocation");
}

TEST(CudaEmulation, CopiesAreCheckedAgainstTheirAllocation) {
  DeviceBuffer<int> d(10);
  std::vector<int> host(11);
  const std::string message = cuda_error_of([&] {
    CAPSERVE_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), 11 * sizeof(int), cudaMemcpyHostToDevice));
  });
  EXPECT_NE(message.find("overrun its 40-byte allocation"), std::string::npos) << message;
}

TEST(CudaEmulation, CountsSynchronisationsAndAllocations) {
  cuda_emu::reset_counters();
  {
    DeviceBuffer<int> d(64);
    launch(fill_kernel, 2, 32, 0, nullptr, d.data(), 5);
    CAPSERVE_CUDA_CHECK_LAUNCH();
    CAPSERVE_CUDA_CHECK(cudaDeviceSynchronize());
    EXPECT_EQ(download(d), std::vector<int>(64, 5));
  }
  const cuda_emu::Counters c = cuda_emu::counters();
  EXPECT_EQ(c.device_allocations, 1);
  EXPECT_EQ(c.device_frees, 1);
  EXPECT_EQ(c.kernel_launches, 1);
  EXPECT_EQ(c.host_syncs, 2);  // cudaDeviceSynchronize and the blocking cudaMemcpy
  EXPECT_EQ(c.copies, 1);
}

// A graph capture takes kernels, asynchronous copies from page-locked memory and events; every call that
// would wait for the device, allocate or copy from pageable memory is refused, as on a device, and the
// capture then ends invalidated.
TEST(CudaEmulation, AGraphCaptureRefusesWhatWouldWaitOrAllocate) {
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  DeviceBuffer<int> d(64);
  void* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, 64 * sizeof(int)), cudaSuccess);
  cudaEvent_t event = nullptr;
  ASSERT_EQ(cudaEventCreate(&event), cudaSuccess);

  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  ASSERT_EQ(cudaStreamIsCapturing(stream, &status), cudaSuccess);
  EXPECT_EQ(status, cudaStreamCaptureStatusActive);
  EXPECT_EQ(cudaMemcpyAsync(d.data(), pinned, 64 * sizeof(int), cudaMemcpyHostToDevice, stream), cudaSuccess);
  launch(fill_kernel, 2, 32, 0, stream, d.data(), 7);
  CAPSERVE_CUDA_CHECK_LAUNCH();
  EXPECT_EQ(cudaEventRecord(event, stream), cudaSuccess);
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);

  std::vector<int> pageable(64, 1);
  void* more = nullptr;
  const auto refused = [&](const char* what, const std::function<cudaError_t()>& call) {
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess) << what;
    EXPECT_EQ(cudaEventRecord(event, stream), cudaSuccess) << what;
    EXPECT_EQ(call(), cudaErrorStreamCaptureUnsupported) << what;
    (void)cudaGetLastError();
    cudaGraph_t invalid = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(stream, &invalid), cudaErrorStreamCaptureInvalidated) << what;
    (void)cudaGetLastError();
    EXPECT_EQ(invalid, nullptr) << what;
  };
  refused("cudaMalloc", [&] { return cudaMalloc(&more, 16); });
  refused("cudaMallocHost", [&] { return cudaMallocHost(&more, 16); });
  refused("cudaStreamSynchronize", [&] { return cudaStreamSynchronize(stream); });
  refused("cudaStreamQuery", [&] { return cudaStreamQuery(stream); });
  refused("cudaEventQuery", [&] { return cudaEventQuery(event); });
  refused("cudaDeviceSynchronize", [] { return cudaDeviceSynchronize(); });
  refused("cudaMemcpy", [&] { return cudaMemcpy(pinned, d.data(), 16, cudaMemcpyDeviceToHost); });
  refused("a copy from pageable memory",
          [&] { return cudaMemcpyAsync(d.data(), pageable.data(), 16, cudaMemcpyHostToDevice, stream); });
  // After the capture, the same calls are fine again.
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(cudaEventRecord(event, stream), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(event), cudaSuccess);
  EXPECT_EQ(download(d), std::vector<int>(64, 7));
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
  EXPECT_EQ(cudaEventDestroy(event), cudaSuccess);
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}

TEST(CudaEmulation, AStreamIsUsableOnlyWhileItsDeviceIsCurrent) {
  int devices = 0;
  CAPSERVE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  ASSERT_GE(devices, 2) << "the test runs with CAPSERVE_CUDA_EMU_DEVICES=2";
  CAPSERVE_CUDA_CHECK(cudaSetDevice(0));
  cudaStream_t stream = nullptr;
  CAPSERVE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceBuffer<int> d(32);
  CAPSERVE_CUDA_CHECK(cudaSetDevice(1));
  const std::string message = cuda_error_of([&] {
    launch(fill_kernel, 1, 32, 0, stream, d.data(), 1);
    CAPSERVE_CUDA_CHECK_LAUNCH();
  });
  EXPECT_NE(message.find("belongs to device 0 but device 1 is current"), std::string::npos) << message;
  CAPSERVE_CUDA_CHECK(cudaSetDevice(0));
  launch(fill_kernel, 1, 32, 0, stream, d.data(), 1);
  CAPSERVE_CUDA_CHECK_LAUNCH();
  CAPSERVE_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Top-p sampling draws the same tokens whatever order the block's threads run in: its mass sums must not
// depend on the order of atomic additions. The nucleus sizes sit within a few ulps of where the mass of the
// first radix round's buckets adds up to top_p, where a sum in another order lands on the other side.
TEST(CudaEmulation, TopPSamplingIsTheSameUnderEveryShuffledSchedule) {
  const std::int64_t vocab = 4096;
  std::mt19937_64 rng(97);
  std::normal_distribution<float> normal(0.0F, 2.0F);
  std::vector<float> logits(static_cast<std::size_t>(vocab));
  for (float& l : logits) l = normal(rng);
  const float top = *std::max_element(logits.begin(), logits.end());
  // The mass of each first-round bucket (the key's top byte: sign and high exponent bits of the logit).
  std::vector<double> bucket(256, 0.0);
  double z = 0.0;
  for (const float l : logits) {
    const auto u = std::bit_cast<std::uint32_t>(l);
    const std::uint32_t ordered = (u & 0x80000000U) != 0 ? ~u : (u | 0x80000000U);
    const double w = std::exp(static_cast<double>(l - top));
    bucket[ordered >> 24] += w;
    z += w;
  }
  std::vector<float> top_ps;
  double cumulative = 0.0;
  for (int b = 255; b >= 0; --b) {
    if (bucket[static_cast<std::size_t>(b)] == 0.0) continue;
    cumulative += bucket[static_cast<std::size_t>(b)];
    if (cumulative >= z) break;
    float p = static_cast<float>(cumulative / z);
    for (int i = 0; i < 6; ++i) p = std::nextafter(p, 0.0F);
    for (int i = 0; i < 13; ++i, p = std::nextafter(p, 1.0F)) top_ps.push_back(p);
  }
  ASSERT_GE(top_ps.size(), 13U * 3);
  const auto rows = static_cast<std::int64_t>(top_ps.size()) * 2;
  std::vector<float> all;
  std::vector<kernels::SampleControls> controls;
  for (std::int64_t r = 0; r < rows; ++r) {
    all.insert(all.end(), logits.begin(), logits.end());
    controls.push_back(
        {1.0F, 0, top_ps[static_cast<std::size_t>(r / 2)], 11, static_cast<std::uint64_t>(r % 2)});
  }
  const auto d_logits = upload(all);
  const auto d_controls = upload(controls);
  const auto draw = [&] {
    DeviceBuffer<std::int32_t> tokens(static_cast<std::size_t>(rows));
    kernels::cuda::sample(d_logits.data(), rows, vocab, d_controls.data(), tokens.data(), nullptr);
    return download(tokens);
  };
  const std::vector<std::int32_t> in_order = draw();
  for (std::uint64_t seed = 1; seed <= 3; ++seed) {
    const cuda_emu::ScopedSchedule shuffled(cuda_emu::Schedule::shuffled, seed);
    const std::vector<std::int32_t> tokens = draw();
    std::int64_t differ = 0;
    for (std::int64_t r = 0; r < rows; ++r)
      differ += tokens[static_cast<std::size_t>(r)] != in_order[static_cast<std::size_t>(r)] ? 1 : 0;
    EXPECT_EQ(differ, 0) << "of " << rows << " rows differ under schedule seed " << seed;
  }
}

class CublasEmulation : public ::testing::Test {
 protected:
  CublasEmulation() { CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle_)); }
  ~CublasEmulation() override { cublasDestroy(handle_); }
  cublasHandle_t handle_ = nullptr;
};

TEST_F(CublasEmulation, GemmIsColumnMajor) {
  // A 2x3 column-major [[1, 2, 3], [4, 5, 6]], B 3x2 [[1, 0], [0, 1], [1, 1]]: A * B = [[4, 5], [10, 11]].
  const auto d_a = upload(std::vector<float>{1, 4, 2, 5, 3, 6});
  const auto d_b = upload(std::vector<float>{1, 0, 1, 0, 1, 1});
  DeviceBuffer<float> d_c(4);
  const float one = 1.0F;
  const float zero = 0.0F;
  CAPSERVE_CUDA_CHECK(cudaMemset(d_c.data(), 0xFF, d_c.bytes()));  // NaN: beta 0 must not read C
  CAPSERVE_CUBLAS_CHECK(cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 3, &one, d_a.data(), CUDA_R_32F,
                                     2, d_b.data(), CUDA_R_32F, 3, &zero, d_c.data(), CUDA_R_32F, 2,
                                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  EXPECT_EQ(download(d_c), (std::vector<float>{4, 10, 5, 11}));
}

TEST_F(CublasEmulation, WrongLeadingDimensionTransposeOrComputeTypeIsRejected) {
  DeviceBuffer<float> d_a(64);
  DeviceBuffer<float> d_b(64);
  DeviceBuffer<float> d_c(64);
  const float one = 1.0F;
  const auto gemm = [&](cublasOperation_t ta, int lda, cublasComputeType_t compute) {
    return cublasGemmEx(handle_, ta, CUBLAS_OP_N, 4, 4, 4, &one, d_a.data(), CUDA_R_32F, lda, d_b.data(),
                        CUDA_R_32F, 4, &one, d_c.data(), CUDA_R_32F, 4, compute, CUBLAS_GEMM_DEFAULT);
  };
  cublasStatus_t status = gemm(CUBLAS_OP_N, 3, CUBLAS_COMPUTE_32F);
  ASSERT_EQ(status, CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_NE(std::string(cublasGetStatusString(status)).find("lda = 3 below the 4 rows"), std::string::npos)
      << cublasGetStatusString(status);
  EXPECT_EQ(gemm(static_cast<cublasOperation_t>(7), 4, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_EQ(gemm(CUBLAS_OP_N, 4, CUBLAS_COMPUTE_16F), CUBLAS_STATUS_NOT_SUPPORTED);
  EXPECT_EQ(gemm(CUBLAS_OP_N, 4, CUBLAS_COMPUTE_32F), CUBLAS_STATUS_SUCCESS);
}

// Strided batched: each item is the product at its strides (here item b scales by b + 1), and an item past
// its allocation fails naming the item, as its kernel would fault on a GPU.
TEST_F(CublasEmulation, StridedBatchedGemmComputesEachItemAndChecksEveryItemsMatrices) {
  const std::vector<float> a = {1, 2, 3, 4, 2, 4, 6, 8, 3, 6, 9, 12};  // three 2x2 items, item b = (b + 1) a0
  const std::vector<float> b = {1, 0, 0, 1};                           // the identity, shared (stride 0)
  const auto d_a = upload(a);
  const auto d_b = upload(b);
  DeviceBuffer<float> d_c(12);
  const float one = 1.0F;
  const float zero = 0.0F;
  const auto gemm = [&](int batch) {
    return cublasGemmStridedBatchedEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, d_a.data(),
                                      CUDA_R_32F, 2, 4, d_b.data(), CUDA_R_32F, 2, 0, &zero, d_c.data(),
                                      CUDA_R_32F, 2, 4, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  ASSERT_EQ(gemm(3), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(download(d_c), a);
  const cublasStatus_t status = gemm(4);
  ASSERT_EQ(status, CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_NE(std::string(cublasGetStatusString(status)).find("batch item 3"), std::string::npos)
      << cublasGetStatusString(status);
  EXPECT_EQ(gemm(-1), CUBLAS_STATUS_INVALID_VALUE);
}

// A handle works on the device current at cublasCreate (the fixture's: device 0); a GEMM on a stream of
// device 1 is refused even with device 1 current, as its kernel could not be launched there on a GPU.
TEST_F(CublasEmulation, AHandleRefusesAStreamOfAnotherDevice) {
  int devices = 0;
  CAPSERVE_CUDA_CHECK(cudaGetDeviceCount(&devices));
  ASSERT_GE(devices, 2) << "the test runs with CAPSERVE_CUDA_EMU_DEVICES=2";
  DeviceBuffer<float> d_a(4);
  DeviceBuffer<float> d_c(4);
  CAPSERVE_CUDA_CHECK(cudaSetDevice(1));
  cudaStream_t stream = nullptr;
  CAPSERVE_CUDA_CHECK(cudaStreamCreate(&stream));
  const float one = 1.0F;
  const auto gemm = [&] {
    return cublasGemmEx(handle_, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &one, d_a.data(), CUDA_R_32F, 2,
                        d_a.data(), CUDA_R_32F, 2, &one, d_c.data(), CUDA_R_32F, 2, CUBLAS_COMPUTE_32F,
                        CUBLAS_GEMM_DEFAULT);
  };
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  const cublasStatus_t status = gemm();
  EXPECT_EQ(status, CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_NE(std::string(cublasGetStatusString(status))
                .find("the handle was created with device 0 current, but its stream belongs to device 1"),
            std::string::npos)
      << cublasGetStatusString(status);
  CAPSERVE_CUDA_CHECK(cudaSetDevice(0));
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, nullptr));
  EXPECT_EQ(gemm(), CUBLAS_STATUS_SUCCESS);
  CAPSERVE_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace capserve
