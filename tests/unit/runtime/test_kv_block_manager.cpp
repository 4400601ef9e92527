// The host side of the paged KV cache: the one blocks-per-tokens formula, and block tables that grow, refuse
// without a change when blocks run out, shrink (speculative rollback), and give their blocks back. With the
// prefix cache: full blocks shared by content with reference counts, kept when freed and evicted least
// recently released first, exact matching whatever the hash, and a state that is a function of the
// operations alone (the server's per-rank mirror relies on it).
#include <gtest/gtest.h>

#include <random>
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

std::vector<std::int32_t> table(const KvBlockManager& m, SequenceId seq) {
  const std::span<const std::int32_t> t = m.block_table(seq);
  return {t.begin(), t.end()};
}

// A sequence computed from scratch: its blocks reserved, then its tokens recorded (a successful step).
void compute(KvBlockManager& m, SequenceId seq, const std::vector<std::int32_t>& tokens) {
  ASSERT_TRUE(m.reserve(seq, static_cast<std::int64_t>(tokens.size())));
  m.append_tokens(seq, tokens);
}

std::uint64_t one_bucket(std::uint64_t /*parent_key*/, std::span<const std::int32_t> /*tokens*/) {
  return 0;
}

TEST(KvBlockManagerPrefixCache, SharesFullBlocksWithReferenceCountsAndKeepsThemForTheOtherHolder) {
  KvBlockManager m(8, 4, true);
  EXPECT_TRUE(m.prefix_cache());
  const std::vector<std::int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
  compute(m, 1, a);                 // blocks 0, 1 full and cached; block 2 partial
  EXPECT_EQ(m.cached_blocks(), 2);  // a partial block is never cached
  const std::vector<std::int32_t> b = {1, 2, 3, 4, 5, 6, 7, 8, 42, 43};
  EXPECT_EQ(m.cached_prefix(b), 8);
  EXPECT_EQ(m.idle_cached_blocks(b, 8), 0);  // sequence 1 holds them
  ASSERT_TRUE(m.adopt_prefix(2, b, 8));
  EXPECT_EQ(table(m, 2), (std::vector<std::int32_t>{0, 1}));
  ASSERT_TRUE(m.reserve(2, 10));
  m.append_tokens(2, std::span(b).subspan(8));
  EXPECT_EQ(table(m, 2), (std::vector<std::int32_t>{0, 1, 3}));
  EXPECT_EQ(m.free_blocks(), 4);
  EXPECT_FALSE(m.adopt_prefix(2, b, 8));      // a known sequence
  EXPECT_FALSE(m.adopt_prefix(3, b, 4 + 2));  // not whole blocks

  // Sequence 1 goes; sequence 2 still holds the shared blocks, which stay cached with their content.
  m.release(1);
  EXPECT_EQ(m.free_blocks(), 5);  // only sequence 1's own partial block came back
  EXPECT_EQ(m.cached_blocks(), 2);
  EXPECT_EQ(m.cached_prefix(a), 8);
  EXPECT_EQ(m.idle_cached_blocks(a, 8), 0);
  ASSERT_TRUE(m.adopt_prefix(3, a, 8));
  EXPECT_EQ(table(m, 3), (std::vector<std::int32_t>{0, 1}));
  m.release(2);
  m.release(3);
  // Nobody holds them now: idle, cached, and free for a reservation.
  EXPECT_EQ(m.free_blocks(), 8);
  EXPECT_EQ(m.cached_blocks(), 2);
  EXPECT_EQ(m.idle_cached_blocks(a, 8), 2);
  EXPECT_EQ(m.idle_cached_blocks(a, 4), 1);
  ASSERT_TRUE(m.adopt_prefix(4, a, 8));
  EXPECT_EQ(m.free_blocks(), 6);  // adopting idle blocks takes them out of the free pool
  EXPECT_EQ(m.evictions(), 0);
}

// After a failed step: every cached block no sequence holds is evicted; the ones a sequence holds stay
// cached and shareable.
TEST(KvBlockManagerPrefixCache, DropIdleEvictsExactlyTheBlocksNoSequenceHolds) {
  KvBlockManager m(8, 4, true);
  const std::vector<std::int32_t> held = {1, 2, 3, 4, 5, 6, 7, 8};
  const std::vector<std::int32_t> idle = {11, 12, 13, 14, 15, 16, 17, 18, 19};
  compute(m, 1, held);
  compute(m, 2, idle);
  m.release(2);
  EXPECT_EQ(m.cached_blocks(), 4);
  EXPECT_EQ(m.free_blocks(), 6);
  m.drop_idle();
  EXPECT_EQ(m.cached_blocks(), 2);
  EXPECT_EQ(m.evictions(), 2);
  EXPECT_EQ(m.free_blocks(), 6);  // the dropped blocks are free, plain ones now
  EXPECT_EQ(m.cached_prefix(idle), 0);
  EXPECT_EQ(m.cached_prefix(held), 8);
  ASSERT_TRUE(m.adopt_prefix(3, held, 8));
  m.drop_idle();  // nothing idle: nothing changes
  EXPECT_EQ(m.cached_blocks(), 2);
  EXPECT_EQ(m.evictions(), 2);
}

TEST(KvBlockManagerPrefixCache, EvictsTheLeastRecentlyReleasedIdleBlockTailFirstUnderMemoryPressure) {
  KvBlockManager m(6, 2, true);
  const std::vector<std::int32_t> x = {1, 2, 3, 4};
  const std::vector<std::int32_t> y = {5, 6, 7, 8};
  compute(m, 1, x);  // blocks 0, 1
  compute(m, 2, y);  // blocks 2, 3
  m.release(1);
  m.release(2);
  // x was released first, but a sequence adopting it and going makes it the most recently used.
  ASSERT_TRUE(m.adopt_prefix(3, x, 4));
  m.release(3);
  EXPECT_EQ(m.free_blocks(), 6);
  EXPECT_EQ(m.idle_cached_blocks(y, 4), 2);
  ASSERT_TRUE(m.reserve(4, 4));  // the two plain free blocks first: nothing evicted
  EXPECT_EQ(table(m, 4), (std::vector<std::int32_t>{4, 5}));
  EXPECT_EQ(m.evictions(), 0);
  ASSERT_TRUE(m.reserve(4, 6));  // then y's tail, the least recently released
  EXPECT_EQ(table(m, 4).back(), 3);
  EXPECT_EQ(m.evictions(), 1);
  EXPECT_EQ(m.cached_blocks(), 3);
  EXPECT_EQ(m.cached_prefix(y), 2);  // its head outlives it
  EXPECT_EQ(m.cached_prefix(x), 4);
  EXPECT_EQ(m.free_blocks(), 3);
  ASSERT_TRUE(m.reserve(4, 8));  // then y's head
  EXPECT_EQ(table(m, 4).back(), 2);
  EXPECT_EQ(m.cached_prefix(y), 0);
  EXPECT_EQ(m.cached_prefix(x), 4);
  // An adopted block is not evictable: with x held, nothing is left to reserve.
  ASSERT_TRUE(m.adopt_prefix(5, x, 4));
  EXPECT_EQ(m.free_blocks(), 0);
  EXPECT_FALSE(m.reserve(5, 6));
  EXPECT_EQ(table(m, 5), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(m.evictions(), 2);
  // Evicted blocks were reused for other content: recording it caches the new content under them.
  m.append_tokens(4, std::vector<std::int32_t>{9, 9, 9, 9, 9, 9, 9, 9});
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{9, 9, 9, 9, 9, 9, 9, 9}), 8);
}

TEST(KvBlockManagerPrefixCache, CachedPrefixStopsAtTheFirstMissingBlockAndAtAPartialLastBlock) {
  KvBlockManager m(8, 2, true);
  compute(m, 1, {1, 2, 3, 4, 5, 6, 7});  // 3 full blocks and one partial
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7}), 6);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4, 5, 6, 7, 8}), 6);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4, 5}), 4);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 9, 5, 6}), 2);  // [5, 6] follows another block
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{3, 4, 5, 6}), 0);        // equal tokens, other parent
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1}), 0);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{}), 0);
  EXPECT_FALSE(m.adopt_prefix(2, std::vector<std::int32_t>{1, 2, 3, 9}, 4));
  EXPECT_THROW((void)m.block_table(2), std::out_of_range);  // no change
  EXPECT_EQ(m.free_blocks(), 4);
}

TEST(KvBlockManagerPrefixCache, MatchingStaysExactWhenEveryBlockHashesToOneBucket) {
  KvBlockManager colliding(64, 2, true, one_bucket);
  KvBlockManager hashed(64, 2, true);
  // Prefixes that differ in one token id anywhere, or only in their parent.
  std::vector<std::vector<std::int32_t>> seqs;
  for (std::int32_t i = 0; i < 6; ++i) {
    seqs.push_back({1, 2, 3, i, 5, 6});
    seqs.push_back({i, 2, 3, 4, 5, 6});
  }
  for (std::size_t s = 0; s < seqs.size(); ++s) {
    compute(colliding, s + 1, seqs[s]);
    compute(hashed, s + 1, seqs[s]);
  }
  EXPECT_EQ(colliding.cached_blocks(), hashed.cached_blocks());
  for (std::int32_t i = 0; i < 8; ++i) {
    for (const std::vector<std::int32_t>& probe :
         {std::vector<std::int32_t>{1, 2, 3, i, 5, 6, 7}, std::vector<std::int32_t>{i, 2, 3, 4, 5, 6},
          std::vector<std::int32_t>{1, 2, i, 4, 5, 6}, std::vector<std::int32_t>{3, i, 5, 6}}) {
      EXPECT_EQ(colliding.cached_prefix(probe), hashed.cached_prefix(probe)) << "i " << i;
    }
    EXPECT_EQ(colliding.cached_prefix(std::vector<std::int32_t>{1, 2, 3, i, 5, 6}), i < 6 ? 6 : 2);
    EXPECT_EQ(colliding.cached_prefix(std::vector<std::int32_t>{1, 2, i, 4, 5, 6}), i == 3 ? 6 : 2);
  }
}

TEST(KvBlockManagerPrefixCache, DuplicatesStayUncachedAndTheirSuccessorsChainOnTheCachedBlock) {
  KvBlockManager m(8, 2, true);
  const std::vector<std::int32_t> p = {1, 2, 3, 4};
  compute(m, 1, p);  // blocks 0, 1
  compute(m, 2, p);  // blocks 2, 3 hold the same content, computed again: not cached twice
  EXPECT_EQ(m.cached_blocks(), 2);
  ASSERT_TRUE(m.reserve(2, 6));
  m.append_tokens(2, std::vector<std::int32_t>{5, 6});
  EXPECT_EQ(m.cached_blocks(), 3);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4, 5, 6}), 6);
  m.release(1);
  EXPECT_EQ(m.free_blocks(), 5);  // 3 plain and sequence 1's 2 blocks, idle cached
  m.release(2);
  // Sequence 2's duplicates go back as plain blocks; its third block stays cached.
  EXPECT_EQ(m.cached_blocks(), 3);
  EXPECT_EQ(m.free_blocks(), 8);
  EXPECT_EQ(m.idle_cached_blocks(std::vector<std::int32_t>{1, 2, 3, 4, 5, 6}, 6), 3);
  ASSERT_TRUE(m.adopt_prefix(3, std::vector<std::int32_t>{1, 2, 3, 4, 5, 6}, 6));
  EXPECT_EQ(table(m, 3), (std::vector<std::int32_t>{0, 1, 4}));
}

TEST(KvBlockManagerPrefixCache, TruncateUncachesTheRejectedBlocksAndTheBlockItCutsInto) {
  KvBlockManager m(8, 2, true);
  compute(m, 1, {1, 2, 3, 4, 5, 6});  // blocks 0, 1, 2, all cached
  EXPECT_EQ(m.cached_blocks(), 3);
  m.truncate(1, 3);  // block 2 is freed, block 1 keeps one position and is written again
  EXPECT_EQ(table(m, 1), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(m.cached_blocks(), 1);
  EXPECT_EQ(m.free_blocks(), 6);  // plain: no rejected position stays cached
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4, 5, 6}), 2);
  m.append_tokens(1, std::vector<std::int32_t>{7});  // position 3: the recorded tokens end at the cut
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 7}), 4);
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 4}), 2);
  EXPECT_THROW(m.append_tokens(1, std::vector<std::int32_t>{8}), std::logic_error);  // no slot reserved

  // A block another sequence holds stays cached when this one lets go of it, and may not be cut into.
  ASSERT_TRUE(m.adopt_prefix(2, std::vector<std::int32_t>{1, 2, 3, 7}, 4));
  EXPECT_THROW(m.truncate(1, 3), std::logic_error);
  EXPECT_EQ(table(m, 1), (std::vector<std::int32_t>{0, 1}));  // no change
  m.truncate(1, 2);
  EXPECT_EQ(table(m, 1), (std::vector<std::int32_t>{0}));
  EXPECT_EQ(m.cached_prefix(std::vector<std::int32_t>{1, 2, 3, 7}), 4);
}

TEST(KvBlockManagerPrefixCache, StateIsAFunctionOfTheOperationsWhateverTheHash) {
  // The same random operations on managers whose hashes order their buckets differently (one puts every
  // block in one bucket): the same block tables, counts and answers after every operation.
  const auto reversed = [](std::uint64_t parent, std::span<const std::int32_t> tokens) {
    return ~KvBlockManager::default_block_hash(parent, tokens);
  };
  std::vector<KvBlockManager> ms;
  ms.emplace_back(24, 2, true);
  ms.emplace_back(24, 2, true, one_bucket);
  ms.emplace_back(24, 2, true, +reversed);
  std::mt19937 rng(7);
  const auto pick = [&rng](int n) { return static_cast<int>(rng() % static_cast<unsigned>(n)); };
  std::vector<std::vector<std::int32_t>> live(6);  // each sequence's recorded tokens; empty: not started
  // 1: the operation took effect; 0: refused (a new sequence that did not fit is released again); 2: threw.
  const auto apply = [](KvBlockManager& m, SequenceId seq, const std::vector<std::int32_t>& tokens, int what,
                        const std::vector<std::int32_t>& more) {
    if (tokens.empty()) {
      const std::int64_t cached = m.cached_prefix(more);
      if (m.adopt_prefix(seq, more, cached) && m.reserve(seq, static_cast<std::int64_t>(more.size()))) {
        m.append_tokens(seq, std::span(more).subspan(static_cast<std::size_t>(cached)));
        return 1;
      }
      m.release(seq);
      return 0;
    }
    if (what == 0) {
      m.release(seq);
      return 1;
    }
    if (what == 1 && tokens.size() > 1) {
      try {
        m.truncate(seq, static_cast<std::int64_t>(tokens.size()) - 1);
        return 1;
      } catch (const std::logic_error&) {
        return 2;  // it would cut into a block another sequence holds
      }
    }
    if (!m.reserve(seq, static_cast<std::int64_t>(tokens.size() + more.size()))) return 0;
    m.append_tokens(seq, more);
    return 1;
  };
  for (int op = 0; op < 3000; ++op) {
    const auto seq = static_cast<std::size_t>(pick(6));
    const int what = pick(4);
    std::vector<std::int32_t> more;
    for (int i = pick(7) + 1; i > 0; --i) more.push_back(pick(2));  // tiny alphabet: many shared prefixes
    const int outcome = apply(ms[0], seq, live[seq], what, more);
    for (std::size_t i = 1; i < ms.size(); ++i)
      ASSERT_EQ(apply(ms[i], seq, live[seq], what, more), outcome) << "op " << op << " manager " << i;
    std::vector<std::int32_t>& tokens = live[seq];
    if (outcome == 1) {
      if (tokens.empty() || what >= 2 || (what == 1 && tokens.size() <= 1)) {
        tokens.insert(tokens.end(), more.begin(), more.end());
      } else if (what == 0) {
        tokens.clear();
      } else {
        tokens.pop_back();
      }
    }
    for (const KvBlockManager& m : ms) {
      ASSERT_EQ(m.free_blocks(), ms[0].free_blocks()) << "op " << op;
      ASSERT_EQ(m.cached_blocks(), ms[0].cached_blocks()) << "op " << op;
      ASSERT_EQ(m.evictions(), ms[0].evictions()) << "op " << op;
      for (std::size_t s = 0; s < live.size(); ++s) {
        if (live[s].empty()) continue;
        ASSERT_EQ(table(m, s), table(ms[0], s)) << "op " << op << " sequence " << s;
        ASSERT_EQ(m.cached_prefix(live[s]), ms[0].cached_prefix(live[s])) << "op " << op;
      }
    }
  }
  EXPECT_GT(ms.front().evictions(), 0);  // the operations did reach memory pressure
}

TEST(KvBlockManagerPrefixCache, OffRecordsNothingAndHandsOutTheSameBlocks) {
  KvBlockManager off(6, 2);
  KvBlockManager plain(6, 2);
  EXPECT_FALSE(off.prefix_cache());
  const std::vector<std::int32_t> p = {1, 2, 3, 4, 5};
  compute(off, 1, p);
  ASSERT_TRUE(plain.reserve(1, 5));
  off.release(1);
  plain.release(1);
  compute(off, 2, {1, 2, 3});
  ASSERT_TRUE(plain.reserve(2, 3));
  EXPECT_EQ(table(off, 2), table(plain, 2));
  EXPECT_EQ(off.cached_prefix(p), 0);
  EXPECT_EQ(off.cached_blocks(), 0);
  EXPECT_EQ(off.idle_cached_blocks(p, 0), 0);
  EXPECT_FALSE(off.adopt_prefix(3, p, 2));
  EXPECT_TRUE(off.adopt_prefix(3, p, 0));  // a sequence with no cached blocks
  EXPECT_EQ(off.free_blocks(), 4);
}

}  // namespace
}  // namespace capserve::runtime
