// Requests with rows in flight (two batches outstanding, as under async scheduling): blocks freed
// while a batch still writes them (fence_freed_blocks), outputs of a preempted request's rows
// (drop_preempted_outputs), and a second batch that leaves them out (schedule_ahead off).
#include <gtest/gtest.h>

#include "scheduler_harness.h"

namespace atom_sched {
namespace {

// fence_freed_blocks: a request that finishes while a later batch holds a row of it keeps its
// blocks out of the pool until that batch is updated; without it they return at once.
TEST(FencedFreeTest, BlocksFreedWithARowInFlightWaitForIt) {
  for (bool fence : {false, true}) {
    SCOPED_TRACE(fence ? "fenced" : "not fenced");
    SchedulerConfig c = Cfg(16);
    c.fence_freed_blocks = fence;
    c.policy = BatchPolicy::kMixed;
    H h(c);
    SamplingParams p = P(4);
    p.stop_token_ids = {9};
    h.add(0, Seq(1, 6), p);
    auto b1 = h.sched();
    ASSERT_TRUE(b1);
    h.add(1, Seq(10, 6), P(4));
    auto b2 = h.sched();  // request 0's decode row ahead, request 1's prefill
    ASSERT_TRUE(b2);
    EXPECT_EQ(b2->row_of(0), 0);
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), 12);
    auto o = h.upd(*b1, {9});
    EXPECT_EQ(o.why(0), "stop_9");
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), fence ? 12 : 14);
    h.upd(*b2, V(static_cast<size_t>(b2->num_rows), 5));
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), 14);
  }
}

// With fence_freed_blocks no request is preempted while a batch is in flight: a decode row
// that needs a block the pool lacks waits; with nothing in flight it preempts as usual.
TEST(FencedFreeTest, NoPreemptionWhileABatchIsInFlight) {
  SchedulerConfig c = Cfg(2);  // two usable blocks of 4 tokens
  c.fence_freed_blocks = true;
  c.policy = BatchPolicy::kMixed;
  H h(c);
  h.add(0, Seq(1, 4), P(8));
  h.add(1, Seq(10, 4), P(8));
  auto b1 = h.sched();  // both prompts: one block each, the pool is full
  ASSERT_TRUE(b1);
  auto b2 = h.sched();  // their next rows need a second block each: none, and none preempted
  EXPECT_FALSE(b2);
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
  h.upd(*b1, {5, 6});
  auto b3 = h.sched();  // nothing in flight: request 1 is preempted for request 0
  ASSERT_TRUE(b3);
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  EXPECT_EQ(b3->req_ids, V64{0});
}

// drop_preempted_outputs: a request preempted with rows in flight gets none of their tokens; it
// recomputes them after its re-prefill. Without it they are appended when they land.
TEST(DropPreemptedOutputsTest, RowsInFlightAtAPreemptionStreamNothing) {
  for (bool drop : {false, true}) {
    SCOPED_TRACE(drop ? "dropped" : "appended");
    SchedulerConfig c = Cfg(16);
    c.drop_preempted_outputs = drop;
    c.policy = BatchPolicy::kMixed;
    H h(c);
    h.add(0, Seq(1, 6), P(3));
    auto b1 = h.sched();
    ASSERT_TRUE(b1);
    auto b2 = h.sched();  // its decode row, one step ahead
    ASSERT_TRUE(b2);
    h.s.preempt_request(0);
    h.Inv("preempt");
    auto o1 = h.upd(*b1, {9});
    auto o2 = h.upd(*b2, {10});
    EXPECT_EQ(o1.has(0), !drop);
    EXPECT_EQ(o2.has(0), !drop);
    EXPECT_EQ(h.s.request(0).tokens.size(), drop ? 6u : 8u);
    // Re-admitted, it computes what it has and goes on to max_tokens.
    V got = drop ? V{} : V{9, 10};
    for (int step = 0; step < 6 && h.s.has_unfinished_requests(); ++step) {
      auto b = h.sched();
      ASSERT_TRUE(b);
      auto o = h.upd(*b, V(static_cast<size_t>(b->num_rows), 20 + step));
      const V t = o.tokens(0);
      if (o.has(0)) got.insert(got.end(), t.begin(), t.end());
    }
    EXPECT_EQ(got.size(), 3u);
    EXPECT_FALSE(h.s.has_unfinished_requests());
  }
}

// schedule_ahead off (a synchronous runner with a batch queue, as vLLM's scheduler with
// pipeline parallelism): a request whose row is in flight sits out the next batch, whatever
// else that batch takes; its next row comes once the output is in, with its token known.
TEST(ScheduleAheadTest, OffARequestWithARowInFlightSitsOutTheNextBatch) {
  for (bool ahead : {true, false}) {
    SCOPED_TRACE(ahead);
    for (int32_t k : {0, 2}) {
      SCOPED_TRACE(k);
      SchedulerConfig c = SpecCfg(32, k);
      c.policy = BatchPolicy::kMixed;
      c.schedule_ahead = ahead;
      H h(c);
      h.add(0, Seq(1, 6), P(8));
      auto b1 = h.sched();
      ASSERT_TRUE(b1);
      h.add(1, Seq(10, 6), P(8));
      auto b2 = h.sched();  // request 1's prompt; request 0 one step ahead, or not at all
      ASSERT_TRUE(b2);
      EXPECT_EQ(b2->req_ids, ahead ? (V64{0, 1}) : (V64{1}));
      if (ahead) EXPECT_EQ(b2->row_tokens(0)[0], -1);  // only the device knows it
      const size_t w = static_cast<size_t>(k) + 1;
      V one(w, 0);
      one[0] = 7;
      h.upd(*b1, one, k ? V{1} : V{}, V(static_cast<size_t>(k), -1));
      V two(w * static_cast<size_t>(b2->num_rows), 0);
      for (size_t r = 0; r < static_cast<size_t>(b2->num_rows); ++r) two[r * w] = 8;
      h.upd(*b2, two, k ? V(static_cast<size_t>(b2->num_rows), 1) : V{},
            V(static_cast<size_t>(b2->num_rows * k), -1));
      auto b3 = h.sched();
      ASSERT_TRUE(b3);
      EXPECT_EQ(b3->req_ids, (V64{0, 1}));
      // Request 0's input: its last token, known on the host now.
      EXPECT_EQ(b3->row_tokens(0)[0], ahead ? 8 : 7);
      EXPECT_EQ(h.s.request(0).num_tokens(), ahead ? 8 : 7);
    }
  }
}

TEST(ScheduleAheadTest, OffAPromptChunkStillFollowsItsChunkInFlight) {
  SchedulerConfig c = Cfg(32);
  c.policy = BatchPolicy::kMixed;
  c.schedule_ahead = false;
  c.max_num_batched_tokens = 8;
  H h(c);
  h.add(0, Seq(1, 20), P(4));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  auto b2 = h.sched();  // the next chunk: its tokens are known
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->ncached, V{8});
  EXPECT_EQ(b2->nsched, V{8});
  h.upd(*b1, {0});
  h.upd(*b2, {0});
}

TEST(ScheduleAheadTest, OffARequestPreemptedWithItsRowInFlightKeepsThatOutput) {
  // vLLM's test_preempt_during_execution: request 1's prompt is in flight when request 0, its
  // output in, needs the block request 1 holds: request 1 is preempted, and the token its row
  // sampled is still its first output.
  SchedulerConfig c = Cfg(4);  // 4 blocks of 4 tokens
  c.policy = BatchPolicy::kMixed;
  c.schedule_ahead = false;
  H h(c);
  h.add(0, Seq(1, 8), P(8));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  h.add(1, Seq(10, 8), P(8));
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, V64{1});
  h.upd(*b1, {5});
  auto b3 = h.sched();  // request 0 needs a third block: request 1 is the victim
  ASSERT_TRUE(b3);
  EXPECT_EQ(b3->req_ids, V64{0});
  EXPECT_EQ(h.s.request(1).status, RequestStatus::kWaiting);
  auto o = h.upd(*b2, {42});
  EXPECT_EQ(o.tokens(1), V{42});
  EXPECT_EQ(h.s.request(1).num_tokens(), 9);
  h.upd(*b3, {6});
}

}  // namespace
}  // namespace atom_sched
