#include "runtime/kv_cache.h"

#include <stdexcept>

namespace capserve::runtime {

namespace {

// Values of one token in one layer's first pool (K, or the latent row); the V pool, if any, has as many.
std::int64_t row_floats(const KvCacheShape& s) {
  return s.latent() ? s.kv_lora_rank + s.rope_dim : s.num_kv_heads * s.head_dim;
}

}  // namespace

std::int64_t KvCacheShape::bytes_per_token_per_layer() const {
  return row_floats(*this) * (latent() ? 1 : 2) * static_cast<std::int64_t>(kernels::dtype_size(dtype));
}

KvCacheShape kv_cache_shape(const ModelConfig& config, std::int64_t block_size, std::int64_t num_blocks,
                            kernels::DType dtype) {
  KvCacheShape s;
  s.num_layers = config.num_layers;
  if (config.mla) {
    s.kv_lora_rank = config.mla->kv_lora_rank;
    s.rope_dim = config.mla->qk_rope_head_dim;
  } else {
    s.num_kv_heads = config.num_kv_heads;
    s.head_dim = config.head_dim;
  }
  s.block_size = block_size;
  s.num_blocks = num_blocks;
  s.dtype = dtype;
  return s;
}

KvCache::KvCache(const KvCacheShape& shape, kernels::Backend& backend, bool prefix_cache)
    : shape_(shape), blocks_(shape.num_blocks, shape.block_size, prefix_cache) {
  backend.check_kv_dtype(shape.dtype);
  const auto bytes =
      static_cast<std::size_t>(shape.num_layers * shape.num_blocks * shape.block_size * row_floats(shape)) *
      kernels::dtype_size(shape.dtype);
  k_ = backend.allocate(bytes);
  if (!shape.latent()) v_ = backend.allocate(bytes);
}

std::int64_t KvCache::bytes() const {
  return static_cast<std::int64_t>(k_.bytes() + v_.bytes());
}

kernels::PagedKvLayer KvCache::layer(std::int64_t layer) {
  if (shape_.latent()) throw std::logic_error("KvCache: a latent cache has no K/V layers");
  const std::int64_t blocks = shape_.num_layers * shape_.num_blocks;
  const auto pool = [&](const kernels::Buffer& b) {
    return b.view(shape_.dtype, {blocks, shape_.block_size, shape_.num_kv_heads, shape_.head_dim})
        .rows(layer * shape_.num_blocks, shape_.num_blocks);
  };
  return {pool(k_), pool(v_), shape_.block_size, shape_.num_kv_heads, shape_.head_dim};
}

kernels::PagedLatentLayer KvCache::latent_layer(std::int64_t layer) {
  if (!shape_.latent()) throw std::logic_error("KvCache: a K/V cache has no latent layers");
  const std::int64_t blocks = shape_.num_layers * shape_.num_blocks;
  return {k_.view(shape_.dtype, {blocks, shape_.block_size, row_floats(shape_)})
              .rows(layer * shape_.num_blocks, shape_.num_blocks),
          shape_.block_size, shape_.kv_lora_rank, shape_.rope_dim};
}

}  // namespace capserve::runtime
