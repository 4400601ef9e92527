#pragma once
// CUDA emulation, device side: what a .cu file needs to build with the plain C++ compiler and run on the
// host. Tests and tools only; never linked into product binaries. kernels/cuda/launch.h includes this header
// when the compiler is not nvcc, and the emulated targets (tests/cuda_emu/CMakeLists.txt) compile the very
// .cu files nvcc builds, as C++, against it plus the real CUDA headers' host declarations
// (cuda_runtime_api.h, cuda_bf16.h, cublas_v2.h, nccl.h), whose functions the emulation library implements on
// host memory.
//
// Execution model: a launch runs at once on the calling host thread (streams are therefore trivially in
// order). Blocks run one after another; the threads of a block are fibers (Boost.Context) that run until they
// reach __syncthreads, __syncwarp or a warp collective and switch there. A kernel without barriers switches
// only once per block: one fiber runs its threads in turn. In the default order threads run by index between
// barriers; the shuffled schedule (cuda_emu.h) runs them in a seeded random order, so a missing barrier or a
// race through shared memory shows up as a wrong result.
//
// `__shared__` variables are function statics (one per host thread; every block of a launch reuses them, so a
// block sees what the previous block left, not garbage). Atomics are std::atomic_ref operations; their order
// is the schedule's.
//
// Accuracy model: the standard single-precision functions (expf, logf, sinf, ...) are the host libm's, which
// glibc rounds correctly or within 1 ulp; the device's are within 1-2 ulp (CUDA Programming Guide,
// "Mathematical Functions"), so results may differ from a GPU's in the last bits, never more. The fast
// intrinsics reproduce the device's formulas: __expf(x) = exp2(x * log2(e)) with the product rounded to float
// as the device rounds it (the dominant error, growing with |x|); __logf(x) = log2(x) * ln(2); __fdividef(x,
// y) = x * (1 / y); each then evaluated correctly rounded, where the device's approximations add up to 2 ulp.
#include <cuda_runtime_api.h>

#include <atomic>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <tuple>
#include <type_traits>
#include <utility>

// The real headers define these as nothing for the host compiler; __shared__ needs storage per block.
#undef __shared__
#define __shared__ static thread_local
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#undef __restrict__
#define __restrict__ __restrict

namespace capserve::cuda_emu::detail {

// One running CUDA thread, as its fiber sees it.
struct ThreadIndex {
  uint3 thread_idx;
  const uint3* block_idx;
  const dim3* block_dim;
  const dim3* grid_dim;
};

// The emulated thread running now on this host thread (null outside a kernel).
extern thread_local const ThreadIndex* current_thread;

inline const ThreadIndex& this_thread() {
  return *current_thread;
}

// Block and warp synchronisation, for the thread running now. `value` is the thread's contribution to a
// collective (bits of a shuffle operand, a predicate); the result is what the collective hands back to it.
enum class Collective : std::uint8_t { syncwarp, shfl_idx, shfl_up, shfl_down, shfl_xor, ballot, all, any };
enum class BlockSync : std::uint8_t { plain, count, all, any };
std::uint64_t warp_collective(Collective kind, unsigned mask, std::uint64_t value, int arg, int width);
int block_barrier(BlockSync kind, int predicate);
unsigned active_mask();
[[noreturn]] void trap(const char* what);

// A kernel argument that is a pointer, checked at launch: null, device memory, or page-locked host memory.
struct PointerArgument {
  const void* pointer;
  int index;  // the parameter's position, from 0
};

// Runs `grid` blocks of `block` threads, each calling run(params). Errors go to cudaGetLastError.
void launch_kernel(const void* kernel, dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
                   void (*run)(const void*), const void* params, std::span<const PointerArgument> pointers);

// Dynamic shared memory of the running block.
void* dynamic_shared_memory();

template <class T>
std::uint64_t to_bits(T v) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "warp collectives move up to 8 bytes");
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  return bits;
}

template <class T>
T from_bits(std::uint64_t bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

template <class T>
void add_pointer(PointerArgument*& out, int& index, const T& arg) {
  if constexpr (std::is_pointer_v<T>) *out++ = {static_cast<const void*>(arg), index};
  ++index;
}

}  // namespace capserve::cuda_emu::detail

namespace capserve::cuda_emu {

// The emulated <<<grid, block, shared_bytes, stream>>>(args...): arguments are copied as the device copies
// them, pointer arguments are checked (see PointerArgument), then every thread runs kernel(params...).
template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t shared_bytes, cudaStream_t stream,
            Args&&... args) {
  struct Pack {
    void (*kernel)(Params...);
    std::tuple<std::decay_t<Params>...> params;
  };
  const Pack pack{kernel, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
  detail::PointerArgument pointers[sizeof...(Params) + 1];
  detail::PointerArgument* end = pointers;
  int index = 0;
  std::apply([&end, &index](const auto&... p) { (detail::add_pointer(end, index, p), ...); }, pack.params);
  detail::launch_kernel(
      reinterpret_cast<const void*>(kernel), grid, block, shared_bytes, stream,
      [](const void* p) {
        const Pack& k = *static_cast<const Pack*>(p);
        std::apply(k.kernel, k.params);
      },
      &pack, std::span(pointers, static_cast<std::size_t>(end - pointers)));
}

}  // namespace capserve::cuda_emu

// ---------------------------------------------------------------------------------------------------------
// The device built-ins, in the global namespace as CUDA has them.

#define threadIdx (::capserve::cuda_emu::detail::this_thread().thread_idx)
#define blockIdx (*::capserve::cuda_emu::detail::this_thread().block_idx)
#define blockDim (*::capserve::cuda_emu::detail::this_thread().block_dim)
#define gridDim (*::capserve::cuda_emu::detail::this_thread().grid_dim)
#define warpSize 32

inline void __syncthreads() {
  ::capserve::cuda_emu::detail::block_barrier(::capserve::cuda_emu::detail::BlockSync::plain, 0);
}
inline int __syncthreads_count(int predicate) {
  return ::capserve::cuda_emu::detail::block_barrier(::capserve::cuda_emu::detail::BlockSync::count,
                                                     predicate);
}
inline int __syncthreads_and(int predicate) {
  return ::capserve::cuda_emu::detail::block_barrier(::capserve::cuda_emu::detail::BlockSync::all, predicate);
}
inline int __syncthreads_or(int predicate) {
  return ::capserve::cuda_emu::detail::block_barrier(::capserve::cuda_emu::detail::BlockSync::any, predicate);
}
// One host thread runs every emulated thread: memory is always coherent.
inline void __threadfence() {}
inline void __threadfence_block() {}
[[noreturn]] inline void __trap() {
  ::capserve::cuda_emu::detail::trap("__trap()");
}

inline void __syncwarp(unsigned mask = 0xFFFFFFFFU) {
  ::capserve::cuda_emu::detail::warp_collective(::capserve::cuda_emu::detail::Collective::syncwarp, mask, 0,
                                                0, 32);
}
inline unsigned __activemask() {
  return ::capserve::cuda_emu::detail::active_mask();
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
  namespace d = ::capserve::cuda_emu::detail;
  return d::from_bits<T>(d::warp_collective(d::Collective::shfl_idx, mask, d::to_bits(var), src_lane, width));
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  namespace d = ::capserve::cuda_emu::detail;
  return d::from_bits<T>(
      d::warp_collective(d::Collective::shfl_up, mask, d::to_bits(var), static_cast<int>(delta), width));
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
  namespace d = ::capserve::cuda_emu::detail;
  return d::from_bits<T>(
      d::warp_collective(d::Collective::shfl_down, mask, d::to_bits(var), static_cast<int>(delta), width));
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
  namespace d = ::capserve::cuda_emu::detail;
  return d::from_bits<T>(
      d::warp_collective(d::Collective::shfl_xor, mask, d::to_bits(var), lane_mask, width));
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  namespace d = ::capserve::cuda_emu::detail;
  return static_cast<unsigned>(
      d::warp_collective(d::Collective::ballot, mask, predicate != 0 ? 1 : 0, 0, 32));
}
inline int __all_sync(unsigned mask, int predicate) {
  namespace d = ::capserve::cuda_emu::detail;
  return static_cast<int>(d::warp_collective(d::Collective::all, mask, predicate != 0 ? 1 : 0, 0, 32));
}
inline int __any_sync(unsigned mask, int predicate) {
  namespace d = ::capserve::cuda_emu::detail;
  return static_cast<int>(d::warp_collective(d::Collective::any, mask, predicate != 0 ? 1 : 0, 0, 32));
}

// Atomics: std::atomic_ref with relaxed order, as CUDA's atomics are relaxed. Threads never overlap, so a
// plain read-modify-write would do; but under ThreadSanitizer (README.md, "The GPU path") only real atomic
// operations are known not to race with each other. The old value is returned.
template <class T>
T atomicAdd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value, std::memory_order_relaxed);
}
template <class T>
T atomicSub(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_sub(value, std::memory_order_relaxed);
}
template <class T>
T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value, std::memory_order_relaxed);
  return compare;  // the value found
}
template <class T>
T atomicMax(T* address, T value) {
  std::atomic_ref<T> a(*address);
  T old = a.load(std::memory_order_relaxed);
  while (old < value && !a.compare_exchange_weak(old, value, std::memory_order_relaxed)) {
  }
  return old;
}
template <class T>
T atomicMin(T* address, T value) {
  std::atomic_ref<T> a(*address);
  T old = a.load(std::memory_order_relaxed);
  while (value < old && !a.compare_exchange_weak(old, value, std::memory_order_relaxed)) {
  }
  return old;
}
template <class T>
T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value, std::memory_order_relaxed);
}
template <class T>
T atomicOr(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_or(value, std::memory_order_relaxed);
}
template <class T>
T atomicAnd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_and(value, std::memory_order_relaxed);
}

template <class T>
T __ldg(const T* p) {
  return *p;
}

// Integer and float min/max as CUDA overloads them for device code.
inline int max(int a, int b) {
  return a > b ? a : b;
}
inline int min(int a, int b) {
  return a < b ? a : b;
}
inline unsigned max(unsigned a, unsigned b) {
  return a > b ? a : b;
}
inline unsigned min(unsigned a, unsigned b) {
  return a < b ? a : b;
}
inline long max(long a, long b) {
  return a > b ? a : b;
}
inline long min(long a, long b) {
  return a < b ? a : b;
}
inline long long max(long long a, long long b) {
  return a > b ? a : b;
}
inline long long min(long long a, long long b) {
  return a < b ? a : b;
}
inline unsigned long max(unsigned long a, unsigned long b) {
  return a > b ? a : b;
}
inline unsigned long min(unsigned long a, unsigned long b) {
  return a < b ? a : b;
}
inline unsigned long long max(unsigned long long a, unsigned long long b) {
  return a > b ? a : b;
}
inline unsigned long long min(unsigned long long a, unsigned long long b) {
  return a < b ? a : b;
}
inline float max(float a, float b) {
  return std::fmax(a, b);
}
inline float min(float a, float b) {
  return std::fmin(a, b);
}
inline double max(double a, double b) {
  return std::fmax(a, b);
}
inline double min(double a, double b) {
  return std::fmin(a, b);
}

inline float rsqrtf(float x) {
  return 1.0F / std::sqrt(x);
}
inline double rsqrt(double x) {
  return 1.0 / std::sqrt(x);
}
inline float __expf(float x) {
  return std::exp2(x * 1.44269504088896340736F);
}
inline float __logf(float x) {
  return std::log2(x) * 0.693147180559945309417F;
}
inline float __fdividef(float x, float y) {
  return x * (1.0F / y);
}
inline float __frcp_rn(float x) {
  return 1.0F / x;
}
inline float __fsqrt_rn(float x) {
  return std::sqrt(x);
}
inline float __frsqrt_rn(float x) {
  return 1.0F / std::sqrt(x);
}
inline float __saturatef(float x) {
  return x < 0.0F ? 0.0F : (x > 1.0F ? 1.0F : x);
}

inline unsigned __float_as_uint(float f) {
  return std::bit_cast<unsigned>(f);
}
inline float __uint_as_float(unsigned u) {
  return std::bit_cast<float>(u);
}
inline int __float_as_int(float f) {
  return std::bit_cast<int>(f);
}
inline float __int_as_float(int i) {
  return std::bit_cast<float>(i);
}
inline int __popc(unsigned x) {
  return std::popcount(x);
}
inline int __popcll(unsigned long long x) {
  return std::popcount(x);
}
inline int __clz(int x) {
  return std::countl_zero(static_cast<unsigned>(x));
}
inline int __clzll(long long x) {
  return std::countl_zero(static_cast<unsigned long long>(x));
}
inline int __ffs(int x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned>(x)) + 1;
}
inline int __ffsll(long long x) {
  return x == 0 ? 0 : std::countr_zero(static_cast<unsigned long long>(x)) + 1;
}

// `extern __shared__ T name[]` has no host spelling; emulated kernels that need dynamic shared memory get it
// through CAPSERVE_DYNAMIC_SHARED (kernels/cuda/launch.h).
template <class T>
T* capserve_dynamic_shared() {
  return static_cast<T*>(::capserve::cuda_emu::detail::dynamic_shared_memory());
}

// The warp matrix functions, over the built-ins above.
#include "wmma_emu.h"
