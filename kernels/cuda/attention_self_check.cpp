#include "kernels/cuda/attention_self_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <span>
#include <vector>

#include "kernels/cuda/cuda_check.h"
#include "kernels/cuda/latent_attention.h"

namespace capserve::kernels::cuda {
namespace {

// bf16 bits of f, rounded to nearest even.
std::uint16_t bf16_bits(float f) {
  std::uint32_t u = 0;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>((u + 0x7FFFU + ((u >> 16) & 1U)) >> 16);
}

template <class T>
DeviceBuffer<T> to_device(const std::vector<T>& host) {
  DeviceBuffer<T> d(host.size());
  if (!host.empty())
    CAPSERVE_CUDA_CHECK(cudaMemcpy(d.data(), host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
  return d;
}

std::vector<float> to_host(const DeviceBuffer<float>& d) {
  std::vector<float> host(d.size());
  CAPSERVE_CUDA_CHECK(cudaMemcpy(host.data(), d.data(), d.bytes(), cudaMemcpyDeviceToHost));
  return host;
}

double relative_difference(const std::vector<float>& out, const std::vector<float>& ref) {
  double num = 0.0;
  double den = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    const double d = static_cast<double>(out[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

// Rounding the probabilities to bf16 costs about 1e-3 (tests/gpu/kernels/test_cuda_kernels.cpp); a wrong
// kernel is off by far more.
constexpr double kTolerance = 1e-2;

}  // namespace

std::string KernelCheck::summary() const {
  return "self-check: " + kernel + ": relative difference " + std::to_string(error) +
         " from the fp32 kernel " +
         (passed() ? "(within " + std::to_string(tolerance) + "): in use"
                   : "(above " + std::to_string(tolerance) + "): NOT used, the fp32 kernel serves instead");
}

KernelCheck check_fast_attention(const FastAttentionShape& shape, const FastAttention& fast,
                                 const FlashWorkspace& workspace, cudaStream_t stream) {
  const std::int64_t key_width = shape.num_kv_heads * shape.dk;
  const std::int64_t value_width = shape.num_kv_heads * shape.dv;
  // A prefill of 24 tokens after 50 cached, a 5-token chunk and two decodes: 64-row tiles where the group has
  // 4 heads or more, 16-row ones, and rows over two key tiles. Small, for it runs at every start.
  const std::int64_t starts[] = {50, 9, 100, 3};
  const std::int64_t counts[] = {24, 5, 1, 1};
  std::vector<std::vector<std::int32_t>> tables(4);
  std::vector<SequenceSlice> seqs;
  std::int64_t rows = 0;
  std::int32_t next_block = 0;
  for (std::size_t s = 0; s < 4; ++s) {
    const std::int64_t context = starts[s] + counts[s];
    for (std::int64_t b = 0; b < (context + shape.block_size - 1) / shape.block_size; ++b)
      tables[s].push_back(next_block++);
    seqs.push_back({rows, counts[s], starts[s], tables[s]});
    rows += counts[s];
  }
  std::mt19937_64 rng(20261128);
  std::normal_distribution<float> normal(0.0F, 1.0F);
  const auto pool = [&](std::int64_t width) {
    std::vector<std::uint16_t> bits(static_cast<std::size_t>(next_block * shape.block_size * width));
    for (std::uint16_t& x : bits) x = bf16_bits(normal(rng));
    return bits;
  };
  const std::vector<std::uint16_t> k = pool(key_width);
  const std::vector<std::uint16_t> v = shape.latent ? std::vector<std::uint16_t>{} : pool(value_width);
  std::vector<float> q(static_cast<std::size_t>(rows * shape.num_heads * shape.dk));
  for (float& x : q) x = 3.0F * normal(rng);  // peaked scores: later tiles rescale earlier ones

  const DeviceAttentionArrays arrays(seqs);
  const DeviceAttentionBatch& batch = arrays.batch();
  const auto d_k = to_device(k);
  const auto d_v = to_device(v);
  const auto d_q = to_device(q);
  DeviceBuffer<float> d_fast(static_cast<std::size_t>(rows * shape.num_heads * shape.dv));
  DeviceBuffer<float> d_ref(d_fast.size());
  const float scale = 1.0F / std::sqrt(static_cast<float>(shape.dk));
  KernelCheck check;
  if (shape.latent) {
    const DeviceLatentLayer cache{d_k.data(), DType::bf16, shape.block_size, shape.dv, shape.dk - shape.dv};
    fast(batch, latent_attention_problem(d_q.data(), cache, shape.num_heads, scale, d_fast.data()), workspace,
         stream);
    latent_attention_core(batch, d_q.data(), cache, shape.num_heads, scale, d_ref.data(), stream);
    check.kernel = "tensor-core latent attention (" + std::to_string(shape.num_heads) +
                   " heads over latent rows of " + std::to_string(shape.dv) + " + " +
                   std::to_string(shape.dk - shape.dv) + ", blocks of " + std::to_string(shape.block_size) +
                   ")";
  } else {
    const DeviceKvLayer cache{d_k.data(),       d_v.data(),         DType::bf16,
                              shape.block_size, shape.num_kv_heads, shape.dk};
    const AttentionParams params{shape.num_heads, scale, shape.sliding_window};
    fast(batch, gqa_attention(d_q.data(), cache, params, d_fast.data()), workspace, stream);
    paged_attention(batch, d_q.data(), cache, params, d_ref.data(), stream);
    check.kernel = "tensor-core attention (" + std::to_string(shape.num_heads) + " heads over " +
                   std::to_string(shape.num_kv_heads) + " K/V heads of " + std::to_string(shape.dk) +
                   ", blocks of " + std::to_string(shape.block_size) +
                   (shape.sliding_window > 0 ? ", window " + std::to_string(shape.sliding_window) : "") + ")";
  }
  CAPSERVE_CUDA_CHECK(cudaStreamSynchronize(stream));
  check.error = relative_difference(to_host(d_fast), to_host(d_ref));
  check.tolerance = kTolerance;
  return check;
}

}  // namespace capserve::kernels::cuda
