// The host side of the paged KV cache: the one blocks-per-tokens formula, and block tables that grow, refuse
// without a change when blocks run out, shrink (speculative rollback), and give their blocks back.
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

TEST(KvBlockManager, TruncateFreesOnlyTheBlocksPastTheKeptTokens) {
  KvBlockManager m(6, 4);
  ASSERT_TRUE(m.reserve(1, 13));  // blocks 0..3
  ASSERT_TRUE(m.reserve(2, 4));   // block 4
  m.truncate(1, 9);               // 9 tokens keep 3 blocks
  EXPECT_EQ(std::vector<std::int32_t>(m.block_table(1).begin(), m.block_table(1).end()),
            (std::vector<std::int32_t>{0, 1, 2}));
  EXPECT_EQ(m.free_blocks(), 2);
  m.truncate(1, 12);  // still 3 blocks: nothing to free, nothing grows
  EXPECT_EQ(m.block_table(1).size(), 3U);
  m.truncate(1, 1);
  EXPECT_EQ(m.block_table(1).size(), 1U);
  EXPECT_EQ(m.free_blocks(), 4);
  ASSERT_TRUE(m.reserve(3, 16));  // the freed blocks are handed out again
  EXPECT_EQ(m.free_blocks(), 0);
  m.truncate(99, 0);  // an unknown sequence: nothing
  EXPECT_EQ(m.block_table(2).size(), 1U);
}

}  // namespace
}  // namespace capserve::runtime
