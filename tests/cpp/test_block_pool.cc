// BlockPool: ref counts, the intrusive LRU free list, the prefix cache (publish, hits, the
// last-block rule, the collision guard, lazy eviction), state slots and KV events.
// Every test calls pool.check_invariants(expected ref counts) after every operation.
#include "atom_sched/block_pool.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <vector>

#include "atom_sched/errors.h"
#include "atom_sched/kv_events.h"
#include "atom_sched/xxhash64.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

using test::Cat;
using test::Seq;
using test::V;
using H = std::vector<uint64_t>;

// ATOM's chained hashes of the full blocks of `tokens`.
H Chain(const V& tokens, int32_t bs) {
  H out;
  std::optional<uint64_t> parent;
  for (size_t i = 0; i + bs <= tokens.size(); i += bs) {
    const uint64_t h = block_hash(std::span<const int32_t>(tokens).subspan(i, bs), parent);
    out.push_back(h);
    parent = h;
  }
  return out;
}

// Expected ref counts from the tables that hold blocks, then the pool's own check.
void Check(const BlockPool& pool, std::initializer_list<const V*> tables) {
  std::vector<int32_t> refs(pool.num_blocks(), 0);
  for (const V* t : tables)
    for (int32_t b : *t) ++refs.at(b);
  ASSERT_NO_THROW(pool.check_invariants(refs));
  int32_t used = 0;
  for (int32_t b = 0; b < pool.num_blocks(); ++b) {
    EXPECT_EQ(pool.ref_count(b), refs[b]) << "block " << b;
    used += refs[b] > 0;
  }
  EXPECT_EQ(pool.num_used_blocks(), used);
  EXPECT_EQ(pool.num_free_blocks(), pool.num_usable_blocks() - used);
  EXPECT_EQ(static_cast<int32_t>(pool.free_list().size()), pool.num_free_blocks());
}

std::vector<KvEvent> OfKind(const std::vector<KvEvent>& events, KvEventKind kind) {
  std::vector<KvEvent> out;
  for (const auto& e : events)
    if (e.kind == kind) out.push_back(e);
  return out;
}

// All hashes named by BlockRemoved events, in order.
H RemovedHashes(const std::vector<KvEvent>& events) {
  H out;
  for (const auto& e : events) {
    if (e.kind != KvEventKind::kBlockRemoved) continue;
    EXPECT_EQ(e.medium, Medium::kGpu);
    out.insert(out.end(), e.block_hashes.begin(), e.block_hashes.end());
  }
  return out;
}

void ExpectStored(const KvEvent& e, const H& hashes, std::optional<uint64_t> parent,
                  const V& tokens, int32_t bs) {
  EXPECT_EQ(e.kind, KvEventKind::kBlockStored);
  EXPECT_EQ(e.block_hashes, hashes);
  EXPECT_EQ(e.parent_block_hash, parent);
  EXPECT_EQ(e.token_ids, tokens);
  EXPECT_EQ(e.block_size, bs);
  EXPECT_EQ(e.medium, Medium::kGpu);
}

TEST(BlockPoolTest, InitialState) {
  BlockPool pool(7, 4, true, true);
  Check(pool, {});
  EXPECT_EQ(pool.num_blocks(), 7);
  EXPECT_EQ(pool.num_usable_blocks(), 6);
  EXPECT_EQ(pool.block_size(), 4);
  EXPECT_TRUE(pool.prefix_caching());
  EXPECT_TRUE(pool.events_enabled());
  EXPECT_EQ(pool.num_free_blocks(), 6);
  EXPECT_EQ(pool.num_used_blocks(), 0);
  EXPECT_DOUBLE_EQ(pool.usage(), 0.0);
  EXPECT_EQ(pool.free_list(), Seq(1, 6));  // every block but the null block
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  EXPECT_EQ(pool.num_state_slots(), 0);
  EXPECT_EQ(pool.num_free_state_slots(), 0);
  for (int32_t b = 0; b < 7; ++b) {
    EXPECT_EQ(pool.ref_count(b), 0);
    EXPECT_FALSE(pool.is_cached(b));
  }
  EXPECT_TRUE(pool.take_events().empty());
}

TEST(BlockPoolTest, ConstructorRejectsBadArguments) {
  EXPECT_THROW(BlockPool(0, 4, true, false), InvalidArgument);
  EXPECT_THROW(BlockPool(1, 4, true, false), InvalidArgument);  // the null block alone
  EXPECT_THROW(BlockPool(-3, 4, true, false), InvalidArgument);
  EXPECT_THROW(BlockPool(4, 0, true, false), InvalidArgument);
  EXPECT_THROW(BlockPool(4, -1, true, false), InvalidArgument);
  EXPECT_THROW(BlockPool(4, 4, true, false, -1), InvalidArgument);
  EXPECT_NO_THROW(BlockPool(2, 1, false, false, 0));
}

// Block 0 is the null block that pads every block table: it is never handed out or cached, even
// when the pool runs dry, is reset, or blocks are freed and reused.
TEST(BlockPoolTest, NullBlockIsNeverHandedOut) {
  BlockPool pool(4, 2, true, true, 1);
  const V p = Seq(100, 6);
  const H hp = Chain(p, 2);
  for (int round = 0; round < 3; ++round) {
    V a;
    ASSERT_EQ(pool.can_allocate(hp, p, 6, false), round == 1 ? 2 : 0);
    pool.allocate(hp, pool.can_allocate(hp, p, 6, false), 6, a);
    Check(pool, {&a});
    EXPECT_EQ(pool.num_free_blocks(), 0);
    EXPECT_EQ(std::count(a.begin(), a.end(), kNullBlock), 0);
    EXPECT_FALSE(pool.grow(a, 4));  // the null block does not count as free
    pool.publish(a, hp, p, 0, 3);
    EXPECT_FALSE(pool.is_cached(kNullBlock));
    pool.free(a);
    Check(pool, {});
    if (round == 1) pool.reset_prefix_cache();
  }
  EXPECT_EQ(pool.ref_count(kNullBlock), 0);
  EXPECT_DOUBLE_EQ(pool.usage(), 0.0);
}

TEST(BlockPoolTest, AllocateAndFreeRefCounts) {
  BlockPool pool(7, 4, true, false);
  V a, b;
  pool.allocate({}, 0, 10, a);  // 10 tokens -> 3 blocks
  Check(pool, {&a});
  EXPECT_EQ(a, (V{1, 2, 3}));
  EXPECT_EQ(pool.free_list(), (V{4, 5, 6}));
  EXPECT_DOUBLE_EQ(pool.usage(), 0.5);

  pool.allocate({}, 0, 4, b);  // exactly one block
  Check(pool, {&a, &b});
  EXPECT_EQ(b, (V{4}));
  EXPECT_EQ(pool.free_list(), (V{5, 6}));

  // Frees go to the tail, the request's last block first.
  pool.free(a);
  a.clear();
  Check(pool, {&b});
  EXPECT_EQ(pool.free_list(), (V{5, 6, 3, 2, 1}));

  pool.free(b);
  b.clear();
  Check(pool, {});
  EXPECT_EQ(pool.free_list(), (V{5, 6, 3, 2, 1, 4}));

  // Allocation takes the head: the least recently freed blocks.
  V c;
  pool.allocate({}, 0, 8, c);
  Check(pool, {&c});
  EXPECT_EQ(c, (V{5, 6}));
  EXPECT_EQ(pool.free_list(), (V{3, 2, 1, 4}));
}

TEST(BlockPoolTest, CanAllocateReturnsMinusOneWhenShort) {
  for (bool caching : {true, false}) {
    SCOPED_TRACE(caching);
    BlockPool pool(5, 4, caching, false);
    V a;
    pool.allocate({}, 0, 12, a);
    Check(pool, {&a});
    ASSERT_EQ(pool.num_free_blocks(), 1);
    const V x = Seq(500, 8);
    const H hx = Chain(x, 4);
    EXPECT_EQ(pool.can_allocate(hx, x, 8, false), -1);  // 2 blocks, 1 free
    EXPECT_EQ(pool.can_allocate(hx, x, 5, false), -1);  // 2 blocks
    EXPECT_EQ(pool.can_allocate(hx, x, 4, false), 0);   // 1 block
    EXPECT_EQ(pool.can_allocate(hx, x, 1, false), 0);
    Check(pool, {&a});  // pure
  }
}

TEST(BlockPoolTest, CanAllocateCountsHitsAndNeverHitsTheLastBlock) {
  BlockPool pool(9, 4, true, false);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);
  pool.publish(a, hp, p, 0, 3);
  Check(pool, {&a});
  ASSERT_EQ(pool.num_cached_hashes(), 3);

  // Same 12 tokens: 3 full blocks cached, but the last block is never a hit.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 2);
  // 16 tokens with the same first 12: blocks 0..2 hit, block 3 is the last.
  const V q = Cat(p, Seq(900, 4));
  EXPECT_EQ(pool.can_allocate(Chain(q, 4), q, 16, false), 3);
  // 10 tokens (2 full blocks + 2): both full blocks may hit.
  const V p10(p.begin(), p.begin() + 10);
  EXPECT_EQ(pool.can_allocate(Chain(p10, 4), p10, 10, false), 2);
  // 8 tokens: 2 full blocks, the second is the last -> 1 hit.
  const V p8(p.begin(), p.begin() + 8);
  EXPECT_EQ(pool.can_allocate(Chain(p8, 4), p8, 8, false), 1);
  // 4 tokens: one block, which is the last -> 0 hits.
  const V p4(p.begin(), p.begin() + 4);
  EXPECT_EQ(pool.can_allocate(Chain(p4, 4), p4, 4, false), 0);
  // Diverging in block 1: only block 0 hits, and the chain stops at the first miss even though
  // block 2's content matches (its chained hash differs).
  V r = p;
  r[5] = 7777;
  r.insert(r.end(), {1, 2, 3, 4});
  EXPECT_EQ(pool.can_allocate(Chain(r, 4), r, 16, false), 1);
  // Diverging in block 0: nothing.
  V s = q;
  s[0] = 1;
  EXPECT_EQ(pool.can_allocate(Chain(s, 4), s, 16, false), 0);

  EXPECT_EQ(pool.count_cached_blocks(hp, p, 3), 3);
  EXPECT_EQ(pool.count_cached_blocks(hp, p, 2), 2);
  EXPECT_EQ(pool.count_cached_blocks(hp, p, 0), 0);
  EXPECT_EQ(pool.count_cached_blocks(Chain(r, 4), r, 4), 1);
  Check(pool, {&a});
}

TEST(BlockPoolTest, HitOnUsedBlockNeedsNoFreeBlock) {
  BlockPool pool(5, 4, true, false);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);  // {1,2,3}, still held
  pool.publish(a, hp, p, 0, 3);
  Check(pool, {&a});
  ASSERT_EQ(pool.num_free_blocks(), 1);
  // 3 blocks needed, 2 of them shared with a live request: 1 fresh block suffices.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 2);

  V b;
  pool.allocate(hp, 2, 12, b);
  Check(pool, {&a, &b});
  EXPECT_EQ(b, (V{1, 2, 4}));
  EXPECT_EQ(pool.ref_count(1), 2);
  EXPECT_EQ(pool.ref_count(2), 2);
  EXPECT_EQ(pool.ref_count(3), 1);
  EXPECT_EQ(pool.ref_count(4), 1);
  EXPECT_EQ(pool.num_free_blocks(), 0);
  // Now even full sharing cannot help: the last block always needs a fresh one.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), -1);
}

// recompute_last_hit (vLLM's EAGLE block drop): a hit gives back its last block, after the
// last-block rule has capped it.
TEST(BlockPoolTest, RecomputeLastHitGivesBackTheHitsLastBlock) {
  BlockPool pool(9, 4, true, false, 0, /*recompute_last_hit=*/true);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);
  pool.publish(a, hp, p, 0, 3);
  Check(pool, {&a});
  // 16 tokens with the same first 12: blocks 0..2 match, block 2 is given back.
  const V q = Cat(p, Seq(900, 4));
  EXPECT_EQ(pool.can_allocate(Chain(q, 4), q, 16, false), 2);
  // The same 12 tokens: 2 may hit (the last block never does), 1 after the drop.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 1);
  // 8 tokens: 1 may hit, none after the drop; no hit, nothing to give back.
  const V p8(p.begin(), p.begin() + 8);
  EXPECT_EQ(pool.can_allocate(Chain(p8, 4), p8, 8, false), 0);
  V s = q;
  s[0] = 1;
  EXPECT_EQ(pool.can_allocate(Chain(s, 4), s, 16, false), 0);
  Check(pool, {&a});
}

TEST(BlockPoolTest, RecomputeLastHitNeedsAFreshBlockForTheGivenBackOne) {
  // A live request holds three cached blocks; a 16-token request with the same first 12 tokens
  // would share all three and need one fresh block, but gives the third back: it shares two and
  // needs two fresh blocks.
  const V p = Seq(100, 12), q = Cat(p, Seq(900, 4));
  const H hp = Chain(p, 4), hq = Chain(q, 4);
  for (int32_t free_blocks : {1, 2}) {
    SCOPED_TRACE(testing::Message() << free_blocks << " free blocks");
    BlockPool pool(4 + free_blocks, 4, true, false, 0, /*recompute_last_hit=*/true);
    V a;
    pool.allocate(hp, 0, 12, a);
    pool.publish(a, hp, p, 0, 3);
    ASSERT_EQ(pool.num_free_blocks(), free_blocks);
    if (free_blocks == 1) {
      EXPECT_EQ(pool.can_allocate(hq, q, 16, false), -1);
      continue;
    }
    ASSERT_EQ(pool.can_allocate(hq, q, 16, false), 2);
    V b;
    pool.allocate(hq, 2, 16, b);
    EXPECT_EQ(b, (V{1, 2, 4, 5}));
    Check(pool, {&a, &b});
  }
}

TEST(BlockPoolTest, HitOnFreeCachedBlockConsumesAFreeBlock) {
  BlockPool pool(5, 4, true, true);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);
  pool.publish(a, hp, p, 0, 3);
  pool.free(a);
  a.clear();
  Check(pool, {});
  EXPECT_EQ(pool.free_list(), (V{4, 3, 2, 1}));
  EXPECT_TRUE(pool.is_cached(1) && pool.is_cached(2) && pool.is_cached(3));
  (void)pool.take_events();

  // Hits on free-cached blocks 1 and 2 still take 2 free blocks, plus 1 fresh: 3 <= 4.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 2);

  // Take 2 fresh blocks: the head (4) and then 3, whose cached hash is evicted.
  V x;
  const V xt = Seq(700, 8);
  pool.allocate(Chain(xt, 4), 0, 8, x);
  Check(pool, {&x});
  EXPECT_EQ(x, (V{4, 3}));
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hp[2]}));
  EXPECT_FALSE(pool.is_cached(3));
  EXPECT_EQ(pool.cached_block(hp[2]), -1);
  ASSERT_EQ(pool.num_free_blocks(), 2);

  // Blocks 1 and 2 are free-cached hits, and each consumes one of the 2 free blocks: 3 > 2.
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), -1);
  // 8 tokens: only block 1 may hit (1 free-cached) + 1 fresh = 2 <= 2.
  const V p8(p.begin(), p.begin() + 8);
  const H h8 = Chain(p8, 4);
  EXPECT_EQ(pool.can_allocate(h8, p8, 8, false), 1);

  // Allocating it claims block 1 straight off the free list (no event, hash kept) and takes block
  // 2 as the fresh block (evicting its hash).
  V b;
  pool.allocate(h8, 1, 8, b);
  Check(pool, {&x, &b});
  EXPECT_EQ(b, (V{1, 2}));
  EXPECT_TRUE(pool.is_cached(1));
  EXPECT_EQ(pool.cached_block(hp[0]), 1);
  EXPECT_FALSE(pool.is_cached(2));
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hp[1]}));
  EXPECT_TRUE(pool.free_list().empty());
}

TEST(BlockPoolTest, CacheHitTakesBlockOutOfTheFreeListWithoutDuplicates) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);  // {1,2,3}
  pool.publish(a, hp, p, 0, 3);
  pool.free(a);
  a.clear();
  Check(pool, {});
  EXPECT_EQ(pool.free_list(), (V{4, 5, 6, 7, 8, 3, 2, 1}));
  (void)pool.take_events();

  V b;
  ASSERT_EQ(pool.can_allocate(hp, p, 12, false), 2);
  pool.allocate(hp, 2, 12, b);
  Check(pool, {&b});
  EXPECT_EQ(b, (V{1, 2, 4}));
  EXPECT_EQ(pool.free_list(), (V{5, 6, 7, 8, 3}));
  EXPECT_TRUE(pool.take_events().empty());  // hits evict nothing; block 4 had no hash

  pool.free(b);
  b.clear();
  Check(pool, {});
  // ATOM's deque would now hold 1 and 2 twice (bug 8.29); the intrusive list holds each once.
  EXPECT_EQ(pool.free_list(), (V{5, 6, 7, 8, 3, 4, 2, 1}));
}

TEST(BlockPoolTest, AllocateSharesCachedBlocksWithLiveRequests) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a, b;
  pool.allocate(hp, 0, 12, a);
  pool.publish(a, hp, p, 0, 3);
  Check(pool, {&a});
  ASSERT_EQ(pool.can_allocate(hp, p, 12, false), 2);
  pool.allocate(hp, 2, 12, b);
  Check(pool, {&a, &b});
  EXPECT_EQ(b, (V{1, 2, 4}));
  EXPECT_EQ(pool.ref_count(1), 2);
  EXPECT_EQ(pool.ref_count(2), 2);

  pool.free(a);
  a.clear();
  Check(pool, {&b});
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.ref_count(2), 1);
  EXPECT_EQ(pool.free_list(), (V{5, 6, 7, 8, 3}));
  pool.free(b);
  b.clear();
  Check(pool, {});
  EXPECT_EQ(pool.free_list(), (V{5, 6, 7, 8, 3, 4, 2, 1}));
  const auto events = pool.take_events();
  EXPECT_EQ(OfKind(events, KvEventKind::kBlockStored).size(), 1u);
  EXPECT_TRUE(OfKind(events, KvEventKind::kBlockRemoved).empty());
}

TEST(BlockPoolTest, PublishRegistersOnlyTheBlocksPassed) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 14);  // 3 full blocks + 2 tokens
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 14, a);
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 0);  // allocation registers nothing
  EXPECT_TRUE(pool.take_events().empty());

  pool.publish(a, hp, p, 0, 1);
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 1);
  EXPECT_TRUE(pool.is_cached(a[0]));
  EXPECT_FALSE(pool.is_cached(a[1]));
  EXPECT_EQ(pool.cached_block(hp[0]), a[0]);
  EXPECT_EQ(pool.cached_block(hp[1]), -1);
  auto events = pool.take_events();
  ASSERT_EQ(events.size(), 1u);
  ExpectStored(events[0], {hp[0]}, std::nullopt, Seq(100, 4), 4);

  pool.publish(a, hp, p, 1, 3);
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 3);
  EXPECT_EQ(pool.cached_block(hp[1]), a[1]);
  EXPECT_EQ(pool.cached_block(hp[2]), a[2]);
  EXPECT_FALSE(pool.is_cached(a[3]));
  events = pool.take_events();
  ASSERT_EQ(events.size(), 1u);  // one event per run of new blocks
  ExpectStored(events[0], {hp[1], hp[2]}, hp[0], Seq(104, 8), 4);

  pool.publish(a, hp, p, 3, 3);  // empty range
  Check(pool, {&a});
  EXPECT_TRUE(pool.take_events().empty());
  EXPECT_EQ(pool.num_cached_hashes(), 3);
}

TEST(BlockPoolTest, PublishingIdenticalContentTwiceRegistersOnce) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 8);
  const H hp = Chain(p, 4);
  V a, b, c;
  // Two requests computed the same content in fresh blocks (neither was published yet).
  pool.allocate(hp, 0, 8, a);
  pool.allocate(hp, 0, 8, b);
  Check(pool, {&a, &b});
  pool.publish(a, hp, p, 0, 2);
  Check(pool, {&a, &b});
  pool.publish(b, hp, p, 0, 2);
  Check(pool, {&a, &b});
  EXPECT_EQ(pool.num_cached_hashes(), 2);
  EXPECT_EQ(pool.cached_block(hp[0]), a[0]);
  EXPECT_EQ(pool.cached_block(hp[1]), a[1]);
  EXPECT_FALSE(pool.is_cached(b[0]));
  EXPECT_FALSE(pool.is_cached(b[1]));
  auto events = pool.take_events();
  ASSERT_EQ(events.size(), 1u) << "fix 8.30: the duplicate must not be stored again";
  ExpectStored(events[0], hp, std::nullopt, p, 4);

  // Shares block 0's content, differs in block 1: only block 1 is new; its parent is hp[0].
  const V q = Cat(Seq(100, 4), Seq(700, 4));
  const H hq = Chain(q, 4);
  pool.allocate(hq, 0, 8, c);
  pool.publish(c, hq, q, 0, 2);
  Check(pool, {&a, &b, &c});
  EXPECT_FALSE(pool.is_cached(c[0]));
  EXPECT_TRUE(pool.is_cached(c[1]));
  EXPECT_EQ(pool.num_cached_hashes(), 3);
  events = pool.take_events();
  ASSERT_EQ(events.size(), 1u);
  ExpectStored(events[0], {hq[1]}, hq[0], Seq(700, 4), 4);

  // Freeing the duplicate: its blocks are free-clean, nothing is removed from the map.
  pool.free(b);
  b.clear();
  Check(pool, {&a, &c});
  EXPECT_EQ(pool.cached_block(hp[0]), a[0]);
  EXPECT_EQ(pool.num_cached_hashes(), 3);
  EXPECT_TRUE(pool.take_events().empty());
}

TEST(BlockPoolTest, LazyEvictionRecordsBlockRemoved) {
  BlockPool pool(5, 4, true, true);
  const V p = Seq(100, 8);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 8, a);  // {1,2}
  pool.publish(a, hp, p, 0, 2);
  pool.free(a);
  a.clear();
  Check(pool, {});
  EXPECT_EQ(pool.free_list(), (V{3, 4, 2, 1}));
  // Freed blocks keep their hashes (free-cached) until handed out fresh.
  EXPECT_EQ(pool.cached_block(hp[0]), 1);
  EXPECT_EQ(pool.cached_block(hp[1]), 2);
  EXPECT_EQ(pool.num_cached_hashes(), 2);
  EXPECT_TRUE(RemovedHashes(pool.take_events()).empty());

  V x;
  pool.allocate({}, 0, 12, x);  // takes 3, 4, 2
  Check(pool, {&x});
  EXPECT_EQ(x, (V{3, 4, 2}));
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hp[1]}));
  EXPECT_FALSE(pool.is_cached(2));
  EXPECT_EQ(pool.cached_block(hp[1]), -1);
  EXPECT_EQ(pool.cached_block(hp[0]), 1);
  EXPECT_EQ(pool.num_cached_hashes(), 1);

  V y;
  ASSERT_TRUE(pool.grow(y, 1));  // grow hands out fresh blocks too
  Check(pool, {&x, &y});
  EXPECT_EQ(y, (V{1}));
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hp[0]}));
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  EXPECT_FALSE(pool.is_cached(1));
}

TEST(BlockPoolTest, HashCollisionIsNeverAHit) {
  BlockPool pool(9, 4, true, false);
  const V p = Seq(100, 8);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 8, a);
  pool.publish(a, hp, p, 0, 2);
  Check(pool, {&a});
  // Different tokens presented with the same hashes (a forged 64-bit collision).
  const V q = Seq(500, 12);
  const H forged = {hp[0], hp[1], 12345};
  EXPECT_EQ(pool.count_cached_blocks(forged, q, 2), 0);
  EXPECT_EQ(pool.can_allocate(forged, q, 12, false), 0);
  // Block 0 matches, block 1's tokens differ: 1 hit.
  V r = p;
  r[6] = 9999;
  r.insert(r.end(), {1, 2, 3, 4});
  const H forged2 = {hp[0], hp[1], 777};
  EXPECT_EQ(pool.count_cached_blocks(forged2, r, 2), 1);
  EXPECT_EQ(pool.can_allocate(forged2, r, 12, false), 1);
  Check(pool, {&a});
}

TEST(BlockPoolTest, GrowFailsWithoutChangingAnything) {
  BlockPool pool(5, 4, true, false);
  V a, b;
  pool.allocate({}, 0, 4, a);  // {1}
  pool.allocate({}, 0, 8, b);  // {2,3}
  Check(pool, {&a, &b});
  ASSERT_EQ(pool.free_list(), (V{4}));

  EXPECT_FALSE(pool.grow(a, 3));
  Check(pool, {&a, &b});
  EXPECT_EQ(a, (V{1}));
  EXPECT_EQ(pool.free_list(), (V{4}));
  EXPECT_EQ(pool.num_free_blocks(), 1);

  EXPECT_TRUE(pool.grow(a, 2));
  Check(pool, {&a, &b});
  EXPECT_EQ(a, (V{1, 4}));
  EXPECT_EQ(pool.num_free_blocks(), 0);

  EXPECT_TRUE(pool.grow(a, 2));  // already holds 2
  Check(pool, {&a, &b});
  EXPECT_EQ(a, (V{1, 4}));
  EXPECT_FALSE(pool.grow(b, 3));
  Check(pool, {&a, &b});
  EXPECT_EQ(b, (V{2, 3}));
}

TEST(BlockPoolTest, StateSlotsAreLifoAndRunOut) {
  BlockPool pool(5, 4, true, false, 3);
  EXPECT_EQ(pool.num_state_slots(), 3);
  EXPECT_EQ(pool.num_free_state_slots(), 3);
  const int32_t s1 = pool.take_state_slot();
  const int32_t s2 = pool.take_state_slot();
  const int32_t s3 = pool.take_state_slot();
  EXPECT_EQ((std::set<int32_t>{s1, s2, s3}), (std::set<int32_t>{0, 1, 2}));
  EXPECT_EQ(pool.num_free_state_slots(), 0);
  EXPECT_EQ(pool.take_state_slot(), -1);
  Check(pool, {});

  // No slot free: a request that needs one cannot be admitted, whatever the blocks say.
  const V t = Seq(1, 4);
  EXPECT_EQ(pool.can_allocate(Chain(t, 4), t, 4, true), -1);
  EXPECT_EQ(pool.can_allocate(Chain(t, 4), t, 4, false), 0);

  pool.release_state_slot(s1);
  pool.release_state_slot(s3);
  EXPECT_EQ(pool.num_free_state_slots(), 2);
  EXPECT_EQ(pool.can_allocate(Chain(t, 4), t, 4, true), 0);
  EXPECT_EQ(pool.take_state_slot(), s3);  // most recently released first
  EXPECT_EQ(pool.take_state_slot(), s1);
  EXPECT_EQ(pool.take_state_slot(), -1);
  Check(pool, {});
  // State slots cost no paged blocks.
  EXPECT_EQ(pool.num_free_blocks(), 4);
}

TEST(BlockPoolTest, ResetPrefixCacheForgetsEveryHash) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  const V q = Seq(300, 8);
  const H hq = Chain(q, 4);
  V a, b;
  pool.allocate(hp, 0, 12, a);  // live
  pool.publish(a, hp, p, 0, 3);
  pool.allocate(hq, 0, 8, b);
  pool.publish(b, hq, q, 0, 2);
  pool.free(b);  // free-cached
  b.clear();
  Check(pool, {&a});
  ASSERT_EQ(pool.num_cached_hashes(), 5);
  (void)pool.take_events();

  pool.reset_prefix_cache();
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  for (int32_t blk = 0; blk < 9; ++blk) EXPECT_FALSE(pool.is_cached(blk)) << blk;
  for (uint64_t h : hp) EXPECT_EQ(pool.cached_block(h), -1);
  for (uint64_t h : hq) EXPECT_EQ(pool.cached_block(h), -1);
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 0);
  auto events = pool.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEventKind::kAllBlocksCleared);
  EXPECT_EQ(events[0].medium, Medium::kNone);

  // Handing out the formerly free-cached blocks records no BlockRemoved: nothing is cached.
  V x;
  pool.allocate({}, 0, 20, x);  // every free block
  Check(pool, {&a, &x});
  EXPECT_EQ(pool.num_free_blocks(), 0);
  EXPECT_TRUE(pool.take_events().empty());
  pool.free(x);
  x.clear();

  // The cache works again afterwards.
  pool.publish(a, hp, p, 0, 3);
  Check(pool, {&a});
  EXPECT_EQ(pool.cached_block(hp[0]), a[0]);
  EXPECT_EQ(pool.can_allocate(hp, p, 12, false), 2);
  EXPECT_EQ(OfKind(pool.take_events(), KvEventKind::kBlockStored).size(), 1u);
}

// The cached set stays a forest a router can mirror. A block can be cached under a parent its
// request does not hold (its prefix was computed twice, and the first copy is the cached one), so
// the parent can be evicted while the child lives on: the child, and its own children, are
// forgotten first, leaves first, and announced again once recomputed.
TEST(BlockPoolTest, EvictingAParentForgetsItsCachedDescendantsLeavesFirst) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 8);
  const H hp = Chain(p, 4);
  const V q = Cat(Seq(100, 4), Seq(500, 8));  // block 0 as p's, then its own two
  const H hq = Chain(q, 4);
  ASSERT_EQ(hq[0], hp[0]);
  V a, b;
  pool.allocate(hp, 0, 8, a);   // {1, 2}
  pool.allocate(hq, 0, 12, b);  // {3, 4, 5}: computed at the same time, no hit
  pool.publish(a, hp, p, 0, 2);
  pool.publish(b, hq, q, 0, 3);  // block 3 is a second copy: 4 is cached under a's block 1
  Check(pool, {&a, &b});
  EXPECT_EQ(pool.cached_block(hq[1]), 4);
  EXPECT_EQ(pool.cached_block(hq[2]), 5);
  auto stored = OfKind(pool.take_events(), KvEventKind::kBlockStored);
  ASSERT_EQ(stored.size(), 2u);
  ExpectStored(stored[1], {hq[1], hq[2]}, hq[0], Seq(500, 8), 4);

  pool.free(a);  // the parent goes free while its other child (4) is live in b
  a.clear();
  V x;
  pool.allocate({}, 0, 16, x);  // 6, 7, 8, then 2 (a's leaf)
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hp[1]}));
  V y;
  ASSERT_TRUE(pool.grow(y, 1));  // block 1: its subtree goes first, leaves first
  Check(pool, {&b, &x, &y});
  EXPECT_EQ(RemovedHashes(pool.take_events()), (H{hq[2], hq[1], hp[0]}));
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  EXPECT_FALSE(pool.is_cached(4));
  EXPECT_FALSE(pool.is_cached(5));

  // Recomputed later, the whole chain is cached and announced again from its root.
  pool.free(x);
  pool.free(y);
  x.clear();
  y.clear();
  V c;
  ASSERT_EQ(pool.can_allocate(hq, q, 12, false), 0);
  pool.allocate(hq, 0, 12, c);
  pool.publish(c, hq, q, 0, 3);
  Check(pool, {&b, &c});
  stored = OfKind(pool.take_events(), KvEventKind::kBlockStored);
  ASSERT_EQ(stored.size(), 1u);
  ExpectStored(stored[0], hq, std::nullopt, q, 4);
}

// After a reset, a live request's later blocks would name a parent every router has cleared:
// they are not cached (and not announced); a prefix recomputed from its first block is.
TEST(BlockPoolTest, BlocksWhoseParentWasResetAwayAreNotCached) {
  BlockPool pool(9, 4, true, true);
  const V p = Seq(100, 16);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 16, a);
  pool.publish(a, hp, p, 0, 2);  // the prompt's blocks
  pool.reset_prefix_cache();
  (void)pool.take_events();
  pool.publish(a, hp, p, 2, 4);  // decode filled blocks 2 and 3: their parent is gone
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  EXPECT_TRUE(pool.take_events().empty());

  V b;
  pool.allocate(hp, 0, 16, b);
  pool.publish(b, hp, p, 0, 4);  // another request computes the whole prefix again
  Check(pool, {&a, &b});
  EXPECT_EQ(pool.num_cached_hashes(), 4);
  auto stored = OfKind(pool.take_events(), KvEventKind::kBlockStored);
  ASSERT_EQ(stored.size(), 1u);
  ExpectStored(stored[0], hp, std::nullopt, p, 4);
}

TEST(BlockPoolTest, EventsDisabledRecordsNothing) {
  BlockPool pool(5, 4, true, false);
  EXPECT_FALSE(pool.events_enabled());
  const V p = Seq(100, 8);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 8, a);
  pool.publish(a, hp, p, 0, 2);
  pool.free(a);
  a.clear();
  V x;
  pool.allocate({}, 0, 16, x);  // evicts both cached blocks
  pool.reset_prefix_cache();
  Check(pool, {&x});
  EXPECT_TRUE(pool.take_events().empty());
}

TEST(BlockPoolTest, PrefixCachingDisabledNeverHits) {
  BlockPool pool(5, 4, false, false);
  EXPECT_FALSE(pool.prefix_caching());
  const V p = Seq(100, 12);
  const H hp = Chain(p, 4);
  V a;
  pool.allocate(hp, 0, 12, a);
  pool.publish(a, hp, p, 0, 3);  // a no-op without prefix caching
  Check(pool, {&a});
  EXPECT_EQ(pool.num_cached_hashes(), 0);
  EXPECT_EQ(pool.can_allocate(hp, p, 4, false), 0);
  EXPECT_EQ(pool.can_allocate(hp, p, 8, false), -1);
}

// Random admissions (with shared prefixes), publishes, grows and frees, checking the invariants
// and the ref counts after every operation, and that hits are exactly the cached blocks.
TEST(BlockPoolTest, RandomOperationsKeepInvariants) {
  constexpr int32_t kBs = 2;
  for (uint32_t seed : {7u, 8u, 9u}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    BlockPool pool(25, kBs, true, true, 4);
    struct Req {
      V tokens;
      V table;
      bool slot = false;
      int32_t state_slot = -1;
    };
    std::vector<Req> live;
    auto check = [&] {
      std::vector<int32_t> refs(pool.num_blocks(), 0);
      for (const Req& r : live)
        for (int32_t b : r.table) ++refs[b];
      ASSERT_NO_THROW(pool.check_invariants(refs));
      for (int32_t b = 0; b < pool.num_blocks(); ++b) ASSERT_EQ(pool.ref_count(b), refs[b]);
      const V fl = pool.free_list();
      ASSERT_EQ(static_cast<int32_t>(fl.size()), pool.num_free_blocks());
      ASSERT_EQ(std::set<int32_t>(fl.begin(), fl.end()).size(), fl.size());
      for (int32_t b : fl) ASSERT_EQ(refs[b], 0);
    };
    for (int op = 0; op < 3000; ++op) {
      const int kind = static_cast<int>(rng() % 4);
      if (kind == 0 || live.empty()) {
        // Admit: a prefix from a small family plus a random tail.
        V t = Seq(static_cast<int32_t>(rng() % 3) * 100, static_cast<int32_t>(rng() % 7));
        const int32_t tail = 1 + static_cast<int32_t>(rng() % 6);
        for (int32_t i = 0; i < tail; ++i) t.push_back(static_cast<int32_t>(rng() % 3));
        const H h = Chain(t, kBs);
        const int32_t n = static_cast<int32_t>(t.size());
        const int32_t nblocks = (n + kBs - 1) / kBs;
        const bool slot = rng() % 4 == 0;
        const int32_t hits = pool.can_allocate(h, t, n, slot);
        const int32_t probe = std::min<int32_t>(static_cast<int32_t>(h.size()), nblocks - 1);
        const int32_t cached = pool.count_cached_blocks(h, t, probe);
        if (hits < 0) continue;
        ASSERT_EQ(hits, cached);
        Req r{t, {}, slot, -1};
        pool.allocate(h, hits, n, r.table);
        ASSERT_EQ(static_cast<int32_t>(r.table.size()), nblocks);
        for (int32_t i = 0; i < hits; ++i) ASSERT_EQ(r.table[i], pool.cached_block(h[i]));
        if (slot) {
          r.state_slot = pool.take_state_slot();
          ASSERT_GE(r.state_slot, 0);
        }
        live.push_back(std::move(r));
      } else if (kind == 1) {
        // The forward ran: publish the full blocks.
        Req& r = live[rng() % live.size()];
        const H h = Chain(r.tokens, kBs);
        pool.publish(r.table, h, r.tokens, 0, static_cast<int32_t>(h.size()));
      } else if (kind == 2) {
        // Decode growth.
        Req& r = live[rng() % live.size()];
        const V before = r.table;
        const int32_t target = static_cast<int32_t>(r.table.size()) + 1 +
                               static_cast<int32_t>(rng() % 2);
        const int32_t free_before = pool.num_free_blocks();
        if (pool.grow(r.table, target)) {
          ASSERT_EQ(static_cast<int32_t>(r.table.size()), target);
          ASSERT_TRUE(std::equal(before.begin(), before.end(), r.table.begin()));
          // Grown blocks hold no content yet: give them random tokens that are never published.
          r.tokens.resize(static_cast<size_t>(target) * kBs - 1, 1000 + op);
        } else {
          ASSERT_EQ(r.table, before);
          ASSERT_EQ(pool.num_free_blocks(), free_before);
        }
      } else {
        const size_t i = rng() % live.size();
        pool.free(live[i].table);
        if (live[i].state_slot >= 0) pool.release_state_slot(live[i].state_slot);
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
      }
      if (op % 700 == 699) pool.reset_prefix_cache();  // live requests keep publishing after it
      check();
      if (HasFatalFailure()) return;
      if (op % 500 == 499) (void)pool.take_events();
    }
  }
}

}  // namespace
}  // namespace atom_sched
