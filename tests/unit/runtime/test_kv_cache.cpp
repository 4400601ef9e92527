// The KV cache's pools: their size for each layout and element type, and a backend that cannot keep the
// requested element type refusing it when the cache is built (at start-up), naming the option.
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>

#include "kernels/cpu/cpu_backend.h"
#include "runtime/kv_cache.h"

namespace capserve::runtime {
namespace {

// Two layers of three 16-token blocks: K/V of 4 heads x 8 dims, or latent rows of rank 32 plus 8 rope dims.
KvCacheShape shape(bool latent, kernels::DType dtype) {
  KvCacheShape s;
  s.num_layers = 2;
  s.num_kv_heads = latent ? 0 : 4;
  s.head_dim = latent ? 0 : 8;
  s.kv_lora_rank = latent ? 32 : 0;
  s.rope_dim = latent ? 8 : 0;
  s.block_size = 16;
  s.num_blocks = 3;
  s.dtype = dtype;
  return s;
}
KvCacheShape standard(kernels::DType dtype) {
  return shape(false, dtype);
}
KvCacheShape latent(kernels::DType dtype) {
  return shape(true, dtype);
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
