// Scheduler scenarios: Decode batches, preemption and stop conditions.
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
// Decode batches and preemption
// ---------------------------------------------------------------------------------------------

// request.h groups a Request's fields by the cache lines a steady decode step touches; a field
// added in the wrong place would quietly cost a miss per row at thousands of requests.
TEST(RequestLayout, DecodeStepFieldsShareTheirCacheLines) {
  const Request r;
  const char* base = reinterpret_cast<const char*>(&r);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(base) % 64, 0u);
  const auto in_line = [&](const auto& field, int line) {
    const char* p = reinterpret_cast<const char*>(&field);
    return p - base >= 64 * line && p + sizeof(field) - base <= 64 * (line + 1);
  };
#define EXPECT_IN_LINE(field, line) EXPECT_TRUE(in_line(r.field, line)) << #field
  // Line 0: all a steady K = 0 row reads or writes, in schedule() (the steady columns hold the
  // rest) and in update() (the token appended through the vector's pointers).
  EXPECT_IN_LINE(num_computed_tokens, 0);
  EXPECT_IN_LINE(num_inflight, 0);
  EXPECT_IN_LINE(token_count, 0);
  EXPECT_IN_LINE(last_token, 0);
  EXPECT_IN_LINE(tokens, 0);
  EXPECT_IN_LINE(prefix_hit_tokens, 0);
  EXPECT_IN_LINE(wants_logprobs, 0);
  // And what a speculative row's output is checked against first (the flagged K = 0 rows too).
  EXPECT_IN_LINE(status, 0);
  EXPECT_IN_LINE(num_unstreamed, 0);
  EXPECT_IN_LINE(has_stop_lists, 0);
  EXPECT_IN_LINE(ignore_eos, 0);
  EXPECT_IN_LINE(stop_length, 0);
  EXPECT_IN_LINE(min_tokens, 0);
  EXPECT_IN_LINE(blocks_published, 0);
  // Line 1: what a row with drafts reads besides, in schedule() and in update().
  EXPECT_IN_LINE(drafts, 1);
  EXPECT_IN_LINE(num_drafts, 1);
  EXPECT_IN_LINE(prefill_target, 1);
  EXPECT_IN_LINE(epoch, 1);
  EXPECT_IN_LINE(id, 1);
  EXPECT_IN_LINE(table_size, 1);
  EXPECT_IN_LINE(last_block, 1);
  EXPECT_IN_LINE(blocks_shipped, 1);
  EXPECT_IN_LINE(num_prompt_tokens, 1);
#undef EXPECT_IN_LINE
}

TEST(SchedulerTest, DecodeBatchArrays) {
  H h(Cfg(6));
  const Snap d = ThreeFillThePool(h, 64);
  EXPECT_FALSE(d.is_prefill);
  EXPECT_EQ(d.num_rows, 3);
  EXPECT_EQ(d.num_tokens, 3);
  EXPECT_EQ(d.num_spec_tokens, 0);
  EXPECT_EQ(d.req_ids, (V64{1, 2, 3}));
  EXPECT_EQ(d.nsched, (V{1, 1, 1}));
  EXPECT_EQ(d.ncached, (V{7, 7, 7}));
  EXPECT_EQ(d.ctx, (V{8, 8, 8}));
  EXPECT_EQ(d.last_block, (V{4, 4, 4}));
  EXPECT_EQ(d.tokens, (V{110, 210, 310}));
  EXPECT_EQ(d.positions, (V64{7, 7, 7}));
  EXPECT_EQ(d.slots, (V64{2 * 4 + 3, 4 * 4 + 3, 6 * 4 + 3}));
  EXPECT_EQ(d.cu_q, (V{0, 1, 2, 3}));
  EXPECT_EQ(d.cu_k, (V{0, 8, 16, 24}));
  EXPECT_EQ(d.max_seqlen_q, 1);
  EXPECT_EQ(d.max_seqlen_k, 8);
  EXPECT_EQ(d.emits, (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(d.exact, (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(d.state_slots, (V{-1, -1, -1}));
  EXPECT_EQ(d.temps, (std::vector<float>{0.5f, 1.0f, 0.0f}));
  EXPECT_EQ(d.top_ks, (V{5, -1, -1}));
  EXPECT_EQ(d.top_ps, (std::vector<float>{0.9f, 1.0f, 1.0f}));
  ASSERT_EQ(d.width, h.s.config().max_blocks_per_request());
  ASSERT_GE(d.width, 3);
  V expect_rows;
  for (const V& t : {V{1, 2}, V{3, 4}, V{5, 6}}) {
    V row(d.width, kNullBlock);
    std::copy(t.begin(), t.end(), row.begin());
    expect_rows.insert(expect_rows.end(), row.begin(), row.end());
  }
  EXPECT_EQ(d.tables, expect_rows) << "block_tables rows padded with the null block";
}

// Continuing ThreeFillThePool (A max_tokens 4):
//   step 3: A needs pos 8 -> a 3rd block, none free -> preempt the TAIL of running, C (not B).
//           C's blocks {4,5} are freed last-first: free {5,4}. A grows with 5, B with 4.
//           rows A, B at pos 8: slots 5*4+0 = 20, 4*4+0 = 16. C heads waiting with its 9 tokens.
//   update: A 112, B 212
//   step 4: C needs 3 blocks, 0 free: stays at the head. decode A, B at pos 9.
//   update: A 113 -> 4 tokens: max_tokens; A's {0,1,5} freed: free {5,1,0}
//   step 5: C re-prefilled: all 9 tokens [300..307) 310 311 into {5,1,0}
//   step 6: decode B (pos 10), C (pos 9): C re-joined the tail of running
TEST(SchedulerTest, PreemptionVictimIsTheTailOfRunning) {
  H h(Cfg(6));
  ThreeFillThePool(h, 4);
  const V c_tokens = Cat(Seq(300, 7), {310, 311});
  h.add(4, Seq(400, 4));  // D: 1 block, none free: waits behind everything
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_FALSE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, (V64{1, 2}));
  EXPECT_EQ(s3->positions, (V64{8, 8}));
  EXPECT_EQ(s3->tokens, (V{111, 211}));
  EXPECT_EQ(s3->slots, (V64{24, 20}));
  EXPECT_EQ(s3->table(0, 4), (V{1, 2, 6, 0}));
  EXPECT_EQ(s3->table(1, 4), (V{3, 4, 5, 0}));
  EXPECT_EQ(h.s.waiting_ids(), (V64{3, 4})) << "the victim goes to the HEAD of waiting";
  EXPECT_EQ(h.s.running_ids(), (V64{1, 2}));
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  {
    const Request& c = h.s.request(3);
    EXPECT_EQ(c.status, RequestStatus::kWaiting);
    EXPECT_EQ(c.tokens, c_tokens) << "a preempted request keeps every token";
    EXPECT_TRUE(c.block_table.empty());
    EXPECT_EQ(c.num_computed_tokens, 0);
    EXPECT_TRUE(c.preempted);
  }
  h.upd(*s3, {112, 212});

  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_FALSE(s4->is_prefill);
  EXPECT_EQ(s4->req_ids, (V64{1, 2}));
  EXPECT_EQ(s4->positions, (V64{9, 9}));
  EXPECT_EQ(h.s.waiting_ids(), (V64{3, 4}));
  auto o4 = h.upd(*s4, {113, 213});
  EXPECT_EQ(o4.why(1), "max_tokens");
  EXPECT_EQ(h.s.block_pool().free_list(), (V{6, 2, 1}));

  auto s5 = h.sched();
  ASSERT_TRUE(s5);
  EXPECT_TRUE(s5->is_prefill);
  EXPECT_EQ(s5->req_ids, V64{3});
  EXPECT_EQ(s5->ncached, V{0});
  EXPECT_EQ(s5->nsched, V{9});
  EXPECT_EQ(s5->tokens, c_tokens);
  EXPECT_EQ(h.s.request(3).prefill_target, 9);
  EXPECT_EQ(h.s.request(3).block_table, (V{6, 2, 1}));
  EXPECT_EQ(s5->slots, (V64{24, 25, 26, 27, 8, 9, 10, 11, 4}));
  EXPECT_EQ(s5->emits, std::vector<uint8_t>{1});
  EXPECT_EQ(h.s.waiting_ids(), V64{4});
  auto o5 = h.upd(*s5, {312});
  EXPECT_EQ(o5.tokens(3), V{312});

  auto s6 = h.sched();
  ASSERT_TRUE(s6);
  EXPECT_FALSE(s6->is_prefill);
  EXPECT_EQ(s6->req_ids, (V64{2, 3}));
  EXPECT_EQ(s6->positions, (V64{10, 9}));
  EXPECT_EQ(s6->tokens, (V{213, 312}));
}

// bs 4, 4 blocks, prefix caching off. A = [100..105) (max_tokens 3), B = [200..207).
//   step 1: prefill A {0,1}, B {2,3}         -> A 110, B 210
//   step 2: decode A pos 5, B pos 7          -> A 111, B 211
//   step 3: A pos 6 fits; B pos 8 needs a block, none free, and B is the tail: B preempts itself.
//           batch = A only                   -> A 112: max_tokens; free {3,2,1,0}
//   step 4: B re-prefilled with its 9 tokens into {3,2,1}
TEST(SchedulerTest, PreemptsItselfWhenItIsTheTail) {
  SchedulerConfig c = Cfg(4);
  c.enable_prefix_caching = false;
  H h(c);
  h.add(1, Seq(100, 5), P(3));
  h.add(2, Seq(200, 7));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110, 210});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->positions, (V64{5, 7}));
  h.upd(*s2, {111, 211});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->req_ids, V64{1});
  EXPECT_EQ(s3->positions, V64{6});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.s.running_ids(), V64{1});
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  EXPECT_EQ(h.s.request(2).tokens, Cat(Seq(200, 7), {210, 211}));
  auto o3 = h.upd(*s3, {112});
  EXPECT_EQ(o3.why(1), "max_tokens");
  EXPECT_EQ(h.s.block_pool().free_list(), (V{4, 3, 2, 1}));
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_TRUE(s4->is_prefill);
  EXPECT_EQ(s4->req_ids, V64{2});
  EXPECT_EQ(s4->tokens, Cat(Seq(200, 7), {210, 211}));
  EXPECT_EQ(h.s.request(2).block_table, (V{4, 3, 2}));
  auto o4 = h.upd(*s4, {212});
  EXPECT_EQ(o4.tokens(2), V{212});
}

// Fix 8.2: a preempted request is re-prefilled to ALL its tokens (its prefill target), in
// chunks, and emits only when the last chunk is done.
// bs 4, 4 blocks, budget 6, prefix caching off. A = [100..104) (max_tokens 6), B = [200..204).
//   step 1: prefill A {0}                              -> A 110
//   step 2: prefill B {1}                              -> B 210
//   steps 3-6: decode A, B at pos 4..7 (A {0,2}, B {1,3}) -> A 111..114, B 211..214
//   step 7: A pos 8 needs a block: preempt B (free {3,1}); A grows with 3 -> A 115: max_tokens
//           A's {0,2,3} freed: free {1,3,2,0}. B = [200..204) 210..214: 9 tokens.
//   step 8: B re-admitted, target 9, chunk 6 = the prompt + 210, 211 (ATOM would stop here and
//           treat B as prefilled, leaving a KV hole): emits nothing
//   step 9: chunk 3 = 212, 213, 214 at pos 6..8, emits -> 215
//   step 10: decode B pos 9, input 215
TEST(SchedulerTest, PreemptedRequestIsRePrefilledToAllItsTokens) {
  SchedulerConfig c = Cfg(4);
  c.enable_prefix_caching = false;
  c.max_num_batched_tokens = 6;
  H h(c);
  h.add(1, Seq(100, 4), P(6));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110});
  h.add(2, Seq(200, 4));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, V64{2});
  h.upd(*s2, {210});
  for (int32_t step = 0; step < 4; ++step) {
    auto d = h.sched();
    ASSERT_TRUE(d);
    EXPECT_EQ(d->req_ids, (V64{1, 2}));
    EXPECT_EQ(d->positions, (V64{4 + step, 4 + step}));
    h.upd(*d, {111 + step, 211 + step});
  }
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 3}));
  EXPECT_EQ(h.s.request(2).block_table, (V{2, 4}));

  auto s7 = h.sched();
  ASSERT_TRUE(s7);
  EXPECT_EQ(s7->req_ids, V64{1});
  EXPECT_EQ(s7->slots, V64{16});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.upd(*s7, {115}).why(1), "max_tokens");
  const V b_tokens = Cat(Seq(200, 4), Seq(210, 5));
  EXPECT_EQ(h.s.request(2).tokens, b_tokens);

  auto s8 = h.sched();
  ASSERT_TRUE(s8);
  EXPECT_TRUE(s8->is_prefill);
  EXPECT_EQ(s8->req_ids, V64{2});
  EXPECT_EQ(h.s.request(2).prefill_target, 9);
  EXPECT_EQ(h.s.request(2).block_table, (V{2, 4, 3}));
  EXPECT_EQ(s8->ncached, V{0});
  EXPECT_EQ(s8->nsched, V{6});
  EXPECT_EQ(s8->tokens, Cat(Seq(200, 4), {210, 211}));
  EXPECT_EQ(s8->emits, std::vector<uint8_t>{0}) << "fix 8.2: the prompt alone is not the target";
  EXPECT_EQ(h.upd(*s8, {-1}).size(), 0u);
  EXPECT_TRUE(h.s.request(2).is_partial_prefill());
  EXPECT_EQ(h.s.request(2).tokens, b_tokens);

  auto s9 = h.sched();
  ASSERT_TRUE(s9);
  EXPECT_TRUE(s9->is_prefill);
  EXPECT_EQ(s9->ncached, V{6});
  EXPECT_EQ(s9->nsched, V{3});
  EXPECT_EQ(s9->tokens, (V{212, 213, 214}));
  EXPECT_EQ(s9->positions, (V64{6, 7, 8}));
  EXPECT_EQ(s9->slots, (V64{18, 19, 12}));
  EXPECT_EQ(s9->emits, std::vector<uint8_t>{1});
  EXPECT_EQ(h.upd(*s9, {215}).tokens(2), V{215});

  auto s10 = h.sched();
  ASSERT_TRUE(s10);
  EXPECT_FALSE(s10->is_prefill);
  EXPECT_EQ(s10->tokens, V{215});
  EXPECT_EQ(s10->positions, V64{9});
}

// Fix 8.3: with prefill vetoed (allow_prefill = false), a partial prefill is not decoded.
// Budget 8. B = [200..203), A = [100..110).
//   step 1: prefill B 3 | A chunk 5 (partial)          -> B 20
//   step 2 (veto): decode B only; A is skipped; D (waiting) is not admitted
//   step 3: prefill A's last 5 (pos 5..9, emits) + D   -> A 10, D 40
//   step 4: decode B, A, D
TEST(SchedulerTest, VetoedPrefillSkipsPartialPrefillsAndAdmissions) {
  SchedulerConfig c = Cfg(16);
  c.max_num_batched_tokens = 8;
  H h(c);
  h.add(2, Seq(200, 3));
  h.add(1, Seq(100, 10));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{2, 1}));
  EXPECT_EQ(s1->nsched, (V{3, 5}));
  h.upd(*s1, {20, -1});
  h.add(4, {7});
  auto s2 = h.sched(0.0, /*allow_prefill=*/false);
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, V64{2});
  EXPECT_EQ(h.s.waiting_ids(), V64{4});
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 5);
  h.upd(*s2, {21});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, (V64{1, 4}));
  EXPECT_EQ(s3->row_positions(0), (V64{5, 6, 7, 8, 9}));
  EXPECT_EQ(s3->nsched, (V{5, 1}));
  auto o3 = h.upd(*s3, {10, 40});
  EXPECT_EQ(o3.tokens(1), V{10});
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_EQ(s4->req_ids, (V64{2, 1, 4}));
  // Only vetoed work: nothing to run.
  H h2(Cfg(16));
  h2.add(1, {1, 2, 3});
  EXPECT_FALSE(h2.sched(0.0, false));
  EXPECT_EQ(h2.s.waiting_ids(), V64{1});
}

// num_state_slots 1: A and B both need the only slot.
//   step 1: prefill A (slot 0); B waits (can_allocate says no: strict FCFS)
//   A finishes (max_tokens 1) -> its slot returns
//   step 2: prefill B with slot 0
TEST(SchedulerTest, StateSlotsGateAdmission) {
  SchedulerConfig c = Cfg(16);
  c.num_state_slots = 1;
  H h(c);
  h.add(1, {1, 2, 3}, P(1));
  h.add(2, {4, 5, 6});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, V64{1});
  EXPECT_EQ(s1->state_slots, V{0});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.upd(*s1, {9}).why(1), "max_tokens");
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, V64{2});
  EXPECT_EQ(s2->state_slots, V{0});
}

// Fix 8.6: the decode reservation is exact. bs 4, a 2-block pool. A = [100..107).
//   step 1: prefill A {0,1} -> 110 (8 tokens)
//   step 2: decode pos 7: still inside block 1, so nothing is needed and nothing is preempted
//           (ATOM's can_append asks for ceil((8+1)/4) = 3 blocks and preempts A)
TEST(SchedulerTest, ExactReservationDoesNotPreemptAtABlockBoundary) {
  H h(Cfg(2));
  h.add(1, Seq(100, 7), P(2));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, V64{1});
  EXPECT_EQ(s2->positions, V64{7});
  EXPECT_EQ(s2->slots, V64{11});
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
  EXPECT_EQ(h.upd(*s2, {111}).why(1), "max_tokens");
}

// Fix 8.7: with bs 2 < K+1 = 4 every decode row gets blocks for all of its K+1 positions.
//   A = [10,11,12,13] {0,1}: prefill -> 20, drafts 30 31 32
//   decode 1: pos 4..7 (ctx 8): 4 blocks {0,1,2,3}; a=4 -> [30 31 32 40]
//   decode 2: pos 8..11 (ctx 12): 6 blocks; a=1 -> [50]
//   decode 3: pos 9..12 (ctx 13): 7 blocks
TEST(SchedulerTest, ReservationCoversKPlusOnePositionsWithSmallBlocks) {
  SchedulerConfig c = SpecCfg(32, 3);
  c.block_size = 2;
  H h(c);
  h.add(1, {10, 11, 12, 13});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {20, -1, -1, -1}, {}, {30, 31, 32});
  auto d1 = h.sched();
  ASSERT_TRUE(d1);
  EXPECT_EQ(d1->positions, (V64{4, 5, 6, 7}));
  EXPECT_EQ(d1->tokens, (V{20, 30, 31, 32}));
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 2, 3, 4}));
  EXPECT_EQ(d1->slots, (V64{6, 7, 8, 9}));
  EXPECT_EQ(h.upd(*d1, {30, 31, 32, 40}, {4}, {41, 42, 43}).tokens(1), (V{30, 31, 32, 40}));
  auto d2 = h.sched();
  ASSERT_TRUE(d2);
  EXPECT_EQ(d2->positions, (V64{8, 9, 10, 11}));
  EXPECT_EQ(h.s.request(1).block_table.size(), 6u);
  EXPECT_EQ(h.upd(*d2, {50, -1, -1, -1}, {1}, {51, 52, 53}).tokens(1), V{50});
  auto d3 = h.sched();
  ASSERT_TRUE(d3);
  EXPECT_EQ(d3->positions, (V64{9, 10, 11, 12}));
  EXPECT_EQ(d3->tokens, (V{50, 51, 52, 53}));
  EXPECT_EQ(h.s.request(1).block_table.size(), 7u);
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
}

// Fix 8.16: KV written for rejected drafts is never published to the prefix cache.
// bs 2, K 2. A = [10,11,12].
//   prefill {0,1} -> 20, drafts 30 31
//   decode: inputs 20 30 31 at pos 3,4,5 -> block 2 holds KV of the drafts 30, 31; a=1 -> [40]
//   B = [10,11,12,20,30,31,7] must not hit block 2 (its content was never accepted): B's hits
//   stop at 2 blocks (4 tokens) at most.
TEST(SchedulerTest, RejectedDraftsAreNeverPublished) {
  SchedulerConfig c = SpecCfg(32);
  c.block_size = 2;
  c.enable_kv_events = true;
  H h(c);
  h.add(1, {10, 11, 12});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {20, -1, -1}, {}, {30, 31});
  auto d1 = h.sched();
  ASSERT_TRUE(d1);
  EXPECT_EQ(d1->tokens, (V{20, 30, 31}));
  EXPECT_EQ(h.upd(*d1, {40, -1, -1}, {1}, {41, 42}).tokens(1), V{40});
  for (const KvEvent& e : h.s.take_events()) {
    if (e.kind != KvEventKind::kBlockStored) continue;
    for (size_t i = 0; i + 1 < e.token_ids.size(); i += 2) {
      EXPECT_FALSE(e.token_ids[i] == 30 && e.token_ids[i + 1] == 31)
          << "a block of rejected drafts was published";
    }
  }
  h.add(2, {10, 11, 12, 20, 30, 31, 7});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  ASSERT_EQ(s2->req_ids, V64{2});
  EXPECT_LE(s2->ncached[0], 4);
  EXPECT_LE(h.s.request(2).prefix_hit_tokens, 4);
}

// scheduler_delay_factor (ATOM's _passed_delay, kept): admission waits until the oldest waiting
// request has waited longer than factor * the latency of the last prompt step, unless nothing
// runs. Factor 1.
//   t=0:  A arrives, nothing runs -> prefill A
//   t=10: B arrives (arrival 10). Last prompt latency = 10 - 0 = 10; B waited 0 <= 10 and A runs:
//         no admission -> decode A
//   t=25: B waited 15 > 10 -> prefill B
TEST(SchedulerTest, DelayFactorHoldsAdmission) {
  SchedulerConfig c = Cfg(16);
  c.scheduler_delay_factor = 1.0;
  H h(c);
  h.s.add_request(1, V{1, 2, 3}, P(), 0.0);
  auto s1 = h.sched(0.0);
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  h.upd(*s1, {10});
  h.s.add_request(2, V{4, 5, 6}, P(), 10.0);
  h.Inv("add_request");
  auto s2 = h.sched(10.0);
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill) << "B has not waited long enough";
  EXPECT_EQ(s2->req_ids, V64{1});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  h.upd(*s2, {11});
  auto s3 = h.sched(25.0);
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, V64{2});
}

// ---------------------------------------------------------------------------------------------
// Stop conditions (fixed semantics 8.8, 8.10-8.12)
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, FinishReasonStrings) {
  EXPECT_EQ(finish_reason_string(FinishReason::kEos, -1), "eos");
  EXPECT_EQ(finish_reason_string(FinishReason::kStopToken, 99), "stop_99");
  EXPECT_EQ(finish_reason_string(FinishReason::kStopSequence, -1), "stop_sequence");
  EXPECT_EQ(finish_reason_string(FinishReason::kMaxTokens, -1), "max_tokens");
  EXPECT_EQ(finish_reason_string(FinishReason::kMaxModelLen, -1), "max_model_len");
  EXPECT_EQ(finish_reason_string(FinishReason::kAborted, -1), "abort");
}

// 16 blocks, EOS 2, config stop tokens {99}.
SchedulerConfig EosAndStopCfg() {
  SchedulerConfig c = Cfg(16);
  c.eos_token_id = 2;
  c.stop_token_ids = {99};
  return c;
}

// EOS 2, config stop tokens {99}.
//   A (ignore_eos, request stop {77}): 2 -> continues; 77 -> "stop_77"
//   B (ignore_eos): 2 -> continues; 99 -> "stop_99" (ignore_eos ignores only EOS, fix 8.12)
//   C: 99 -> "stop_99"        D: 2 -> "eos"        (the stop token is kept in the output)
TEST(SchedulerTest, EosAndStopTokens) {
  H h(EosAndStopCfg());
  SamplingParams pa = P();
  pa.ignore_eos = true;
  pa.stop_token_ids = {77};
  SamplingParams pb = P();
  pb.ignore_eos = true;
  h.add(1, {10, 11}, pa);
  h.add(2, {20, 21}, pb);
  h.add(3, {30, 31});
  h.add(4, {40, 41});
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  auto o1 = h.upd(*s1, {2, 2, 99, 2});
  EXPECT_EQ(o1.why(1), "");
  EXPECT_EQ(o1.why(2), "");
  EXPECT_EQ(o1.why(3), "stop_99");
  EXPECT_EQ(o1.tokens(3), V{99});
  EXPECT_EQ(o1.by_id[3].reason, FinishReason::kStopToken);
  EXPECT_EQ(o1.why(4), "eos");
  EXPECT_EQ(o1.tokens(4), V{2});
  EXPECT_EQ(h.s.running_ids(), (V64{1, 2}));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, (V64{1, 2}));
  EXPECT_EQ(s2->tokens, (V{2, 2}));
  auto o2 = h.upd(*s2, {77, 99});
  EXPECT_EQ(o2.why(1), "stop_77");
  EXPECT_EQ(o2.tokens(1), V{77});
  EXPECT_EQ(o2.why(2), "stop_99");
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_EQ(h.s.stats().num_finished, 4);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16);
}

// min_tokens 3 (vLLM's semantics): EOS, a stop id and a stop sequence in the first two tokens end
// nothing; the third token is the first that may stop (here EOS). Request 2 (min_tokens 1): its
// first token may stop it, and EOS does, before the max_tokens rule, as without min_tokens.
// (A length rule before min_tokens: tests/python/test_min_tokens.py.)
TEST(SchedulerTest, MinTokensHoldsBackEosStopIdsAndStopSequences) {
  H h(EosAndStopCfg());
  SamplingParams p = P();
  p.min_tokens = 3;
  p.stop_token_sequences = {{2, 99}};
  h.add(1, {10, 11}, p);
  SamplingParams q = P(1);
  q.min_tokens = 1;
  h.add(2, {20, 21}, q);
  auto s = h.sched();
  ASSERT_TRUE(s);
  auto o = h.upd(*s, {2, 2});
  EXPECT_EQ(o.why(1), "");  // EOS as the 1st token: below min_tokens
  EXPECT_EQ(o.why(2), "eos");
  s = h.sched();
  ASSERT_TRUE(s);
  EXPECT_EQ(h.upd(*s, {99}).why(1), "");  // a stop id that also completes the stop sequence
  s = h.sched();
  ASSERT_TRUE(s);
  o = h.upd(*s, {2});
  EXPECT_EQ(o.why(1), "eos");
  EXPECT_EQ(h.s.stats().num_finished, 2);
  SamplingParams bad = P(4);
  bad.min_tokens = 5;
  EXPECT_THROW(h.s.add_request(3, V{1}, bad), InvalidArgument);
  bad.min_tokens = -1;
  EXPECT_THROW(h.s.add_request(3, V{1}, bad), InvalidArgument);
  EXPECT_FALSE(h.s.contains(3));
}

// A = [5,6] with stop sequence [6,7]; the window never reaches into the prompt (fix 8.11).
//   gen 7: tokens end with 6,7 but the 6 is a prompt token -> continue
//   gen 6, gen 7: the generated tokens end with [6,7] -> "stop_sequence", 7 kept
TEST(SchedulerTest, StopSequenceMatchesGeneratedTokensOnly) {
  H h(Cfg(16));
  SamplingParams p = P();
  p.stop_token_sequences = {{6, 7}};
  h.add(1, {5, 6}, p);
  auto s = h.sched();
  ASSERT_TRUE(s);
  EXPECT_EQ(h.upd(*s, {7}).why(1), "");
  s = h.sched();
  ASSERT_TRUE(s);
  EXPECT_EQ(h.upd(*s, {6}).why(1), "");
  s = h.sched();
  ASSERT_TRUE(s);
  auto o = h.upd(*s, {7});
  EXPECT_EQ(o.why(1), "stop_sequence");
  EXPECT_EQ(o.tokens(1), V{7});
  EXPECT_FALSE(h.s.contains(1));
}

// max_model_len 8 (fix 8.8: checked during decode too). A: 6-token prompt, max_tokens 64.
// B: 6-token prompt, max_tokens 2: both reach 8 tokens at the same step; max_tokens comes first.
//   step 1: prefill             -> A 7 tokens, B 7 tokens
//   step 2: decode pos 6        -> 8 tokens: A "max_model_len", B "max_tokens"
TEST(SchedulerTest, MaxModelLenStopsDecode) {
  SchedulerConfig c = Cfg(16);
  c.max_model_len = 8;
  H h(c);
  h.add(1, Seq(100, 6));
  h.add(2, Seq(200, 6), P(2));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  auto o1 = h.upd(*s1, {10, 20});
  EXPECT_EQ(o1.why(1), "");
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  auto o2 = h.upd(*s2, {11, 21});
  EXPECT_EQ(o2.why(1), "max_model_len");
  EXPECT_EQ(o2.tokens(1), V{11});
  EXPECT_EQ(o2.why(2), "max_tokens");
  EXPECT_FALSE(h.s.has_unfinished_requests());
}

}  // namespace
}  // namespace atom_sched
