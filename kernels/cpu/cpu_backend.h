#pragma once
// The CPU implementation of the kernel interface: OpenBLAS sgemm for large row counts, a direct bf16/f16/f32
// weight-streaming kernel for the small row counts of decode, OpenMP over heads and rows elsewhere.
#include <vector>

#include "kernels/backend.h"

namespace capserve::kernels::cpu {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int num_threads);

  void linear(std::span<const float> x, std::int64_t m, const WeightView& w, const WeightView& bias,
              std::span<float> y) override;
  void embedding(std::span<const std::int32_t> ids, const WeightView& table, std::span<float> out) override;
  void rms_norm(std::span<const float> x, std::int64_t cols, const WeightView& weight, float eps,
                std::span<float> out) override;
  void rope(std::span<float> x, const RotaryLayout& layout, std::span<const float> cos,
            std::span<const float> sin) override;
  void kv_store(std::span<const SequenceSlice> seqs, std::span<const float> k, std::span<const float> v,
                const PagedKvLayer& cache) override;
  void paged_attention(std::span<const SequenceSlice> seqs, std::span<const float> q,
                       const PagedKvLayer& cache, const AttentionParams& params,
                       std::span<float> out) override;
  void latent_store(std::span<const SequenceSlice> seqs, std::span<const float> latent,
                    std::span<const float> rope_key, const PagedLatentLayer& cache) override;
  void latent_attention(std::span<const SequenceSlice> seqs, std::span<const float> q,
                        const PagedLatentLayer& cache, const WeightView& kv_b,
                        const LatentAttentionParams& params, std::span<float> out) override;
  void grouped_expert_ffn(std::span<const float> x, std::span<const std::int64_t> offsets,
                          std::span<const ExpertWeights> experts, std::span<float> out) override;
  void set_num_threads(int n) override;

 private:
  int num_threads_;
  // Grow-only scratch, reused across calls so a step allocates nothing once warm.
  std::vector<float> widened_weight_;
  std::vector<float> bias_;
  std::vector<float> norm_weight_;
  std::vector<float> gate_;
  std::vector<float> up_;
  // latent_attention: per sequence its form and scratch offset; absorbed queries and outputs as latents
  // [absorbed rows, heads, kv_lora_rank]; expanded sequences' context keys/values; one context's latents.
  std::vector<std::uint8_t> latent_absorbed_;
  std::vector<std::int64_t> latent_offset_;
  std::vector<float> latent_q_;
  std::vector<float> latent_o_;
  std::vector<float> latent_kv_;
  std::vector<float> latent_ctx_;
};

}  // namespace capserve::kernels::cpu
