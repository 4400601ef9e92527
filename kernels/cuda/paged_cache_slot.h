#pragma once
// Where a token of a paged cache lives, on the device: the slot of position `pos` of the sequence that batch
// row `row` belongs to, through that sequence's block table.
#include <cstdint>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/layer_kernels.h"

namespace capserve::kernels::cuda {

__device__ inline std::int64_t cache_slot(const DeviceAttentionBatch& batch, std::int64_t block_size,
                                          std::int64_t row, std::int64_t pos) {
  const std::int32_t* table =
      batch.block_tables + static_cast<std::int64_t>(batch.row_seq[row]) * batch.max_blocks;
  return static_cast<std::int64_t>(table[pos / block_size]) * block_size + pos % block_size;
}

}  // namespace capserve::kernels::cuda
