#include "kernels/cuda/linear.h"

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/gemm.h"
#include "kernels/cuda/grid_stride.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/wmma.h"

namespace capserve::kernels::cuda {
namespace {

template <typename T>
__global__ void narrow_kernel(const float* x, std::int64_t n, T* out) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    narrow(x[i], out + i);
}

template <typename T>
__global__ void split_kernel(const float* x, std::int64_t n, T* hi, T* lo) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    narrow(x[i], hi + i);
    narrow(x[i] - widen(hi, i), lo + i);
  }
}

// The FP8 GEMM's tiles: a block of 4 warps computes y[32 rows, 64 outputs], walking k 64 at a time; warp
// (wm, wn) the 16 x 32 corner (wm, wn) as two 16x16x16 WMMA accumulators. Each step stages x rounded to bf16
// and the weight dequantized to bf16 in shared memory, so that only the FP8 bytes (and a scale per block)
// come from device memory: half the bytes of a bf16 weight, which is what a memory-bound decode reads.
constexpr int kFp8Threads = 128;
constexpr int kFp8Rows = 32;             // rows of x and y per block
constexpr int kFp8Outs = 64;             // outputs (weight rows) per block
constexpr int kFp8Depth = 64;            // k per step
constexpr int kFp8Ld = kFp8Depth + 8;    // bf16 per staged row: 8 more for fewer bank conflicts (144 bytes)
constexpr int kFp8OutLd = kFp8Outs + 4;  // f32 per row of the staged result
constexpr int kWmma = 16;
constexpr std::size_t kFp8XBytes = std::size_t{kFp8Rows} * kFp8Ld * 2;
constexpr std::size_t kFp8WBytes = std::size_t{kFp8Outs} * kFp8Ld * 2;
constexpr std::size_t kFp8YBytes = std::size_t{kFp8Rows} * kFp8OutLd * 4;
static_assert(kFp8XBytes % 128 == 0 && kFp8WBytes % 128 == 0, "each staged tile starts 128-byte aligned");

using FragA = wmma::fragment<wmma::matrix_a, kWmma, kWmma, kWmma, __nv_bfloat16, wmma::row_major>;
using FragBCol = wmma::fragment<wmma::matrix_b, kWmma, kWmma, kWmma, __nv_bfloat16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, kWmma, kWmma, kWmma, float>;

// Shared memory of one block, as bytes (a __shared__ variable may not have a constructor): x, w, then y.
struct alignas(128) Fp8Tiles {
  unsigned char bytes[kFp8XBytes + kFp8WBytes + kFp8YBytes];
};

// Four bytes (4-aligned) and four floats (16-aligned) from global memory in one load each.
__device__ inline std::uint32_t load_four(const std::uint8_t* p) {
#if defined(__CUDACC__)
  return *reinterpret_cast<const std::uint32_t*>(p);
#else
  std::uint32_t v = 0;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

__device__ inline float4 load_four(const float* p) {
#if defined(__CUDACC__)
  return *reinterpret_cast<const float4*>(p);
#else
  float4 v;
  std::memcpy(&v, p, sizeof v);
  return v;
#endif
}

// Stages one step's tiles: x [kFp8Rows, kFp8Depth] from column k0 rounded to bf16 (as the bf16 path's
// narrow_to), and w [kFp8Outs, kFp8Depth] dequantized to bf16 (the f32 product of the byte's value and its
// block's scale, rounded to nearest even: the checkpoint's dequantization); zeros past m, n and k.
// Vectorised (kVector): each thread loads four consecutive columns at once, which needs k, the blocks' width
// and the pointers to be multiples of 4 (16 bytes for x), so that the four share a scale; otherwise one
// element at a time.
template <bool kVector>
__device__ inline void stage_fp8_step(const float* x, std::int64_t m, std::int64_t k, const std::uint8_t* w,
                                      const float* scales, int block_cols, std::int64_t n, std::int64_t row0,
                                      std::int64_t out0, std::int64_t k0, const std::int64_t* scale_row,
                                      __nv_bfloat16* xs, __nv_bfloat16* ws) {
  constexpr int kWidth = kVector ? 4 : 1;         // columns per load
  constexpr int kLanes = kFp8Depth / kWidth;      // threads across a row
  constexpr int kRowStep = kFp8Threads / kLanes;  // rows between a thread's loads
  const int t = static_cast<int>(threadIdx.x);
  const int c = t % kLanes * kWidth;
  const std::int64_t col = k0 + c;
  const bool in_k = col < k;  // all kWidth columns, as k is a multiple of kWidth
  for (int r = t / kLanes; r < kFp8Rows; r += kRowStep) {
    const std::int64_t row = row0 + r;
    const bool in = in_k && row < m;
    if constexpr (kVector) {
      const float4 v = in ? load_four(x + row * k + col) : float4{0.0F, 0.0F, 0.0F, 0.0F};
      __nv_bfloat16* dst = xs + r * kFp8Ld + c;
      dst[0] = __float2bfloat16(v.x);
      dst[1] = __float2bfloat16(v.y);
      dst[2] = __float2bfloat16(v.z);
      dst[3] = __float2bfloat16(v.w);
    } else {
      xs[r * kFp8Ld + c] = __float2bfloat16(in ? x[row * k + col] : 0.0F);
    }
  }
  const std::int64_t scale_col = col / block_cols;
  for (int r = t / kLanes; r < kFp8Outs; r += kRowStep) {
    const std::int64_t out = out0 + r;
    const bool in = in_k && out < n;
    const float scale = in ? scales[scale_row[r] + scale_col] : 0.0F;
    if constexpr (kVector) {
      const std::uint32_t four = in ? load_four(w + out * k + col) : 0U;
      for (int i = 0; i < 4; ++i)  // little-endian: column c + i is byte i
        ws[r * kFp8Ld + c + i] =
            __float2bfloat16(widen_f8_e4m3(static_cast<std::uint8_t>(four >> (8 * i))) * scale);
    } else {
      ws[r * kFp8Ld + c] = __float2bfloat16(in ? widen_f8_e4m3(w[out * k + col]) * scale : 0.0F);
    }
  }
}

// y[m, n] = bf16(x)[m, k] * bf16(w x scale)[n, k]^T with fp32 sums: the bf16 path's product on the weight the
// checkpoint's dequantization gives, so that the two paths differ only in the order of the sums. Rows and
// outputs past m and n, and k past the end, are zeros in the tiles: any m, n, k and any block shape, partial
// blocks included.
template <bool kVector>
__global__ void __launch_bounds__(kFp8Threads)
    fp8_linear_kernel(const float* x, std::int64_t m, std::int64_t k, const std::uint8_t* w,
                      const float* scales, int block_rows, int block_cols, std::int64_t scale_cols,
                      std::int64_t n, float* y) {
  __shared__ Fp8Tiles tiles;
  __shared__ std::int64_t scale_row[kFp8Outs];  // first scale of each output's block row
  auto* xs = reinterpret_cast<__nv_bfloat16*>(tiles.bytes);
  auto* ws = reinterpret_cast<__nv_bfloat16*>(tiles.bytes + kFp8XBytes);
  auto* ys = reinterpret_cast<float*>(tiles.bytes + kFp8XBytes + kFp8WBytes);
  const std::int64_t row0 = static_cast<std::int64_t>(blockIdx.y) * kFp8Rows;
  const std::int64_t out0 = static_cast<std::int64_t>(blockIdx.x) * kFp8Outs;
  const int t = static_cast<int>(threadIdx.x);
  const int warp = t / 32;
  const int wm = warp / 2;
  const int wn = warp % 2;
  if (t < kFp8Outs) scale_row[t] = (out0 + t) / block_rows * scale_cols;

  FragC acc[2];
  wmma::fill_fragment(acc[0], 0.0F);
  wmma::fill_fragment(acc[1], 0.0F);
  for (std::int64_t k0 = 0; k0 < k; k0 += kFp8Depth) {
    __syncthreads();  // the previous step's tiles are read (and scale_row written)
    stage_fp8_step<kVector>(x, m, k, w, scales, block_cols, n, row0, out0, k0, scale_row, xs, ws);
    __syncthreads();
    for (int kk = 0; kk < kFp8Depth; kk += kWmma) {
      FragA a;
      wmma::load_matrix_sync(a, xs + wm * kWmma * kFp8Ld + kk, kFp8Ld);
      for (int j = 0; j < 2; ++j) {
        FragBCol b;
        wmma::load_matrix_sync(b, ws + (wn * 2 * kWmma + j * kWmma) * kFp8Ld + kk, kFp8Ld);
        wmma::mma_sync(acc[j], a, b, acc[j]);
      }
    }
  }
  for (int j = 0; j < 2; ++j)
    wmma::store_matrix_sync(ys + wm * kWmma * kFp8OutLd + wn * 2 * kWmma + j * kWmma, acc[j], kFp8OutLd,
                            wmma::mem_row_major);
  __syncthreads();
  for (int i = t; i < kFp8Rows * kFp8Outs; i += kFp8Threads) {
    const int r = i / kFp8Outs;
    const int o = i % kFp8Outs;
    if (row0 + r < m && out0 + o < n) y[(row0 + r) * n + out0 + o] = ys[r * kFp8OutLd + o];
  }
}

void fp8_linear(const float* x, std::int64_t m, std::int64_t k, const void* w, const BlockScales& scales,
                std::int64_t n, float* y, cudaStream_t stream) {
  if (scales.empty() || scales.dtype != DType::f32 || scales.block_rows <= 0 || scales.block_cols <= 0)
    throw std::invalid_argument("cuda::Linear: an F8_E4M3 weight without f32 block scales");
  if (n == 0) return;
  const dim3 grid(static_cast<unsigned>((n + kFp8Outs - 1) / kFp8Outs),
                  static_cast<unsigned>((m + kFp8Rows - 1) / kFp8Rows));
  const bool vector = k % 4 == 0 && scales.block_cols % 4 == 0 &&
                      reinterpret_cast<std::uintptr_t>(x) % 16 == 0 &&
                      reinterpret_cast<std::uintptr_t>(w) % 4 == 0;
  launch(vector ? fp8_linear_kernel<true> : fp8_linear_kernel<false>, grid, kFp8Threads, 0, stream, x, m, k,
         static_cast<const std::uint8_t*>(w), static_cast<const float*>(scales.data),
         static_cast<int>(scales.block_rows), static_cast<int>(scales.block_cols), scales.grid_cols(k), n, y);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

template <typename B>
__global__ void add_bias_kernel(float* y, std::int64_t rows, std::int64_t n, const B* bias) {
  const std::int64_t total = rows * n;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += stride)
    y[i] += widen(bias, i % n);
}

void add_bias(float* y, std::int64_t m, std::int64_t n, const void* bias, DType dtype, cudaStream_t stream) {
  const unsigned grid = grid_stride_blocks(m * n);
  switch (dtype) {
    case DType::f32:
      launch(add_bias_kernel<float>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const float*>(bias));
      break;
    case DType::bf16:
      launch(add_bias_kernel<__nv_bfloat16>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const __nv_bfloat16*>(bias));
      break;
    case DType::f16:
      launch(add_bias_kernel<__half>, grid, kGridStrideThreads, 0, stream, y, m, n,
             static_cast<const __half*>(bias));
      break;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      throw std::invalid_argument("cuda::Linear: a bias of type " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace

Linear::Linear() {
  CAPSERVE_CUBLAS_CHECK(cublasCreate(&handle_));
}

Linear::~Linear() {
  cublasDestroy(handle_);
}

std::int64_t Linear::workspace_bytes(std::int64_t m, std::int64_t k, DType weight_dtype) {
  // f32 weights take x as it is; FP8 rounds it while staging its tiles.
  return weight_dtype == DType::f32 || weight_dtype == DType::f8_e4m3
             ? 0
             : m * k * static_cast<std::int64_t>(dtype_size(weight_dtype));
}

void Linear::run(const float* x, std::int64_t m, std::int64_t k, const void* w, DType weight_dtype,
                 const BlockScales& scales, std::int64_t n, const void* bias, DType bias_dtype, float* y,
                 void* workspace, cudaStream_t stream) {
  if (m == 0) return;
  CAPSERVE_CUBLAS_CHECK(cublasSetStream(handle_, stream));
  switch (weight_dtype) {
    case DType::f32:
      gemm_xwt(handle_, x, w, CUDA_R_32F, m, n, k, y, CUDA_R_32F);
      break;
    case DType::bf16:
      narrow_to(x, m * k, DType::bf16, workspace, stream);
      gemm_xwt(handle_, workspace, w, CUDA_R_16BF, m, n, k, y, CUDA_R_32F);
      break;
    case DType::f16:
      narrow_to(x, m * k, DType::f16, workspace, stream);
      gemm_xwt(handle_, workspace, w, CUDA_R_16F, m, n, k, y, CUDA_R_32F);
      break;
    case DType::f8_e4m3:
      fp8_linear(x, m, k, w, scales, n, y, stream);
      break;
    case DType::i32:
    case DType::i64:
    case DType::u8:
      throw std::invalid_argument("cuda::Linear: a weight of type " + std::string(dtype_name(weight_dtype)));
  }
  if (bias != nullptr) add_bias(y, m, n, bias, bias_dtype, stream);
}

void narrow_to(const float* x, std::int64_t n, DType dtype, void* out, cudaStream_t stream) {
  if (n <= 0) return;
  if (dtype == DType::bf16) {
    launch(narrow_kernel<__nv_bfloat16>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__nv_bfloat16*>(out));
  } else if (dtype == DType::f16) {
    launch(narrow_kernel<__half>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__half*>(out));
  } else {
    throw std::invalid_argument("cuda::narrow_to: to " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void split_to(const float* x, std::int64_t n, DType dtype, void* hi, void* lo, cudaStream_t stream) {
  if (n <= 0) return;
  if (dtype == DType::bf16) {
    launch(split_kernel<__nv_bfloat16>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__nv_bfloat16*>(hi), static_cast<__nv_bfloat16*>(lo));
  } else if (dtype == DType::f16) {
    launch(split_kernel<__half>, grid_stride_blocks(n), kGridStrideThreads, 0, stream, x, n,
           static_cast<__half*>(hi), static_cast<__half*>(lo));
  } else {
    throw std::invalid_argument("cuda::split_to: to " + std::string(dtype_name(dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
