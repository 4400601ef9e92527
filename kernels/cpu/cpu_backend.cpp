#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#if defined(__AVX512F__)
// GCC 12's AVX-512 headers build "undefined" vectors from themselves, which -Werror=(maybe-)uninitialized
// rejects.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>

#include "kernels/cpu/weight_convert.h"

namespace capserve::kernels::cpu {
namespace {

// Up to this many rows the weights are streamed once through a direct kernel (memory-bound decode); above it
// a dense f32 copy of the weight feeds sgemm, whose blocking wins once the widening cost is amortized over
// rows.
constexpr std::int64_t kDirectMaxRows = 32;
constexpr std::int64_t kLanes = 16;

#if defined(__AVX512F__)
template <DType D>
__m512 load16(const std::byte* p) {
  if constexpr (D == DType::f32) {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (D == DType::bf16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
}

// Fewer than four activation rows: one weight row at a time, read front to back with four accumulators in
// flight per activation row, which keeps a single sequential stream for the prefetcher (the decode case is
// memory-bound).
template <DType D, int ROWS>
void dot_rows(const float* x, std::int64_t k, const std::byte* wr, float* y, std::int64_t ldy) {
  constexpr std::int64_t kEl = dtype_size(D);
  const std::int64_t k64 = k - k % (4 * kLanes);
  __m512 acc[ROWS][4];
  for (int r = 0; r < ROWS; ++r) {
    for (int u = 0; u < 4; ++u) acc[r][u] = _mm512_setzero_ps();
  }
  for (std::int64_t i = 0; i < k64; i += 4 * kLanes) {
    for (int u = 0; u < 4; ++u) {
      const __m512 wv = load16<D>(wr + (i + u * kLanes) * kEl);
      for (int r = 0; r < ROWS; ++r)
        acc[r][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * k + i + u * kLanes), wv, acc[r][u]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float sum = _mm512_reduce_add_ps(
        _mm512_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]), _mm512_add_ps(acc[r][2], acc[r][3])));
    for (std::int64_t i = k64; i < k; ++i) sum += x[r * k + i] * load_element<D>(wr, i);
    y[r * ldy] = sum;
  }
}

// Register-blocked tile: MB activation rows x NB weight rows, MB*NB accumulators. Each weight vector is
// widened once and used MB times, each activation vector used NB times, so the loads keep pace with the FMAs.
template <DType D, int MB, int NB>
void gemm_tile(const float* x, std::int64_t k, const std::byte* w, float* y, std::int64_t ldy) {
  constexpr std::int64_t kEl = dtype_size(D);
  const std::int64_t k16 = k - k % kLanes;
  __m512 acc[MB][NB];
  for (int r = 0; r < MB; ++r) {
    for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
  }
  for (std::int64_t i = 0; i < k16; i += kLanes) {
    __m512 wv[NB];
    for (int c = 0; c < NB; ++c) wv[c] = load16<D>(w + (c * k + i) * kEl);
    for (int r = 0; r < MB; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * k + i);
      for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MB; ++r) {
    for (int c = 0; c < NB; ++c) {
      float sum = _mm512_reduce_add_ps(acc[r][c]);
      for (std::int64_t i = k16; i < k; ++i) sum += x[r * k + i] * load_element<D>(w, c * k + i);
      y[r * ldy + c] = sum;
    }
  }
}
#else
template <DType D, int MB, int NB>
void gemm_tile(const float* x, std::int64_t k, const std::byte* w, float* y, std::int64_t ldy) {
  for (int r = 0; r < MB; ++r) {
    for (int c = 0; c < NB; ++c) {
      float acc[kLanes] = {};
      const std::int64_t k16 = k - k % kLanes;
      for (std::int64_t i = 0; i < k16; i += kLanes) {
        for (std::int64_t t = 0; t < kLanes; ++t)
          acc[t] += x[r * k + i + t] * load_element<D>(w, c * k + i + t);
      }
      float sum = 0.0F;
      for (const float a : acc) sum += a;
      for (std::int64_t i = k16; i < k; ++i) sum += x[r * k + i] * load_element<D>(w, c * k + i);
      y[r * ldy + c] = sum;
    }
  }
}

template <DType D, int ROWS>
void dot_rows(const float* x, std::int64_t k, const std::byte* wr, float* y, std::int64_t ldy) {
  gemm_tile<D, ROWS, 1>(x, k, wr, y, ldy);
}
#endif

template <DType D, int NB>
void gemm_column_block(const float* x, std::int64_t m, std::int64_t k, const std::byte* w, float* y,
                       std::int64_t n) {
  std::int64_t r = 0;
  for (; r + 4 <= m; r += 4) gemm_tile<D, 4, NB>(x + r * k, k, w, y + r * n, n);
  switch (m - r) {
    case 3:
      gemm_tile<D, 3, NB>(x + r * k, k, w, y + r * n, n);
      break;
    case 2:
      gemm_tile<D, 2, NB>(x + r * k, k, w, y + r * n, n);
      break;
    case 1:
      gemm_tile<D, 1, NB>(x + r * k, k, w, y + r * n, n);
      break;
    default:
      break;
  }
}

// Streams the weights once from memory in blocks of kColBlock rows, each block against every activation row.
template <DType D>
void linear_direct(const float* x, std::int64_t m, std::int64_t k, const std::byte* w, std::int64_t n,
                   float* y) {
  const auto row_bytes = static_cast<std::size_t>(k) * dtype_size(D);
  if (m < 4) {
#pragma omp parallel for schedule(static)
    for (std::int64_t j = 0; j < n; ++j) {
      const std::byte* wr = w + static_cast<std::size_t>(j) * row_bytes;
      if (m == 1) {
        dot_rows<D, 1>(x, k, wr, y + j, n);
      } else if (m == 2) {
        dot_rows<D, 2>(x, k, wr, y + j, n);
      } else {
        dot_rows<D, 3>(x, k, wr, y + j, n);
      }
    }
    return;
  }
  constexpr std::int64_t kColBlock = 4;
  const std::int64_t blocks = n / kColBlock;
#pragma omp parallel for schedule(static)
  for (std::int64_t b = 0; b < blocks; ++b) {
    const std::int64_t j = b * kColBlock;
    gemm_column_block<D, kColBlock>(x, m, k, w + static_cast<std::size_t>(j) * row_bytes, y + j, n);
  }
  for (std::int64_t j = blocks * kColBlock; j < n; ++j) {
    gemm_column_block<D, 1>(x, m, k, w + static_cast<std::size_t>(j) * row_bytes, y + j, n);
  }
}

void sgemm_xwt(const float* x, std::int64_t m, std::int64_t k, const float* w, std::int64_t n, float* y) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, static_cast<blasint>(m), static_cast<blasint>(n),
              static_cast<blasint>(k), 1.0F, x, static_cast<blasint>(k), w, static_cast<blasint>(k), 0.0F, y,
              static_cast<blasint>(n));
}

template <DType D>
void convert_typed(const std::byte* base, std::int64_t first, std::int64_t count, float* out) {
  for (std::int64_t i = 0; i < count; ++i) out[i] = load_element<D>(base, first + i);
}

float silu(float v) {
  return v / (1.0F + std::exp(-v));
}

}  // namespace

void convert_to_f32(DType dtype, const std::byte* base, std::int64_t first, std::int64_t count, float* out) {
  switch (dtype) {
    case DType::f32:
      convert_typed<DType::f32>(base, first, count, out);
      return;
    case DType::bf16:
      convert_typed<DType::bf16>(base, first, count, out);
      return;
    case DType::f16:
      convert_typed<DType::f16>(base, first, count, out);
      return;
  }
}

CpuBackend::CpuBackend(int num_threads) : num_threads_(num_threads) {
  set_num_threads(num_threads);
}

void CpuBackend::set_num_threads(int n) {
  num_threads_ = std::max(1, n);
  omp_set_num_threads(num_threads_);
  openblas_set_num_threads(num_threads_);
}

void CpuBackend::linear(std::span<const float> x, std::int64_t m, const WeightView& w, const WeightView& bias,
                        std::span<float> y) {
  const std::int64_t k = w.cols;
  const std::int64_t n = w.rows;
  if (static_cast<std::int64_t>(x.size()) < m * k || static_cast<std::int64_t>(y.size()) < m * n) {
    throw std::invalid_argument("linear: activation buffers smaller than m x k / m x n");
  }
  if (m == 0) return;
  if (m > kDirectMaxRows) {
    const float* wf = nullptr;
    if (w.dtype == DType::f32 && reinterpret_cast<std::uintptr_t>(w.data) % alignof(float) == 0) {
      wf = reinterpret_cast<const float*>(w.data);
    } else {
      widened_weight_.resize(static_cast<std::size_t>(n * k));
      float* dst = widened_weight_.data();
#pragma omp parallel for schedule(static)
      for (std::int64_t j = 0; j < n; ++j) convert_to_f32(w.dtype, w.data, j * k, k, dst + j * k);
      wf = dst;
    }
    sgemm_xwt(x.data(), m, k, wf, n, y.data());
  } else {
    switch (w.dtype) {
      case DType::f32:
        linear_direct<DType::f32>(x.data(), m, k, w.data, n, y.data());
        break;
      case DType::bf16:
        linear_direct<DType::bf16>(x.data(), m, k, w.data, n, y.data());
        break;
      case DType::f16:
        linear_direct<DType::f16>(x.data(), m, k, w.data, n, y.data());
        break;
    }
  }
  if (!bias.empty()) {
    bias_.resize(static_cast<std::size_t>(n));
    convert_to_f32(bias.dtype, bias.data, 0, n, bias_.data());
    for (std::int64_t r = 0; r < m; ++r) {
      float* yr = y.data() + r * n;
      for (std::int64_t j = 0; j < n; ++j) yr[j] += bias_[static_cast<std::size_t>(j)];
    }
  }
}

void CpuBackend::embedding(std::span<const std::int32_t> ids, const WeightView& table, std::span<float> out) {
  const std::int64_t cols = table.cols;
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t id = ids[i];
    if (id < 0 || id >= table.rows) throw std::out_of_range("embedding: token id out of range");
    convert_to_f32(table.dtype, table.data, id * cols, cols,
                   out.data() + static_cast<std::int64_t>(i) * cols);
  }
}

void CpuBackend::rms_norm(std::span<const float> x, std::int64_t cols, const WeightView& weight, float eps,
                          std::span<float> out) {
  norm_weight_.resize(static_cast<std::size_t>(cols));
  convert_to_f32(weight.dtype, weight.data, 0, cols, norm_weight_.data());
  const float* g = norm_weight_.data();
  const auto rows = static_cast<std::int64_t>(x.size()) / cols;
#pragma omp parallel for schedule(static) if (rows > 64)
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x.data() + r * cols;
    float* yr = out.data() + r * cols;
    float ss = 0.0F;
    for (std::int64_t i = 0; i < cols; ++i) ss += xr[i] * xr[i];
    const float inv = 1.0F / std::sqrt(ss / static_cast<float>(cols) + eps);
    for (std::int64_t i = 0; i < cols; ++i) yr[i] = g[i] * (xr[i] * inv);
  }
}

void CpuBackend::rope(std::span<float> x, std::int64_t heads, std::int64_t head_dim,
                      std::span<const float> cos, std::span<const float> sin) {
  const std::int64_t half = head_dim / 2;
  const auto tokens = static_cast<std::int64_t>(x.size()) / (heads * head_dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* c = cos.data() + t * half;
    const float* s = sin.data() + t * half;
    for (std::int64_t h = 0; h < heads; ++h) {
      float* v = x.data() + (t * heads + h) * head_dim;
      for (std::int64_t i = 0; i < half; ++i) {
        const float a = v[i];
        const float b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
      }
    }
  }
}

namespace {

std::int64_t cache_row(const PagedKvLayer& cache, std::span<const std::int32_t> block_table,
                       std::int64_t pos) {
  const std::int64_t block = block_table[static_cast<std::size_t>(pos / cache.block_size)];
  return block * cache.block_size + pos % cache.block_size;
}

}  // namespace

void CpuBackend::kv_store(std::span<const SequenceSlice> seqs, std::span<const float> k,
                          std::span<const float> v, const PagedKvLayer& cache) {
  const std::int64_t width = cache.num_kv_heads * cache.head_dim;
  for (const SequenceSlice& s : seqs) {
    for (std::int64_t i = 0; i < s.num_tokens; ++i) {
      const std::int64_t dst = cache_row(cache, s.block_table, s.start_pos + i) * width;
      const std::int64_t src = (s.first_row + i) * width;
      std::memcpy(cache.k.data() + dst, k.data() + src, static_cast<std::size_t>(width) * sizeof(float));
      std::memcpy(cache.v.data() + dst, v.data() + src, static_cast<std::size_t>(width) * sizeof(float));
    }
  }
}

void CpuBackend::paged_attention(std::span<const SequenceSlice> seqs, std::span<const float> q,
                                 const PagedKvLayer& cache, const AttentionParams& params,
                                 std::span<float> out) {
  const std::int64_t d = cache.head_dim;
  const std::int64_t heads = params.num_heads;
  const std::int64_t group = heads / cache.num_kv_heads;
  const std::int64_t kv_width = cache.num_kv_heads * d;
  const auto num_seqs = static_cast<std::int64_t>(seqs.size());
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<std::int64_t> rows;
#pragma omp for collapse(2) schedule(dynamic)
    for (std::int64_t si = 0; si < num_seqs; ++si) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const SequenceSlice& s = seqs[static_cast<std::size_t>(si)];
        const std::int64_t kv_off = (h / group) * d;
        const std::int64_t context = s.start_pos + s.num_tokens;
        rows.resize(static_cast<std::size_t>(context));
        for (std::int64_t p = 0; p < context; ++p)
          rows[static_cast<std::size_t>(p)] = cache_row(cache, s.block_table, p);
        scores.resize(static_cast<std::size_t>(context));
        for (std::int64_t i = 0; i < s.num_tokens; ++i) {
          const std::int64_t pos = s.start_pos + i;
          const std::int64_t lo =
              params.sliding_window > 0 ? std::max<std::int64_t>(0, pos - params.sliding_window + 1) : 0;
          const float* qv = q.data() + ((s.first_row + i) * heads + h) * d;
          float mx = -std::numeric_limits<float>::infinity();
          for (std::int64_t p = lo; p <= pos; ++p) {
            const float* kv = cache.k.data() + rows[static_cast<std::size_t>(p)] * kv_width + kv_off;
            float dot = 0.0F;
            for (std::int64_t e = 0; e < d; ++e) dot += qv[e] * kv[e];
            dot *= params.scale;
            scores[static_cast<std::size_t>(p)] = dot;
            mx = std::max(mx, dot);
          }
          float sum = 0.0F;
          for (std::int64_t p = lo; p <= pos; ++p) {
            const float e = std::exp(scores[static_cast<std::size_t>(p)] - mx);
            scores[static_cast<std::size_t>(p)] = e;
            sum += e;
          }
          const float inv = 1.0F / sum;
          float* o = out.data() + ((s.first_row + i) * heads + h) * d;
          std::fill(o, o + d, 0.0F);
          for (std::int64_t p = lo; p <= pos; ++p) {
            const float w = scores[static_cast<std::size_t>(p)] * inv;
            const float* vv = cache.v.data() + rows[static_cast<std::size_t>(p)] * kv_width + kv_off;
            for (std::int64_t e = 0; e < d; ++e) o[e] += w * vv[e];
          }
        }
      }
    }
  }
}

void CpuBackend::grouped_expert_ffn(std::span<const float> x, std::span<const std::int64_t> offsets,
                                    std::span<const ExpertWeights> experts, std::span<float> out) {
  if (experts.empty()) return;
  const std::int64_t hidden = experts.front().gate.cols;
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    const std::int64_t first = offsets[e];
    const std::int64_t n = offsets[e + 1] - first;
    if (n == 0) continue;
    const ExpertWeights& w = experts[e];
    const std::int64_t ffn = w.gate.rows;
    gate_.resize(static_cast<std::size_t>(n * ffn));
    up_.resize(static_cast<std::size_t>(n * ffn));
    const std::span<const float> xe = x.subspan(static_cast<std::size_t>(first * hidden));
    linear(xe, n, w.gate, {}, gate_);
    linear(xe, n, w.up, {}, up_);
    for (std::size_t i = 0; i < static_cast<std::size_t>(n * ffn); ++i) gate_[i] = silu(gate_[i]) * up_[i];
    linear(gate_, n, w.down, {}, out.subspan(static_cast<std::size_t>(first * hidden)));
  }
}

}  // namespace capserve::kernels::cpu
