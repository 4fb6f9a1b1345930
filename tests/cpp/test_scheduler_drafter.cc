// What a drafter with its own KV (vLLM's draft models) needs from the scheduler:
// num_lookahead_tokens, the KV slots it writes past a row's tokens, reserved at admission and by
// every decode row up to the position limit (the prompt's last block still never a prefix hit);
// draft_slots_per_row, the tokens of the batch budget each row also takes for its inputs.
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

SchedulerConfig DraftSlotsCfg(int32_t budget, int32_t k, int32_t slots) {
  SchedulerConfig c = SpecCfg(64, k);
  c.max_num_batched_tokens = budget;
  c.draft_slots_per_row = slots;
  return c;
}

TEST(DraftSlotsTest, APromptChunkLeavesTheDraftersInputSlot) {
  for (int32_t slots : {0, 1}) {
    SCOPED_TRACE(testing::Message() << "slots " << slots);
    H h(DraftSlotsCfg(16, 3, slots));
    h.add(0, Seq(1, 40), P(2));
    h.add(1, Seq(100, 40), P(2));
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->nsched, V{16 - slots});  // the second prompt gets no room at all
  }
}

TEST(DraftSlotsTest, DecodeRowsTakeTheirInputSlotsFromTheBudget) {
  for (int32_t slots : {0, 1}) {
    SCOPED_TRACE(testing::Message() << "slots " << slots);
    SchedulerConfig c = DraftSlotsCfg(12, 3, slots);
    c.policy = BatchPolicy::kMixed;
    H h(c);
    for (int64_t id = 0; id < 3; ++id) h.add(id, Seq(10 * static_cast<int32_t>(id) + 1, 3), P(8));
    auto b1 = h.sched();  // three prompts of 3 tokens: 9 tokens, + 3 slots = 12
    ASSERT_TRUE(b1);
    EXPECT_EQ(b1->num_rows, 3);
    h.upd(*b1, V(12, 5), {1, 1, 1}, V(9, 5));  // each proposes 3 drafts
    auto b2 = h.sched();  // rows of 4 tokens: three fit 12 alone, two with a slot each (10)
    ASSERT_TRUE(b2);
    EXPECT_EQ(b2->num_rows, slots ? 2 : 3);
    EXPECT_LE(b2->num_tokens + b2->num_rows * slots, 12);
  }
}

TEST(DraftSlotsTest, AWholePromptMustFitWithItsSlotWithoutChunkedPrefill) {
  SchedulerConfig c = DraftSlotsCfg(16, 2, 1);
  c.enable_chunked_prefill = false;
  H h(c);
  h.add(0, Seq(1, 16), P(2));  // 16 tokens fill the budget: no room for the drafter's input
  h.add(1, Seq(100, 15), P(2));
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->req_ids, V64{1});
  const auto rejected = h.s.take_rejected();
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_NE(rejected[0].reason.find("and the drafter's inputs"), std::string::npos)
      << rejected[0].reason;
}

TEST(DraftSlotsTest, ConfigRefusesSlotsWithoutDraftsPastKOrPastTheBudget) {
  EXPECT_THROW(DraftSlotsCfg(16, 0, 1).validate(), InvalidArgument);
  EXPECT_THROW(DraftSlotsCfg(16, 2, 3).validate(), InvalidArgument);
  EXPECT_THROW(DraftSlotsCfg(16, 2, -1).validate(), InvalidArgument);
  EXPECT_THROW(DraftSlotsCfg(3, 2, 1).validate(), InvalidArgument);  // a decode row needs 4
  EXPECT_NO_THROW(DraftSlotsCfg(4, 2, 1).validate());
}

// An EAGLE-family drafter (vLLM's use_eagle_block_drop): a prefix hit gives back its last block,
// so the drafter gets the target's hidden states for the tokens just before the first computed
// one. The hit it keeps is all the step reports as cached.
TEST(RecomputeLastHitTest, APrefixHitGivesBackItsLastBlock) {
  for (bool drop : {false, true}) {
    SCOPED_TRACE(testing::Message() << "recompute_last_hit_block " << drop);
    SchedulerConfig c = SpecCfg(16, 2);
    c.recompute_last_hit_block = drop;
    H h(c);
    h.add(0, Seq(1, 12), P(1));  // three full blocks, cached once computed
    auto b1 = h.sched();
    ASSERT_TRUE(b1);
    h.upd(*b1, {5, 0, 0}, {1}, {-1, -1});
    ASSERT_FALSE(h.s.contains(0));
    h.add(1, Cat(Seq(1, 12), Seq(50, 4)), P(1));  // the same three blocks, then a fourth
    auto b2 = h.sched();
    ASSERT_TRUE(b2);
    EXPECT_EQ(b2->ncached, V{drop ? 8 : 12});
    EXPECT_EQ(b2->nsched, V{drop ? 8 : 4});
    EXPECT_EQ(h.s.stats().prefix_hit_tokens, drop ? 8 : 12);
    h.upd(*b2, {6, 0, 0}, {1}, {-1, -1});
    // A one-block hit gives back everything: nothing is cached.
    h.add(2, Cat(Seq(1, 4), Seq(70, 4)), P(1));
    auto b3 = h.sched();
    ASSERT_TRUE(b3);
    EXPECT_EQ(b3->ncached, V{drop ? 0 : 4});
  }
}

}  // namespace
}  // namespace atom_sched
