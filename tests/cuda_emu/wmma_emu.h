#pragma once
// CUDA emulation of the warp matrix functions (nvcuda::wmma, <mma.h>) for the 16x16x16 bf16 and f16 shapes
// with fp32 accumulators, which the tensor-core kernels use.
//
// On a GPU a fragment is spread over the warp's 32 lanes in a layout the API keeps opaque. Here every lane
// holds the whole tile (row-major, logical element (i, j) at x[i * cols + j]) and computes the whole product
// itself, so that no lane needs another's data: the results equal a warp's, and code that uses x[] only for
// element-wise operations on every element (as the API requires, since the mapping is unspecified) behaves
// the same. A load ends by waiting for the warp, as the device's lanes load together before any of them goes
// on to store (a tile loaded, updated and stored back is read by every lane first). Nothing orders a lane's
// plain stores before another lane's load: that needs a __syncwarp, as on the device, and without it the
// emulation gives a wrong result (each lane stores the whole tile when it runs).
//
// Products are exact in fp32 (bf16 x bf16 fits a float) and summed in k order: a tensor core may add in
// another order, so sums may differ from a GPU's in the last bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstddef>
#include <type_traits>

namespace nvcuda::wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "the emulation has the 16x16x16 shape");
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  static constexpr int num_elements = rows * cols;
  std::array<T, num_elements> x{};
};

namespace detail {

inline float widen(float v) {
  return v;
}
inline float widen(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
inline float widen(__half v) {
  return __half2float(v);
}

// Element (i, j) of a tile stored with leading dimension ldm.
template <class T>
T at(const T* p, int i, int j, unsigned ldm, bool row_major_memory) {
  return row_major_memory ? p[static_cast<std::size_t>(i) * ldm + static_cast<std::size_t>(j)]
                          : p[static_cast<std::size_t>(j) * ldm + static_cast<std::size_t>(i)];
}

}  // namespace detail

template <class Use, int M, int N, int K, class T, class Layout>
void fill_fragment(fragment<Use, M, N, K, T, Layout>& f, T value) {
  f.x.fill(value);
}

// matrix_a and matrix_b: the memory layout is the fragment's.
template <class Use, int M, int N, int K, class T, class Layout>
requires(!std::is_same_v<Use, accumulator>) void load_matrix_sync(fragment<Use, M, N, K, T, Layout>& f,
                                                                  const T* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, Layout>;
  for (int i = 0; i < F::rows; ++i)
    for (int j = 0; j < F::cols; ++j)
      f.x[static_cast<std::size_t>(i * F::cols + j)] =
          detail::at(p, i, j, ldm, std::is_same_v<Layout, row_major>);
  __syncwarp();
}

template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm,
                      layout_t layout) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j)
      f.x[static_cast<std::size_t>(i * N + j)] = detail::at(p, i, j, ldm, layout == mem_row_major);
  __syncwarp();
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm,
                       layout_t layout) {
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float& dst = layout == mem_row_major
                       ? p[static_cast<std::size_t>(i) * ldm + static_cast<std::size_t>(j)]
                       : p[static_cast<std::size_t>(j) * ldm + static_cast<std::size_t>(i)];
      dst = f.x[static_cast<std::size_t>(i * N + j)];
    }
  }
}

// d = a * b + c; d may be c.
template <int M, int N, int K, class T, class LayoutA, class LayoutB>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, LayoutA>& a,
              const fragment<matrix_b, M, N, K, T, LayoutB>& b,
              const fragment<accumulator, M, N, K, float>& c) {
  std::array<float, static_cast<std::size_t>(M * N)> out{};
  for (int i = 0; i < M; ++i) {
    for (int j = 0; j < N; ++j) {
      float sum = c.x[static_cast<std::size_t>(i * N + j)];
      for (int k = 0; k < K; ++k)
        sum += detail::widen(a.x[static_cast<std::size_t>(i * K + k)]) *
               detail::widen(b.x[static_cast<std::size_t>(k * N + j)]);
      out[static_cast<std::size_t>(i * N + j)] = sum;
    }
  }
  d.x = out;
}

}  // namespace nvcuda::wmma
