// publish_prompt_blocks_at_schedule (vLLM caches blocks at allocation): a prompt chunk's full
// blocks are published when the chunk is scheduled, so requests admitted in the same step, or
// while its step is in flight, share them instead of computing the same prompt again.
#include <gtest/gtest.h>

#include <memory>

#include "atom_sched/kv_connector.h"
#include "scheduler_harness.h"

namespace atom_sched {
namespace {

SchedulerConfig ShareCfg(bool share) {
  SchedulerConfig c = Cfg(64);  // blocks of 4 tokens
  c.policy = BatchPolicy::kMixed;
  c.publish_prompt_blocks_at_schedule = share;
  return c;
}

TEST(SharedInStepTest, IdenticalPromptsAdmittedTogetherComputeOnePrompt) {
  for (bool share : {true, false}) {
    SCOPED_TRACE(share);
    H h(ShareCfg(share));
    h.add(0, Seq(1, 10), P(4));
    h.add(1, Seq(1, 10), P(4));
    auto b = h.sched();
    ASSERT_TRUE(b);
    ASSERT_EQ(b->req_ids, (V64{0, 1}));
    // Request 1 hits request 0's two full blocks (the prompt's last block is never a hit).
    EXPECT_EQ(b->nsched, (V{10, share ? 2 : 10}));
    EXPECT_EQ(b->ncached, (V{0, share ? 8 : 0}));
    EXPECT_EQ(b->table(1, 2) == b->table(0, 2), share);
    h.upd(*b, {20, 20});
  }
}

TEST(SharedInStepTest, ARequestAdmittedWhileTheWritersStepFliesSharesItsBlocks) {
  H h(ShareCfg(true));
  h.add(0, Seq(1, 10), P(4));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  h.add(1, Seq(1, 10), P(4));
  auto b2 = h.sched();  // one step ahead: request 0 decodes, request 1 hits its blocks
  ASSERT_TRUE(b2);
  const int32_t row = b2->row_of(1);
  ASSERT_GE(row, 0);
  EXPECT_EQ(b2->ncached[row], 8);
  EXPECT_EQ(b2->nsched[row], 2);
  h.upd(*b1, {20});
  h.upd(*b2, {21, 20});
}

TEST(SharedInStepTest, OnlyTheBlocksAScheduledChunkComputes) {
  SchedulerConfig c = ShareCfg(true);
  c.long_prefill_token_threshold = 6;  // request 0's 20 tokens: 6 a step
  H h(c);
  h.add(0, Seq(1, 20), P(4));
  h.add(1, Seq(1, 20), P(4));
  auto b = h.sched();
  ASSERT_TRUE(b);
  // Request 0's chunk covers positions 0..5: block 0 only is whole. Request 1 hits it.
  EXPECT_EQ(b->ncached, (V{0, 4}));
  EXPECT_EQ(b->nsched, (V{6, 6}));
}

TEST(SharedInStepTest, ARequestEndedWithItsStepInFlightLeavesItsBlocksCached) {
  // Its step still runs (a batch, once scheduled, executes): the blocks it publishes hold KV
  // by the time a later step reads them.
  H h(ShareCfg(true));
  h.add(0, Seq(1, 10), P(4));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  h.s.abort_request(0);
  h.Inv("abort_request");
  h.add(1, Seq(1, 10), P(4));
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->ncached, V{8});
  h.upd(*b1, {20});
  h.upd(*b2, {20});
}

// Supplies the KV of request 0's first 4 tokens.
class LoadsFourTokens : public KvConnector {
 public:
  bool is_producer() const override { return false; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    RemoteMatch m;
    if (r.id == 0) m.num_tokens = 4;
    return m;
  }
  void update_state_after_alloc(const ConnectorRequest&) override {}
  bool request_finished(const ConnectorRequest&) override { return false; }
};

TEST(SharedInStepTest, NotTheBlocksOfARequestThatLoadedKv) {
  // Its computed blocks follow a load that may yet be reported failed: they are published when
  // its step returns, as without the option.
  H h(ShareCfg(true));
  h.s.set_kv_connector(std::make_shared<LoadsFourTokens>());
  h.add(0, Seq(1, 10), P(4));
  h.add(1, Seq(1, 10), P(4));
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->ncached, (V{4, 0}));
  EXPECT_EQ(b->nsched, (V{6, 10}));
}

}  // namespace
}  // namespace atom_sched
