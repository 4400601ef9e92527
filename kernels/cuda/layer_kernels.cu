#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "kernels/cuda/block_reduce.h"
#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/element_types.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/layer_kernels.h"
#include "kernels/cuda/paged_cache_slot.h"
#include "kernels/moe/index_logic.h"

namespace capserve::kernels::cuda {
namespace {

template <typename W>
__global__ void rms_norm_kernel(const float* x, std::int64_t cols, const W* weight, float eps, float* out) {
  __shared__ float scratch[32];
  const float* xr = x + static_cast<std::int64_t>(blockIdx.x) * cols;
  float* yr = out + static_cast<std::int64_t>(blockIdx.x) * cols;
  float ss = 0.0F;
  for (std::int64_t i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
  const float inv = rsqrtf(block_sum(ss, scratch) / static_cast<float>(cols) + eps);
  for (std::int64_t i = threadIdx.x; i < cols; i += blockDim.x) yr[i] = widen(weight, i) * (xr[i] * inv);
}

__global__ void rope_kernel(float* x, RotaryLayout layout, const float* cos, const float* sin) {
  const std::int64_t t = blockIdx.x;
  const std::int64_t half = layout.dim / 2;
  const std::int64_t stride = layout.interleaved ? 2 : 1;
  const std::int64_t partner = layout.interleaved ? 1 : half;
  for (std::int64_t j = threadIdx.x; j < layout.heads * half; j += blockDim.x) {
    const std::int64_t h = j / half;
    const std::int64_t i = j % half;
    float* pa = x + (t * layout.heads + h) * layout.head_dim + layout.offset + i * stride;
    float* pb = pa + partner;
    const float a = *pa;
    const float b = *pb;
    const float c = cos[t * half + i];
    const float s = sin[t * half + i];
    *pa = a * c - b * s;
    *pb = b * c + a * s;
  }
}

template <typename T>
__global__ void kv_store_kernel(DeviceAttentionBatch batch, const float* k, const float* v,
                                DeviceKvLayer cache) {
  const std::int64_t row = blockIdx.x;
  const std::int64_t width = cache.num_kv_heads * cache.head_dim;
  const std::int64_t dst = cache_slot(batch, cache.block_size, row, batch.row_pos[row]) * width;
  T* ck = static_cast<T*>(cache.k);
  T* cv = static_cast<T*>(cache.v);
  for (std::int64_t i = threadIdx.x; i < width; i += blockDim.x) {
    narrow(k[row * width + i], ck + dst + i);
    narrow(v[row * width + i], cv + dst + i);
  }
}

constexpr int kAttnThreads = 128;
constexpr int kAttnDims = 4;  // head dims per thread: head_dim <= 512

template <typename T>
__global__ void __launch_bounds__(kAttnThreads)
    paged_attention_kernel(DeviceAttentionBatch batch, const float* q, DeviceKvLayer cache,
                           AttentionParams params, float* out) {
  __shared__ float scratch[kAttnThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  const std::int64_t head = blockIdx.y;
  const std::int64_t d = cache.head_dim;
  const std::int64_t group = params.num_heads / cache.num_kv_heads;
  const std::int64_t kv_width = cache.num_kv_heads * d;
  const std::int64_t kv_off = (head / group) * d;
  const std::int64_t pos = batch.row_pos[row];
  const std::int64_t lo =
      params.sliding_window > 0 ? max(std::int64_t{0}, pos - params.sliding_window + 1) : 0;
  const float* qr = q + (row * params.num_heads + head) * d;
  float qv[kAttnDims];
  float acc[kAttnDims];
#pragma unroll
  for (int i = 0; i < kAttnDims; ++i) {
    const std::int64_t e = threadIdx.x + i * kAttnThreads;
    qv[i] = e < d ? qr[e] : 0.0F;
    acc[i] = 0.0F;
  }
  float m = -INFINITY;
  float l = 0.0F;
  for (std::int64_t p = lo; p <= pos; ++p) {
    const std::int64_t slot = cache_slot(batch, cache.block_size, row, p);
    const T* kr = static_cast<const T*>(cache.k) + slot * kv_width + kv_off;
    const T* vr = static_cast<const T*>(cache.v) + slot * kv_width + kv_off;
    float partial = 0.0F;
#pragma unroll
    for (int i = 0; i < kAttnDims; ++i) {
      const std::int64_t e = threadIdx.x + i * kAttnThreads;
      if (e < d) partial += qv[i] * widen(kr, e);
    }
    const float s = block_sum(partial, scratch) * params.scale;
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);
    const float weight = expf(s - m_new);
    l = l * correction + weight;
#pragma unroll
    for (int i = 0; i < kAttnDims; ++i) {
      const std::int64_t e = threadIdx.x + i * kAttnThreads;
      if (e < d) acc[i] = acc[i] * correction + weight * widen(vr, e);
    }
    m = m_new;
  }
  float* o = out + (row * params.num_heads + head) * d;
#pragma unroll
  for (int i = 0; i < kAttnDims; ++i) {
    const std::int64_t e = threadIdx.x + i * kAttnThreads;
    if (e < d) o[e] = acc[i] / l;
  }
}

// Sampling order: larger logit first, ties to the lower id, as one 64-bit key (float bits made
// order-preserving above, the complemented id below). NaN orders below every number, -inf included: its keys
// lie below kNumberKeys, so a NaN logit never wins and is never drawn.
constexpr std::uint64_t kNumberKeys = moe::kLow32 + 1;

__device__ std::uint64_t logit_key(float logit, std::int64_t id) {
  const std::uint32_t u = moe::float_bits(logit);
  const std::uint32_t ordered = logit != logit ? 0U : (u & 0x80000000U) != 0 ? ~u : (u | 0x80000000U);
  return (static_cast<std::uint64_t>(ordered) << 32) | (moe::kLow32 - static_cast<std::uint64_t>(id));
}

__device__ std::int64_t key_id(std::uint64_t key) {
  return static_cast<std::int64_t>(moe::kLow32 - (key & moe::kLow32));
}

constexpr int kLogprobThreads = 256;

// One block per row: the row's log-sum-exp (max-subtracted, f32 sums), the chosen token's log-probability,
// then the top k by k block-wide maxima of the keys below the previous one (keys are unique: one vocabulary
// pass per entry, no per-thread lists).
__global__ void __launch_bounds__(kLogprobThreads)
    token_logprobs_kernel(const float* logits, std::int64_t vocab, const std::int32_t* tokens,
                          std::int64_t top_k, float* values, std::int32_t* top_ids) {
  __shared__ float fscratch[kLogprobThreads / kWarp];
  __shared__ std::uint64_t kscratch[kLogprobThreads / kWarp];
  const std::int64_t row = blockIdx.x;
  const float* lr = logits + row * vocab;
  float* out = values + row * (1 + top_k);

  std::uint64_t best = 0;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const std::uint64_t k = logit_key(lr[i], i);
    best = k > best ? k : best;
  }
  best = block_max_u64(best, kscratch);
  const float top = lr[key_id(best)];
  float sum = 0.0F;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) sum += expf(lr[i] - top);
  const float log_sum = logf(block_sum(sum, fscratch));
  if (threadIdx.x == 0) {
    const std::int32_t token = tokens[row];
    out[0] = token >= 0 && token < vocab ? (lr[token] - top) - log_sum : nanf("");
  }
  std::uint64_t below = ~std::uint64_t{0};
  for (std::int64_t j = 0; j < top_k; ++j) {
    std::uint64_t next = 0;
    for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      const std::uint64_t k = logit_key(lr[i], i);
      next = k < below && k > next ? k : next;
    }
    next = block_max_u64(next, kscratch);
    if (threadIdx.x == 0) {
      const std::int64_t id = key_id(next);
      top_ids[row * top_k + j] = static_cast<std::int32_t>(id);
      out[1 + j] = (lr[id] - top) - log_sum;
    }
    below = next;
  }
}

constexpr int kSampleThreads = 512;
constexpr int kAdjustThreads = 256;
constexpr float kMinusInf = -INFINITY;

// Block b adjusts logits row rows[b] (kernels/sampling.h's order) into row b of adjusted. Each adjustment is
// one block-wide pass with a barrier after it, so a later one reads what the earlier wrote. A penalized row
// counts its history into row b of counts (generated count, flag for the prompt) first.
__global__ void __launch_bounds__(kAdjustThreads)
    adjust_logits_kernel(const float* logits, std::int64_t vocab, DeviceSampleInputs in,
                         const std::int32_t* rows, float* adjusted, std::int32_t* counts) {
  constexpr std::int32_t kInPrompt = 1 << 30;
  const std::int64_t row = rows[blockIdx.x];
  const SampleControls c = in.controls[row];
  const float* lr = logits + row * vocab;
  float* out = adjusted + static_cast<std::int64_t>(blockIdx.x) * vocab;
  std::int32_t* count = counts + static_cast<std::int64_t>(blockIdx.x) * vocab;
  const std::int32_t* mask = in.allowed == nullptr ? nullptr : in.allowed + row * allowed_words(vocab);
  const bool penalized = c.penalized();
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    out[i] = mask != nullptr && !allowed_bit(mask, i) ? kMinusInf : lr[i];
    if (penalized) count[i] = 0;
  }
  __syncthreads();
  for (std::int64_t j = c.banned.begin + threadIdx.x; j < c.banned.end; j += blockDim.x) {
    const std::int32_t id = in.banned[j];
    if (id >= 0 && id < vocab) out[id] = kMinusInf;
  }
  __syncthreads();
  for (std::int64_t j = c.bias.begin + threadIdx.x; j < c.bias.end; j += blockDim.x) {
    const LogitBias b = in.biases[j];
    if (b.token >= 0 && b.token < vocab) out[b.token] += b.bias;
  }
  if (!penalized) return;
  for (std::int64_t j = c.history.begin + threadIdx.x; j < c.history.end; j += blockDim.x) {
    const std::int32_t id = in.history[j - in.history_offset];
    if (id < 0 || id >= vocab) continue;
    if (j - c.history.begin < c.prompt_tokens) {
      atomicOr(&count[id], kInPrompt);
    } else {
      atomicAdd(&count[id], 1);
    }
  }
  __syncthreads();
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const std::int32_t n = count[i];
    if (n != 0) out[i] = penalize(out[i], n & (kInPrompt - 1), (n & kInPrompt) != 0, c);
  }
}

// A token's sampling weight (in (0, 1]: its exp relative to the best token's) as a fixed-point integer: 2^31
// units for weight 1, so the sum over a vocabulary of up to 2^32 tokens fits 63 bits. Weights below 2^-31
// count as nothing in the nucleus's mass.
__device__ unsigned long long mass_units(float weight) {
  return static_cast<unsigned long long>(weight * 0x1.0p31F);
}

__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const float* logits, std::int64_t vocab, const SampleControls* controls,
                  const std::int32_t* rows, std::int32_t* tokens) {
  __shared__ float fscratch[kSampleThreads / kWarp];
  __shared__ std::uint64_t kscratch[kSampleThreads / kWarp];
  __shared__ unsigned long long hist[moe::kRadixBuckets];
  __shared__ unsigned long long mass[moe::kRadixBuckets];
  __shared__ unsigned long long total_mass;
  __shared__ float partial[kSampleThreads];
  __shared__ std::int64_t chosen;
  const float* lr = logits + static_cast<std::int64_t>(blockIdx.x) * vocab;
  const std::int64_t row = rows == nullptr ? blockIdx.x : rows[blockIdx.x];
  const SampleControls c = controls[row];

  std::uint64_t best = 0;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    const std::uint64_t k = logit_key(lr[i], i);
    best = k > best ? k : best;
  }
  best = block_max_u64(best, kscratch);
  // Every logit -inf: the adjustments ruled out every token (a NaN row is marked after).
  if (lr[key_id(best)] == kMinusInf) {
    if (threadIdx.x == 0) tokens[row] = kNoAllowedToken;
    return;
  }
  if (c.temperature == 0.0F) {
    if (threadIdx.x == 0) tokens[row] = static_cast<std::int32_t>(key_id(best));
    return;
  }
  const float inv_t = 1.0F / c.temperature;
  const float top = lr[key_id(best)] * inv_t;

  // The floor: the lowest key of a token that is allowed (not -inf) and that min_p keeps (weight relative to
  // the best one's; the best one always). Those tokens are a prefix of the order, as top-k's are, so each
  // filter is a key threshold and together the larger one. The block's minimum key, as the maximum of the
  // complemented keys.
  std::uint64_t low = 0;
  for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
    if (i == key_id(best) ||
        (lr[i] != kMinusInf && (c.min_p <= 0.0F || expf(lr[i] * inv_t - top) >= c.min_p))) {
      const std::uint64_t k = ~logit_key(lr[i], i);
      low = k > low ? k : low;
    }
  }
  const std::uint64_t floor = ~block_max_u64(low, kscratch);

  // Top-k: the k largest keys, by radix select. Every thread resolves its own copy of the selection from the
  // same shared histogram, so all reach the same threshold; a selection in shared memory written by one
  // thread let the compiler hoist the other threads' read of it above that thread's write (racecheck on an
  // H100).
  std::uint64_t threshold = floor > kNumberKeys ? floor : kNumberKeys;
  if (c.top_k > 0 && c.top_k < vocab) {
    moe::SelectState select = moe::begin_select(vocab, c.top_k);
    for (int shift = 64 - moe::kRadixBits; shift >= 0; shift -= moe::kRadixBits) {
      for (int b = threadIdx.x; b < moe::kRadixBuckets; b += blockDim.x) hist[b] = 0;
      __syncthreads();
      if (select.unresolved != 0) {
        for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
          const std::uint64_t k = logit_key(lr[i], i);
          if ((k & moe::radix_high_mask(shift)) == select.prefix)
            atomicAdd(&hist[moe::radix_digit(k, shift)], 1ULL);
        }
      }
      __syncthreads();
      moe::radix_resolve(select, reinterpret_cast<const std::int64_t*>(hist), shift);
      __syncthreads();  // every thread has read the histogram before the next round clears it
    }
    threshold = select.threshold > threshold ? select.threshold : threshold;
  }

  // Top-p: the smallest set of the best keys whose mass reaches top_p, by radix descent on the mass. Masses
  // are fixed-point integers (mass_units), so their atomic sums do not depend on the order threads add them:
  // the same seed draws the same token on every run.
  if (c.top_p < 1.0F) {
    if (threadIdx.x == 0) total_mass = 0;
    __syncthreads();
    unsigned long long z = 0;
    for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
      if (logit_key(lr[i], i) >= threshold) z += mass_units(expf(lr[i] * inv_t - top));
    }
    atomicAdd(&total_mass, z);
    __syncthreads();
    std::uint64_t prefix = 0;
    auto need =
        static_cast<unsigned long long>(static_cast<double>(c.top_p) * static_cast<double>(total_mass));
    for (int shift = 64 - moe::kRadixBits; shift >= 0; shift -= moe::kRadixBits) {
      for (int b = threadIdx.x; b < moe::kRadixBuckets; b += blockDim.x) mass[b] = 0;
      __syncthreads();
      for (std::int64_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        const std::uint64_t k = logit_key(lr[i], i);
        if (k >= threshold && (k & moe::radix_high_mask(shift)) == prefix)
          atomicAdd(&mass[moe::radix_digit(k, shift)], mass_units(expf(lr[i] * inv_t - top)));
      }
      __syncthreads();
      // Every thread scans the same shared histogram, so all reach the same digit.
      unsigned long long above = 0;
      int digit = -1;
      for (int b = moe::kRadixBuckets - 1; b >= 0; --b) {
        if (mass[b] == 0) continue;
        digit = b;  // the lowest non-empty bucket, should `need` be out of reach
        if (above + mass[b] < need) {
          above += mass[b];
          continue;
        }
        break;
      }
      if (digit >= 0) {
        prefix |= static_cast<std::uint64_t>(digit) << shift;
        need -= above;
      }
      __syncthreads();
    }
    threshold = prefix > threshold ? prefix : threshold;
  }

  // Draw: u in [0, kept mass), then the token whose cumulative mass (in id order) passes u.
  const std::int64_t per = (vocab + blockDim.x - 1) / blockDim.x;
  const std::int64_t begin = threadIdx.x * per;
  const std::int64_t end = begin + per < vocab ? begin + per : vocab;
  float mine = 0.0F;
  for (std::int64_t i = begin; i < end; ++i) {
    if (logit_key(lr[i], i) >= threshold) mine += expf(lr[i] * inv_t - top);
  }
  partial[threadIdx.x] = mine;
  // A kept token, should rounding leave u unreached (the best one when no cut was made).
  if (threadIdx.x == 0) chosen = key_id(threshold > kNumberKeys ? threshold : best);
  __syncthreads();
  if (threadIdx.x == 0) {
    float run = 0.0F;
    for (int t = 0; t < static_cast<int>(blockDim.x); ++t) {
      const float v = partial[t];
      partial[t] = run;
      run += v;
    }
    fscratch[0] = run;
  }
  __syncthreads();
  const std::uint64_t bits = moe::mix64(c.seed ^ moe::mix64(c.step));
  const float u = static_cast<float>(static_cast<double>(bits >> 11) * 0x1.0p-53) * fscratch[0];
  float run = partial[threadIdx.x];
  if (u >= run && u < run + mine) {
    for (std::int64_t i = begin; i < end; ++i) {
      if (logit_key(lr[i], i) < threshold) continue;
      run += expf(lr[i] * inv_t - top);
      if (u < run) {
        chosen = i;
        break;
      }
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) tokens[row] = static_cast<std::int32_t>(chosen);
}

}  // namespace

void check_cache_dtype(DType dtype, const char* op) {
  if (dtype != DType::f32 && dtype != DType::bf16)
    throw std::invalid_argument(std::string(op) + ": a KV cache of " + std::string(dtype_name(dtype)) +
                                " (f32 or bf16)");
}

void rms_norm(const float* x, std::int64_t rows, std::int64_t cols, const void* weight, DType weight_dtype,
              float eps, float* out, cudaStream_t stream) {
  if (rows <= 0) return;
  const auto grid = static_cast<unsigned>(rows);
  switch (weight_dtype) {
    case DType::f32:
      launch(rms_norm_kernel<float>, grid, 256, 0, stream, x, cols, static_cast<const float*>(weight), eps,
             out);
      break;
    case DType::bf16:
      launch(rms_norm_kernel<__nv_bfloat16>, grid, 256, 0, stream, x, cols,
             static_cast<const __nv_bfloat16*>(weight), eps, out);
      break;
    case DType::f16:
      launch(rms_norm_kernel<__half>, grid, 256, 0, stream, x, cols, static_cast<const __half*>(weight), eps,
             out);
      break;
    case DType::i32:
    case DType::i64:
    case DType::u8:
    case DType::f8_e4m3:
      throw std::invalid_argument("cuda::rms_norm: a weight of type " +
                                  std::string(dtype_name(weight_dtype)));
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void rope(float* x, std::int64_t tokens, const RotaryLayout& layout, const float* cos, const float* sin,
          cudaStream_t stream) {
  if (tokens <= 0) return;
  launch(rope_kernel, static_cast<unsigned>(tokens), 256, 0, stream, x, layout, cos, sin);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

AttentionBatchArrays attention_batch_arrays(std::span<const SequenceSlice> seqs) {
  AttentionBatchArrays a;
  attention_batch_arrays(seqs, a);
  return a;
}

void attention_batch_arrays(std::span<const SequenceSlice> seqs, AttentionBatchArrays& a) {
  a.row_pos.clear();
  a.row_seq.clear();
  a.seq_first_row.clear();
  a.seq_tokens.clear();
  a.max_blocks = 0;
  a.max_seq_tokens = 0;
  for (const SequenceSlice& s : seqs)
    a.max_blocks = std::max(a.max_blocks, static_cast<std::int64_t>(s.block_table.size()));
  a.block_tables.assign(seqs.size() * static_cast<std::size_t>(a.max_blocks), 0);
  for (std::size_t si = 0; si < seqs.size(); ++si) {
    const SequenceSlice& s = seqs[si];
    a.seq_first_row.push_back(static_cast<std::int32_t>(s.first_row));
    a.seq_tokens.push_back(static_cast<std::int32_t>(s.num_tokens));
    a.max_seq_tokens = std::max(a.max_seq_tokens, s.num_tokens);
    std::copy(s.block_table.begin(), s.block_table.end(),
              a.block_tables.begin() + static_cast<std::ptrdiff_t>(si) * a.max_blocks);
    const auto end = static_cast<std::size_t>(s.first_row + s.num_tokens);
    if (a.row_pos.size() < end) {
      a.row_pos.resize(end, 0);
      a.row_seq.resize(end, 0);
    }
    for (std::int64_t i = 0; i < s.num_tokens; ++i) {
      a.row_pos[static_cast<std::size_t>(s.first_row + i)] = static_cast<std::int32_t>(s.start_pos + i);
      a.row_seq[static_cast<std::size_t>(s.first_row + i)] = static_cast<std::int32_t>(si);
    }
  }
}

namespace {

DeviceBuffer<std::int32_t> on_device(const std::vector<std::int32_t>& host) {
  DeviceBuffer<std::int32_t> d(host.size());
  if (!host.empty()) {
    CAPSERVE_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), d.bytes(), cudaMemcpyHostToDevice));
  }
  return d;
}

}  // namespace

DeviceAttentionArrays::DeviceAttentionArrays(std::span<const SequenceSlice> seqs) {
  const AttentionBatchArrays a = attention_batch_arrays(seqs);
  row_pos_ = on_device(a.row_pos);
  row_seq_ = on_device(a.row_seq);
  block_tables_ = on_device(a.block_tables);
  seq_first_row_ = on_device(a.seq_first_row);
  seq_tokens_ = on_device(a.seq_tokens);
  batch_ = {static_cast<std::int64_t>(a.row_pos.size()),
            row_pos_.data(),
            row_seq_.data(),
            block_tables_.data(),
            a.max_blocks,
            seq_first_row_.data(),
            seq_tokens_.data(),
            static_cast<std::int64_t>(a.seq_tokens.size()),
            a.max_seq_tokens};
}

void kv_store(const DeviceAttentionBatch& batch, const float* k, const float* v, const DeviceKvLayer& cache,
              cudaStream_t stream) {
  check_cache_dtype(cache.dtype, "kv_store");
  if (batch.rows <= 0) return;
  if (cache.dtype == DType::bf16) {
    launch(kv_store_kernel<__nv_bfloat16>, static_cast<unsigned>(batch.rows), 256, 0, stream, batch, k, v,
           cache);
  } else {
    launch(kv_store_kernel<float>, static_cast<unsigned>(batch.rows), 256, 0, stream, batch, k, v, cache);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void paged_attention(const DeviceAttentionBatch& batch, const float* q, const DeviceKvLayer& cache,
                     const AttentionParams& params, float* out, cudaStream_t stream) {
  if (cache.head_dim > static_cast<std::int64_t>(kAttnThreads) * kAttnDims)
    throw std::invalid_argument("paged_attention: head_dim above 512");
  if (cache.num_kv_heads <= 0 || params.num_heads % cache.num_kv_heads != 0)
    throw std::invalid_argument("paged_attention: heads must be a multiple of the kv heads");
  check_cache_dtype(cache.dtype, "paged_attention");
  if (batch.rows <= 0) return;
  const dim3 grid(static_cast<unsigned>(batch.rows), static_cast<unsigned>(params.num_heads));
  if (cache.dtype == DType::bf16) {
    launch(paged_attention_kernel<__nv_bfloat16>, grid, kAttnThreads, 0, stream, batch, q, cache, params,
           out);
  } else {
    launch(paged_attention_kernel<float>, grid, kAttnThreads, 0, stream, batch, q, cache, params, out);
  }
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void token_logprobs(const float* logits, std::int64_t rows, std::int64_t vocab, const std::int32_t* tokens,
                    std::int64_t top_k, float* values, std::int32_t* top_ids, cudaStream_t stream) {
  if (rows <= 0) return;
  if (vocab <= 0 || vocab > static_cast<std::int64_t>(moe::kLow32))
    throw std::invalid_argument("token_logprobs: vocab size");
  launch(token_logprobs_kernel, static_cast<unsigned>(rows), kLogprobThreads, 0, stream, logits, vocab,
         tokens, top_k, values, top_ids);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void adjust_logits(const float* logits, std::int64_t vocab, const DeviceSampleInputs& inputs,
                   const std::int32_t* rows, std::int64_t count, float* adjusted, std::int32_t* counts,
                   cudaStream_t stream) {
  if (count <= 0) return;
  launch(adjust_logits_kernel, static_cast<unsigned>(count), kAdjustThreads, 0, stream, logits, vocab, inputs,
         rows, adjusted, counts);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

void sample(const float* logits, std::int64_t rows, std::int64_t vocab, const SampleControls* controls,
            std::int32_t* tokens, cudaStream_t stream, const std::int32_t* row_ids) {
  if (rows <= 0) return;
  if (vocab <= 0 || vocab > static_cast<std::int64_t>(moe::kLow32))
    throw std::invalid_argument("sample: vocab size");
  launch(sample_kernel, static_cast<unsigned>(rows), kSampleThreads, 0, stream, logits, vocab, controls,
         row_ids, tokens);
  CAPSERVE_CUDA_CHECK_LAUNCH();
}

}  // namespace capserve::kernels::cuda
