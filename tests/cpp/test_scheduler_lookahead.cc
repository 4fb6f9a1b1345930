// num_lookahead_tokens: the KV slots a drafter writes past a row's tokens (vLLM's draft models)
// are reserved at admission and by every decode row, up to the position limit; the prompt's
// last block is still never a prefix hit.
#include <gtest/gtest.h>

#include "scheduler_harness.h"

namespace atom_sched {
namespace {

SchedulerConfig LookaheadCfg(int32_t usable_blocks, int32_t k, int32_t ahead) {
  SchedulerConfig c = SpecCfg(usable_blocks, k);
  c.num_lookahead_tokens = ahead;
  return c;
}

TEST(LookaheadTest, AdmissionAndDecodeRowsReserveTheDraftersSlots) {
  for (int32_t ahead : {0, 3}) {
    SCOPED_TRACE(testing::Message() << "lookahead " << ahead);
    H h(LookaheadCfg(16, 3, ahead));
    h.add(0, Seq(1, 8), P(20));
    auto b1 = h.sched();  // the prompt: positions 0..7 (2 blocks), + 3 ahead: 11 slots, 3 blocks
    ASSERT_TRUE(b1);
    EXPECT_EQ(h.s.request(0).block_table.size(), ahead ? 3u : 2u);
    h.upd(*b1, {5, 0, 0, 0}, {1}, {6, 7, 8});
    auto b2 = h.sched();  // [5 6 7 8] at 8..11: 12 slots, + 3 ahead: 15, 4 blocks
    ASSERT_TRUE(b2);
    EXPECT_EQ(b2->nsched, V{4});
    EXPECT_EQ(h.s.request(0).block_table.size(), ahead ? 4u : 3u);
    h.upd(*b2, {6, 7, 9, 10}, {2}, {11, 12, 13});  // drafts 6 accepted, 7 too; then 9: a = 2
    // S = 10 (positions 0..9 computed); the next row [9 11 12 13] at 10..13: 14, + 3: 17 slots.
    auto b3 = h.sched();
    ASSERT_TRUE(b3);
    EXPECT_EQ(h.s.request(0).block_table.size(), ahead ? 5u : 4u);
  }
}

TEST(LookaheadTest, CappedAtThePositionLimit) {
  SchedulerConfig c = LookaheadCfg(16, 3, 3);
  c.max_model_len = 10;
  H h(c);
  h.add(0, Seq(1, 8), P(20));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  // 8 tokens + 3 ahead = 11 slots, but no position reaches 10: 10 slots, 3 blocks.
  EXPECT_EQ(h.s.request(0).block_table.size(), 3u);
  h.upd(*b1, {5, 0, 0, 0}, {1}, {6, 7, 8});
  auto b2 = h.sched();  // one position left below max_model_len: [5 6] at 8, 9
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->nsched, V{2});
  EXPECT_EQ(h.s.request(0).block_table.size(), 3u);
}

TEST(LookaheadTest, ThePromptsLastBlockIsStillComputed) {
  H h(LookaheadCfg(16, 2, 2));
  h.add(0, Seq(1, 8), P(1));  // two full blocks, cached once it is done
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  h.upd(*b1, {5, 0, 0}, {1}, {-1, -1});
  ASSERT_FALSE(h.s.contains(0));
  h.add(1, Seq(1, 8), P(1));
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  // The first block hits; the second (the prompt's last) is computed, as without a lookahead.
  EXPECT_EQ(b2->ncached, V{4});
  EXPECT_EQ(b2->nsched, V{4});
  EXPECT_EQ(h.s.request(1).block_table.size(), 3u);  // 8 + 2 slots
}

TEST(LookaheadTest, AdmissionWaitsForTheLookaheadsBlocksToo) {
  H h(LookaheadCfg(3, 2, 2));  // three usable blocks
  h.add(0, Seq(1, 4), P(1));   // 4 + 2 slots: 2 blocks
  h.add(1, Seq(10, 4), P(1));  // 2 more: only one is left
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(b1->req_ids, V64{0});
  h.upd(*b1, {5, 0, 0}, {1}, {-1, -1});  // request 0 ends (max_tokens 1): its blocks return
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, V64{1});
}

TEST(LookaheadTest, APromptThatFillsThePoolRunsWithoutItsLookahead) {
  H h(LookaheadCfg(2, 2, 2));  // 8 slots: no position reaches 8
  h.add(0, Seq(1, 8), P(4));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(h.s.request(0).block_table.size(), 2u);
  EXPECT_TRUE(h.s.take_rejected().empty());
}

TEST(LookaheadTest, ConfigRefusesLookaheadWithoutDraftsOrPastKPlusOne) {
  SchedulerConfig c = LookaheadCfg(8, 0, 1);
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = LookaheadCfg(8, 2, 4);
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = LookaheadCfg(8, 2, -1);
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = LookaheadCfg(8, 2, 3);  // K + 1: vLLM's DFlash
  EXPECT_NO_THROW(c.validate());
}

}  // namespace
}  // namespace atom_sched
