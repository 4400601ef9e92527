#include "kernels/cpu/cpu_backend.h"

#include <cblas.h>
#include <omp.h>

#if defined(__AVX512F__)
// GCC 12's AVX-512 headers build "undefined" vectors from themselves, which -Werror=(maybe-)uninitialized
// rejects (clang has neither the problem nor the second warning).
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <string>

#include "kernels/cpu/weight_convert.h"

namespace capserve::kernels::cpu {
namespace {

// Up to this many rows the weights are streamed once through a direct kernel (memory-bound decode); above it
// a dense f32 copy of the weight feeds sgemm, whose blocking wins once the widening cost is amortized over
// rows.
constexpr std::int64_t kDirectMaxRows = 32;
constexpr std::int64_t kLanes = 16;
// Host buffers start on a cache line (and an AVX-512 vector).
constexpr std::size_t kHostAlignment = 64;

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

// c[m, n] = a[m, k] * b (b[k, n], or b[n, k] transposed), row-major with leading dimensions.
void sgemm(bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, const float* a, std::int64_t lda,
           const float* b, std::int64_t ldb, float* c, std::int64_t ldc) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans, static_cast<blasint>(m),
              static_cast<blasint>(n), static_cast<blasint>(k), 1.0F, a, static_cast<blasint>(lda), b,
              static_cast<blasint>(ldb), 0.0F, c, static_cast<blasint>(ldc));
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
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      break;
  }
  throw std::invalid_argument("convert_to_f32: " + std::string(dtype_name(dtype)) + " is not a weight type");
}

namespace {

// The weight as float32 for sgemm: the mapped data itself when it already is aligned f32, else a widened copy
// in `scratch`.
const float* widen(const WeightView& w, std::vector<float>& scratch) {
  if (w.dtype == DType::f32 && reinterpret_cast<std::uintptr_t>(w.data) % alignof(float) == 0)
    return reinterpret_cast<const float*>(w.data);
  const std::int64_t k = w.cols;
  scratch.resize(static_cast<std::size_t>(w.numel()));
  float* dst = scratch.data();
#pragma omp parallel for schedule(static)
  for (std::int64_t j = 0; j < w.rows; ++j) convert_to_f32(w.dtype, w.data, j * k, k, dst + j * k);
  return dst;
}

}  // namespace

CpuBackend::CpuBackend(int num_threads) : num_threads_(num_threads) {
  set_num_threads(num_threads);
}

void CpuBackend::check_kv_dtype(DType dtype) const {
  if (dtype != DType::f32)
    throw std::invalid_argument("CpuBackend: the CPU keeps its KV cache in f32, not " +
                                std::string(dtype_name(dtype)) + " (--kv-cache-dtype f32)");
}

void CpuBackend::set_num_threads(int n) {
  num_threads_ = std::max(1, n);
  omp_set_num_threads(num_threads_);
  openblas_set_num_threads(num_threads_);
}

namespace {

// A weight tensor as the host view the kernels read; an empty tensor gives an empty view.
WeightView host_weight(const Tensor& w) {
  if (w.dims() == 0) return {};
  if (!is_float(w.dtype())) {
    throw std::invalid_argument("CpuBackend: a weight of type " + std::string(dtype_name(w.dtype())));
  }
  return {w.dtype(), static_cast<const std::byte*>(w.host_data()), w.dim(0), w.row_numel()};
}

}  // namespace

Tensor CpuBackend::upload(const WeightView& host, Buffer& /*storage*/) {
  if (!host.scales.empty())
    throw std::invalid_argument(
        "CpuBackend::upload: a block-quantized FP8 weight (this backend takes them "
        "dequantized: keeps_fp8 is false)");
  return weight_tensor(host);
}

void CpuBackend::linear(const Tensor& xt, const Tensor& wt, const Tensor& biast, const Tensor& yt) {
  const WeightView w = host_weight(wt);
  const WeightView bias = host_weight(biast);
  const std::int64_t k = w.cols;
  const std::int64_t n = w.rows;
  const std::int64_t m = xt.dims() == 0 ? 0 : xt.dim(0);
  if (xt.numel() != m * k || yt.numel() != m * n) {
    throw std::invalid_argument("linear: x " + xt.shape_text() + " and y " + yt.shape_text() + " for a [" +
                                std::to_string(n) + ", " + std::to_string(k) + "] weight");
  }
  const std::span<const float> x = xt.host_span<const float>();
  const std::span<float> y = yt.host_span<float>();
  if (m == 0) return;
  if (m > kDirectMaxRows) {
    sgemm(true, m, n, k, x.data(), k, widen(w, widened_weight_), k, y.data(), n);
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
      case DType::i32:
      case DType::i64:
      case DType::u8:
      case DType::f8_e4m3:
        throw std::invalid_argument("linear: " + std::string(dtype_name(w.dtype)) + " is not a weight type");
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

void CpuBackend::embedding(const Tensor& idst, const Tensor& tablet, const Tensor& outt) {
  const WeightView table = host_weight(tablet);
  const std::int64_t cols = table.cols;
  const std::span<const std::int32_t> ids = idst.host_span<const std::int32_t>();
  const std::span<float> out = outt.host_span<float>();
  if (outt.numel() != static_cast<std::int64_t>(ids.size()) * cols)
    throw std::invalid_argument("embedding: out " + outt.shape_text() + " for " + std::to_string(ids.size()) +
                                " ids of width " + std::to_string(cols));
  for (std::size_t i = 0; i < ids.size(); ++i) {
    const std::int64_t id = ids[i];
    if (id < 0 || id >= table.rows) throw std::out_of_range("embedding: token id out of range");
    convert_to_f32(table.dtype, table.data, id * cols, cols,
                   out.data() + static_cast<std::int64_t>(i) * cols);
  }
}

void CpuBackend::rms_norm(const Tensor& xt, const Tensor& weightt, float eps, const Tensor& outt) {
  const WeightView weight = host_weight(weightt);
  const std::int64_t cols = xt.row_numel();
  if (weight.numel() != cols || outt.numel() != xt.numel())
    throw std::invalid_argument("rms_norm: x " + xt.shape_text() + ", out " + outt.shape_text() +
                                ", weight of " + std::to_string(weight.numel()));
  const std::span<const float> x = xt.host_span<const float>();
  const std::span<float> out = outt.host_span<float>();
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

void CpuBackend::rope(const Tensor& xt, const RotaryLayout& layout, const Tensor& cost, const Tensor& sint) {
  const std::span<float> x = xt.host_span<float>();
  const std::span<const float> cos = cost.host_span<const float>();
  const std::span<const float> sin = sint.host_span<const float>();
  const std::int64_t half = layout.dim / 2;
  const auto tokens = static_cast<std::int64_t>(x.size()) / (layout.heads * layout.head_dim);
  for (std::int64_t t = 0; t < tokens; ++t) {
    const float* c = cos.data() + t * half;
    const float* s = sin.data() + t * half;
    for (std::int64_t h = 0; h < layout.heads; ++h) {
      float* v = x.data() + (t * layout.heads + h) * layout.head_dim + layout.offset;
      // Pair i, turned by the angle of frequency i: elements i and i + half, or 2i and 2i + 1.
      const std::int64_t stride = layout.interleaved ? 2 : 1;
      const std::int64_t partner = layout.interleaved ? 1 : half;
      for (std::int64_t i = 0; i < half; ++i) {
        float* pa = v + i * stride;
        float* pb = pa + partner;
        const float a = *pa;
        const float b = *pb;
        *pa = a * c[i] - b * s[i];
        *pb = b * c[i] + a * s[i];
      }
    }
  }
}

namespace {

// The cache slot of position `pos`, given the sequence's block table.
std::int64_t cache_row(std::int64_t block_size, std::span<const std::int32_t> block_table, std::int64_t pos) {
  const std::int64_t block = block_table[static_cast<std::size_t>(pos / block_size)];
  return block * block_size + pos % block_size;
}

// Softmax in place over scores[lo..hi] (inclusive).
void softmax_range(float* scores, std::int64_t lo, std::int64_t hi) {
  float mx = -std::numeric_limits<float>::infinity();
  for (std::int64_t p = lo; p <= hi; ++p) mx = std::max(mx, scores[p]);
  float sum = 0.0F;
  for (std::int64_t p = lo; p <= hi; ++p) {
    scores[p] = std::exp(scores[p] - mx);
    sum += scores[p];
  }
  const float inv = 1.0F / sum;
  for (std::int64_t p = lo; p <= hi; ++p) scores[p] *= inv;
}

float dot(const float* a, const float* b, std::int64_t n) {
  float acc = 0.0F;
  // Lets the compiler split the sum over vector lanes (a float reduction is otherwise kept in order).
#pragma omp simd reduction(+ : acc)
  for (std::int64_t e = 0; e < n; ++e) acc += a[e] * b[e];
  return acc;
}

}  // namespace

void CpuBackend::kv_store(std::span<const SequenceSlice> seqs, const Tensor& kt, const Tensor& vt,
                          const PagedKvLayer& cache) {
  const std::int64_t width = cache.num_kv_heads * cache.head_dim;
  const std::span<const float> k = kt.host_span<const float>();
  const std::span<const float> v = vt.host_span<const float>();
  check_kv_dtype(cache.k.dtype());
  float* const cache_k = cache.k.host_span<float>().data();
  float* const cache_v = cache.v.host_span<float>().data();
  for (const SequenceSlice& s : seqs) {
    for (std::int64_t i = 0; i < s.num_tokens; ++i) {
      const std::int64_t dst = cache_row(cache.block_size, s.block_table, s.start_pos + i) * width;
      const std::int64_t src = (s.first_row + i) * width;
      std::memcpy(cache_k + dst, k.data() + src, static_cast<std::size_t>(width) * sizeof(float));
      std::memcpy(cache_v + dst, v.data() + src, static_cast<std::size_t>(width) * sizeof(float));
    }
  }
}

void CpuBackend::paged_attention(std::span<const SequenceSlice> seqs, const Tensor& qt,
                                 const PagedKvLayer& cache, const AttentionParams& params,
                                 const Tensor& outt) {
  const std::span<const float> q = qt.host_span<const float>();
  const std::span<float> out = outt.host_span<float>();
  const float* const cache_k = cache.k.host_span<const float>().data();
  const float* const cache_v = cache.v.host_span<const float>().data();
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
          rows[static_cast<std::size_t>(p)] = cache_row(cache.block_size, s.block_table, p);
        scores.resize(static_cast<std::size_t>(context));
        for (std::int64_t i = 0; i < s.num_tokens; ++i) {
          const std::int64_t pos = s.start_pos + i;
          const std::int64_t lo =
              params.sliding_window > 0 ? std::max<std::int64_t>(0, pos - params.sliding_window + 1) : 0;
          const float* qv = q.data() + ((s.first_row + i) * heads + h) * d;
          for (std::int64_t p = lo; p <= pos; ++p) {
            const float* kv = cache_k + rows[static_cast<std::size_t>(p)] * kv_width + kv_off;
            scores[static_cast<std::size_t>(p)] = dot(qv, kv, d) * params.scale;
          }
          softmax_range(scores.data(), lo, pos);
          float* o = out.data() + ((s.first_row + i) * heads + h) * d;
          std::fill(o, o + d, 0.0F);
          for (std::int64_t p = lo; p <= pos; ++p) {
            const float w = scores[static_cast<std::size_t>(p)];
            const float* vv = cache_v + rows[static_cast<std::size_t>(p)] * kv_width + kv_off;
            for (std::int64_t e = 0; e < d; ++e) o[e] += w * vv[e];
          }
        }
      }
    }
  }
}

void CpuBackend::latent_store(std::span<const SequenceSlice> seqs, const Tensor& latentt,
                              const Tensor& rope_keyt, const PagedLatentLayer& cache) {
  check_kv_dtype(cache.rows.dtype());
  const std::span<const float> latent = latentt.host_span<const float>();
  const std::span<const float> rope_key = rope_keyt.host_span<const float>();
  float* const cache_rows = cache.rows.host_span<float>().data();
  const std::int64_t r = cache.kv_lora_rank;
  const std::int64_t dr = cache.rope_dim;
  for (const SequenceSlice& s : seqs) {
    for (std::int64_t i = 0; i < s.num_tokens; ++i) {
      float* dst = cache_rows + cache_row(cache.block_size, s.block_table, s.start_pos + i) * (r + dr);
      const std::int64_t row = s.first_row + i;
      std::memcpy(dst, latent.data() + row * r, static_cast<std::size_t>(r) * sizeof(float));
      std::memcpy(dst + r, rope_key.data() + row * dr, static_cast<std::size_t>(dr) * sizeof(float));
    }
  }
}

namespace {

// Multiply-adds per head of each form for n new tokens over a context of L, counting every (query, key)
// pair (the causal mask halves both forms alike). Absorbed: fold W_uk into the queries (n dn r), scores on
// latent + rope key (n L (r + dr)), weighted latent sum (n L r), W_uv after (n r dv). Expanded: keys and
// values of the whole context (L r (dn + dv)), then attention at head size (n L (dn + dr + dv)).
bool absorbed_is_cheaper(std::int64_t n, std::int64_t context, std::int64_t r,
                         const LatentAttentionParams& p) {
  const std::int64_t dn = p.qk_nope_head_dim;
  const std::int64_t dr = p.qk_rope_head_dim;
  const std::int64_t dv = p.v_head_dim;
  const std::int64_t absorbed = n * r * (dn + dv) + n * context * (2 * r + dr);
  const std::int64_t expanded = context * r * (dn + dv) + n * context * (dn + dr + dv);
  return absorbed <= expanded;
}

}  // namespace

void CpuBackend::latent_attention(std::span<const SequenceSlice> seqs, const Tensor& qt,
                                  const PagedLatentLayer& cache, const Tensor& kv_bt,
                                  const LatentAttentionParams& params, const Tensor& outt) {
  const WeightView kv_b = host_weight(kv_bt);
  const std::span<const float> q = qt.host_span<const float>();
  const std::span<float> out = outt.host_span<float>();
  const float* const cache_rows = cache.rows.host_span<const float>().data();
  const std::int64_t heads = params.num_heads;
  const std::int64_t dn = params.qk_nope_head_dim;
  const std::int64_t dr = params.qk_rope_head_dim;
  const std::int64_t dv = params.v_head_dim;
  const std::int64_t qk = dn + dr;
  const std::int64_t r = cache.kv_lora_rank;
  const std::int64_t row_width = r + dr;
  const std::int64_t kv_width = heads * (dn + dv);  // one context token's expanded keys and values
  const auto num_seqs = static_cast<std::int64_t>(seqs.size());
  if (num_seqs == 0) return;  // an idle rank's step: nothing to widen kv_b for
  const float* wkv = widen(kv_b, widened_weight_);
  // Head h: W_uk = wkv rows [h (dn + dv), + dn), W_uv = the dv rows after it; both [., r].
  const auto w_uk = [&](std::int64_t h) { return wkv + h * (dn + dv) * r; };
  const auto w_uv = [&](std::int64_t h) { return wkv + (h * (dn + dv) + dn) * r; };

  // Per sequence: its form, and where its rows live in the form's scratch (absorbed: row index among the
  // absorbed rows in latent_q_/latent_o_; expanded: first float of its context's keys/values in latent_kv_).
  latent_absorbed_.resize(static_cast<std::size_t>(num_seqs));
  latent_offset_.resize(static_cast<std::size_t>(num_seqs));
  std::int64_t absorbed_rows = 0;
  std::int64_t expanded_floats = 0;
  for (std::int64_t si = 0; si < num_seqs; ++si) {
    const SequenceSlice& s = seqs[static_cast<std::size_t>(si)];
    const std::int64_t context = s.start_pos + s.num_tokens;
    const bool absorbed = params.form == LatentForm::cheaper
                              ? absorbed_is_cheaper(s.num_tokens, context, r, params)
                              : params.form == LatentForm::absorbed;
    latent_absorbed_[static_cast<std::size_t>(si)] = absorbed ? 1 : 0;
    if (absorbed) {
      latent_offset_[static_cast<std::size_t>(si)] = absorbed_rows;
      absorbed_rows += s.num_tokens;
    } else {
      latent_offset_[static_cast<std::size_t>(si)] = expanded_floats;
      expanded_floats += context * kv_width;
    }
  }
  latent_q_.resize(static_cast<std::size_t>(absorbed_rows * heads * r));
  latent_o_.resize(static_cast<std::size_t>(absorbed_rows * heads * r));
  latent_kv_.resize(static_cast<std::size_t>(expanded_floats));

  // Runs of consecutive absorbed sequences whose rows are adjacent, so that folding W_uk in and applying W_uv
  // is one product per head per run (a decode batch is one run).
  const auto for_each_absorbed_run = [&](const auto& fn) {
    for (std::int64_t si = 0; si < num_seqs;) {
      if (latent_absorbed_[static_cast<std::size_t>(si)] == 0) {
        ++si;
        continue;
      }
      const SequenceSlice& first = seqs[static_cast<std::size_t>(si)];
      std::int64_t rows = first.num_tokens;
      std::int64_t next = si + 1;
      while (next < num_seqs && latent_absorbed_[static_cast<std::size_t>(next)] != 0 &&
             seqs[static_cast<std::size_t>(next)].first_row == first.first_row + rows) {
        rows += seqs[static_cast<std::size_t>(next)].num_tokens;
        ++next;
      }
      fn(first.first_row, latent_offset_[static_cast<std::size_t>(si)], rows);
      si = next;
    }
  };

  // Absorbed: q_lat[h] = q_nope[h] W_uk[h], [rows, r] per head.
  for_each_absorbed_run([&](std::int64_t first_row, std::int64_t lat_row, std::int64_t rows) {
    for (std::int64_t h = 0; h < heads; ++h) {
      sgemm(false, rows, r, dn, q.data() + first_row * heads * qk + h * qk, heads * qk, w_uk(h), r,
            latent_q_.data() + (lat_row * heads + h) * r, heads * r);
    }
  });

  // Expanded: the context's keys and values [context, heads, dn + dv] = latents [context, r] kv_b^T.
  for (std::int64_t si = 0; si < num_seqs; ++si) {
    if (latent_absorbed_[static_cast<std::size_t>(si)] != 0) continue;
    const SequenceSlice& s = seqs[static_cast<std::size_t>(si)];
    const std::int64_t context = s.start_pos + s.num_tokens;
    latent_ctx_.resize(static_cast<std::size_t>(context * r));
    for (std::int64_t p = 0; p < context; ++p) {
      std::memcpy(latent_ctx_.data() + p * r,
                  cache_rows + cache_row(cache.block_size, s.block_table, p) * row_width,
                  static_cast<std::size_t>(r) * sizeof(float));
    }
    sgemm(true, context, kv_width, r, latent_ctx_.data(), r, wkv, r,
          latent_kv_.data() + latent_offset_[static_cast<std::size_t>(si)], kv_width);
  }

#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<const float*> rows;
#pragma omp for collapse(2) schedule(dynamic)
    for (std::int64_t si = 0; si < num_seqs; ++si) {
      for (std::int64_t h = 0; h < heads; ++h) {
        const SequenceSlice& s = seqs[static_cast<std::size_t>(si)];
        const bool absorbed = latent_absorbed_[static_cast<std::size_t>(si)] != 0;
        const std::int64_t offset = latent_offset_[static_cast<std::size_t>(si)];
        const std::int64_t context = s.start_pos + s.num_tokens;
        rows.resize(static_cast<std::size_t>(context));
        for (std::int64_t p = 0; p < context; ++p) {
          rows[static_cast<std::size_t>(p)] =
              cache_rows + cache_row(cache.block_size, s.block_table, p) * row_width;
        }
        scores.resize(static_cast<std::size_t>(context));
        for (std::int64_t i = 0; i < s.num_tokens; ++i) {
          const std::int64_t pos = s.start_pos + i;
          const float* q_nope = q.data() + ((s.first_row + i) * heads + h) * qk;
          const float* q_rope = q_nope + dn;
          if (absorbed) {
            // Scores on the latents themselves; the output stays a latent until W_uv below.
            const float* q_lat = latent_q_.data() + ((offset + i) * heads + h) * r;
            for (std::int64_t p = 0; p <= pos; ++p) {
              const float* row = rows[static_cast<std::size_t>(p)];
              scores[static_cast<std::size_t>(p)] =
                  (dot(q_lat, row, r) + dot(q_rope, row + r, dr)) * params.scale;
            }
            softmax_range(scores.data(), 0, pos);
            float* o = latent_o_.data() + ((offset + i) * heads + h) * r;
            std::fill(o, o + r, 0.0F);
            for (std::int64_t p = 0; p <= pos; ++p) {
              const float w = scores[static_cast<std::size_t>(p)];
              const float* row = rows[static_cast<std::size_t>(p)];
              for (std::int64_t e = 0; e < r; ++e) o[e] += w * row[e];
            }
          } else {
            const float* kv = latent_kv_.data() + offset + h * (dn + dv);
            for (std::int64_t p = 0; p <= pos; ++p) {
              scores[static_cast<std::size_t>(p)] = (dot(q_nope, kv + p * kv_width, dn) +
                                                     dot(q_rope, rows[static_cast<std::size_t>(p)] + r, dr)) *
                                                    params.scale;
            }
            softmax_range(scores.data(), 0, pos);
            float* o = out.data() + ((s.first_row + i) * heads + h) * dv;
            std::fill(o, o + dv, 0.0F);
            for (std::int64_t p = 0; p <= pos; ++p) {
              const float w = scores[static_cast<std::size_t>(p)];
              const float* v = kv + p * kv_width + dn;
              for (std::int64_t e = 0; e < dv; ++e) o[e] += w * v[e];
            }
          }
        }
      }
    }
  }

  // Absorbed: out[h] = o_lat[h] W_uv[h]^T, [rows, dv] per head.
  for_each_absorbed_run([&](std::int64_t first_row, std::int64_t lat_row, std::int64_t rows) {
    for (std::int64_t h = 0; h < heads; ++h) {
      sgemm(true, rows, dv, r, latent_o_.data() + (lat_row * heads + h) * r, heads * r, w_uv(h), r,
            out.data() + first_row * heads * dv + h * dv, heads * dv);
    }
  });
}

void CpuBackend::grouped_expert_ffn(const Tensor& x, std::span<const std::int64_t> offsets,
                                    std::span<const ExpertWeights> experts, const Tensor& out) {
  if (experts.empty()) return;
  for (std::size_t e = 0; e + 1 < offsets.size(); ++e) {
    const std::int64_t first = offsets[e];
    const std::int64_t n = offsets[e + 1] - first;
    if (n == 0) continue;
    const ExpertWeights& w = experts[e];
    const std::int64_t ffn = w.gate.dim(0);
    gate_.resize(static_cast<std::size_t>(n * ffn));
    up_.resize(static_cast<std::size_t>(n * ffn));
    const Tensor xe = x.rows(first, n);
    const Tensor gate = Tensor::host(std::span(gate_.data(), gate_.size()), {n, ffn});
    const Tensor up = Tensor::host(std::span(up_.data(), up_.size()), {n, ffn});
    linear(xe, w.gate, {}, gate);
    linear(xe, w.up, {}, up);
    for (std::size_t i = 0; i < static_cast<std::size_t>(n * ffn); ++i) gate_[i] = silu(gate_[i]) * up_[i];
    linear(gate, w.down, {}, out.rows(first, n));
  }
}

namespace {

void release_host(void* data, Device /*device*/) noexcept {
  ::operator delete (data, std::align_val_t{kHostAlignment});
}

}  // namespace

Buffer CpuBackend::allocate_memory(std::size_t bytes) {
  return {::operator new (std::max<std::size_t>(bytes, 1), std::align_val_t{kHostAlignment}), bytes, kCpu,
          release_host};
}

void CpuBackend::copy_to_host(const Tensor& src, std::span<std::byte> dst) {
  std::memcpy(dst.data(), src.data(), dst.size());
}

bool CpuBackend::copy_to_host_later(const Tensor& src, std::span<std::byte> dst) {
  copy_to_host(src, dst);
  return false;
}

void CpuBackend::copy_from_host(std::span<const std::byte> src, const Tensor& dst) {
  std::memcpy(dst.data(), src.data(), src.size());
}

void CpuBackend::add(const Tensor& dst, const Tensor& src) {
  if (dst.numel() != src.numel())
    throw std::invalid_argument("add: dst " + dst.shape_text() + " and src " + src.shape_text());
  const std::span<float> d = dst.host_span<float>();
  const std::span<const float> s = src.host_span<const float>();
  for (std::size_t i = 0; i < d.size(); ++i) d[i] += s[i];
}

void CpuBackend::add_sigmoid_gated(const Tensor& dst, const Tensor& src, const Tensor& gate) {
  const std::int64_t rows = gate.numel();
  if (dst.numel() != src.numel() || dst.dims() == 0 || dst.dim(0) != rows)
    throw std::invalid_argument("add_sigmoid_gated: dst " + dst.shape_text() + ", src " + src.shape_text() +
                                ", gate " + gate.shape_text());
  const std::int64_t width = dst.row_numel();
  const std::span<float> d = dst.host_span<float>();
  const std::span<const float> s = src.host_span<const float>();
  const std::span<const float> g = gate.host_span<const float>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float w = 1.0F / (1.0F + std::exp(-g[static_cast<std::size_t>(r)]));
    float* dr = d.data() + r * width;
    const float* sr = s.data() + r * width;
    for (std::int64_t i = 0; i < width; ++i) dr[i] += w * sr[i];
  }
}

void CpuBackend::copy(const Tensor& src, const Tensor& dst) {
  if (src.bytes() != dst.bytes())
    throw std::invalid_argument("CpuBackend::copy: " + src.shape_text() + " into " + dst.shape_text());
  if (!src.empty()) std::memcpy(dst.host_data(), src.host_data(), src.bytes());
}

void CpuBackend::zero(const Tensor& t) {
  if (!t.empty()) std::memset(t.host_data(), 0, t.bytes());
}

void CpuBackend::clamp(const Tensor& x, float limit) {
  for (float& v : x.host_span<float>()) v = std::clamp(v, -limit, limit);
}

void CpuBackend::gather_rows(const Tensor& src, std::span<const std::int64_t> rows, const Tensor& dst) {
  const std::int64_t width = src.row_numel();
  if (dst.dims() == 0 || dst.dim(0) != static_cast<std::int64_t>(rows.size()) || dst.row_numel() != width)
    throw std::invalid_argument("gather_rows: " + std::to_string(rows.size()) + " rows of " +
                                src.shape_text() + " into " + dst.shape_text());
  const std::span<const float> s = src.host_span<const float>();
  const std::span<float> d = dst.host_span<float>();
  for (std::size_t i = 0; i < rows.size(); ++i) {
    if (rows[i] < 0 || rows[i] >= src.dim(0))
      throw std::out_of_range("gather_rows: row " + std::to_string(rows[i]) + " of " + src.shape_text());
    std::memcpy(d.data() + static_cast<std::int64_t>(i) * width, s.data() + rows[i] * width,
                static_cast<std::size_t>(width) * sizeof(float));
  }
}

}  // namespace capserve::kernels::cpu
