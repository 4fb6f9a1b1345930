// Scheduler: step-by-step scenarios with the token timeline drawn in comments.
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
// Admission
// ---------------------------------------------------------------------------------------------

// bs 4, 16 blocks. Requests arrive as 7: [100,101,102], 3: [200..205), 5: [300,301].
//   step 1: prefill rows 7, 3, 5 (arrival order); tables 7:{0} 3:{1,2} 5:{3}
//           positions 0..2 | 0..4 | 0,1     slots 0..2 | 4..8 | 12,13
//   update: 7 -> 110, 3 -> 210, 5 -> 310
//   step 2: decode rows 7, 3, 5 at pos 3 | 5 | 2, inputs 110 | 210 | 310, slots 3 | 9 | 14
TEST(SchedulerTest, AdmissionIsFcfs) {
  H h(Cfg(16));
  h.add(7, Seq(100, 3));
  h.add(3, Seq(200, 5));
  h.add(5, Seq(300, 2));
  EXPECT_EQ(h.s.waiting_ids(), (V64{7, 3, 5}));
  EXPECT_EQ(h.s.num_waiting(), 3);
  EXPECT_EQ(h.s.num_running(), 0);
  EXPECT_TRUE(h.s.has_unfinished_requests());

  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_TRUE(b->is_prefill);
  EXPECT_EQ(b->req_ids, (V64{7, 3, 5}));
  EXPECT_EQ(b->nsched, (V{3, 5, 2}));
  EXPECT_EQ(b->ncached, (V{0, 0, 0}));
  EXPECT_EQ(b->ctx, (V{3, 5, 2}));
  EXPECT_EQ(b->cu_q, (V{0, 3, 8, 10}));
  EXPECT_EQ(b->cu_k, (V{0, 3, 8, 10}));
  EXPECT_EQ(b->num_tokens, 10);
  EXPECT_EQ(b->max_seqlen_q, 5);
  EXPECT_EQ(b->max_seqlen_k, 5);
  EXPECT_EQ(b->tokens, Cat(Cat(Seq(100, 3), Seq(200, 5)), Seq(300, 2)));
  EXPECT_EQ(b->positions, (V64{0, 1, 2, 0, 1, 2, 3, 4, 0, 1}));
  EXPECT_EQ(b->slots, (V64{0, 1, 2, 4, 5, 6, 7, 8, 12, 13}));
  EXPECT_EQ(b->emits, (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(b->last_block, (V{3, 1, 2}));
  EXPECT_EQ(b->table(0, 2), (V{0, 0}));
  EXPECT_EQ(b->table(1, 3), (V{1, 2, 0}));
  EXPECT_EQ(b->table(2, 2), (V{3, 0}));
  EXPECT_EQ(h.s.waiting_ids(), V64{});
  EXPECT_EQ(h.s.running_ids(), (V64{7, 3, 5}));
  EXPECT_EQ(h.s.request(3).prefill_target, 5);

  auto o = h.upd(*b, {110, 210, 310});
  EXPECT_EQ(o.order, (V64{7, 3, 5}));
  EXPECT_EQ(o.tokens(7), V{110});
  EXPECT_EQ(o.tokens(3), V{210});
  EXPECT_EQ(o.tokens(5), V{310});
  EXPECT_EQ(o.why(7), "");

  auto d = h.sched();
  ASSERT_TRUE(d);
  EXPECT_FALSE(d->is_prefill);
  EXPECT_EQ(d->req_ids, (V64{7, 3, 5}));
  EXPECT_EQ(d->positions, (V64{3, 5, 2}));
  EXPECT_EQ(d->tokens, (V{110, 210, 310}));
  EXPECT_EQ(d->slots, (V64{3, 9, 14}));
  EXPECT_EQ(d->ctx, (V{4, 6, 3}));
  EXPECT_EQ(d->last_block, (V{4, 2, 3}));
}

// max_num_seqs 2 bounds the running set (fix 8.40), not only the rows of one batch.
//   A, B, C prompts of 3; A max_tokens 2.
//   step 1: prefill A, B (cap reached); C waits
//   step 2: decode A, B; C still waits (ATOM would prefill C here, growing running to 3)
//           A's 2nd token -> max_tokens, A leaves
//   step 3: prefill C (running 1 < 2)
//   step 4: decode B, C
TEST(SchedulerTest, MaxNumSeqsBoundsTheRunningSet) {
  SchedulerConfig c = Cfg(16);
  c.max_num_seqs = 2;
  H h(c);
  h.add(1, Seq(100, 3), P(2));
  h.add(2, Seq(200, 3));
  h.add(3, Seq(300, 3));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{1, 2}));
  EXPECT_EQ(h.s.waiting_ids(), V64{3});
  h.upd(*s1, {10, 20});

  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill) << "C must not be admitted while 2 requests run";
  EXPECT_EQ(s2->req_ids, (V64{1, 2}));
  EXPECT_EQ(h.s.num_running(), 2);
  EXPECT_EQ(h.s.waiting_ids(), V64{3});
  auto o2 = h.upd(*s2, {11, 21});
  EXPECT_EQ(o2.why(1), "max_tokens");
  EXPECT_EQ(o2.tokens(1), V{11});

  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, V64{3});
  h.upd(*s3, {30});
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_FALSE(s4->is_prefill);
  EXPECT_EQ(s4->req_ids, (V64{2, 3}));
}

// Chunked prefill off, budget 10. A 6 tokens, B 6, C 2.
//   step 1: A (6). B: 6 > 4 left and the batch has tokens -> back to the head, break. C is not
//           considered (strict FCFS) although it would fit.
//   step 2: B 6 + C 2 (A does not decode: batches never mix prefill and decode)
//   step 3: decode A, B, C
TEST(SchedulerTest, NonChunkedPrefillBreaksOnTheBudget) {
  SchedulerConfig c = Cfg(16);
  c.enable_chunked_prefill = false;
  c.max_num_batched_tokens = 10;
  H h(c);
  h.add(1, Seq(100, 6));
  h.add(2, Seq(200, 6));
  h.add(3, Seq(300, 2));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, V64{1});
  EXPECT_EQ(s1->num_tokens, 6);
  EXPECT_EQ(h.s.waiting_ids(), (V64{2, 3}));
  h.upd(*s1, {10});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, (V64{2, 3}));
  EXPECT_EQ(s2->nsched, (V{6, 2}));
  EXPECT_EQ(s2->ncached, (V{0, 0}));
  h.upd(*s2, {20, 30});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_FALSE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, (V64{1, 2, 3}));
  EXPECT_EQ(s3->tokens, (V{10, 20, 30}));
}

// Chunked prefill on, budget 10. A 6, B 6, C 2.
//   step 1: A 6 | B chunk 4 (partial: emits nothing); budget spent, C waits
//   update: A -> 10; B's sampled value is ignored
//   step 2: phase 1: B chunk 2 (pos 4,5, emits) | phase 2: C 2
//   step 3: decode A, B, C
TEST(SchedulerTest, ChunkedPrefillSplitsAtTheBudget) {
  SchedulerConfig c = Cfg(16);
  c.max_num_batched_tokens = 10;
  H h(c);
  h.add(1, Seq(100, 6));
  h.add(2, Seq(200, 6));
  h.add(3, Seq(300, 2));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{1, 2}));
  EXPECT_EQ(s1->nsched, (V{6, 4}));
  EXPECT_EQ(s1->emits, (std::vector<uint8_t>{1, 0}));
  EXPECT_EQ(h.s.waiting_ids(), V64{3});
  EXPECT_EQ(h.s.request(2).prefill_target, 6);
  EXPECT_EQ(h.s.request(2).num_computed_tokens, 4);
  EXPECT_TRUE(h.s.request(2).is_partial_prefill());
  auto o1 = h.upd(*s1, {10, -1});
  EXPECT_EQ(o1.order, V64{1});
  EXPECT_EQ(h.s.request(2).num_tokens(), 6);

  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, (V64{2, 3}));
  EXPECT_EQ(s2->nsched, (V{2, 2}));
  EXPECT_EQ(s2->ncached, (V{4, 0}));
  EXPECT_EQ(s2->row_positions(0), (V64{4, 5}));
  EXPECT_EQ(s2->row_tokens(0), (V{204, 205}));
  EXPECT_EQ(s2->emits, (std::vector<uint8_t>{1, 1}));
  auto o2 = h.upd(*s2, {20, 30});
  EXPECT_EQ(o2.tokens(2), V{20});
  EXPECT_EQ(o2.tokens(3), V{30});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_FALSE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, (V64{1, 2, 3}));
}

// bs 4, budget 4, 8 blocks. X = [1,2] (max_tokens 1) runs first, so the free list becomes
// {1..7, 0}. A = [100..110) (10 tokens) then takes {1,2,3} at admission (the whole prompt).
//   step 1: chunk A[0..4)  pos 0..3  slots 4..7    cu_k {0,4}   emits 0
//   step 2: chunk A[4..8)  pos 4..7  slots 8..11   cu_k {0,8}   emits 0
//   step 3: chunk A[8..10) pos 8,9   slots 12,13   cu_k {0,10}  emits 1 -> 55
//   step 4: decode pos 10, input 55, slot 14
TEST(SchedulerTest, ChunkedPrefillAcrossSteps) {
  SchedulerConfig c = Cfg(8);
  c.max_num_batched_tokens = 4;
  H h(c);
  h.add(9, {1, 2}, P(1));
  auto s0 = h.sched();
  ASSERT_TRUE(s0);
  EXPECT_EQ(h.upd(*s0, {5}).why(9), "max_tokens");
  EXPECT_EQ(h.s.block_pool().free_list(), (V{1, 2, 3, 4, 5, 6, 7, 0}));

  const V a = Seq(100, 10);
  h.add(1, a);
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  EXPECT_EQ(h.s.request(1).block_table, (V{1, 2, 3}));
  EXPECT_EQ(s1->table(0, 4), (V{1, 2, 3, 0}));
  EXPECT_EQ(s1->ncached, V{0});
  EXPECT_EQ(s1->nsched, V{4});
  EXPECT_EQ(s1->tokens, Seq(100, 4));
  EXPECT_EQ(s1->positions, (V64{0, 1, 2, 3}));
  EXPECT_EQ(s1->slots, (V64{4, 5, 6, 7}));
  EXPECT_EQ(s1->cu_q, (V{0, 4}));
  EXPECT_EQ(s1->cu_k, (V{0, 4}));
  EXPECT_EQ(s1->emits, std::vector<uint8_t>{0});
  EXPECT_EQ(h.upd(*s1, {-1}).size(), 0u);
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 4);

  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->ncached, V{4});
  EXPECT_EQ(s2->tokens, Seq(104, 4));
  EXPECT_EQ(s2->positions, (V64{4, 5, 6, 7}));
  EXPECT_EQ(s2->slots, (V64{8, 9, 10, 11}));
  EXPECT_EQ(s2->cu_q, (V{0, 4}));
  EXPECT_EQ(s2->cu_k, (V{0, 8}));
  EXPECT_EQ(s2->max_seqlen_k, 8);
  EXPECT_EQ(s2->emits, std::vector<uint8_t>{0});
  EXPECT_EQ(h.upd(*s2, {-1}).size(), 0u);

  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->ncached, V{8});
  EXPECT_EQ(s3->nsched, V{2});
  EXPECT_EQ(s3->tokens, (V{108, 109}));
  EXPECT_EQ(s3->positions, (V64{8, 9}));
  EXPECT_EQ(s3->slots, (V64{12, 13}));
  EXPECT_EQ(s3->cu_k, (V{0, 10}));
  EXPECT_EQ(s3->emits, std::vector<uint8_t>{1});
  EXPECT_EQ(s3->last_block, V{2});
  auto o3 = h.upd(*s3, {55});
  EXPECT_EQ(o3.tokens(1), V{55});

  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_FALSE(s4->is_prefill);
  EXPECT_EQ(s4->tokens, V{55});
  EXPECT_EQ(s4->positions, V64{10});
  EXPECT_EQ(s4->slots, V64{14});
  EXPECT_EQ(s4->ctx, V{11});
}

// ---------------------------------------------------------------------------------------------
// Prefix cache
// ---------------------------------------------------------------------------------------------

std::vector<uint64_t> Chain(const V& tokens, int32_t bs) {
  std::vector<uint64_t> out;
  std::optional<uint64_t> parent;
  for (size_t i = 0; i + bs <= tokens.size(); i += bs) {
    const uint64_t h = block_hash(std::span<const int32_t>(tokens).subspan(i, bs), parent);
    out.push_back(h);
    parent = h;
  }
  return out;
}

// bs 4, events on. Prefix P = [100..108) (2 blocks); A = P+[1,2], B = P+[3,4], C = P+[5].
//   step 1: prefill A {0,1,2}, B {3,4,5}: no hits (nothing is published before the outputs)
//   update: A publishes blocks 0,1 (one BlockStored); B's identical blocks are not stored again
//           (fix 8.30)
//   step 2: C hits 2 blocks {0,1}: prefills only C[8..9) at pos 8 into a fresh block
TEST(SchedulerTest, PrefixCacheNothingIsPublishedBeforeTheOutputs) {
  SchedulerConfig c = Cfg(16);
  c.enable_kv_events = true;
  H h(c);
  const V p = Seq(100, 8);
  const auto hp = Chain(p, 4);
  h.add(1, Cat(p, {1, 2}));
  h.add(2, Cat(p, {3, 4}));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->ncached, (V{0, 0}));
  EXPECT_EQ(s1->nsched, (V{10, 10}));
  EXPECT_EQ(h.s.block_pool().num_cached_hashes(), 0);
  EXPECT_TRUE(h.s.take_events().empty());

  auto o1 = h.upd(*s1, {10, 20});
  EXPECT_EQ(o1.by_id[1].hit_tokens, 0);
  EXPECT_EQ(o1.by_id[2].hit_tokens, 0);
  const auto events = h.s.take_events();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, KvEventKind::kBlockStored);
  EXPECT_EQ(events[0].block_hashes, hp);
  EXPECT_EQ(events[0].parent_block_hash, std::nullopt);
  EXPECT_EQ(events[0].token_ids, p);
  EXPECT_EQ(events[0].block_size, 4);
  EXPECT_EQ(h.s.block_pool().cached_block(hp[0]), 0);
  EXPECT_EQ(h.s.block_pool().cached_block(hp[1]), 1);
  EXPECT_FALSE(h.s.block_pool().is_cached(3));
  EXPECT_FALSE(h.s.block_pool().is_cached(4));

  h.add(3, Cat(p, {5}));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, V64{3});
  EXPECT_EQ(s2->ncached, V{8});
  EXPECT_EQ(s2->nsched, V{1});
  EXPECT_EQ(s2->tokens, V{5});
  EXPECT_EQ(s2->positions, V64{8});
  EXPECT_EQ(h.s.request(3).block_table, (V{0, 1, 6}));
  EXPECT_EQ(s2->slots, V64{24});
  EXPECT_EQ(h.s.block_pool().ref_count(0), 2);
  EXPECT_EQ(h.s.block_pool().ref_count(1), 2);
  EXPECT_EQ(h.s.stats().num_prefix_queries, 3);
  EXPECT_EQ(h.s.stats().prefix_query_tokens, 29);
  EXPECT_EQ(h.s.stats().prefix_hit_tokens, 8);
  auto o2 = h.upd(*s2, {30});
  EXPECT_EQ(o2.tokens(3), V{30});
  EXPECT_EQ(o2.by_id[3].hit_tokens, 8);
}

// bs 4. A = [100..110) (10 tokens).
//   step 1: prefill A {0,1,2}; update publishes A's 2 full blocks (0,1)
//   step 2: B = A[0..8)+[50,51] hits 2 blocks: prefill only [50,51] at pos 8,9 (block 3)
//   step 3: C = A[0..8) exactly: its 2nd block is its last and never a hit (at least one token is
//           computed): 1 hit, prefill C[4..8) at pos 4..7 (block 4)
TEST(SchedulerTest, PrefixCacheHitsAfterTheOutputsArriveAndNeverOnTheLastBlock) {
  H h(Cfg(16));
  const V a = Seq(100, 10);
  h.add(1, a);
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {10});
  EXPECT_EQ(h.s.block_pool().num_cached_hashes(), 2);

  h.add(2, Cat(Seq(100, 8), {50, 51}));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, V64{2});
  EXPECT_EQ(s2->ncached, V{8});
  EXPECT_EQ(s2->nsched, V{2});
  EXPECT_EQ(s2->ctx, V{10});
  EXPECT_EQ(s2->tokens, (V{50, 51}));
  EXPECT_EQ(s2->positions, (V64{8, 9}));
  EXPECT_EQ(h.s.request(2).block_table, (V{0, 1, 3}));
  EXPECT_EQ(s2->slots, (V64{12, 13}));
  EXPECT_EQ(h.s.request(2).prefix_hit_tokens, 8);
  auto o2 = h.upd(*s2, {20});
  EXPECT_EQ(o2.by_id[2].hit_tokens, 8);

  h.add(3, Seq(100, 8));
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, V64{3});
  EXPECT_EQ(s3->ncached, V{4});
  EXPECT_EQ(s3->nsched, V{4});
  EXPECT_EQ(s3->tokens, Seq(104, 4));
  EXPECT_EQ(s3->positions, (V64{4, 5, 6, 7}));
  EXPECT_EQ(h.s.request(3).block_table, (V{0, 4}));
  EXPECT_EQ(s3->slots, (V64{16, 17, 18, 19}));
  auto o3 = h.upd(*s3, {30});
  EXPECT_EQ(o3.by_id[3].hit_tokens, 4);
  EXPECT_EQ(h.s.block_pool().ref_count(0), 3);
  EXPECT_EQ(h.s.block_pool().ref_count(1), 2);

  EXPECT_EQ(h.s.stats().num_prefix_queries, 3);
  EXPECT_EQ(h.s.stats().prefix_query_tokens, 28);
  EXPECT_EQ(h.s.stats().prefix_hit_tokens, 12);
  EXPECT_DOUBLE_EQ(h.s.stats().prefix_hit_rate(), 12.0 / 28.0);

  // reset_prefix_cache forgets everything: the same prompt again gets no hit.
  h.s.reset_prefix_cache();
  h.Inv("reset_prefix_cache");
  EXPECT_EQ(h.s.block_pool().num_cached_hashes(), 0);
  h.add(4, Seq(100, 8));
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_EQ(s4->req_ids, V64{4});
  EXPECT_EQ(s4->ncached, V{0});
}

// ---------------------------------------------------------------------------------------------
// Static rejection
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, RejectionReasonsAreAtomsExactText) {
  {
    SchedulerConfig c = Cfg(64);
    c.max_model_len = 16;
    H h(c);
    h.add(1, Seq(0, 17));
    h.add(2, Seq(0, 3));
    h.add(3, Seq(0, 16));  // exactly max_model_len: admitted
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, (V64{2, 3}));
    const auto rej = h.s.take_rejected();
    ASSERT_EQ(rej.size(), 1u);
    EXPECT_EQ(rej[0].req_id, 1);
    EXPECT_EQ(rej[0].reason,
              "unschedulable: input tokens=17 > max_model_len=16. Increase max_model_len or "
              "shorten the prompt.");
    EXPECT_FALSE(h.s.contains(1));
    EXPECT_TRUE(h.s.take_rejected().empty());
    EXPECT_EQ(h.s.stats().num_rejected, 1);
  }
  {
    SchedulerConfig c = Cfg(64);
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 8;
    H h(c);
    h.add(1, Seq(0, 9));
    EXPECT_FALSE(h.sched()) << "only a rejected request: nothing to run";
    const auto rej = h.s.take_rejected();
    ASSERT_EQ(rej.size(), 1u);
    EXPECT_EQ(rej[0].req_id, 1);
    EXPECT_EQ(rej[0].reason,
              "unschedulable: input tokens=9 > max_num_batched_tokens=8. Increase "
              "max_num_batched_tokens, enable chunked prefill, or shorten the prompt.");
    EXPECT_FALSE(h.s.has_unfinished_requests());
  }
  {
    SchedulerConfig c = Cfg(4);
    c.max_model_len = 64;
    H h(c);
    h.add(1, Seq(0, 17));
    h.add(2, Seq(0, 16));  // exactly the pool: admitted
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, V64{2});
    const auto rej = h.s.take_rejected();
    ASSERT_EQ(rej.size(), 1u);
    EXPECT_EQ(rej[0].reason,
              "unschedulable: needs 5 KV blocks for 17 input tokens > num_blocks=4. Shorten "
              "the prompt or increase num_blocks.");
  }
  {
    // max_model_len is checked first.
    SchedulerConfig c = Cfg(4);
    c.max_model_len = 16;
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 8;
    H h(c);
    h.add(1, Seq(0, 17));
    EXPECT_FALSE(h.sched());
    const auto rej = h.s.take_rejected();
    ASSERT_EQ(rej.size(), 1u);
    EXPECT_EQ(rej[0].reason.rfind("unschedulable: input tokens=17 > max_model_len=16.", 0), 0u)
        << rej[0].reason;
  }
}

// ---------------------------------------------------------------------------------------------
// Decode batches and preemption
// ---------------------------------------------------------------------------------------------

// Three requests of 7 tokens fill a 6-block pool (bs 4):
//   A = [100..107) {0,1}   B = [200..207) {2,3}   C = [300..307) {4,5}   free {}
//   step 1: prefill A, B, C            -> A 110, B 210, C 310
//   step 2: decode pos 7 (no growth)   -> A 111, B 211, C 311     (returned)
Snap ThreeFillThePool(H& h, int32_t a_max_tokens) {
  SamplingParams pa = P(a_max_tokens);
  pa.temperature = 0.5f;
  pa.top_k = 5;
  pa.top_p = 0.9f;
  SamplingParams pc = P();
  pc.temperature = 0.0f;
  h.add(1, Seq(100, 7), pa);
  h.add(2, Seq(200, 7));
  h.add(3, Seq(300, 7), pc);
  auto s1 = h.sched();
  if (!s1 || s1->num_rows != 3) {
    ADD_FAILURE() << "step 1 should prefill 3 rows";
    return Snap();
  }
  h.upd(*s1, {110, 210, 310});
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
  auto s2 = h.sched();
  if (!s2 || s2->num_rows != 3) {
    ADD_FAILURE() << "step 2 should decode 3 rows";
    return Snap();
  }
  h.upd(*s2, {111, 211, 311});
  return *s2;
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
  EXPECT_EQ(d.slots, (V64{1 * 4 + 3, 3 * 4 + 3, 5 * 4 + 3}));
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
  for (const V& t : {V{0, 1}, V{2, 3}, V{4, 5}}) {
    V row(d.width, 0);
    std::copy(t.begin(), t.end(), row.begin());
    expect_rows.insert(expect_rows.end(), row.begin(), row.end());
  }
  EXPECT_EQ(d.tables, expect_rows) << "block_tables rows padded with 0";
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
  EXPECT_EQ(s3->slots, (V64{20, 16}));
  EXPECT_EQ(s3->table(0, 4), (V{0, 1, 5, 0}));
  EXPECT_EQ(s3->table(1, 4), (V{2, 3, 4, 0}));
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
  EXPECT_EQ(h.s.block_pool().free_list(), (V{5, 1, 0}));

  auto s5 = h.sched();
  ASSERT_TRUE(s5);
  EXPECT_TRUE(s5->is_prefill);
  EXPECT_EQ(s5->req_ids, V64{3});
  EXPECT_EQ(s5->ncached, V{0});
  EXPECT_EQ(s5->nsched, V{9});
  EXPECT_EQ(s5->tokens, c_tokens);
  EXPECT_EQ(h.s.request(3).prefill_target, 9);
  EXPECT_EQ(h.s.request(3).block_table, (V{5, 1, 0}));
  EXPECT_EQ(s5->slots, (V64{20, 21, 22, 23, 4, 5, 6, 7, 0}));
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
  EXPECT_EQ(h.s.block_pool().free_list(), (V{3, 2, 1, 0}));
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_TRUE(s4->is_prefill);
  EXPECT_EQ(s4->req_ids, V64{2});
  EXPECT_EQ(s4->tokens, Cat(Seq(200, 7), {210, 211}));
  EXPECT_EQ(h.s.request(2).block_table, (V{3, 2, 1}));
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
  EXPECT_EQ(h.s.request(1).block_table, (V{0, 2}));
  EXPECT_EQ(h.s.request(2).block_table, (V{1, 3}));

  auto s7 = h.sched();
  ASSERT_TRUE(s7);
  EXPECT_EQ(s7->req_ids, V64{1});
  EXPECT_EQ(s7->slots, V64{12});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.upd(*s7, {115}).why(1), "max_tokens");
  const V b_tokens = Cat(Seq(200, 4), Seq(210, 5));
  EXPECT_EQ(h.s.request(2).tokens, b_tokens);

  auto s8 = h.sched();
  ASSERT_TRUE(s8);
  EXPECT_TRUE(s8->is_prefill);
  EXPECT_EQ(s8->req_ids, V64{2});
  EXPECT_EQ(h.s.request(2).prefill_target, 9);
  EXPECT_EQ(h.s.request(2).block_table, (V{1, 3, 2}));
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
  EXPECT_EQ(s9->slots, (V64{14, 15, 8}));
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
  EXPECT_EQ(s2->slots, V64{7});
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
  EXPECT_EQ(h.s.request(1).block_table, (V{0, 1, 2, 3}));
  EXPECT_EQ(d1->slots, (V64{4, 5, 6, 7}));
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

// EOS 2, config stop tokens {99}.
//   A (ignore_eos, request stop {77}): 2 -> continues; 77 -> "stop_77"
//   B (ignore_eos): 2 -> continues; 99 -> "stop_99" (ignore_eos ignores only EOS, fix 8.12)
//   C: 99 -> "stop_99"        D: 2 -> "eos"        (the stop token is kept in the output)
TEST(SchedulerTest, EosAndStopTokens) {
  SchedulerConfig c = Cfg(16);
  c.eos_token_id = 2;
  c.stop_token_ids = {99};
  H h(c);
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
  EXPECT_EQ(h.s.request(1).block_table, (V{0, 3}));
  EXPECT_EQ(h.s.request(2).block_table, (V{1, 2}));
  EXPECT_EQ(s2->slots, (V64{3, 12, 13, 9, 10, 11}));
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
  EXPECT_EQ(h.s.request(2).block_table, (V{1, 2, 4}));
  EXPECT_EQ(s3->slots, (V64{13, 14, 15, 16, 17, 18}));
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
  EXPECT_EQ(b2->slots, V64{3});
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
  EXPECT_EQ(h.s.request(1).block_table, (V{0, 1}));
  EXPECT_EQ(b3->slots, V64{4});
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
  EXPECT_EQ(b3->slots, V64{12});
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
  EXPECT_EQ(h.s.block_pool().free_list(), (V{2, 3, 1, 0}));

  auto s5 = h.sched();
  ASSERT_TRUE(s5);
  EXPECT_TRUE(s5->is_prefill);
  EXPECT_EQ(s5->req_ids, V64{2});
  EXPECT_EQ(s5->tokens, Cat(Seq(200, 7), {210, 211}));
  EXPECT_EQ(h.s.request(2).block_table, (V{2, 3, 1}));
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
  EXPECT_EQ(h.s.request(1).block_table, (V{0, 1, 2}));
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

// ---------------------------------------------------------------------------------------------
// Bad input: typed errors, state unchanged
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, BadConfigIsRejected) {
  auto bad = [](auto mutate) {
    SchedulerConfig c = Cfg(16);
    mutate(c);
    EXPECT_THROW(c.validate(), InvalidArgument);
    EXPECT_THROW(Scheduler{c}, InvalidArgument);
  };
  bad([](SchedulerConfig& c) { c.num_blocks = 0; });
  bad([](SchedulerConfig& c) { c.block_size = 0; });
  bad([](SchedulerConfig& c) { c.max_num_seqs = 0; });
  bad([](SchedulerConfig& c) { c.max_num_batched_tokens = 0; });
  bad([](SchedulerConfig& c) { c.max_model_len = 0; });
  bad([](SchedulerConfig& c) { c.num_speculative_tokens = -1; });
  bad([](SchedulerConfig& c) { c.num_speculative_tokens = kMaxSpeculativeTokens + 1; });
  bad([](SchedulerConfig& c) {
    c.num_speculative_tokens = 2;
    c.max_num_batched_tokens = 2;
  });
  bad([](SchedulerConfig& c) { c.scheduler_delay_factor = -0.5; });
  bad([](SchedulerConfig& c) { c.num_state_slots = -1; });
  bad([](SchedulerConfig& c) { c.eos_token_id = -2; });
  bad([](SchedulerConfig& c) { c.stop_token_ids = {5, -1}; });
  SchedulerConfig ok = Cfg(1, 1);
  ok.num_speculative_tokens = kMaxSpeculativeTokens;
  ok.max_num_batched_tokens = kMaxSpeculativeTokens + 1;
  EXPECT_NO_THROW(ok.validate());
  EXPECT_NO_THROW(Scheduler{ok});
}

TEST(SchedulerTest, BadRequestsAreRejectedAndChangeNothing) {
  H h(Cfg(4));
  h.add(1, Seq(100, 12));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {10});
  h.add(2, Seq(200, 8));  // needs 2 blocks, 1 free: waits
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  h.upd(*s2, {11});
  ASSERT_EQ(h.s.waiting_ids(), V64{2});
  ASSERT_EQ(h.s.running_ids(), V64{1});
  const State before = Capture(h.s);

  auto expect_bad_add = [&](int64_t id, const V& prompt, const SamplingParams& p,
                            const char* what) {
    EXPECT_THROW(h.s.add_request(id, prompt, p), InvalidArgument) << what;
    h.Inv(what);
    ExpectSame(before, Capture(h.s), what);
  };
  expect_bad_add(-1, {1}, P(), "negative id");
  expect_bad_add(1, {1}, P(), "duplicate running id");
  expect_bad_add(2, {1}, P(), "duplicate waiting id");
  expect_bad_add(3, {}, P(), "empty prompt");
  expect_bad_add(3, {1, -2, 3}, P(), "negative token");
  auto with = [](auto mutate) {
    SamplingParams p = P();
    mutate(p);
    return p;
  };
  const std::vector<std::pair<const char*, SamplingParams>> bad_params = {
      {"top_k 0", with([](SamplingParams& p) { p.top_k = 0; })},
      {"top_k -2", with([](SamplingParams& p) { p.top_k = -2; })},
      {"top_p 0", with([](SamplingParams& p) { p.top_p = 0.0f; })},
      {"top_p 1.5", with([](SamplingParams& p) { p.top_p = 1.5f; })},
      {"n 2", with([](SamplingParams& p) { p.n = 2; })},
      {"n 0", with([](SamplingParams& p) { p.n = 0; })},
      {"max_tokens 0", with([](SamplingParams& p) { p.max_tokens = 0; })},
      {"temperature -1", with([](SamplingParams& p) { p.temperature = -1.0f; })},
      {"stop id -1", with([](SamplingParams& p) { p.stop_token_ids = {-1}; })},
      {"empty stop sequence", with([](SamplingParams& p) { p.stop_token_sequences = {{}}; })},
      {"negative in stop sequence",
       with([](SamplingParams& p) { p.stop_token_sequences = {{1, -1}}; })},
  };
  for (const auto& [what, p] : bad_params) {
    if (p.n != 2) {
      EXPECT_THROW(p.validate(), InvalidArgument) << what;
    }
    expect_bad_add(3, {1, 2}, p, what);
  }
  {
    SamplingParams n2 = P();
    n2.n = 2;
    EXPECT_NO_THROW(n2.validate()) << "n > 1 is valid params; only add_request refuses it";
  }

  EXPECT_THROW(h.s.abort_request(3), UnknownRequest);
  EXPECT_THROW(h.s.abort_request(-1), UnknownRequest);
  EXPECT_THROW((void)h.s.request(3), UnknownRequest);
  EXPECT_FALSE(h.s.contains(3));
  h.Inv("unknown ids");
  ExpectSame(before, Capture(h.s), "unknown ids");

  // update with nothing outstanding.
  {
    const V t = {1};
    ModelOutputs o;
    o.sampled_token_ids = t;
    EXPECT_THROW(h.s.update(s2->id, o), InvalidArgument);
    EXPECT_THROW(h.s.update(s2->id + 1, o), InvalidArgument);
    h.Inv("update with nothing outstanding");
    ExpectSame(before, Capture(h.s), "update with nothing outstanding");
  }
}

TEST(SchedulerTest, BadOutputsAreRejectedAndChangeNothing) {
  H h(Cfg(16));
  h.add(1, {10, 11, 12});
  h.add(2, {13, 14});
  auto b = h.sched();
  ASSERT_TRUE(b);
  const State before = Capture(h.s);
  auto expect_bad = [&](uint64_t id, const V& sampled, const V& acc, const V& drafts,
                        const std::vector<float>& logprobs, const char* what) {
    ModelOutputs o;
    o.sampled_token_ids = sampled;
    o.num_accepted = acc;
    o.draft_token_ids = drafts;
    o.logprobs = logprobs;
    EXPECT_THROW(h.s.update(id, o), InvalidArgument) << what;
    h.Inv(what);
    ExpectSame(before, Capture(h.s), what);
  };
  expect_bad(b->id + 1, {20, 30}, {}, {}, {}, "unknown batch id");
  expect_bad(b->id, {}, {}, {}, {}, "no tokens");
  expect_bad(b->id, {20}, {}, {}, {}, "too few tokens");
  expect_bad(b->id, {20, 30, 40}, {}, {}, {}, "too many tokens");
  expect_bad(b->id, {20, -5}, {}, {}, {}, "negative accepted token");
  expect_bad(b->id, {20, 30}, {2, 1}, {}, {}, "num_accepted 2 with K = 0");
  expect_bad(b->id, {20, 30}, {1}, {}, {}, "num_accepted of the wrong length");
  expect_bad(b->id, {20, 30}, {}, {1, 2}, {}, "drafts with K = 0");
  expect_bad(b->id, {20, 30}, {}, {}, {0.5f}, "logprobs of the wrong length");
  auto o = h.upd(*b, {20, 30}, {1, 1}, {});
  EXPECT_EQ(o.tokens(1), V{20});
  EXPECT_EQ(o.tokens(2), V{30});
}

TEST(SchedulerTest, BadSpeculativeOutputsAreRejectedAndChangeNothing) {
  H h(SpecCfg(16));
  h.add(1, {10, 11, 12});
  auto b = h.sched();
  ASSERT_TRUE(b);
  State before = Capture(h.s);
  auto expect_bad = [&](const Snap& batch, const V& sampled, const V& acc, const V& drafts,
                        const char* what) {
    ModelOutputs o;
    o.sampled_token_ids = sampled;
    o.num_accepted = acc;
    o.draft_token_ids = drafts;
    EXPECT_THROW(h.s.update(batch.id, o), InvalidArgument) << what;
    h.Inv(what);
    ExpectSame(before, Capture(h.s), what);
  };
  expect_bad(*b, {20, -1, -1}, {}, {}, "prefill without drafts");
  expect_bad(*b, {20, -1, -1}, {2}, {30, 31}, "prefill rows must accept 1");
  expect_bad(*b, {20, -1, -1}, {}, {30}, "too few drafts");
  h.upd(*b, {20, -1, -1}, {1}, {30, 31});

  auto d = h.sched();
  ASSERT_TRUE(d);
  before = Capture(h.s);
  expect_bad(*d, {30, 31, 32}, {}, {40, 41}, "decode without num_accepted");
  expect_bad(*d, {30, 31, 32}, {0}, {40, 41}, "num_accepted 0");
  expect_bad(*d, {30, 31, 32}, {4}, {40, 41}, "num_accepted K + 2");
  expect_bad(*d, {30, -1, 32}, {2}, {40, 41}, "a negative accepted token");
  expect_bad(*d, {30, 31, 32}, {3}, {}, "decode without drafts");
  auto o = h.upd(*d, {30, 31, -7}, {2}, {40, 41});  // entries past the accepted ones are ignored
  EXPECT_EQ(o.tokens(1), (V{30, 31}));
}

// scheduler.h (ModelOutputs: "W = 1 when K == 0, else K + 1") and docs/api.md ("shape
// (num_rows,) (only when K = 0) or (num_rows, K+1)") require K + 1 values per row whenever K > 0,
// prefill batches included.
TEST(SchedulerTest, SpeculativePrefillOutputsMustBeKPlusOneWide) {
  H h(SpecCfg(16));
  h.add(1, {10, 11, 12});
  auto b = h.sched();
  ASSERT_TRUE(b);
  const State before = Capture(h.s);
  const V sampled = {20};
  const V drafts = {30, 31};
  ModelOutputs o;
  o.sampled_token_ids = sampled;
  o.draft_token_ids = drafts;
  EXPECT_THROW(h.s.update(b->id, o), InvalidArgument) << "one token per row with K = 2";
  h.Inv("one token per row with K = 2");
  ExpectSame(before, Capture(h.s), "one token per row with K = 2");
}

// ---------------------------------------------------------------------------------------------
// next_batch_info agrees with schedule() (fix 8.17); the harness compares them at every step.
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, NextBatchInfoAgreesWithSchedule) {
  {
    // Empty; then budgeted chunked admission, a partial prefill + admission, then decode.
    SchedulerConfig c = Cfg(16);
    c.max_num_batched_tokens = 10;
    H h(c);
    h.check_next_info = true;
    const NextBatchInfo empty = h.s.next_batch_info();
    EXPECT_FALSE(empty.is_prefill);
    EXPECT_EQ(empty.num_tokens, 0);
    EXPECT_EQ(empty.num_rows, 0);
    EXPECT_FALSE(h.sched());
    h.add(1, Seq(100, 6));
    h.add(2, Seq(200, 6));
    h.add(3, Seq(300, 2));
    const State before = Capture(h.s);
    const NextBatchInfo i1 = h.s.next_batch_info();
    ExpectSame(before, Capture(h.s), "next_batch_info is a pure query");
    EXPECT_TRUE(i1.is_prefill);
    EXPECT_EQ(i1.num_tokens, 10);
    EXPECT_EQ(i1.num_rows, 2);
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {10, -1});
    // Vetoed prefill: only the decode rows.
    const NextBatchInfo veto = h.s.next_batch_info(0.0, false);
    EXPECT_FALSE(veto.is_prefill);
    EXPECT_EQ(veto.num_rows, 1);
    EXPECT_EQ(veto.num_tokens, 1);
    auto s2 = h.sched(0.0, false);
    ASSERT_TRUE(s2);
    h.upd(*s2, {11});
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->num_tokens, 4);
    h.upd(*s3, {20, 30});
    // One step ahead: the info for the batch after an outstanding one.
    auto b4 = h.sched();
    ASSERT_TRUE(b4);
    auto b5 = h.sched();
    ASSERT_TRUE(b5);
    h.upd(*b4, {12, 21, 31});
    h.upd(*b5, {13, 22, 32});
  }
  {
    // KV pressure: the decode batch after a preemption (ThreeFillThePool, step 3).
    H h(Cfg(6));
    h.check_next_info = true;
    ThreeFillThePool(h, 4);
    const NextBatchInfo i3 = h.s.next_batch_info();
    EXPECT_FALSE(i3.is_prefill);
    EXPECT_EQ(i3.num_rows, 2);
    EXPECT_EQ(h.s.num_running(), 3) << "next_batch_info must not preempt for real";
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->num_rows, 2);
  }
  {
    // K = 2 decode, max_num_seqs and prefix hits.
    SchedulerConfig c = SpecCfg(32);
    c.max_num_seqs = 2;
    H h(c);
    h.check_next_info = true;
    h.add(1, Seq(100, 9));
    h.add(2, Seq(200, 3));
    h.add(3, Seq(300, 3));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {10, -1, -1, 20, -1, -1}, {}, {1, 2, 3, 4});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->num_tokens, 6);
    h.upd(*s2, {1, 2, 3, 4, 5, 6}, {3, 1}, {1, 2, 3, 4});
    h.s.abort_request(2);
    h.add(4, Seq(100, 9));  // 2 hit blocks
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->req_ids, V64{3}) << "one free running slot";
    h.upd(*s3, {30, -1, -1}, {}, {1, 2});
  }
}

// ---------------------------------------------------------------------------------------------
// Abort, stats
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, AbortWaitingAndRunningRequests) {
  H h(Cfg(8));
  h.add(1, Seq(100, 5));
  h.add(2, Seq(200, 5));
  h.add(3, Seq(300, 5));
  h.s.abort_request(2);
  h.Inv("abort waiting");
  EXPECT_EQ(h.s.waiting_ids(), (V64{1, 3}));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{1, 3}));
  h.upd(*s1, {10, 30});
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 4);
  h.s.abort_request(1);
  h.Inv("abort running");
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 6);
  EXPECT_THROW(h.s.abort_request(1), UnknownRequest);
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, V64{3});
  auto o2 = h.upd(*s2, {31});
  EXPECT_FALSE(o2.has(1));
  EXPECT_EQ(h.s.stats().num_aborted, 2);
  h.s.abort_request(3);
  h.Inv("abort last");
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_FALSE(h.sched());
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 8);
}

TEST(SchedulerTest, Stats) {
  SchedulerConfig c = Cfg(16);
  c.max_model_len = 32;
  H h(c);
  const SchedulerStats& st = h.s.stats();
  EXPECT_EQ(st.num_steps, 0);
  EXPECT_DOUBLE_EQ(st.prefix_hit_rate(), 0.0);
  EXPECT_DOUBLE_EQ(st.acceptance_rate(), 0.0);
  h.add(1, Seq(100, 9), P(2));
  h.add(2, Seq(0, 40));  // rejected: > max_model_len
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(st.num_steps, 1);
  EXPECT_EQ(st.num_rejected, 1);
  EXPECT_EQ(st.num_prefix_queries, 1);
  EXPECT_EQ(st.prefix_query_tokens, 9);
  EXPECT_EQ(st.prefix_hit_tokens, 0);
  h.upd(*s1, {10});
  h.add(3, Seq(100, 9));  // 2 hit blocks
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(st.num_steps, 2);
  EXPECT_EQ(st.num_prefix_queries, 2);
  EXPECT_EQ(st.prefix_query_tokens, 18);
  EXPECT_EQ(st.prefix_hit_tokens, 8);
  EXPECT_DOUBLE_EQ(st.prefix_hit_rate(), 8.0 / 18.0);
  h.upd(*s2, {30});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  auto o3 = h.upd(*s3, {11, 31});
  EXPECT_EQ(o3.why(1), "max_tokens");
  EXPECT_EQ(st.num_steps, 3);
  EXPECT_EQ(st.num_finished, 1);
  h.s.abort_request(3);
  EXPECT_EQ(st.num_aborted, 1);
  EXPECT_EQ(st.num_preemptions, 0);
  EXPECT_EQ(st.num_spec_steps, 0);
  EXPECT_FALSE(h.sched());
  EXPECT_EQ(st.num_steps, 3) << "a schedule() with nothing to run is not a step";
}

// ---------------------------------------------------------------------------------------------
// Synchronous and one-step-ahead runs stream the same tokens (DESIGN.md section 4)
// ---------------------------------------------------------------------------------------------

struct RunResult {
  std::map<int64_t, V> tokens;
  std::map<int64_t, std::string> why;
  int64_t preemptions = 0;
};

// The "model": request id's n-th output token. EOS (2) for some requests.
int32_t ModelToken(int64_t id, int32_t n) {
  if (id % 3 == 0 && n == 4 + id % 5) return 2;
  return 10 + static_cast<int32_t>((id * 37 + n * 11) % 97);
}

RunResult RunWorkload(bool one_step_ahead, bool chunked, bool check_plan = false) {
  SchedulerConfig c = Cfg(14);
  // Without chunking the budget must hold a preempted request's whole re-prefill.
  c.max_num_batched_tokens = chunked ? 16 : 64;
  c.max_num_seqs = 5;
  c.eos_token_id = 2;
  c.enable_chunked_prefill = chunked;
  H h(c);
  h.check_device_plan = check_plan;
  for (int64_t id = 0; id < 10; ++id) {
    V prompt = Seq(static_cast<int32_t>(1000 * (id % 2)), 3 + static_cast<int32_t>(id % 9));
    prompt.push_back(static_cast<int32_t>(id));
    h.add(id, prompt, P(3 + static_cast<int32_t>(id % 7)));
  }
  RunResult res;
  std::map<int64_t, int32_t> received;
  std::deque<Snap> q;
  auto apply = [&](const Snap& b) {
    V sampled;
    for (int64_t id : b.req_ids) sampled.push_back(ModelToken(id, received[id]));
    const Outs o = h.upd(b, sampled);
    for (int64_t id : o.order) {
      const ROut& r = o.by_id.at(id);
      received[id] += static_cast<int32_t>(r.tokens.size());
      V& all = res.tokens[id];
      all.insert(all.end(), r.tokens.begin(), r.tokens.end());
      if (r.reason != FinishReason::kNone) {
        EXPECT_EQ(res.why.count(id), 0u) << "request " << id << " finished twice";
        res.why[id] = r.why;
      }
    }
  };
  for (int guard = 0; guard < 2000; ++guard) {
    if (static_cast<int32_t>(q.size()) < (one_step_ahead ? 2 : 1)) {
      auto b = h.sched();
      if (b) {
        q.push_back(*b);
        continue;
      }
    }
    if (q.empty()) break;
    apply(q.front());
    q.pop_front();
  }
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_EQ(h.s.num_outstanding_batches(), 0);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 14);
  res.preemptions = h.s.stats().num_preemptions;
  return res;
}

TEST(SchedulerTest, SynchronousAndOneStepAheadStreamTheSameTokens) {
  for (bool chunked : {true, false}) {
    SCOPED_TRACE(chunked);
    const RunResult sync = RunWorkload(false, chunked);
    const RunResult async = RunWorkload(true, chunked);
    EXPECT_EQ(sync.why.size(), 10u);
    EXPECT_EQ(sync.tokens, async.tokens);
    EXPECT_EQ(sync.why, async.why);
    EXPECT_GT(sync.preemptions + async.preemptions, 0) << "the workload should preempt";
    for (const auto& [id, t] : sync.tokens) {
      for (size_t n = 0; n < t.size(); ++n) {
        EXPECT_EQ(t[n], ModelToken(id, static_cast<int32_t>(n)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Random request streams: invariants after every call, every request ends exactly once
// ---------------------------------------------------------------------------------------------

void RandomStream(uint32_t seed, bool check_plan) {
  {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    auto pick = [&](int32_t lo, int32_t hi) {  // inclusive
      return lo + static_cast<int32_t>(rng() % static_cast<uint32_t>(hi - lo + 1));
    };
    SchedulerConfig c;
    c.block_size = pick(1, 3) * 2;
    c.num_speculative_tokens = std::vector<int32_t>{0, 0, 1, 2, 3}[rng() % 5];
    c.num_blocks = pick(12, 40);
    c.max_model_len = std::max(8, c.num_blocks * c.block_size / 3 - c.num_speculative_tokens);
    c.max_num_seqs = pick(1, 8);
    c.max_num_batched_tokens = pick(c.num_speculative_tokens + 1, 48);
    c.enable_chunked_prefill = rng() % 4 != 0;
    c.enable_prefix_caching = rng() % 4 != 0;
    c.enable_kv_events = rng() % 2 == 0;
    c.eos_token_id = 2;
    c.stop_token_ids = {3};
    c.num_state_slots = rng() % 4 == 0 ? pick(1, 4) : 0;
    const int32_t k = c.num_speculative_tokens;
    H h(c);
    h.check_device_plan = check_plan;
    std::set<int64_t> live;
    std::map<int64_t, int32_t> generated, max_tokens, prompt_len;
    int64_t next_id = 0;
    std::deque<Snap> q;
    auto add_some = [&] {
      const int32_t n = pick(0, 2);
      for (int32_t i = 0; i < n; ++i) {
        const int64_t id = next_id++;
        V prompt = Seq(100 * pick(0, 3), pick(0, 12));
        const int32_t tail = pick(1, 6);
        for (int32_t j = 0; j < tail; ++j) prompt.push_back(pick(4, 9));
        if (rng() % 10 == 0) prompt = Seq(0, c.max_model_len + pick(1, 5));  // rejected
        SamplingParams p = P(pick(1, 12));
        p.ignore_eos = rng() % 5 == 0;
        if (rng() % 6 == 0) p.stop_token_sequences = {{5, 6}};
        h.add(id, prompt, p);
        live.insert(id);
        generated[id] = 0;
        max_tokens[id] = p.max_tokens;
        prompt_len[id] = static_cast<int32_t>(prompt.size());
      }
    };
    auto apply = [&](const Snap& b) {
      const int32_t w = k == 0 ? 1 : k + 1;  // prefill batches too
      V sampled, acc, drafts;
      for (int32_t r = 0; r < b.num_rows; ++r) {
        for (int32_t j = 0; j < w; ++j) sampled.push_back(rng() % 12 == 0 ? 2 : pick(4, 40));
        if (k > 0) {
          acc.push_back(b.is_prefill ? 1 : pick(1, b.nsched[r]));  // K+1, fewer near the limit
          for (int32_t j = 0; j < k; ++j) drafts.push_back(pick(4, 40));
        }
      }
      const Outs o = h.upd(b, sampled, acc, drafts);
      for (int64_t id : o.order) {
        const ROut& r = o.by_id.at(id);
        EXPECT_TRUE(live.count(id)) << "output for request " << id << " that already ended";
        generated[id] += static_cast<int32_t>(r.tokens.size());
        EXPECT_LE(generated[id], max_tokens[id]) << id;
        // A prompt of max_model_len tokens still gets its one prefill token.
        EXPECT_LE(prompt_len[id] + generated[id], std::max(c.max_model_len, prompt_len[id] + 1))
            << id;
        if (r.reason != FinishReason::kNone) live.erase(id);
      }
      if (testing::Test::HasFailure()) return;
    };
    for (int step = 0; step < 400 && !testing::Test::HasFailure(); ++step) {
      if (step < 150) add_some();
      if (step < 300 && rng() % 25 == 0 && !live.empty()) {
        auto it = live.begin();
        std::advance(it, rng() % live.size());
        if (h.s.contains(*it)) {
          h.s.abort_request(*it);
          h.Inv("abort_request");
          live.erase(it);
        }
      }
      const bool ahead = rng() % 2 == 0;
      if (static_cast<int32_t>(q.size()) < (ahead ? 2 : 1)) {
        auto b = h.sched(0.0, rng() % 8 != 0);
        for (const auto& rej : h.s.take_rejected()) {
          EXPECT_TRUE(live.count(rej.req_id));
          EXPECT_EQ(rej.reason.rfind("unschedulable: ", 0), 0u);
          live.erase(rej.req_id);
        }
        if (b) {
          q.push_back(*b);
          continue;
        }
      }
      if (!q.empty()) {
        apply(q.front());
        q.pop_front();
      }
      (void)h.s.take_events();
    }
    // Drain: everything must finish.
    for (int guard = 0; guard < 5000 && !testing::Test::HasFailure(); ++guard) {
      if (q.size() < 2) {
        auto b = h.sched();
        for (const auto& rej : h.s.take_rejected()) live.erase(rej.req_id);
        if (b) {
          q.push_back(*b);
          continue;
        }
      }
      if (q.empty()) break;
      apply(q.front());
      q.pop_front();
    }
    EXPECT_TRUE(live.empty()) << live.size() << " requests never finished";
    EXPECT_FALSE(h.s.has_unfinished_requests());
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), c.num_blocks);
  }
}

TEST(SchedulerTest, RandomStreamsKeepInvariants) {
  for (uint32_t seed = 1; seed <= 12 && !HasFailure(); ++seed) RandomStream(seed, false);
}

// ---------------------------------------------------------------------------------------------
// Device plan: replaying slot_reset / new_block_starts / new_block_ids in batch order rebuilds
// every row's block table in its device slot (docs/api.md).
// ---------------------------------------------------------------------------------------------

TEST(SchedulerTest, DevicePlanRebuildsTheBlockTables) {
  for (bool ahead : {false, true}) {
    for (bool chunked : {true, false}) {
      SCOPED_TRACE(testing::Message() << "one_step_ahead " << ahead << " chunked " << chunked);
      RunWorkload(ahead, chunked, /*check_plan=*/true);
    }
  }
  for (uint32_t seed = 1; seed <= 6 && !HasFailure(); ++seed) RandomStream(seed, true);
}

}  // namespace
}  // namespace atom_sched
