#pragma once
// What each rank of a model would hold, from its config.json alone (no weights): the replicated weights by
// kind, its own routed experts, and the KV cache a device-memory budget leaves room for. The weights are
// those the loader's own walk fetches (model_weight_shapes, model_weights.h), held in the type the loader
// (or, for FP8, the chosen holding) gives them; the KV cache is KvCache's allocation. `capserve-memory-plan`
// prints it (runtime/README.md, "Memory plan").
#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/dtype.h"
#include "runtime/architectures/architecture.h"
#include "runtime/kv_cache.h"
#include "runtime/model_config.h"

namespace capserve::runtime {

// How a device holds block-quantized FP8 checkpoint weights: dequantized to bf16 (the CPU backend), or kept
// FP8 with one f32 scale per block (a backend whose keeps_fp8() is true: the CUDA backend).
enum class Fp8Holding : std::uint8_t { dequantize_bf16, keep_fp8 };

// The weights of one rank, by kind. The MTP layers (loaded only for MTP speculation) are one kind whatever
// their tensors are.
enum class WeightKind : std::uint8_t {
  embedding,
  lm_head,
  attention,  // projections and their biases
  norms,
  routers,  // router matrices, correction biases, shared-expert gates
  dense_mlp,
  shared_experts,
  routed_experts,  // this rank's own
  mtp_layers,
};
inline constexpr std::size_t kWeightKinds = 9;
std::string_view weight_kind_name(WeightKind kind);

struct MemoryPlanOptions {
  int ranks = 1;
  // As --expert-placement: contiguous, round-robin or a --moe-stats file.
  std::string placement = "contiguous";
  std::int64_t redundant_experts = 0;  // as --redundant-experts
  // A device backend (routers widened to f32, runtime/model_weights.cpp) or the CPU (which counts the
  // checkpoint's mapped bytes as ModelWeights::bytes does).
  bool device = true;
  Fp8Holding fp8 = Fp8Holding::dequantize_bf16;
  bool mtp = false;  // the MTP layers loaded (--speculative mtp)
  // Which optional tensors the checkpoint holds (an MTP layer, its own embed_tokens / shared_head.head
  // copies); unset: all of them, as DeepSeek-V3's release does.
  std::function<bool(std::string_view)> present;
  // The KV cache: block size and element type as EngineOptions, and either a fixed block count or (0) as
  // many blocks as fit in device_memory - weights - reserve.
  std::int64_t kv_block_size = 16;
  kernels::DType kv_dtype = kernels::DType::bf16;
  std::int64_t kv_blocks = 0;
  std::int64_t device_memory = 0;  // bytes per rank
  // Kept back from the KV cache: the step buffers (not counted here: the backend sizes them from
  // --max-batched-tokens at start-up), cuBLAS / NCCL workspaces and the CUDA context.
  std::int64_t reserve = 0;
  std::int64_t max_batched_tokens = 0;
};

struct RankMemoryPlan {
  int rank = 0;
  std::int64_t experts = 0;  // routed experts held, over all MoE layers
  std::array<std::int64_t, kWeightKinds> weights{};
  std::int64_t kv_room = 0;    // device_memory - reserve - weights (negative: the weights alone overflow)
  std::int64_t kv_blocks = 0;  // --kv-blocks, or as many as kv_room holds
  std::int64_t kv_bytes = 0;   // KvCache::bytes for kv_blocks
  // The cache fits kv_room and holds MemoryPlan::required_kv_tokens.
  bool fits = false;

  [[nodiscard]] std::int64_t weight_bytes() const;
};

struct MemoryPlan {
  MemoryPlanOptions options;
  KvCacheShape kv;  // the engine's cache shape (MTP layers included when loaded), num_blocks = kv_blocks
  std::int64_t kv_bytes_per_token = 0;  // over every cached layer
  // The largest single step buffer whose size is known from the config: the f32 logits of
  // max_batched_tokens rows (every position's, as the engine sizes them), against the reserve.
  std::int64_t logits_bytes = 0;
  std::vector<RankMemoryPlan> ranks;
  // The KV tokens a rank must hold for the model to count as fitting: one sequence of its whole context
  // (ModelConfig::max_context_length) and at least one step of max_batched_tokens.
  std::int64_t required_kv_tokens = 0;

  // The blocks every rank can hold (the engine takes one --kv-blocks for all ranks).
  [[nodiscard]] std::int64_t kv_blocks() const;
  [[nodiscard]] std::int64_t kv_tokens() const { return kv_blocks() * kv.block_size; }
  // Every rank fits: weights + reserve + a cache of at least required_kv_tokens within device_memory.
  [[nodiscard]] bool fits() const;
};

// std::invalid_argument on options that cannot be planned (no device memory, no rank, no block size) or a
// config without a torch_dtype; LoadError on a bad placement.
MemoryPlan plan_memory(const ModelConfig& config, const TensorNames& names, const MemoryPlanOptions& options);

// "141GB" (10^9), "141GiB" (2^30), "512MiB", "80G" (= GB), or a byte count; std::invalid_argument otherwise.
std::int64_t parse_byte_size(std::string_view text);

}  // namespace capserve::runtime
