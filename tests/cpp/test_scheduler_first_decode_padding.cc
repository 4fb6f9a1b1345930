// pad_first_decode_rows (vLLM's first-decode padding): a request admitted with only its last
// token to compute gets a verify row of K+1 tokens, its drafts -1, so a step of decode rows
// keeps its uniform K+1 shape; when it does not apply, the one-token prompt row of before.
#include <gtest/gtest.h>

#include <memory>

#include "atom_sched/kv_connector.h"
#include "scheduler_harness.h"

namespace atom_sched {
namespace {

constexpr int32_t kK = 3;

SchedulerConfig PadCfg(int32_t usable_blocks = 32, int32_t k = kK) {
  SchedulerConfig c = SpecCfg(usable_blocks, k);  // blocks of 4 tokens
  c.policy = BatchPolicy::kMixed;
  c.pad_first_decode_rows = true;
  return c;
}

// Request 0 with a 9-token prompt, prefilled: its first two blocks are cached, and it decodes
// with K drafts {21 22 ...} set. A second request with the same prompt hits 8 tokens: one to go.
void StartDecodingTwin(H& h, int32_t k = kK) {
  h.add(0, Seq(1, 9), P(16));
  auto b = h.sched();
  ASSERT_TRUE(b);
  V sampled(static_cast<size_t>(k) + 1, 0);
  sampled[0] = 20;
  h.upd(*b, sampled, {1}, Seq(21, k));
}

TEST(FirstDecodePaddingTest, AnAdmissionWithOneTokenLeftVerifiesKPlaceholderDrafts) {
  H h(PadCfg());
  StartDecodingTwin(h);
  h.add(1, Seq(1, 9), P(16));
  auto b = h.sched();
  ASSERT_TRUE(b);
  ASSERT_EQ(b->req_ids, (V64{0, 1}));
  EXPECT_FALSE(b->is_prefill);
  EXPECT_EQ(b->num_spec_tokens, kK);
  EXPECT_EQ(b->nsched, (V{4, 4}));  // both rows 1 + K
  EXPECT_EQ(b->prefill_rows, (std::vector<uint8_t>{0, 0}));
  EXPECT_EQ(b->emits, (std::vector<uint8_t>{1, 1}));
  EXPECT_EQ(b->ncached, (V{9, 8}));
  EXPECT_EQ(b->row_drafts(0), (V{21, 22, 23}));
  EXPECT_EQ(b->row_drafts(1), (V{-1, -1, -1}));
  EXPECT_EQ(b->row_tokens(1), (V{9, -1, -1, -1}));  // the last prompt token, then placeholders
  EXPECT_EQ(b->row_positions(1), (V64{8, 9, 10, 11}));
  EXPECT_EQ(b->slot_reset[1], 1);  // an admission: its device slot starts afresh
  // KV for the four positions: 12 slots, three blocks (the first two shared with request 0).
  EXPECT_EQ(h.s.request(1).block_table.size(), 3u);
  EXPECT_EQ(V(h.s.request(1).block_table.begin(), h.s.request(1).block_table.begin() + 2),
            V(h.s.request(0).block_table.begin(), h.s.request(0).block_table.begin() + 2));
  // The placeholders are rejected: request 1 gets one token, and decodes from position 9.
  auto o = h.upd(*b, {21, 22, 30, 0, 40, 0, 0, 0}, {3, 1}, {31, 32, 33, 41, 42, 43});
  EXPECT_EQ(o.tokens(1), V{40});
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 9);
  auto next = h.sched();
  ASSERT_TRUE(next);
  const int32_t row = next->row_of(1);
  ASSERT_GE(row, 0);
  EXPECT_EQ(next->row_tokens(row), (V{40, 41, 42, 43}));
  EXPECT_EQ(next->row_positions(row), (V64{9, 10, 11, 12}));
}

TEST(FirstDecodePaddingTest, ALoadedPromptAloneIsPaddedToo) {
  // vLLM pads a request that computed something before even with nothing else running.
  H h(PadCfg());
  StartDecodingTwin(h);
  auto b = h.sched();  // request 0 decodes; finish it by max_tokens
  ASSERT_TRUE(b);
  h.s.abort_request(0);
  h.upd(*b, {21, 22, 23, 24}, {4}, {-1, -1, -1});
  ASSERT_EQ(h.s.num_running(), 0);
  h.add(1, Seq(1, 9), P(16));
  auto a = h.sched();
  ASSERT_TRUE(a);
  EXPECT_EQ(a->nsched, V{kK + 1});
  EXPECT_FALSE(a->is_prefill);
}

TEST(FirstDecodePaddingTest, OffAnAdmissionWithOneTokenLeftGetsAOneTokenPromptRow) {
  SchedulerConfig c = PadCfg();
  c.pad_first_decode_rows = false;
  H h(c);
  StartDecodingTwin(h);
  h.add(1, Seq(1, 9), P(16));
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->nsched, (V{4, 1}));
  EXPECT_EQ(b->prefill_rows, (std::vector<uint8_t>{0, 1}));
}

TEST(FirstDecodePaddingTest, NotWhereAPromptChunkContinuesInTheStep) {
  SchedulerConfig c = PadCfg();
  c.long_prefill_token_threshold = 8;  // request 2's prompt takes 8 tokens a step
  H h(c);
  StartDecodingTwin(h);
  h.add(2, Seq(100, 40), P(4));
  auto b = h.sched();
  ASSERT_TRUE(b);
  ASSERT_EQ(b->req_ids, (V64{0, 2}));
  h.upd(*b, {21, 22, 23, 24, 0, 0, 0, 0}, {1, 1}, {-1, -1, -1, -1, -1, -1});
  h.add(1, Seq(1, 9), P(16));
  auto b2 = h.sched();  // request 2's prompt continues: request 1's row stays one token
  ASSERT_TRUE(b2);
  ASSERT_EQ(b2->req_ids, (V64{0, 2, 1}));
  EXPECT_EQ(b2->nsched, (V{1, 8, 1}));
  EXPECT_EQ(b2->prefill_rows[2], 1);
}

TEST(FirstDecodePaddingTest, NotAOneTokenPromptWithNothingDecoding) {
  H h(PadCfg());
  h.add(0, V{7}, P(4));
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->nsched, V{1});
  EXPECT_TRUE(b->is_prefill);
}

TEST(FirstDecodePaddingTest, NotWhenThePaddedPositionsReachThePositionLimit) {
  // Positions 8..11 and the token they sample need max_model_len >= 13 (vLLM's rule).
  for (int32_t limit : {12, 13}) {
    SCOPED_TRACE(limit);
    SchedulerConfig c = PadCfg();
    c.max_model_len = limit;
    H h(c);
    StartDecodingTwin(h);
    h.add(1, Seq(1, 9), P(2));
    auto b = h.sched();
    ASSERT_TRUE(b);
    const int32_t row = b->row_of(1);
    ASSERT_GE(row, 0);
    EXPECT_EQ(b->nsched[row], limit == 13 ? kK + 1 : 1);
  }
}

TEST(FirstDecodePaddingTest, ARequestTheBudgetCannotPadWaits) {
  SchedulerConfig c = PadCfg();
  c.max_num_batched_tokens = 10;
  H h(c);
  StartDecodingTwin(h);  // request 0's prompt: 9 tokens
  h.add(2, Seq(100, 5), P(16));
  auto b = h.sched();  // request 0's row (4) and request 2's prompt (5)
  ASSERT_TRUE(b);
  ASSERT_EQ(b->nsched, (V{4, 5}));
  h.upd(*b, {21, 22, 23, 24, 30, 0, 0, 0}, {4, 1}, {25, 26, 27, 31, 32, 33});
  h.add(1, Seq(1, 9), P(16));
  auto b2 = h.sched();  // two rows of 4: 2 tokens left, enough for one, not for 1 + K
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, (V64{0, 2}));
  EXPECT_EQ(h.s.num_waiting(), 1);
}

TEST(FirstDecodePaddingTest, WithoutBlocksForThePaddingTheRowIsOneToken) {
  // K = 4: the padded positions 8..12 cross into a fourth block. Five usable blocks: request 0
  // holds four once its first row [9..13] is scheduled, request 1 takes the last for its prompt's
  // last block (never a hit), and none is left for the padding.
  H h(PadCfg(5, 4));
  StartDecodingTwin(h, 4);
  h.add(1, Seq(1, 9), P(16));
  auto b = h.sched();
  ASSERT_TRUE(b);
  ASSERT_EQ(b->req_ids, (V64{0, 1}));
  EXPECT_EQ(b->nsched, (V{5, 1}));
  EXPECT_EQ(b->prefill_rows[1], 1);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
}

// Supplies the KV of every token of request 0's prompt (the step computes the last one).
class LoadsRequestZero : public KvConnector {
 public:
  bool is_producer() const override { return false; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    RemoteMatch m;
    if (r.id == 0) m.num_tokens = r.num_prompt_tokens;
    return m;
  }
  void update_state_after_alloc(const ConnectorRequest&) override {}
  bool request_finished(const ConnectorRequest&) override { return false; }
};

TEST(FirstDecodePaddingTest, APaddedRowThatCompletesThePromptsLastBlockPublishesIt) {
  // An 8-token prompt loaded but for its last token: that token completes block 2. A decode row
  // publishes it only with cache_decode_blocks; without, the row stays a prompt row, which does.
  for (bool cache_decode : {true, false}) {
    SCOPED_TRACE(cache_decode);
    SchedulerConfig c = PadCfg();
    c.cache_decode_blocks = cache_decode;
    H h(c);
    h.s.set_kv_connector(std::make_shared<LoadsRequestZero>());
    h.add(0, Seq(1, 8), P(16));
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->ncached, V{7});
    EXPECT_EQ(b->nsched, V{cache_decode ? kK + 1 : 1});
    h.upd(*b, {20, 0, 0, 0}, {1}, {-1, -1, -1});
    h.add(1, Cat(Seq(1, 8), V{50}), P(16));  // its first two blocks: request 0's
    auto b2 = h.sched();
    ASSERT_TRUE(b2);
    const int32_t row = b2->row_of(1);
    ASSERT_GE(row, 0);
    EXPECT_EQ(b2->ncached[row], 8);
  }
}

TEST(FirstDecodePaddingTest, ConfigNeedsDraftsAndTheMixedPolicy) {
  SchedulerConfig c = PadCfg();
  EXPECT_NO_THROW(c.validate());
  c.num_speculative_tokens = 0;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c = PadCfg();
  c.policy = BatchPolicy::kAtom;
  EXPECT_THROW(c.validate(), InvalidArgument);
}

}  // namespace
}  // namespace atom_sched
