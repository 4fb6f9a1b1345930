// The policy seam (policy.h): the rule types on their own, priority scheduling (vLLM's
// semantics: waiting by (priority, arrival), the victim the lowest priority, latest arrival),
// long_prefill_token_threshold, the data-parallel readiness probe calling the admission rule,
// and mixed batches (policy kMixed: decode rows first, prefill chunks in the budget left).
//
// Every schedule() and update() goes through the harness H, which runs check_invariants() (queues
// in service order included) after each call and checks every batch against the request table.
#include "atom_sched/policy.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

SamplingParams Prio(int32_t priority, int32_t max_tokens = 64) {
  SamplingParams p = P(max_tokens);
  p.priority = priority;
  return p;
}

SchedulerConfig PriorityCfg(int32_t usable_blocks) {
  SchedulerConfig c = Cfg(usable_blocks);
  c.scheduling = SchedulingPolicy::kPriority;
  return c;
}

// ---------------------------------------------------------------------------------------------
// The rule types
// ---------------------------------------------------------------------------------------------

TEST(PolicyTest, PrefillChunkWholeOrNothingWithoutChunking) {
  const PrefillChunk rule{/*chunked_prefill=*/false, /*long_prefill_token_threshold=*/0};
  EXPECT_EQ(rule(10, 10, false), 10);
  EXPECT_EQ(rule(10, 9, false), 0) << "does not fit: admission stops at it";
  EXPECT_EQ(rule(10, 4, true), 4) << "a preempted request is re-prefilled in chunks";
}

TEST(PolicyTest, PrefillChunkTakesWhatIsLeftUpToTheThreshold) {
  const PrefillChunk chunked{true, 0};
  EXPECT_EQ(chunked(10, 100, false), 10);
  EXPECT_EQ(chunked(10, 3, false), 3);
  EXPECT_EQ(chunked(10, 0, false), 0);
  const PrefillChunk capped{true, 4};
  EXPECT_EQ(capped(10, 100, false), 4);
  EXPECT_EQ(capped(3, 100, false), 3);
  EXPECT_EQ(capped(10, 2, false), 2);
  EXPECT_EQ(capped(10, 100, true), 4);
}

TEST(PolicyTest, ServiceOrderIsPriorityThenArrivalTimeThenAddOrder) {
  auto req = [](int32_t priority, double arrival, uint64_t seq) {
    Request r;
    r.priority = priority;
    r.arrival_time = arrival;
    r.arrival_seq = seq;
    return r;
  };
  const ServiceOrder order{SchedulingPolicy::kPriority};
  EXPECT_TRUE(order.sorted());
  EXPECT_TRUE(order(req(0, 9.0, 9), req(1, 0.0, 0))) << "priority first";
  EXPECT_TRUE(order(req(-5, 9.0, 9), req(0, 0.0, 0))) << "negative priorities are served first";
  EXPECT_TRUE(order(req(1, 1.0, 9), req(1, 2.0, 0))) << "then arrival time";
  EXPECT_TRUE(order(req(1, 1.0, 3), req(1, 1.0, 4))) << "then add order";
  EXPECT_FALSE(order(req(1, 1.0, 4), req(1, 1.0, 4)));
  EXPECT_FALSE(ServiceOrder{SchedulingPolicy::kFcfs}.sorted());
}

// ---------------------------------------------------------------------------------------------
// Priority scheduling
// ---------------------------------------------------------------------------------------------

// Non-chunked, budget 8: two prompts of 4 per step.
//   add 1 (p 2), 2 (p 0), 3 (p 1), 4 (p 0): waiting 2, 4, 3, 1
//   step 1: prefill 2, 4
//   add 5 (p -1): it overtakes 3 and 1
//   step 2 (decode 2, 4 first: ATOM's prefill-first step admits 5, 3)
TEST(SchedulerTest, PriorityAdmitsInPriorityThenArrivalOrder) {
  SchedulerConfig c = PriorityCfg(32);
  c.enable_chunked_prefill = false;
  c.max_num_batched_tokens = 8;
  H h(c);
  h.add(1, Seq(100, 4), Prio(2));
  h.add(2, Seq(200, 4), Prio(0));
  h.add(3, Seq(300, 4), Prio(1));
  h.add(4, Seq(400, 4), Prio(0));
  EXPECT_EQ(h.s.waiting_ids(), (V64{2, 4, 3, 1}));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  EXPECT_EQ(s1->req_ids, (V64{2, 4}));
  h.upd(*s1, {210, 410});
  h.add(5, Seq(500, 4), Prio(-1));
  EXPECT_EQ(h.s.waiting_ids(), (V64{5, 3, 1}));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_TRUE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, (V64{5, 3}));
  EXPECT_EQ(h.s.running_ids(), (V64{5, 2, 4, 3})) << "running is kept in service order too";
  h.upd(*s2, {510, 310});
}

// bs 4, 4 usable blocks, prompts of 4 (one block each): after the prefill one block is free and
// every decode row needs a second block.
//   FCFS: running 1, 2, 3; row 1 takes the free block, row 2 preempts the tail, 3.
//   priority (1 p 0, 2 p 5, 3 p 0): running 1, 3, 2; row 1 takes the free block, row 3 preempts
//   the lowest priority, 2, which was admitted before it.
TEST(SchedulerTest, PriorityVictimIsTheLowestPriorityNotTheLastAdmitted) {
  for (const SchedulingPolicy policy : {SchedulingPolicy::kFcfs, SchedulingPolicy::kPriority}) {
    const bool prio = policy == SchedulingPolicy::kPriority;
    SCOPED_TRACE(prio ? "priority" : "fcfs");
    SchedulerConfig c = Cfg(4);
    c.enable_prefix_caching = false;
    c.scheduling = policy;
    H h(c);
    h.add(1, Seq(100, 4), Prio(0));
    h.add(2, Seq(200, 4), Prio(prio ? 5 : 0));
    h.add(3, Seq(300, 4), Prio(0));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, prio ? (V64{1, 3, 2}) : (V64{1, 2, 3}));
    h.upd(*s1, {110, 310, 210});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_FALSE(s2->is_prefill);
    EXPECT_EQ(s2->req_ids, prio ? (V64{1, 3}) : (V64{1, 2}));
    EXPECT_EQ(h.s.waiting_ids(), prio ? V64{2} : V64{3});
    EXPECT_EQ(h.s.stats().num_preemptions, 1);
    h.upd(*s2, {111, prio ? 311 : 211});
  }
}

// Among the lowest priority, the latest arrival (arrival_time, not add order) is the victim; a
// preempted request returns to waiting at its place in service order, not at the head.
//   add 1 (p 0, t 0), 2 (p 1, t 5), 3 (p 1, t 1): running 1, 3, 2 after the prefill
//   add 4 (p 0, t 9): 12 tokens, 3 blocks: waits (1 block free)
//   add 5 (p 2, t 2): waits behind 4
//   decode: row 1 takes the free block, row 3 preempts 2 (t 5 > t 1); waiting 4, 2, 5
TEST(SchedulerTest, PriorityVictimIsTheLatestArrivalAndRequeuesInOrder) {
  SchedulerConfig c = PriorityCfg(4);
  c.enable_prefix_caching = false;
  H h(c);
  auto add = [&](int64_t id, int32_t n, int32_t priority, double t) {
    h.s.add_request(id, Seq(100 * static_cast<int32_t>(id), n), Prio(priority), t);
    h.Inv("add_request");
  };
  add(1, 4, 0, 0.0);
  add(2, 4, 1, 5.0);
  add(3, 4, 1, 1.0);
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{1, 3, 2}));
  h.upd(*s1, {110, 310, 210});
  add(4, 12, 0, 9.0);
  add(5, 4, 2, 2.0);
  EXPECT_EQ(h.s.waiting_ids(), (V64{4, 5}));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill);
  EXPECT_EQ(s2->req_ids, (V64{1, 3}));
  EXPECT_EQ(h.s.waiting_ids(), (V64{4, 2, 5}));
  EXPECT_TRUE(h.s.request(2).preempted);
}

TEST(SchedulerTest, PriorityWithoutPrioritySchedulingIsRefused) {
  H h(Cfg(8));
  h.add(1, Seq(100, 4));
  EXPECT_THROW(h.s.add_request(2, Seq(200, 4), Prio(1)), InvalidArgument);
  EXPECT_THROW(h.s.add_request(2, Seq(200, 4), Prio(-1)), InvalidArgument);
  h.Inv("refused add_request");
  EXPECT_FALSE(h.s.contains(2));
  EXPECT_EQ(h.s.waiting_ids(), V64{1});
  h.add(2, Seq(200, 4), Prio(0));  // the id is still free
}

TEST(SchedulerTest, ArrivalTimeMustBeFinite) {
  H h(PriorityCfg(8));
  for (double t : {std::nan(""), std::numeric_limits<double>::infinity(),
                   -std::numeric_limits<double>::infinity()}) {
    EXPECT_THROW(h.s.add_request(1, Seq(100, 4), P(), t), InvalidArgument) << t;
  }
  h.Inv("refused add_request");
  EXPECT_FALSE(h.s.contains(1));
}

// ---------------------------------------------------------------------------------------------
// long_prefill_token_threshold
// ---------------------------------------------------------------------------------------------

// Threshold 8, budget 64, prompts A 30, B 20, C 5:
//   step 1: A 8, B 8, C 5 (whole: under the cap)     computed A 8, B 8
//   step 2: A 8, B 8 (partials resume, capped)       A 16, B 16
//   step 3: A 8, B 4 (B done: it emits)              A 24
//   step 4: A 6 (done)
TEST(SchedulerTest, LongPrefillThresholdCapsEachRequestsChunk) {
  SchedulerConfig c = Cfg(64);
  c.max_num_batched_tokens = 64;
  c.long_prefill_token_threshold = 8;
  H h(c);
  h.add(1, Seq(100, 30));
  h.add(2, Seq(200, 20));
  h.add(3, Seq(300, 5));
  const std::vector<V> chunks = {{8, 8, 5}, {8, 8}, {8, 4}, {6}};
  const std::vector<std::vector<uint8_t>> emits = {{0, 0, 1}, {0, 0}, {0, 1}, {1}};
  for (size_t step = 0; step < chunks.size(); ++step) {
    SCOPED_TRACE(step + 1);
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_TRUE(b->is_prefill);
    EXPECT_EQ(b->nsched, chunks[step]);
    EXPECT_EQ(b->emits, emits[step]);
    h.upd(*b, V(static_cast<size_t>(b->num_rows), 7));
  }
}

TEST(SchedulerTest, LongPrefillThresholdDoesNotCapARequestAlone) {
  SchedulerConfig c = Cfg(64);
  c.max_num_batched_tokens = 32;
  c.long_prefill_token_threshold = 8;
  H h(c);
  h.add(1, Seq(100, 40));
  auto b1 = h.sched();  // nobody to starve: the whole budget
  ASSERT_TRUE(b1);
  EXPECT_EQ(b1->nsched, V{32});
  h.upd(*b1, V{7});
  h.add(2, Seq(200, 20));
  auto b2 = h.sched();  // another request waits: both capped
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->nsched, (V{8, 8}));
}

TEST(SchedulerTest, AdaptiveLongPrefillThresholdIsFlooredAtAFairShare) {
  for (bool adaptive : {false, true}) {
    SCOPED_TRACE(testing::Message() << "adaptive " << adaptive);
    SchedulerConfig c = Cfg(64);
    c.max_num_batched_tokens = 32;
    c.long_prefill_token_threshold = 4;
    c.long_prefill_token_threshold_adaptive = adaptive;
    H h(c);
    h.add(1, Seq(100, 40));
    h.add(2, Seq(200, 40));
    auto b = h.sched();  // a fair share is 32 / 2 = 16, above the threshold
    ASSERT_TRUE(b);
    EXPECT_EQ(b->nsched, adaptive ? (V{16, 16}) : (V{4, 4}));
  }
}

TEST(SchedulerTest, LongPrefillThresholdIsValidated) {
  SchedulerConfig c = Cfg(8);
  c.long_prefill_token_threshold = -1;
  EXPECT_THROW(c.validate(), InvalidArgument);
  c.long_prefill_token_threshold = 8;
  c.enable_chunked_prefill = false;
  EXPECT_THROW(c.validate(), InvalidArgument) << "a cap on chunks needs chunked prefill";
  EXPECT_THROW(Scheduler{c}, InvalidArgument);
  c.enable_chunked_prefill = true;
  EXPECT_NO_THROW(c.validate());
}

// ---------------------------------------------------------------------------------------------
// admission_watermark_blocks
// ---------------------------------------------------------------------------------------------

// 10 usable blocks of 4, watermark 2. A (16 tokens, 4 blocks) is admitted with nothing running
// (no headroom needed); B (4 blocks) leaves 2 free: admitted; C (1 block) would leave 1: it
// waits, where ATOM's rule (watermark 0) admits it.
TEST(SchedulerTest, WatermarkKeepsBlocksFreeForRunningRequests) {
  for (const int32_t watermark : {0, 2}) {
    SCOPED_TRACE(testing::Message() << "watermark " << watermark);
    SchedulerConfig c = Cfg(10);
    c.enable_prefix_caching = false;
    c.admission_watermark_blocks = watermark;
    H h(c);
    h.add(1, Seq(100, 16));
    h.add(2, Seq(200, 16));
    h.add(3, Seq(300, 4));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, watermark > 0 ? (V64{1, 2}) : (V64{1, 2, 3}));
    EXPECT_EQ(h.s.waiting_ids(), watermark > 0 ? V64{3} : V64{});
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), watermark > 0 ? 2 : 1);
    h.upd(*s1, watermark > 0 ? V{110, 210} : V{110, 210, 310});
  }
}

// With nothing running the watermark does not apply: a request that needs all but one of the
// usable blocks is admitted under a watermark of 5 (it would wait forever otherwise).
TEST(SchedulerTest, WatermarkNeverBlocksARequestThatFitsAnEmptyPool) {
  SchedulerConfig c = Cfg(10);
  c.admission_watermark_blocks = 5;
  H h(c);
  h.add(1, Seq(100, 36));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, V64{1});
  h.upd(*s1, {110});
  h.add(2, Seq(200, 4));  // one block: 1 is free, but 5 must stay free while 1 runs
  EXPECT_EQ(h.s.count_admittable_head_prefills(4), 0);
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->req_ids, V64{1});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
}

TEST(SchedulerTest, WatermarkIsValidated) {
  for (const int32_t bad : {-1, 10, 11}) {
    SchedulerConfig c = Cfg(10);  // num_blocks 11: at most 9
    c.admission_watermark_blocks = bad;
    EXPECT_THROW(c.validate(), InvalidArgument) << bad;
  }
  SchedulerConfig c = Cfg(10);
  c.admission_watermark_blocks = 9;
  EXPECT_NO_THROW(c.validate());
}

// ---------------------------------------------------------------------------------------------
// The readiness probe admits as admission does
// ---------------------------------------------------------------------------------------------

// Random waiting queues (no prefix caching: the probe's KV count is then exact) under every
// admission rule: count_admittable_head_prefills(limit) equals the number of the first 4 waiting
// requests that the next schedule() admits, capped at limit.
TEST(SchedulerTest, ReadinessProbeCountsWhatAdmissionAdmits) {
  std::mt19937 rng(7);
  auto pick = [&](int32_t lo, int32_t hi) {
    return lo + static_cast<int32_t>(rng() % static_cast<uint32_t>(hi - lo + 1));
  };
  int32_t nonzero = 0, partial_fit = 0;
  for (int trial = 0; trial < 400 && !HasFailure(); ++trial) {
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    SchedulerConfig c = Cfg(pick(2, 30));
    c.enable_prefix_caching = false;
    c.max_num_seqs = pick(1, 6);
    c.max_num_batched_tokens = pick(4, 48);
    c.max_model_len = 512;
    c.enable_chunked_prefill = rng() % 2 == 0;
    if (c.enable_chunked_prefill && rng() % 2 == 0) c.long_prefill_token_threshold = pick(1, 20);
    c.scheduling = std::array{SchedulingPolicy::kPriority, SchedulingPolicy::kFcfs,
                              SchedulingPolicy::kFairShare}[rng() % 3];
    if (rng() % 3 == 0 && c.num_blocks > 3) c.admission_watermark_blocks = pick(1, c.num_blocks - 3);
    H h(c);
    const int32_t n = pick(1, 6);
    for (int64_t id = 0; id < n; ++id) {
      // Schedulable prompts only: the loop would reject the others, which the probe skips.
      const int32_t most = std::min(c.enable_chunked_prefill ? 120 : c.max_num_batched_tokens,
                                    (c.num_blocks - 1) * c.block_size);
      SamplingParams p = P();
      if (c.scheduling == SchedulingPolicy::kPriority) p.priority = pick(0, 2);
      p.tenant = std::string(1, static_cast<char>('a' + pick(0, 2)));  // fair share's
      h.add(id, Seq(100 * static_cast<int32_t>(id), pick(1, most)), p);
    }
    // Nothing runs: every row is an admission, in the order the probe follows (the head of
    // waiting on; fair share: its picks), so the probe counts the first 4 of them.
    Scheduler copy = h.s;
    const Batch* b = copy.schedule();
    const int32_t admitted = b == nullptr ? 0 : std::min(b->num_rows, 4);
    for (int32_t limit = 1; limit <= 4; ++limit)
      EXPECT_EQ(h.s.count_admittable_head_prefills(limit), std::min(limit, admitted))
          << "limit " << limit;
    nonzero += admitted > 0;
    if (b != nullptr && admitted > 1) {
      const int32_t last = admitted - 1;  // every row is an admission, in order
      partial_fit += b->num_scheduled_tokens[last] < copy.request(b->req_ids[last]).num_prompt_tokens;
    }
  }
  EXPECT_GT(nonzero, 100) << "the trials should admit";
  EXPECT_GT(partial_fit, 10) << "the trials should admit a chunk of a second request";
}

// ---------------------------------------------------------------------------------------------
// Mixed batches
// ---------------------------------------------------------------------------------------------

// bs 4, budget 16, K = 0. A, B prompts of 4; then C of 30 arrives.
//   step 1: prefill A, B (nothing runs yet: an all-prefill batch)
//   step 2: decode A, B (1 token each), then C's first chunk of 14: rows A B C, kinds 0 0 1
//   step 3: A, B, C 14 more (28)       step 4: A, B, C 2 (emits)       step 5: A, B, C decode
// ATOM's policy would stall A and B for two whole prefill steps of C.
TEST(SchedulerTest, MixedBatchDecodesEveryRunningRequestThenPrefills) {
  SchedulerConfig c = Cfg(64);
  c.max_num_batched_tokens = 16;
  c.policy = BatchPolicy::kMixed;
  H h(c);
  h.add(1, Seq(100, 4));
  h.add(2, Seq(200, 4));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_TRUE(s1->is_prefill);
  EXPECT_EQ(s1->prefill_rows, (std::vector<uint8_t>{1, 1}));
  h.upd(*s1, {110, 210});
  h.add(3, Seq(300, 30));
  const std::vector<V> nsched = {{1, 1, 14}, {1, 1, 14}, {1, 1, 2}, {1, 1, 1}};
  const std::vector<std::vector<uint8_t>> kinds = {
      {0, 0, 1}, {0, 0, 1}, {0, 0, 1}, {0, 0, 0}};
  const std::vector<std::vector<uint8_t>> emits = {
      {1, 1, 0}, {1, 1, 0}, {1, 1, 1}, {1, 1, 1}};
  for (size_t step = 0; step < nsched.size(); ++step) {
    SCOPED_TRACE(step + 2);
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_FALSE(b->is_prefill);
    EXPECT_EQ(b->req_ids, (V64{1, 2, 3}));
    EXPECT_EQ(b->nsched, nsched[step]);
    EXPECT_EQ(b->prefill_rows, kinds[step]);
    EXPECT_EQ(b->emits, emits[step]);
    const int32_t g = static_cast<int32_t>(step);
    const Outs o = h.upd(*b, {111 + g, 211 + g, 310 + g});
    EXPECT_EQ(o.tokens(1), V{111 + g});
    EXPECT_EQ(o.has(3), step >= 2) << "C streams once its prompt is done";
  }
  EXPECT_EQ(h.s.request(3).tokens, Cat(Seq(300, 30), {312, 313}));
}

// K = 2, mixed: decode rows verify drafts while a prefill row runs. The prefill row has no
// drafts (-1) and accepts exactly 1 token; its own drafts for the next step are kept.
TEST(SchedulerTest, MixedBatchVerifiesDraftsBesidePrefillRows) {
  SchedulerConfig c = SpecCfg(64, 2);
  c.policy = BatchPolicy::kMixed;
  H h(c);
  h.add(1, Seq(100, 4));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110, 0, 0}, {1}, {111, 112});
  h.add(2, Seq(200, 5));
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_FALSE(s2->is_prefill);
  EXPECT_EQ(s2->num_spec_tokens, 2);
  EXPECT_EQ(s2->req_ids, (V64{1, 2}));
  EXPECT_EQ(s2->prefill_rows, (std::vector<uint8_t>{0, 1}));
  EXPECT_EQ(s2->nsched, (V{3, 5}));
  EXPECT_EQ(s2->drafts, (V{111, 112, -1, -1}));
  EXPECT_EQ(s2->tokens, Cat({110, 111, 112}, Seq(200, 5)));
  // A prefill row accepts exactly one token: 2 is refused, state unchanged.
  ModelOutputs bad;
  const V sampled = {111, 112, 113, 210, 0, 0}, acc_bad = {3, 2}, drafts = {114, 115, 211, 212};
  bad.sampled_token_ids = sampled;
  bad.num_accepted = acc_bad;
  bad.draft_token_ids = drafts;
  EXPECT_THROW(h.s.update(s2->id, bad), InvalidArgument);
  h.Inv("refused update");
  const Outs o = h.upd(*s2, sampled, {3, 1}, drafts);
  EXPECT_EQ(o.tokens(1), (V{111, 112, 113}));
  EXPECT_EQ(o.tokens(2), V{210});
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->prefill_rows, (std::vector<uint8_t>{0, 0}));
  EXPECT_EQ(s3->drafts, (V{114, 115, 211, 212}));
}

// Mixed, 6 usable blocks of 4. A and B (8-token prompts, 2 blocks each) run; C (4 tokens) waits.
//   step 2: decode A, B at pos 8: each takes a block (0 free); C does not fit and waits: decode
//           rows come first, and a waiting prompt never preempts a running request
//   steps 3-5: A, B at pos 9..11
//   step 6: A needs a block at pos 12: preempts the tail, B (as ATOM's policy); B heads waiting
//           with 13 tokens (4 blocks, 2 free): B and C wait behind it
TEST(SchedulerTest, MixedBatchDecodesBeforeAdmittingAndPreemptsAsAtom) {
  SchedulerConfig c = Cfg(6);
  c.enable_prefix_caching = false;
  c.policy = BatchPolicy::kMixed;
  H h(c);
  h.add(1, Seq(100, 8));
  h.add(2, Seq(200, 8));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {110, 210});
  h.add(3, Seq(300, 4));
  for (int32_t step = 2; step <= 5; ++step) {
    SCOPED_TRACE(step);
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, (V64{1, 2}));
    EXPECT_EQ(b->positions, (V64{6 + step, 6 + step}));
    EXPECT_EQ(h.s.waiting_ids(), V64{3});
    h.upd(*b, {111, 211});
  }
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
  auto s6 = h.sched();
  ASSERT_TRUE(s6);
  EXPECT_EQ(s6->req_ids, V64{1});
  EXPECT_EQ(s6->positions, V64{12});
  EXPECT_EQ(h.s.waiting_ids(), (V64{2, 3}));
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
}

// Mixed, K = 2, bs 4, 3 usable blocks. X (3 tokens, max_tokens 2) then A (6 tokens).
//   step 1: prefill X {1 block}, A {2 blocks}: pool full; X proposes no draft, A two
//   step 2: X's row [pos 3] needs no block; A's [pos 6 7 8] needs a third: A is the tail, so it
//           preempts itself (its 2 blocks freed). Its 7 tokens would fit those 2 blocks, and the
//           prefill pass used to re-admit it at once as a prefill row of 7 tokens (its KV
//           recomputed for nothing in the step that freed it). A step that preempted admits
//           nothing (as vLLM): the batch is X alone, A waits.
//   step 3: X finished (max_tokens): A re-prefills its 7 tokens and streams on
TEST(SchedulerTest, MixedStepThatPreemptsDoesNotReadmitTheVictim) {
  SchedulerConfig c = SpecCfg(3, 2);
  c.enable_prefix_caching = false;
  c.policy = BatchPolicy::kMixed;
  H h(c);
  h.add(1, Seq(100, 3), P(2));
  h.add(2, Seq(200, 6));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{1, 2}));
  EXPECT_EQ(s1->nsched, (V{3, 6}));
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
  h.upd(*s1, {110, 0, 0, 210, 0, 0}, {1, 1}, {-1, -1, 211, 212});

  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  EXPECT_EQ(s2->req_ids, V64{1}) << "the victim is in the batch of the step that preempted it";
  EXPECT_EQ(s2->prefill_rows, std::vector<uint8_t>{0});
  EXPECT_EQ(s2->positions, V64{3});
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.s.request(2).status, RequestStatus::kWaiting);
  EXPECT_TRUE(h.s.request(2).block_table.empty()) << "re-admitted in the step that preempted it";
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 2);
  const Outs o2 = h.upd(*s2, {111, 0, 0}, {1}, {-1, -1});
  EXPECT_EQ(o2.tokens(1), V{111});
  EXPECT_FALSE(o2.has(2));

  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, V64{2});
  EXPECT_EQ(s3->nsched, V{7});
  EXPECT_EQ(s3->tokens, Cat(Seq(200, 6), {210}));
  EXPECT_EQ(s3->slot_reset, std::vector<uint8_t>{1});
  const Outs o3 = h.upd(*s3, {213, 0, 0}, {1}, {-1, -1});
  EXPECT_EQ(o3.tokens(2), V{213});
  EXPECT_EQ(h.s.request(2).tokens, Cat(Seq(200, 6), {210, 213}));
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
}

// ---------------------------------------------------------------------------------------------
// Variable-length drafts
// ---------------------------------------------------------------------------------------------

// K = 3, bs 4, A = [100..106). Drafts known when a row is scheduled (synchronous) decide its
// width, and so the KV it reserves:
//   prefill: A samples 10, drafts [11, -1, -1]      -> decode 1: [10 11] at pos 6, 7 (2 tokens)
//   decode 1 accepts 2 (11 12), drafts [-1 -1 -1]    -> decode 2: [12] at pos 8 (no drafts)
//   decode 2 accepts 1 (13), drafts [14 15 16]       -> decode 3: [13 14 15 16] at pos 9..12
TEST(SchedulerTest, RowsVerifyOnlyTheDraftsProposed) {
  H h(SpecCfg(32, 3));
  h.add(1, Seq(100, 6));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {10, 0, 0, 0}, {1}, {11, -1, -1});
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  EXPECT_EQ(s2->tokens, (V{10, 11}));
  EXPECT_EQ(s2->positions, (V64{6, 7}));
  EXPECT_EQ(s2->drafts, (V{11, -1, -1}));
  EXPECT_EQ(h.s.request(1).block_table.size(), 2u) << "KV for 8 positions, not 9";
  ModelOutputs too_many;  // a row of 2 tokens accepts at most 2
  const V sampled = {11, 12, 0, 0}, acc3 = {3}, none = {-1, -1, -1};
  too_many.sampled_token_ids = sampled;
  too_many.num_accepted = acc3;
  too_many.draft_token_ids = none;
  EXPECT_THROW(h.s.update(s2->id, too_many), InvalidArgument);
  h.upd(*s2, sampled, {2}, none);
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_EQ(s3->tokens, V{12});
  EXPECT_EQ(s3->positions, V64{8});
  EXPECT_EQ(s3->drafts, (V{-1, -1, -1}));
  h.upd(*s3, {13, 0, 0, 0}, {1}, {14, 15, 16});
  auto s4 = h.sched();
  ASSERT_TRUE(s4);
  EXPECT_EQ(s4->tokens, (V{13, 14, 15, 16}));
  EXPECT_EQ(s4->positions, (V64{9, 10, 11, 12}));
  EXPECT_EQ(h.s.stats().num_draft_tokens, 1 + 0) << "verified so far: decodes 1 and 2";
}

}  // namespace
}  // namespace atom_sched

namespace atom_sched {
namespace {

// prefill_lookahead_tokens (vLLM's num_prefill_lookahead_tokens, multi-module MTP): a chunk takes
// the rest of the prompt or leaves at least L tokens of it.
TEST(PolicyTest, PrefillChunkLeavesTheDraftersLookahead) {
  const PrefillChunk rule{/*chunked_prefill=*/true, /*long_prefill_token_threshold=*/0,
                          /*lookahead=*/3};
  EXPECT_EQ(rule(10, 100, false), 10) << "the rest fits: no boundary";
  EXPECT_EQ(rule(10, 8, false), 7) << "8 would leave 2: cut to leave 3";
  EXPECT_EQ(rule(10, 7, false), 7) << "leaves exactly 3";
  EXPECT_EQ(rule(4, 2, false), 1) << "leaves 3";
  EXPECT_EQ(rule(3, 2, false), 0) << "would leave 1: nothing this step";
  const PrefillChunk capped{true, 4, 3};
  EXPECT_EQ(capped(6, 100, false), 3);
  const PrefillChunk whole{false, 0, 3};
  EXPECT_EQ(whole(10, 9, false), 0) << "without chunking: whole or nothing, as before";
}

TEST(PrefillLookaheadTest, NoChunkEndsWithinTheLookaheadOfThePromptsEnd) {
  for (int32_t budget : {4, 5, 6, 7}) {
    SCOPED_TRACE(budget);
    SchedulerConfig c = Cfg(32);
    c.enable_chunked_prefill = true;
    c.max_num_batched_tokens = budget;
    c.prefill_lookahead_tokens = 3;
    H h(c);
    h.add(0, Seq(1, 14), P(1));
    int32_t computed = 0;
    for (int32_t step = 0; step < 20; ++step) {
      auto b = h.sched();
      ASSERT_TRUE(b);
      computed = b->ctx[0];
      const int32_t left = 14 - computed;
      EXPECT_TRUE(left == 0 || left >= 3) << "a chunk ended " << left << " before the end";
      h.upd(*b, V{50});
      if (left == 0) break;
    }
    EXPECT_EQ(computed, 14);
  }
  SchedulerConfig bad = Cfg(32);
  bad.max_num_batched_tokens = 8;
  bad.prefill_lookahead_tokens = 8;
  EXPECT_THROW(Scheduler{bad}, InvalidArgument);
  bad.prefill_lookahead_tokens = 3;
  bad.long_prefill_token_threshold = 2;
  EXPECT_THROW(Scheduler{bad}, InvalidArgument);
}

}  // namespace
}  // namespace atom_sched
