#pragma once
// The CPU implementation of the kernel interface: OpenBLAS sgemm for large row counts, a direct bf16/f16/f32
// weight-streaming kernel for the small row counts of decode, OpenMP over heads and rows elsewhere.
#include <vector>

#include "kernels/backend.h"

namespace capserve::kernels::cpu {

class CpuBackend : public Backend {
 public:
  explicit CpuBackend(int num_threads);

  [[nodiscard]] Device device() const override { return kCpu; }
  [[nodiscard]] Stream stream() const override { return nullptr; }
  void check_kv_dtype(DType dtype) const override;
  [[nodiscard]] Tensor upload(const WeightView& host, Buffer& storage) override;

  void linear(const Tensor& x, const Tensor& w, const Tensor& bias, const Tensor& y) override;
  void embedding(const Tensor& ids, const Tensor& table, const Tensor& out) override;
  void rms_norm(const Tensor& x, const Tensor& weight, float eps, const Tensor& out) override;
  void rope(const Tensor& x, const RotaryLayout& layout, const Tensor& cos, const Tensor& sin) override;
  void add(const Tensor& dst, const Tensor& src) override;
  void add_sigmoid_gated(const Tensor& dst, const Tensor& src, const Tensor& gate) override;
  void copy(const Tensor& src, const Tensor& dst) override;
  void zero(const Tensor& t) override;
  void clamp(const Tensor& x, float limit) override;
  void gather_rows(const Tensor& src, std::span<const std::int64_t> rows, const Tensor& dst) override;
  void kv_store(std::span<const SequenceSlice> seqs, const Tensor& k, const Tensor& v,
                const PagedKvLayer& cache) override;
  void paged_attention(std::span<const SequenceSlice> seqs, const Tensor& q, const PagedKvLayer& cache,
                       const AttentionParams& params, const Tensor& out) override;
  void latent_store(std::span<const SequenceSlice> seqs, const Tensor& latent, const Tensor& rope_key,
                    const PagedLatentLayer& cache) override;
  void latent_attention(std::span<const SequenceSlice> seqs, const Tensor& q, const PagedLatentLayer& cache,
                        const Tensor& kv_b, const LatentAttentionParams& params, const Tensor& out) override;
  void grouped_expert_ffn(const Tensor& x, std::span<const std::int64_t> offsets,
                          std::span<const ExpertWeights> experts, const Tensor& out) override;
  using Backend::sample;
  void sample(const Tensor& logits, const SampleInputs& inputs, const Tensor& tokens) override;
  void adjust_logits(const Tensor& logits, const SampleInputs& inputs, const Tensor& adjusted) override;
  void token_logprobs(const Tensor& logits, const Tensor& tokens, const Tensor& values,
                      const Tensor& top_ids) override;
  void route(const moe::RouterParams& params, const Tensor& logits, const Tensor& bias, const Tensor& probs,
             const Tensor& experts, const Tensor& weights) override;
  void schedule_capacity(const CapacityCall& call) override;
  void count_experts(const Tensor& experts, const Tensor& counts) override;
  void assign_copies(const Tensor& experts, const Tensor& first_copy, std::int64_t salt,
                     const Tensor& copies) override;
  void count_slot_states(const Tensor& status, const Tensor& dropped, const Tensor& rerouted) override;
  void plan_dispatch(const Tensor& experts, const Tensor& weights, const Tensor& owners,
                     const Tensor& local_index, const DispatchPlan& plan) override;
  void group_received(const ReceivedGroups& groups) override;
  void take_rows(const Tensor& src, const Tensor& index, const Tensor& dst) override;
  void block_index(const Tensor& offsets, const Tensor& source, std::int64_t block, const Tensor& index,
                   const Tensor& overflow) override;
  void block_positions(const Tensor& position, const Tensor& offsets, std::int64_t block,
                       const Tensor& out) override;
  void combine(const Tensor& y, const Tensor& position, const Tensor& weights, const Tensor& out) override;
  void set_num_threads(int n) override;

 protected:
  [[nodiscard]] Buffer allocate_memory(std::size_t bytes) override;
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override;
  void copy_from_host(std::span<const std::byte> src, const Tensor& dst) override;
  bool copy_to_host_later(const Tensor& src, std::span<std::byte> dst) override;
  void finish_copies_to_host() override {}

 private:
  // group_received in the block layout (ReceivedGroups::entry_counts).
  void group_received_blocks(const ReceivedGroups& g);
  // sample: row r's raw logits adjusted by its controls (kernels/sampling.h) into out.
  void adjust_row(std::span<const float> raw, const SampleInputs& in, std::size_t r, std::span<float> out);
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
  // MoE index work: the capacity scheduler's workspace; the dispatch plan's destinations and entry places;
  // each permute's per-chunk bases.
  std::vector<std::uint64_t> capacity_workspace_;
  std::vector<std::int32_t> dest_, first_dest_, entry_token_;
  std::vector<std::int64_t> entry_position_, row_chunks_, entry_chunks_, group_chunks_;
  // sample: one row's adjusted logits, its candidate ids and their weights; per token id its generated count
  // and flags while a row's penalties are applied (all zero between rows).
  std::vector<float> adjusted_;
  std::vector<std::int32_t> sample_order_;
  std::vector<float> sample_probs_;
  std::vector<std::int32_t> counts_;
  // token_logprobs: one row's ids, its top-k first.
  std::vector<std::int32_t> logprob_order_;
};

}  // namespace capserve::kernels::cpu
