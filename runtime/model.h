#pragma once
// A loaded model and its shared forward pass: one ragged batch of new tokens from many sequences (prefill
// chunks and single decode tokens mixed), attention over the paged KV cache, MoE or dense feed-forward per
// layer.
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "runtime/kv_cache.h"
#include "runtime/model_config.h"
#include "runtime/model_weights.h"
#include "runtime/moe_block.h"
#include "runtime/rope.h"
#include "runtime/weights/checkpoint.h"

namespace capserve::runtime {

struct ForwardBatch {
  std::span<const std::int32_t> tokens;          // [rows]: every sequence's new tokens, back to back
  std::span<const std::int32_t> positions;       // [rows]
  std::span<const kernels::SequenceSlice> seqs;  // which rows belong to which sequence, and its cache blocks
  std::span<const std::int64_t> logit_rows;      // rows whose next-token logits are wanted
};

class Model {
 public:
  // Reads config.json and the safetensors checkpoint in `dir`; LoadError naming the key, file or tensor at
  // fault.
  static std::unique_ptr<Model> load(const std::filesystem::path& dir);

  [[nodiscard]] const ModelConfig& config() const { return config_; }

  // Writes the new tokens' K/V into `cache` and fills logits [logit_rows.size(), vocab_size].
  void forward(const ForwardBatch& batch, KvCache& cache, kernels::Backend& backend, std::span<float> logits);

  // Tokens routed to each expert by the last forward: [num_layers, num_experts], row-major (zero on dense
  // layers).
  [[nodiscard]] std::span<const std::int64_t> last_expert_load() const { return expert_load_; }

 private:
  Model(ModelConfig config, Checkpoint checkpoint, const TensorNames& names);

  void attention(std::int64_t layer, const ForwardBatch& batch, KvCache& cache, kernels::Backend& backend);
  void feed_forward(std::int64_t layer, std::int64_t rows, kernels::Backend& backend);

  ModelConfig config_;
  Checkpoint checkpoint_;  // owns the mappings the weight views point into
  ModelWeights weights_;
  Rope rope_;
  std::vector<std::int64_t> expert_load_;

  // Grow-only activation buffers, reused by every step.
  struct Scratch {
    std::vector<float> residual, normed, q, k, v, attn, proj, cos, sin, final_rows;
    MoeScratch moe;
  } scratch_;
};

}  // namespace capserve::runtime
