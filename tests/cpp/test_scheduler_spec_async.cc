// Scheduler scenarios: Speculative decoding (K = 2) and the one-step-ahead protocol.
//
// Every schedule() and update() goes through the harness H, which runs check_invariants() after
// each call and checks every batch against the request table (cu_seqlens, positions, slot
// mapping = block * block_size + offset, block-table rows padded with 0, emits_token, input
// tokens, sampling columns). Notation in the timelines: "A[0..7)" = A's tokens 0..6, "pos 7" = the
// KV position written, "{0,1}" = a block table, "free {5,4}" = the free list, head first.
#include "atom_sched/scheduler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "atom_sched/batch.h"
#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/kv_events.h"
#include "atom_sched/request.h"
#include "atom_sched/step_output.h"
#include "atom_sched/xxhash64.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

// ---------------------------------------------------------------------------------------------
// Speculative decoding, K = 2
// ---------------------------------------------------------------------------------------------

// bs 4, K 2. A = [10,11,12], B = [20..25).
//   step 1: prefill A {0}, B {1,2}   -> A 100 (drafts 30,31), B 200 (drafts 40,41)
//   step 2: decode, 3 tokens a row:
//           A: inputs 100 30 31 at pos 3,4,5 (grows to {0,3}): slots 3, 12, 13
//           B: inputs 200 40 41 at pos 5,6,7:                  slots 9, 10, 11
//           outputs A [30 50 -] a=2 (1 draft rejected: S rolls back by 1), drafts 32,33
//                   B [40 41 60] a=3, drafts 42,43
//   step 3: A: inputs 50 32 33 at pos 5,6,7; B: inputs 60 42 43 at pos 8,9,10 (grows {1,2,4})
//           outputs A [70 - -] a=1, B [80 81 82] a=3
TEST(SchedulerTest, SpeculativeDecodingK2) {
  H h(SpecCfg(16));
  h.add(1, {10, 11, 12});
  h.add(2, Seq(20, 5));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  EXPECT_EQ(s1->num_spec_tokens, 0);
  auto o1 = h.upd(*s1, {100, -1, -1, 200, -1, -1}, {}, {30, 31, 40, 41});
  EXPECT_EQ(o1.tokens(1), V{100});
  EXPECT_EQ(o1.tokens(2), V{200});
  EXPECT_EQ(h.s.request(1).drafts, (V{30, 31}));
  EXPECT_EQ(h.s.request(2).drafts, (V{40, 41}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 3);
  EXPECT_EQ(h.s.stats().num_spec_steps, 0) << "prefill outputs are not verification steps";

  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill);
  EXPECT_EQ(s2->num_spec_tokens, 2);
  EXPECT_EQ(s2->req_ids, (V64{1, 2}));
  EXPECT_EQ(s2->nsched, (V{3, 3}));
  EXPECT_EQ(s2->ncached, (V{3, 5}));
  EXPECT_EQ(s2->ctx, (V{6, 8}));
  EXPECT_EQ(s2->tokens, (V{100, 30, 31, 200, 40, 41}));
  EXPECT_EQ(s2->positions, (V64{3, 4, 5, 5, 6, 7}));
  EXPECT_EQ(s2->drafts, (V{30, 31, 40, 41}));
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 4}));
  EXPECT_EQ(h.s.request(2).block_table, (V{2, 3}));
  EXPECT_EQ(s2->slots, (V64{7, 16, 17, 13, 14, 15}));
  EXPECT_EQ(s2->cu_q, (V{0, 3, 6}));
  EXPECT_EQ(s2->cu_k, (V{0, 6, 14}));
  auto o2 = h.upd(*s2, {30, 50, -1, 40, 41, 60}, {2, 3}, {32, 33, 42, 43});
  EXPECT_EQ(o2.tokens(1), (V{30, 50}));
  EXPECT_EQ(o2.tokens(2), (V{40, 41, 60}));
  EXPECT_EQ(h.s.request(1).tokens, (V{10, 11, 12, 100, 30, 50}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 5) << "rolled back by the rejected draft";
  EXPECT_EQ(h.s.request(2).num_computed_tokens, 8);
  EXPECT_EQ(h.s.request(1).drafts, (V{32, 33}));

  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->tokens, (V{50, 32, 33, 60, 42, 43}));
  EXPECT_EQ(s3->positions, (V64{5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(s3->drafts, (V{32, 33, 42, 43}));
  EXPECT_EQ(h.s.request(2).block_table, (V{2, 3, 5}));
  EXPECT_EQ(s3->slots, (V64{17, 18, 19, 20, 21, 22}));
  auto o3 = h.upd(*s3, {70, -1, -1, 80, 81, 82}, {1, 3}, {34, 35, 44, 45});
  EXPECT_EQ(o3.tokens(1), V{70});
  EXPECT_EQ(o3.tokens(2), (V{80, 81, 82}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 6);
  EXPECT_EQ(h.s.request(2).num_computed_tokens, 11);

  const SchedulerStats& st = h.s.stats();
  EXPECT_EQ(st.num_spec_steps, 4);
  EXPECT_EQ(st.num_draft_tokens, 8);
  EXPECT_EQ(st.num_accepted_draft_tokens, 5);
  EXPECT_EQ(st.acceptance_counts, (std::vector<int64_t>{1, 1, 2}));
  EXPECT_DOUBLE_EQ(st.acceptance_rate(), 5.0 / 8.0);
}

// Drafts proposed after the update (vLLM's n-gram proposer runs after it), bs 4, K 2:
//   prefill A [10,11,12] -> 100, no drafts          next row: 1 token
//   set_drafts(A, {30})   -> row [100 30] at pos 3,4 (KV for 2 positions only)
//   outputs [30 50] a=2   -> A [.. 100 30 50], S 5; set_drafts(A, {32, 33}) -> row [50 32 33]
// Each refusal leaves the kept drafts as they were.
TEST(SchedulerTest, DraftsSetAfterTheUpdateAreVerifiedByTheNextRow) {
  H h(SpecCfg(16));
  h.add(1, {10, 11, 12});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {100, -1, -1}, {}, {-1, -1});
  auto one = h.sched();  // no drafts: one token, then the same step again with a draft
  ASSERT_TRUE(one);
  EXPECT_EQ(one->nsched, V{1});
  h.upd(*one, {101, -1, -1}, {1}, {-1, -1});
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 4);

  h.s.set_drafts(1, V{30});
  h.Inv("set_drafts");
  EXPECT_EQ(h.s.request(1).drafts, (V{30, -1}));
  EXPECT_EQ(h.s.request(1).num_drafts, 1);
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->nsched, V{2});
  EXPECT_EQ(s2->tokens, (V{101, 30}));
  EXPECT_EQ(s2->positions, (V64{4, 5}));
  EXPECT_EQ(s2->drafts, (V{30, -1}));
  EXPECT_THROW(h.s.set_drafts(1, V{7}), InvalidArgument) << "its row is in flight";
  EXPECT_EQ(h.s.request(1).drafts, (V{30, -1}));
  auto o2 = h.upd(*s2, {30, 50, -1}, {2}, {-1, -1});
  EXPECT_EQ(o2.tokens(1), (V{30, 50}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 6);

  h.s.set_drafts(1, V{32, 33});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->tokens, (V{50, 32, 33}));
  EXPECT_EQ(s3->drafts, (V{32, 33}));
  auto o3 = h.upd(*s3, {32, 60, -1}, {2}, {-1, -1});
  EXPECT_EQ(o3.tokens(1), (V{32, 60}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 8) << "rolled back by the rejected draft";
  EXPECT_EQ(h.s.stats().num_accepted_draft_tokens, 2);

  // Refusals, the kept drafts unchanged.
  h.s.set_drafts(1, V{40});
  EXPECT_THROW(h.s.set_drafts(1, V{1, 2, 3}), InvalidArgument) << "more than K";
  EXPECT_THROW(h.s.set_drafts(1, V{5, -1}), InvalidArgument) << "a negative draft";
  EXPECT_THROW(h.s.set_drafts(9, V{5}), UnknownRequest);
  EXPECT_EQ(h.s.request(1).drafts, (V{40, -1}));
  h.add(2, Seq(20, 9));  // waiting
  EXPECT_THROW(h.s.set_drafts(2, V{5}), InvalidArgument) << "waiting";
  h.s.set_drafts(1, V{});  // none: the next row verifies nothing
  EXPECT_EQ(h.s.request(1).num_drafts, 0);

  H plain(Cfg(16));
  plain.add(1, {10, 11, 12});
  auto p1 = plain.sched();
  ASSERT_TRUE(p1);
  plain.upd(*p1, {100});
  EXPECT_THROW(plain.s.set_drafts(1, V{5}), InvalidArgument) << "K = 0";
}

// K 2, EOS 2, stop token 99. After the prefill (one token each), one decode row each:
//   A accepts [7 2 9]   -> [7 2] "eos": tokens after the stop are dropped
//   B accepts [99 2 5]  -> [99] "stop_99": the earliest stop wins (fix 8.12)
//   C accepts [1 2 3], stop sequence [1,2] -> [1 2] "stop_sequence" (earliest match, 8.11)
//   D accepts [20 21 22], max_tokens 3 -> [20 21] "max_tokens": no overshoot (fix 8.10)
//   E accepts [30 31 32], max_model_len 7 (prompt 3 + 1) -> [30 31 32] reaches 7: max_model_len
TEST(SchedulerTest, SpeculativeStopsTruncateTheRow) {
  SchedulerConfig c = SpecCfg(32);
  c.eos_token_id = 2;
  c.stop_token_ids = {99};
  c.max_model_len = 7;
  H h(c);
  SamplingParams pc = P();
  pc.stop_token_sequences = {{5, 5, 5}, {1, 2}};
  h.add(1, {50, 51, 52});
  h.add(2, {50, 51, 52});
  h.add(3, {50, 51, 52}, pc);
  h.add(4, {50, 51, 52}, P(3));
  h.add(5, {50, 51, 52});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  ASSERT_EQ(s1->num_rows, 5);
  V sampled;
  for (int i = 0; i < 5; ++i) sampled.insert(sampled.end(), {10, -1, -1});
  h.upd(*s1, sampled, {1, 1, 1, 1, 1}, V(10, 60));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  ASSERT_EQ(s2->req_ids, (V64{1, 2, 3, 4, 5}));
  auto o = h.upd(*s2, {7, 2, 9, 99, 2, 5, 1, 2, 3, 20, 21, 22, 30, 31, 32}, {3, 3, 3, 3, 3},
                 V(10, 60));
  EXPECT_EQ(o.tokens(1), (V{7, 2}));
  EXPECT_EQ(o.why(1), "eos");
  EXPECT_EQ(o.tokens(2), V{99});
  EXPECT_EQ(o.why(2), "stop_99");
  EXPECT_EQ(o.tokens(3), (V{1, 2}));
  EXPECT_EQ(o.why(3), "stop_sequence");
  EXPECT_EQ(o.tokens(4), (V{20, 21}));
  EXPECT_EQ(o.why(4), "max_tokens");
  EXPECT_EQ(o.tokens(5), (V{30, 31, 32}));
  EXPECT_EQ(o.why(5), "max_model_len");
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 32);
}

// K 3, EOS 2 and no stop lists (the stop rule's case update() inlines for each accepted token).
// After the prefill (one token each), one decode row each:
//   A accepts [7 2 9 4]            -> [7 2] "eos"
//   B (ignore_eos) accepts [2 2 5] -> [2 2 5], running
//   C (min_tokens 3) accepts [2 2 8 6] -> [2 2] "eos": the first EOS is its 2nd token, the
//     second its 3rd
//   D accepts [5 6] of [5 6 2 9]   -> [5 6], running: an EOS past the accepted tokens is not one
//   E (max_tokens 3) accepts [3 4 5 6] -> [3 4] "max_tokens"
TEST(SchedulerTest, SpeculativeEosWithoutStopListsTruncatesTheRow) {
  SchedulerConfig c = SpecCfg(32, 3);
  c.eos_token_id = 2;
  H h(c);
  SamplingParams pb = P();
  pb.ignore_eos = true;
  SamplingParams pc = P();
  pc.min_tokens = 3;
  for (int64_t id : {1, 2, 3, 4, 5})
    h.add(id, {50, 51, 52}, id == 2 ? pb : id == 3 ? pc : id == 5 ? P(3) : P());
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  ASSERT_EQ(s1->num_rows, 5);
  V sampled;
  for (int i = 0; i < 5; ++i) sampled.insert(sampled.end(), {10, -1, -1, -1});
  h.upd(*s1, sampled, {1, 1, 1, 1, 1}, V(15, 60));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  ASSERT_EQ(s2->req_ids, (V64{1, 2, 3, 4, 5}));
  auto o = h.upd(*s2, {7, 2, 9, 4, 2, 2, 5, 6, 2, 2, 8, 6, 5, 6, 2, 9, 3, 4, 5, 6},
                 {4, 3, 4, 2, 4}, V(15, 60));
  EXPECT_EQ(o.tokens(1), (V{7, 2}));
  EXPECT_EQ(o.why(1), "eos");
  EXPECT_EQ(o.tokens(2), (V{2, 2, 5}));
  EXPECT_EQ(o.why(2), "");
  EXPECT_EQ(o.tokens(3), (V{2, 2}));
  EXPECT_EQ(o.why(3), "eos");
  EXPECT_EQ(o.tokens(4), (V{5, 6}));
  EXPECT_EQ(o.why(4), "");
  EXPECT_EQ(o.tokens(5), (V{3, 4}));
  EXPECT_EQ(o.why(5), "max_tokens");
  EXPECT_EQ(h.s.running_ids(), (V64{2, 4}));
  EXPECT_EQ(h.s.request(2).tokens, (V{50, 51, 52, 10, 2, 2, 5}));
  EXPECT_EQ(h.s.request(4).tokens, (V{50, 51, 52, 10, 5, 6}));
  EXPECT_EQ(h.s.request(4).last_token, 6);
}

// bs 4, K 2, 4 usable blocks. A = [10,11,12], B = [20,21,22]; every draft accepted.
//   step 1: prefill A {1}, B {2}          -> A 100, B 200 (drafts proposed)
//   step 2: A pos 3,4,5 and B pos 3,4,5 cross into their second blocks (the last two free)
//   step 3: A pos 6,7,8 crosses into a third block with none free: B, the tail, is preempted
//           and A takes the block B freed; the batch holds A alone.
TEST(SchedulerTest, SpeculativeRowCrossingIntoABlockPreemptsWhenThePoolIsEmpty) {
  H h(SpecCfg(4));
  h.add(1, {10, 11, 12});
  h.add(2, {20, 21, 22});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {100, -1, -1, 200, -1, -1}, {}, {30, 31, 40, 41});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->positions, (V64{3, 4, 5, 3, 4, 5}));
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
  h.upd(*s2, {30, 31, 101, 40, 41, 201}, {3, 3}, {32, 33, 42, 43});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->req_ids, V64{1});
  EXPECT_EQ(s3->positions, (V64{6, 7, 8}));
  EXPECT_EQ(s3->tokens, (V{101, 32, 33}));
  EXPECT_EQ(h.s.request(1).block_table.size(), 3u);
  EXPECT_EQ(h.s.running_ids(), V64{1});
  EXPECT_EQ(h.s.request(2).status, RequestStatus::kWaiting);
  EXPECT_EQ(h.s.request(2).num_computed_tokens, 0);
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
}

// Log-probabilities stay aligned with the streamed tokens under MTP (fix 8.13): one per kept
// token, the dropped tokens' values dropped with them. K 2, EOS 2.
//   prefill: A 10 (-0.1), B 20 (-0.2)
//   decode:  A accepts [7 2 9] -> [7 2] "eos", logprobs [-0.7 -0.2]
//            B accepts [5 6 -] -> [5 6],      logprobs [-0.5 -0.6]
TEST(SchedulerTest, LogprobsStayAlignedWithTokensUnderMtp) {
  SchedulerConfig c = SpecCfg(16);
  c.eos_token_id = 2;
  H h(c);
  SamplingParams p = P();
  p.logprobs = true;
  h.add(1, {50, 51, 52}, p);
  h.add(2, {60, 61, 62}, p);
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  auto o1 = h.upd(*s1, {10, -1, -1, 20, -1, -1}, {}, {30, 31, 40, 41},
                  {-0.1f, 0.0f, 0.0f, -0.2f, 0.0f, 0.0f});
  EXPECT_EQ(o1.by_id[1].logprobs, std::vector<float>{-0.1f});
  EXPECT_EQ(o1.by_id[2].logprobs, std::vector<float>{-0.2f});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  auto o2 = h.upd(*s2, {7, 2, 9, 5, 6, 8}, {3, 2}, {1, 1, 1, 1},
                  {-0.7f, -0.2f, -0.9f, -0.5f, -0.6f, -0.8f});
  EXPECT_EQ(o2.tokens(1), (V{7, 2}));
  EXPECT_EQ(o2.why(1), "eos");
  EXPECT_EQ(o2.by_id[1].logprobs, (std::vector<float>{-0.7f, -0.2f}));
  EXPECT_EQ(o2.tokens(2), (V{5, 6}));
  EXPECT_EQ(o2.by_id[2].logprobs, (std::vector<float>{-0.5f, -0.6f}));
}

// ---------------------------------------------------------------------------------------------
// One step ahead (async)
// ---------------------------------------------------------------------------------------------

// bs 4. A = [10,11,12], max_tokens 3.
//   b1: prefill pos 0..2                        (in flight)
//   b2: decode pos 3, input -1 (b1's token is on the device), slot 3   (in flight)
//       a third schedule() is refused (2 outstanding); update(b2) before b1 is refused
//   update b1 -> 20
//   b3: decode pos 4, input -1, grows to {0,1}: slot 4
//   update b2 -> 21; update b3 -> 22: max_tokens
TEST(SchedulerTest, OneStepAheadInFlightTokensAreUnknown) {
  H h(Cfg(8));
  h.add(1, {10, 11, 12}, P(3));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(h.s.num_outstanding_batches(), 1);
  EXPECT_EQ(h.s.request(1).num_inflight, 1);
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_GT(b2->id, b1->id);
  EXPECT_FALSE(b2->is_prefill);
  EXPECT_EQ(b2->ncached, V{3});
  EXPECT_EQ(b2->ctx, V{4});
  EXPECT_EQ(b2->positions, V64{3});
  EXPECT_EQ(b2->tokens, V{-1});
  EXPECT_EQ(b2->slots, V64{7});
  EXPECT_EQ(h.s.request(1).num_inflight, 2);
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 4);
  EXPECT_EQ(h.s.num_outstanding_batches(), 2);

  const State before = Capture(h.s);
  EXPECT_THROW(h.s.schedule(), InvalidArgument);
  h.Inv("refused schedule");
  ExpectSame(before, Capture(h.s), "third schedule()");
  {
    const V t = {21};
    ModelOutputs o;
    o.sampled_token_ids = t;
    EXPECT_THROW(h.s.update(b2->id, o), InvalidArgument);
    h.Inv("refused update");
    ExpectSame(before, Capture(h.s), "update of the newer batch first");
  }

  EXPECT_EQ(h.upd(*b1, {20}).tokens(1), V{20});
  auto b3 = h.sched();
  ASSERT_TRUE(b3);
  EXPECT_EQ(b3->positions, V64{4});
  EXPECT_EQ(b3->tokens, V{-1});
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 2}));
  EXPECT_EQ(b3->slots, V64{8});
  EXPECT_EQ(h.upd(*b2, {21}).tokens(1), V{21});
  auto o3 = h.upd(*b3, {22});
  EXPECT_EQ(o3.tokens(1), V{22});
  EXPECT_EQ(o3.why(1), "max_tokens");
  EXPECT_FALSE(h.sched());
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_EQ(h.s.num_outstanding_batches(), 0);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 8);
}

// A and B, EOS 20. b1 = prefill A, B; b2 = decode A, B (in flight).
//   update b1: A -> 20 "eos" (A finishes while b2 still holds it); B -> 30
//   update b2: A's output is discarded; B -> 31
// (A finish the scheduler can foresee, max_tokens or max_model_len, gets no later row at all:
// test_scheduler_contract.cc, NoRowForATokenAlreadyInFlight.)
TEST(SchedulerTest, OneStepAheadFinishDiscardsTheLaterOutput) {
  SchedulerConfig c = Cfg(8);
  c.eos_token_id = 20;
  H h(c);
  h.add(1, {10, 11, 12});
  h.add(2, {13, 14, 15});
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, (V64{1, 2}));
  auto o1 = h.upd(*b1, {20, 30});
  EXPECT_EQ(o1.why(1), "eos");
  EXPECT_EQ(o1.tokens(1), V{20});
  EXPECT_FALSE(h.s.contains(1));
  EXPECT_EQ(h.s.running_ids(), V64{2});
  auto o2 = h.upd(*b2, {21, 31});
  EXPECT_FALSE(o2.has(1)) << "output for a finished request must be discarded";
  EXPECT_EQ(o2.tokens(2), V{31});
  EXPECT_EQ(h.s.stats().num_finished, 1);
  // The id may be reused now.
  h.add(1, {1, 2});
  EXPECT_TRUE(h.s.contains(1));
}

// Abort while the request's prefill is in flight: its output is dropped, its KV freed.
TEST(SchedulerTest, AbortWhileInFlightDiscardsTheOutput) {
  H h(Cfg(8));
  h.add(1, {10, 11, 12});
  h.add(2, {13, 14, 15, 16, 17});
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 5);
  h.s.abort_request(1);
  h.Inv("abort_request");
  EXPECT_FALSE(h.s.contains(1));
  EXPECT_EQ(h.s.running_ids(), V64{2});
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 6);
  EXPECT_EQ(h.s.stats().num_aborted, 1);
  auto o1 = h.upd(*b1, {20, 30});
  EXPECT_FALSE(o1.has(1));
  EXPECT_EQ(o1.tokens(2), V{30});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, V64{2});
}

// A prefill chunk scheduled while the request's previous chunk is in flight: its tokens come from
// the prompt and its positions are exact, so row_exact must be 1 ("1 when every value of the row
// is exact", batch.h / docs/api.md).
//   budget 4. A = [100..108).  b1: chunk A[0..4) (in flight)   b2: chunk A[4..8), emits
TEST(SchedulerTest, OneStepAheadPrefillChunkRowIsExact) {
  SchedulerConfig c = Cfg(8);
  c.max_num_batched_tokens = 4;
  H h(c);
  h.add(1, Seq(100, 8));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_TRUE(b2->is_prefill);
  EXPECT_EQ(b2->tokens, Seq(104, 4));
  EXPECT_EQ(b2->positions, (V64{4, 5, 6, 7}));
  EXPECT_EQ(b2->emits, std::vector<uint8_t>{1});
  EXPECT_EQ(b2->exact, std::vector<uint8_t>{1}) << "every value of this row is known";
  EXPECT_EQ(h.upd(*b1, {-1}).size(), 0u);
  EXPECT_EQ(h.upd(*b2, {20}).tokens(1), V{20});
}

// Preemption while the victim's token is in flight keeps that token (fix 8.1).
// bs 4, 4 blocks, prefix caching off. A = [100..107) (max_tokens 4), B = [200..207).
//   step 1 (sync): prefill A {0,1}, B {2,3}   -> A 110, B 210
//   b2: decode A, B at pos 7                  (in flight)
//   b3: A pos 8 needs a block, none free: preempt B (tail) although b2 holds it. B's {2,3}
//       freed: free {3,2}; A grows with 3: A pos 8, input -1, slot 12. B heads waiting.
//   update b2: A 111, B 211 (B keeps it: 9 tokens, none lost, no placeholder)
//   update b3: A 112
//   step 4: B needs 3 blocks, 1 free: waits. decode A pos 9 -> 113: max_tokens; free {2,3,1,0}
//   step 5: B re-prefilled with [200..207) 210 211 into {2,3,1} -> 212
TEST(SchedulerTest, PreemptionWhileInFlightKeepsTheInFlightToken) {
  SchedulerConfig c = Cfg(4);
  c.enable_prefix_caching = false;
  H h(c);
  h.add(1, Seq(100, 7), P(4));
  h.add(2, Seq(200, 7));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110, 210});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, (V64{1, 2}));
  EXPECT_EQ(b2->tokens, (V{110, 210}));
  auto b3 = h.sched();
  ASSERT_TRUE(b3);
  EXPECT_EQ(b3->req_ids, V64{1});
  EXPECT_EQ(b3->positions, V64{8});
  EXPECT_EQ(b3->tokens, V{-1});
  EXPECT_EQ(b3->slots, V64{16});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.s.running_ids(), V64{1});
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  EXPECT_EQ(h.s.request(2).status, RequestStatus::kWaiting);
  EXPECT_EQ(h.s.request(2).num_inflight, 1);
  EXPECT_EQ(h.s.request(2).tokens, Cat(Seq(200, 7), {210}));

  auto o2 = h.upd(*b2, {111, 211});
  EXPECT_EQ(o2.tokens(1), V{111});
  EXPECT_EQ(o2.tokens(2), V{211}) << "the preempted request keeps its in-flight token";
  EXPECT_EQ(h.s.request(2).tokens, Cat(Seq(200, 7), {210, 211}));
  EXPECT_EQ(h.s.request(2).status, RequestStatus::kWaiting);
  EXPECT_EQ(h.upd(*b3, {112}).tokens(1), V{112});

  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_EQ(s4->req_ids, V64{1});
  EXPECT_EQ(s4->positions, V64{9});
  EXPECT_EQ(s4->tokens, V{112});
  EXPECT_EQ(h.upd(*s4, {113}).why(1), "max_tokens");
  EXPECT_EQ(h.s.block_pool().free_list(), (V{3, 4, 2, 1}));

  auto s5 = h.sched();
  ASSERT_TRUE(s5);
  EXPECT_TRUE(s5->is_prefill);
  EXPECT_EQ(s5->req_ids, V64{2});
  EXPECT_EQ(s5->tokens, Cat(Seq(200, 7), {210, 211}));
  EXPECT_EQ(h.s.request(2).block_table, (V{3, 4, 2}));
  EXPECT_EQ(h.upd(*s5, {212}).tokens(2), V{212});
}

// The same start as PreemptionWhileInFlightKeepsTheInFlightToken (B preempted by b3 while b2
// holds it), then B's in-flight token ends it while it waits (EOS 2), or B is aborted before the
// token arrives: either way B leaves the waiting queue, nothing is streamed twice, no KV leaks.
TEST(SchedulerTest, PreemptedRequestFinishesOrIsAbortedWhileItsTokenIsInFlight) {
  for (bool abort : {false, true}) {
    SCOPED_TRACE(abort ? "abort" : "eos");
    SchedulerConfig c = Cfg(4);
    c.enable_prefix_caching = false;
    c.eos_token_id = 2;
    H h(c);
    h.add(1, Seq(100, 7), P(4));
    h.add(2, Seq(200, 7));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {110, 210});
    auto b2 = h.sched();
    ASSERT_TRUE(b2);
    auto b3 = h.sched();
    ASSERT_TRUE(b3);
    ASSERT_EQ(h.s.waiting_ids(), V64{2});
    if (abort) {
      h.s.abort_request(2);
      h.Inv("abort_request");
      EXPECT_FALSE(h.s.contains(2));
      EXPECT_TRUE(h.s.waiting_ids().empty());
    }
    auto o2 = h.upd(*b2, {111, 2});
    if (abort) {
      EXPECT_FALSE(o2.has(2));
    } else {
      EXPECT_EQ(o2.tokens(2), V{2});
      EXPECT_EQ(o2.why(2), "eos");
    }
    EXPECT_FALSE(h.s.contains(2));
    EXPECT_TRUE(h.s.waiting_ids().empty());
    h.upd(*b3, {112});
    auto s4 = h.sched();
    ASSERT_TRUE(s4);
    EXPECT_EQ(s4->req_ids, V64{1});
    EXPECT_EQ(h.upd(*s4, {113}).why(1), "max_tokens");
    EXPECT_FALSE(h.sched());
    EXPECT_FALSE(h.s.has_unfinished_requests());
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), 4);
  }
}

// K 2, one step ahead. A = [10,11,12].
//   step 1 (sync): prefill -> 20, drafts 30 31
//   b2: decode inputs 20 30 31 at pos 3,4,5 (exact)                  S = 6
//   b3 (b2 in flight): 3 more rows at upper-bound pos 6,7,8; every input and draft is -1,
//       row_exact 0; blocks reserved for the worst case {0,1,2}     S = 9
//   update b2: a=2 [30 40] -> R = 6; S = 9 - 1 rejected = 8
//   update b3: a=3 [50 51 52] -> R = 9; S = 8 = R - 1
//   step 4 (sync): inputs 52 60 61 at pos 8,9,10
TEST(SchedulerTest, OneStepAheadWithDraftsReconcilesTheComputedCount) {
  H h(SpecCfg(16));
  h.add(1, {10, 11, 12});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {20, -1, -1}, {}, {30, 31});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->tokens, (V{20, 30, 31}));
  EXPECT_EQ(b2->positions, (V64{3, 4, 5}));
  EXPECT_EQ(b2->exact, std::vector<uint8_t>{1});
  auto b3 = h.sched();
  ASSERT_TRUE(b3);
  EXPECT_FALSE(b3->is_prefill);
  EXPECT_EQ(b3->ncached, V{6});
  EXPECT_EQ(b3->ctx, V{9});
  EXPECT_EQ(b3->positions, (V64{6, 7, 8}));
  EXPECT_EQ(b3->tokens, (V{-1, -1, -1}));
  EXPECT_EQ(b3->drafts, (V{-1, -1}));
  EXPECT_EQ(b3->exact, std::vector<uint8_t>{0});
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 2, 3}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 9);

  auto o2 = h.upd(*b2, {30, 40, -1}, {2}, {50, 51});
  EXPECT_EQ(o2.tokens(1), (V{30, 40}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 8);
  auto o3 = h.upd(*b3, {50, 51, 52}, {3}, {60, 61});
  EXPECT_EQ(o3.tokens(1), (V{50, 51, 52}));
  EXPECT_EQ(h.s.request(1).tokens, (V{10, 11, 12, 20, 30, 40, 50, 51, 52}));
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 8);
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_EQ(s4->tokens, (V{52, 60, 61}));
  EXPECT_EQ(s4->positions, (V64{8, 9, 10}));
  EXPECT_EQ(s4->exact, std::vector<uint8_t>{1});
}

// uniform_decode_rows: every decode row verifies K+1 (ATOM's runner verifies [rows, K+1]).
SchedulerConfig UniformCfg(int32_t k, int32_t max_model_len) {
  SchedulerConfig c = SpecCfg(32, k);
  c.max_model_len = max_model_len;
  c.uniform_decode_rows = true;
  return c;
}

TEST(SchedulerTest, UniformDecodeRowsVerifyKPlusOneWithFewerDrafts) {
  for (bool uniform : {false, true}) {
    SCOPED_TRACE(uniform ? "uniform" : "real drafts only");
    SchedulerConfig c = UniformCfg(2, 64);
    c.uniform_decode_rows = uniform;
    H h(c);
    h.add(1, Seq(100, 5));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {20, -1, -1}, {}, {7, -1});  // the drafter proposed one draft of two
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->nsched[0], uniform ? 3 : 2);
    EXPECT_EQ(s2->row_drafts(0), (V{7, -1}));
    EXPECT_EQ(s2->row_tokens(0), uniform ? (V{20, 7, -1}) : (V{20, 7}));
    auto o2 = h.upd(*s2, {21, 22, 23}, {uniform ? 3 : 2}, {8, 9});
    EXPECT_EQ(o2.tokens(1), uniform ? (V{21, 22, 23}) : (V{21, 22}));
  }
}

TEST(SchedulerTest, UniformDecodeRowsWaitOneStepAheadAndAreShortOnlyAtTheLimit) {
  {
    // K = 2, limit 16: one step ahead only one position fits: no row until the outputs land.
    H h(UniformCfg(2, 16));
    h.add(1, Seq(100, 12));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {20, -1, -1}, {}, {1, 2});
    auto s2 = h.sched();  // exact: S = 12, three positions
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->nsched[0], 3);
    EXPECT_FALSE(h.sched()) << "S = 15 one step ahead: a K+1 row would pass the limit";
    h.upd(*s2, {21, -1, -1}, {1}, {3, 4});  // 14 tokens
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->nsched[0], 3);
    EXPECT_EQ(s3->ctx[0], 16);
    auto o3 = h.upd(*s3, {22, 23, 24}, {3}, {5, 6});
    EXPECT_EQ(o3.tokens(1), (V{22, 23})) << "ends at max_model_len";
    EXPECT_EQ(o3.why(1), "max_model_len");
  }
  {
    // K = 3, limit 16: the exact row at the limit has three positions, and its tokens end it.
    H h(UniformCfg(3, 16));
    h.add(1, Seq(100, 12));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {20, -1, -1, -1}, {}, {1, 2, 3});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->nsched[0], 4);
    h.upd(*s2, {21, -1, -1, -1}, {1}, {4, 5, 6});  // 14 tokens, S = 13
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->nsched[0], 3) << "short only at the limit";
    auto o3 = h.upd(*s3, {22, 23, 24, -1}, {3}, {7, 8, 9});
    EXPECT_EQ(o3.tokens(1), (V{22, 23}));
    EXPECT_EQ(o3.why(1), "max_model_len");
  }
}

}  // namespace
}  // namespace atom_sched
