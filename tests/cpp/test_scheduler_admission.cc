// Scheduler scenarios: Admission, prefix cache and static rejection.
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
  EXPECT_EQ(b->slots, (V64{4, 5, 6, 8, 9, 10, 11, 12, 16, 17}));
  EXPECT_EQ(b->emits, (std::vector<uint8_t>{1, 1, 1}));
  EXPECT_EQ(b->last_block, (V{3, 1, 2}));
  EXPECT_EQ(b->table(0, 2), (V{1, 0}));
  EXPECT_EQ(b->table(1, 3), (V{2, 3, 0}));
  EXPECT_EQ(b->table(2, 2), (V{4, 0}));
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
  EXPECT_EQ(d->slots, (V64{7, 13, 18}));
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
  EXPECT_EQ(h.s.block_pool().free_list(), (V{2, 3, 4, 5, 6, 7, 8, 1}));

  const V a = Seq(100, 10);
  h.add(1, a);
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  EXPECT_EQ(h.s.request(1).block_table, (V{2, 3, 4}));
  EXPECT_EQ(s1->table(0, 4), (V{2, 3, 4, 0}));
  EXPECT_EQ(s1->ncached, V{0});
  EXPECT_EQ(s1->nsched, V{4});
  EXPECT_EQ(s1->tokens, Seq(100, 4));
  EXPECT_EQ(s1->positions, (V64{0, 1, 2, 3}));
  EXPECT_EQ(s1->slots, (V64{8, 9, 10, 11}));
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
  EXPECT_EQ(s2->slots, (V64{12, 13, 14, 15}));
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
  EXPECT_EQ(s3->slots, (V64{16, 17}));
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
  EXPECT_EQ(s4->slots, V64{18});
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
  EXPECT_EQ(h.s.block_pool().cached_block(hp[0]), 1);
  EXPECT_EQ(h.s.block_pool().cached_block(hp[1]), 2);
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
  EXPECT_EQ(h.s.request(3).block_table, (V{1, 2, 7}));
  EXPECT_EQ(s2->slots, V64{28});
  EXPECT_EQ(h.s.block_pool().ref_count(1), 2);
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
  EXPECT_EQ(h.s.request(2).block_table, (V{1, 2, 4}));
  EXPECT_EQ(s2->slots, (V64{16, 17}));
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
  EXPECT_EQ(h.s.request(3).block_table, (V{1, 5}));
  EXPECT_EQ(s3->slots, (V64{20, 21, 22, 23}));
  auto o3 = h.upd(*s3, {30});
  EXPECT_EQ(o3.by_id[3].hit_tokens, 4);
  EXPECT_EQ(h.s.block_pool().ref_count(1), 3);
  EXPECT_EQ(h.s.block_pool().ref_count(2), 2);

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

// Extra keys (vLLM's cache_salt and LoRA): bs 4, events on, P = [100..112) (3 blocks).
// Requests share cached blocks only under the same keys; block 0's parent is the keys'
// namespace, so the whole chain differs. Each admission runs alone (prefill, update).
TEST(SchedulerTest, ExtraKeysKeepTenantsApartInThePrefixCache) {
  SchedulerConfig c = Cfg(64);
  c.enable_kv_events = true;
  H h(c);
  const V p = Seq(100, 12);
  auto keyed = [](const std::string& lora, const std::string& salt) {
    SamplingParams sp = P(1);
    sp.lora_name = lora;
    sp.cache_salt = salt;
    return sp;
  };
  auto hit_tokens = [&](int64_t id, const SamplingParams& sp) {
    h.add(id, p, sp);
    auto b = h.sched();
    EXPECT_TRUE(b.has_value());
    if (!b) return -1;
    h.upd(*b, {7});
    return b->ncached[0];
  };
  EXPECT_EQ(hit_tokens(1, keyed("", "a")), 0);
  const auto events = h.s.take_events();
  ASSERT_EQ(events.size(), 1u);
  const std::optional<uint64_t> ns = hash_namespace("", "a");
  ASSERT_TRUE(ns.has_value());
  std::vector<uint64_t> chain;
  for (int32_t i = 0; i < 3; ++i)
    chain.push_back(block_hash(std::span<const int32_t>(p).subspan(4 * i, 4),
                               i == 0 ? ns : std::optional<uint64_t>(chain.back())));
  EXPECT_EQ(events[0].block_hashes, chain);
  EXPECT_EQ(events[0].parent_block_hash, std::nullopt) << "block 0 starts the sequence";
  EXPECT_EQ(events[0].cache_salt, "a");
  EXPECT_EQ(events[0].lora_name, "");
  EXPECT_EQ(hit_tokens(2, keyed("", "b")), 0) << "another tenant's salt";
  EXPECT_EQ(hit_tokens(3, keyed("", "a")), 8) << "the same salt shares (never the last block)";
  EXPECT_EQ(hit_tokens(4, keyed("", "")), 0) << "no salt: ATOM's chain";
  EXPECT_EQ(hit_tokens(5, keyed("x", "")), 0) << "a LoRA adapter";
  EXPECT_EQ(h.s.take_events().back().lora_name, "x");
  EXPECT_EQ(hit_tokens(6, keyed("x", "")), 8);
  EXPECT_EQ(hit_tokens(7, keyed("x", "a")), 0) << "both keys";
  EXPECT_EQ(hit_tokens(8, keyed("", "")), 8) << "the unkeyed prompt of request 4";
  EXPECT_NE(hash_namespace("a", ""), hash_namespace("", "a")) << "the keys are not mixed up";
  EXPECT_EQ(hash_namespace("", ""), std::nullopt);
  SamplingParams long_salt = keyed("", std::string(kMaxExtraKeyBytes + 1, 's'));
  EXPECT_THROW(long_salt.validate(), InvalidArgument);
}

// Decode-block caching (cache_decode_blocks), K = 2, bs 4, events on. A = [100..106), max 5.
//   prefill: block 0 [100..104) published; A samples 10, drafts 11 12
//   decode 1: [10 11 12] at pos 6..8; accepts 1 (55): A = ..., 10, 55 (R 8). Position 7 holds
//             the rejected draft 11's KV: block 1 is not published
//   decode 2: [55 13 14] at pos 7..9; accepts 3 (13 14 15): R 11, positions 0..9 verified:
//             block 1 = [104 105 10 55] published (block 2 would need position 11); A finishes
//   turn 2: A's 11 tokens + [7 8] hits blocks 0 and 1 (8 tokens); without decode caching, 4
TEST(SchedulerTest, DecodeBlocksArePublishedOnceVerifiedAndHitByTheNextTurn) {
  for (const bool cache_decode : {true, false}) {
    SCOPED_TRACE(cache_decode ? "cache_decode_blocks" : "prompt blocks only (ATOM)");
    SchedulerConfig c = SpecCfg(32, 2);
    c.enable_kv_events = true;
    c.cache_decode_blocks = cache_decode;
    H h(c);
    const V a = Seq(100, 6);
    h.add(1, a, P(5));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {10, 0, 0}, {1}, {11, 12});
    EXPECT_EQ(h.s.take_events().size(), 1u) << "the prompt's full block";
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->tokens, (V{10, 11, 12}));
    h.upd(*s2, {55, 0, 0}, {1}, {13, 14});
    EXPECT_TRUE(h.s.take_events().empty()) << "position 7 held a rejected draft";
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_EQ(s3->tokens, (V{55, 13, 14}));
    EXPECT_EQ(s3->positions, (V64{7, 8, 9}));
    const auto o3 = h.upd(*s3, {13, 14, 15}, {3}, {0, 0});
    EXPECT_EQ(o3.why(1), "max_tokens");
    const V full = Cat(a, {10, 55, 13, 14, 15});
    const auto hashes = Chain(full, 4);
    const auto events = h.s.take_events();
    if (cache_decode) {
      ASSERT_EQ(events.size(), 1u);
      EXPECT_EQ(events[0].kind, KvEventKind::kBlockStored);
      EXPECT_EQ(events[0].block_hashes, std::vector<uint64_t>{hashes[1]});
      EXPECT_EQ(events[0].parent_block_hash, hashes[0]);
      EXPECT_EQ(events[0].token_ids, (V{104, 105, 10, 55}));
    } else {
      EXPECT_TRUE(events.empty());
    }
    h.add(2, Cat(full, {7, 8}));
    auto s4 = h.sched();
    ASSERT_TRUE(s4);
    EXPECT_EQ(s4->ncached, V{cache_decode ? 8 : 4});
  }
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
              "unschedulable: needs 5 KV blocks for 17 input tokens > the pool's 4 "
              "(num_blocks=5 less the null block). Shorten the prompt or increase num_blocks.");
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


// fill_positions() writes a prompt chunk's positions and slots four lanes at a time, a whole
// block of 16 with a fixed count, the rest with a remainder loop. Chunks here start and end
// anywhere in a block (an odd token budget, prefix hits that end on a block boundary, prompts of
// every length mod 16), at block sizes with and without that fixed case; the harness checks every
// position and slot of every batch against the request's block table (CheckBatch).
TEST(SchedulerTest, PromptChunkPositionsAndSlotsAtEveryOffset) {
  for (const int32_t bs : {16, 32, 8, 5}) {
    SCOPED_TRACE(testing::Message() << "block_size " << bs);
    SchedulerConfig c = Cfg(400, bs);
    c.max_num_batched_tokens = 37;  // chunks start and end mid-block
    c.max_model_len = 512;
    H h(c);
    const V shared = Seq(1000, 3 * bs + 7);
    int64_t id = 0;
    for (int32_t len : {1, 3, 4, 15, 16, 17, 31, 33, 64, 70, 101}) {
      V prompt = shared;  // the later prompts hit the shared prefix's full blocks
      const V tail = Seq(5000 + 200 * static_cast<int32_t>(id), len);
      prompt.insert(prompt.end(), tail.begin(), tail.end());
      h.add(id++, prompt, P(2));
      h.add(id++, tail, P(2));
    }
    int32_t steps = 0;
    while (h.s.has_unfinished_requests()) {
      auto b = h.sched();  // CheckBatch: every position and slot
      ASSERT_TRUE(b);
      h.upd(*b, V(b->num_rows, 7));
      ASSERT_LT(++steps, 2000) << "no progress";
    }
    EXPECT_GT(h.s.stats().prefix_hit_tokens, 0);
  }
}

}  // namespace
}  // namespace atom_sched
