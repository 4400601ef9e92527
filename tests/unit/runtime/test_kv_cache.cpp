// The KV cache's pools: their size for each layout and element type, and a backend that cannot keep the
// requested element type refusing it when the cache is built (at start-up), naming the option.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/kv_cache.h"

namespace capserve::runtime {
namespace {

KvCacheShape standard(kernels::DType dtype) {
  KvCacheShape s;
  s.num_layers = 2;
  s.num_kv_heads = 4;
  s.head_dim = 8;
  s.block_size = 16;
  s.num_blocks = 3;
  s.dtype = dtype;
  return s;
}

KvCacheShape latent(kernels::DType dtype) {
  KvCacheShape s;
  s.num_layers = 2;
  s.kv_lora_rank = 32;
  s.rope_dim = 8;
  s.block_size = 16;
  s.num_blocks = 3;
  s.dtype = dtype;
  return s;
}

TEST(KvCache, PoolsHoldEveryLayersBlocksInTheirElementType) {
  EXPECT_EQ(standard(kernels::DType::f32).bytes_per_token_per_layer(), 2 * 4 * 8 * 4);
  EXPECT_EQ(standard(kernels::DType::bf16).bytes_per_token_per_layer(), 2 * 4 * 8 * 2);
  EXPECT_EQ(latent(kernels::DType::f32).bytes_per_token_per_layer(), (32 + 8) * 4);
  EXPECT_EQ(latent(kernels::DType::bf16).bytes_per_token_per_layer(), (32 + 8) * 2);
  kernels::cpu::CpuBackend cpu(1);
  const KvCache k_v(standard(kernels::DType::f32), cpu);
  EXPECT_EQ(k_v.bytes(), 2 * 3 * 16 * standard(kernels::DType::f32).bytes_per_token_per_layer());
  const KvCache rows(latent(kernels::DType::f32), cpu);
  EXPECT_EQ(rows.bytes(), 2 * 3 * 16 * latent(kernels::DType::f32).bytes_per_token_per_layer());
}

TEST(KvCache, TheCpuRefusesABf16CacheWhenItIsBuiltNamingTheOption) {
  kernels::cpu::CpuBackend cpu(1);
  for (const KvCacheShape& shape : {standard(kernels::DType::bf16), latent(kernels::DType::bf16)}) {
    try {
      const KvCache cache(shape, cpu);
      ADD_FAILURE() << "a bf16 cache on the CPU was built";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("--kv-cache-dtype f32"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace capserve::runtime
