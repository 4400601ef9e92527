#pragma once
// The kernel interface on one CUDA device: every Backend operation as the kernels of kernels/cuda/, queued on
// the backend's own stream. Weights are uploaded once (upload copies them into device memory the caller
// keeps); activations, caches and scratch are device buffers; the host waits only in to_host. Host metadata
// of a step (the ragged batch's positions and block tables, gathered rows, sampling controls) is copied to
// the device per call without a wait. A backend is used from one thread at a time (the engine's); it makes
// its device current on every call, so that thread may also drive other devices.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/attention_self_check.h"
#include "kernels/cuda/host_readback.h"
#include "kernels/cuda/host_staging.h"
#include "kernels/cuda/latent_attention.h"
#include "kernels/cuda/layer_kernels.h"
#include "kernels/cuda/linear.h"

namespace capserve::kernels::cuda {

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device);
  ~CudaBackend() override;

  [[nodiscard]] Device device() const override { return {DeviceKind::cuda, device_}; }
  [[nodiscard]] Stream stream() const override { return stream_; }
  // For work on stream() that can stall for a reason the device does not see (the collectives of an NCCL
  // communicator whose peer died): the host then polls in to_host, running `check` between polls, which
  // throws to end the wait (kernels/cuda/stream_wait.h). Without one it blocks in cudaStreamSynchronize. The
  // staging ring's waits for the device to read a chunk poll with it too.
  void set_wait_check(std::function<void()> check);
  void check_kv_dtype(DType dtype) const override;
  // The tensor-core attention (GQA, or the latent core) against the fp32 kernel for a bf16 cache
  // (attention_self_check.h).
  std::vector<FastKernelCheck> check_fast_kernels(const AttentionShapes& shapes) override;
  // The fast attention kernel that check_fast_kernels compares and paged_attention then uses:
  // flash_attention, unless a test puts a broken one in its place.
  void use_fast_attention(FastAttention fast) { fast_attention_ = std::move(fast); }
  // FP8 weights stay FP8, their scales beside them (f32).
  [[nodiscard]] Tensor upload(const WeightView& host, Buffer& storage) override;
  [[nodiscard]] bool keeps_fp8() const override { return true; }

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
  void set_num_threads(int /*n*/) override {}

 protected:
  [[nodiscard]] Buffer allocate_memory(std::size_t bytes) override;
  void copy_to_host(const Tensor& src, std::span<std::byte> dst) override;
  void copy_from_host(std::span<const std::byte> src, const Tensor& dst) override;
  bool copy_to_host_later(const Tensor& src, std::span<std::byte> dst) override;
  void finish_copies_to_host() override;

 private:
  // Makes this backend's device current and checks that every tensor lives on it.
  void enter(std::initializer_list<const Tensor*> tensors) const;
  // The ragged batch's rows, positions and block tables on the device (copied from the slices).
  DeviceAttentionBatch attention_batch(std::span<const SequenceSlice> seqs);
  // upload() of a block-quantized weight of `bytes` FP8 bytes.
  Tensor upload_fp8(const WeightView& host, std::size_t bytes, Buffer& storage);
  // Host values on the device (staging_'s device mirror), queued on the stream.
  template <typename T>
  const T* stage(std::span<const T> host);
  // inputs checked against logits [rows, vocab] and staged on the device.
  cuda::DeviceSampleInputs stage_sample_inputs(const SampleInputs& inputs, std::int64_t rows,
                                               std::int64_t vocab);
  void run_linear(const float* x, std::int64_t m, std::int64_t k, const Tensor& w, const Tensor& bias,
                  float* y);

  int device_;  // first: its initialiser makes the device current for the stream and linear_'s cuBLAS handle
  cudaStream_t stream_ = nullptr;
  Linear linear_;
  std::function<void()> wait_check_;
  AttentionBatchArrays arrays_;  // host side of the last attention batch, reused
  FastAttention fast_attention_ = flash_attention;
  Buffer flash_partial_;  // split-K partial results, allocated once
  FlashWorkspace flash_workspace_;
  // What check_fast_kernels found per attention shape (checked once per backend).
  std::vector<std::pair<FastAttentionShape, FastKernelCheck>> attention_checks_;
  // Whether the fast kernel serves this shape: it takes it, and no check refused it.
  [[nodiscard]] bool fast_attention_serves(const SharedKvAttention& problem,
                                           const FastAttentionShape& shape) const;
  LatentAttention latent_;
  Buffer latent_workspace_;
  Buffer linear_workspace_, gate_, up_;
  // MoE index work (moe_stages.cpp): the capacity scheduler's workspace; the dispatch plan's destinations and
  // entry places; each permute's per-chunk bases.
  Buffer capacity_workspace_, dest_, first_dest_, entry_position_, entry_token_, row_chunks_, entry_chunks_,
      group_chunks_;
  // sample: rows with adjustments go kSampleChunkRows at a time through the adjusted logits and the
  // penalties' per-token counts ([kSampleChunkRows, vocab] each, whatever the step's rows); their ids.
  static constexpr std::int64_t kSampleChunkRows = 64;
  [[nodiscard]] Tensor sample_chunk_counts(std::int64_t vocab);
  // How many of the rows sample_rows_[first, ...) go through the scratch together: at most kSampleChunkRows,
  // and no more than one staging chunk of penalty history.
  [[nodiscard]] std::int64_t sample_chunk_rows(const SampleInputs& inputs, std::int64_t first) const;
  // device with the penalty histories of rows sample_rows_[first, first + count) staged.
  cuda::DeviceSampleInputs with_history(cuda::DeviceSampleInputs device, const SampleInputs& inputs,
                                        std::int64_t first, std::int64_t count);
  Buffer sample_adjusted_, sample_counts_;
  std::vector<std::int32_t> sample_rows_;
  std::unique_ptr<HostStaging> staging_;
  HostReadback readback_;
};

}  // namespace capserve::kernels::cuda
