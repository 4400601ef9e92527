#pragma once
// Paged KV cache: fixed-size blocks of token slots shared by all sequences, a free list, and one block table
// per sequence. Every layer has its own pools: K and V [num_blocks, block_size, num_kv_heads, head_dim] for
// standard attention, or for multi-head latent attention one pool of latent rows [num_blocks, block_size,
// kv_lora_rank + rope_dim] (the compressed latent and the shared rope key; keys and values of every head are
// recovered from it, so nothing per head is stored).
#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "kernels/backend.h"
#include "runtime/kv_block_manager.h"
#include "runtime/model_config.h"

namespace capserve::runtime {

struct KvCacheShape {
  std::int64_t num_layers = 0;
  // Standard attention.
  std::int64_t num_kv_heads = 0;
  std::int64_t head_dim = 0;
  // Multi-head latent attention instead, when kv_lora_rank > 0.
  std::int64_t kv_lora_rank = 0;
  std::int64_t rope_dim = 0;
  std::int64_t block_size = 16;
  std::int64_t num_blocks = 0;
  // K/V (or latent) elements: f32, or bf16 (half the memory; the CUDA backend only).
  kernels::DType dtype = kernels::DType::f32;

  [[nodiscard]] bool latent() const { return kv_lora_rank > 0; }
  // What one token costs in one layer.
  [[nodiscard]] std::int64_t bytes_per_token_per_layer() const;
};

// The cache a model needs: latent rows for MLA models, K and V otherwise.
KvCacheShape kv_cache_shape(const ModelConfig& config, std::int64_t block_size, std::int64_t num_blocks,
                            kernels::DType dtype = kernels::DType::f32);

class KvCache {
 public:
  // The pools are allocated by `backend`, on its device (uninitialised: attention reads only written slots).
  // `prefix_cache`: the block manager keeps full blocks by content for sharing (KvBlockManager). Their K/V
  // also depend on what this cache fixes (the model, the element type), so one manager per cache keys them
  // completely.
  KvCache(const KvCacheShape& shape, kernels::Backend& backend, bool prefix_cache = false);

  // Which blocks each sequence holds (the host side; the pools below are the backend's).
  [[nodiscard]] KvBlockManager& blocks() { return blocks_; }
  [[nodiscard]] const KvBlockManager& blocks() const { return blocks_; }
  [[nodiscard]] const KvCacheShape& shape() const { return shape_; }
  // Bytes allocated for all layers' pools.
  [[nodiscard]] std::int64_t bytes() const;

  // The layer's pools: layer() for standard attention, latent_layer() for multi-head latent attention.
  [[nodiscard]] kernels::PagedKvLayer layer(std::int64_t layer);
  [[nodiscard]] kernels::PagedLatentLayer latent_layer(std::int64_t layer);

 private:
  KvCacheShape shape_;
  kernels::Buffer k_;  // K, or the latent rows
  kernels::Buffer v_;  // V; empty for a latent cache
  KvBlockManager blocks_;
};

}  // namespace capserve::runtime
