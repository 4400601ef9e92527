// The host side of the paged KV cache: the one blocks-per-tokens formula, and block tables that grow, refuse
// without a change when blocks run out, and give their blocks back.
#include <gtest/gtest.h>

#include <vector>

#include "runtime/kv_block_manager.h"

namespace capserve::runtime {
namespace {

TEST(KvBlockManager, BlocksForRoundsUpToWholeBlocks) {
  EXPECT_EQ(KvBlockManager::blocks_for(0, 16), 0);
  EXPECT_EQ(KvBlockManager::blocks_for(1, 16), 1);
  EXPECT_EQ(KvBlockManager::blocks_for(16, 16), 1);
  EXPECT_EQ(KvBlockManager::blocks_for(17, 16), 2);
  EXPECT_EQ(KvBlockManager(4, 8).blocks_for(33), 5);
}

TEST(KvBlockManager, TablesGrowRefuseWithoutChangeAndGiveBlocksBack) {
  KvBlockManager m(5, 4);
  ASSERT_TRUE(m.reserve(1, 6));  // 2 blocks, the lowest ids first
  EXPECT_EQ(std::vector<std::int32_t>(m.block_table(1).begin(), m.block_table(1).end()),
            (std::vector<std::int32_t>{0, 1}));
  ASSERT_TRUE(m.reserve(2, 4));
  EXPECT_EQ(m.free_blocks(), 2);
  EXPECT_FALSE(m.reserve(2, 16));  // needs 3 more, 2 free
  EXPECT_EQ(m.free_blocks(), 2);
  EXPECT_EQ(m.block_table(2).size(), 1U);
  ASSERT_TRUE(m.reserve(1, 8));  // still 2 blocks
  EXPECT_EQ(m.free_blocks(), 2);
  m.release(1);
  EXPECT_EQ(m.free_blocks(), 4);
  EXPECT_THROW((void)m.block_table(1), std::out_of_range);
  m.release(1);  // releasing twice changes nothing
  EXPECT_EQ(m.free_blocks(), 4);
  EXPECT_THROW(KvBlockManager(3, 0), std::invalid_argument);
}

}  // namespace
}  // namespace capserve::runtime
