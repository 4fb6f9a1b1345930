// Scheduler scenarios: Bad input (typed errors, state unchanged), next_batch_info, abort and stats.
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

// update() decides whether a step's outputs are valid in one branch-free pass and words the
// error only when they are not. Random outputs (values around the edges: -2, -1, 0, a token)
// against the rules written out plainly here: it refuses exactly the bad ones, and a refusal
// changes nothing. Prefill and decode batches, K = 1..4.
TEST(SchedulerTest, SpeculativeOutputValidationMatchesTheRules) {
  std::mt19937 rng(11);
  const int32_t edge[] = {-2, -1, 0, 7};
  auto pick = [&] { return edge[rng() % 4]; };
  for (int32_t k = 1; k <= 4; ++k) {
    H h(SpecCfg(64, k));
    for (int64_t id = 1; id <= 3; ++id) h.add(id, {10, 11, 12, 13, 14});
    int32_t refused = 0, accepted_steps = 0;
    for (int32_t step = 0; step < 60 && h.s.has_unfinished_requests(); ++step) {
      auto b = h.sched();
      ASSERT_TRUE(b);
      const State before = Capture(h.s);
      for (int32_t attempt = 0; attempt < 200; ++attempt) {
        // Mostly plausible rows with an edge value here and there.
        V sampled, acc, drafts;
        bool bad = false;
        for (int32_t i = 0; i < b->num_rows; ++i) {
          const int32_t max_acc = b->prefill_rows[i] ? 1 : b->nsched[i];
          const int32_t a = rng() % 16 == 0 ? static_cast<int32_t>(rng() % (k + 3))
                                           : 1 + static_cast<int32_t>(rng() % max_acc);
          if (!b->is_prefill) acc.push_back(a);
          const int32_t rule_a = b->is_prefill ? 1 : a;
          bad |= rule_a < 1 || rule_a > max_acc;
          bool row_bad = false, missing = false;
          for (int32_t j = 0; j <= k; ++j) {
            sampled.push_back(rng() % 12 == 0 ? pick() : 20 + j);
            row_bad |= j < rule_a && sampled.back() < 0;
          }
          for (int32_t j = 0; j < k; ++j) {
            drafts.push_back(rng() % 10 == 0 ? pick() : 30 + j);
            const int32_t d = drafts.back();
            row_bad |= d < -1 || (d >= 0 && missing);
            missing |= d == -1;
          }
          bad |= row_bad && b->emits[i] != 0;
        }
        ModelOutputs o;
        o.sampled_token_ids = sampled;
        o.num_accepted = acc;
        o.draft_token_ids = drafts;
        if (bad) {
          EXPECT_THROW(h.s.update(b->id, o), InvalidArgument) << "K " << k << " step " << step;
          h.Inv("refused outputs");
          ExpectSame(before, Capture(h.s), "refused outputs");
          ++refused;
          continue;
        }
        EXPECT_NO_THROW(h.upd(*b, sampled, acc, drafts)) << "K " << k << " step " << step;
        ++accepted_steps;
        break;
      }
      if (h.s.num_outstanding_batches() > 0) break;  // 200 bad draws in a row: stop here
    }
    EXPECT_GT(refused, 10) << "K " << k;
    EXPECT_GT(accepted_steps, 5) << "K " << k;
  }
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

// preempt_request(): an engine's own victim (ATOM's Scheduler.preempt(seq)).
TEST(SchedulerTest, PreemptRequestRequeuesAtTheHeadKeepingTokens) {
  H h(Cfg(8));
  h.add(1, Seq(100, 5));
  h.add(2, Seq(200, 5));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {10, 20});
  h.add(3, Seq(300, 5));  // waits behind the preempted one
  const int32_t free_before = h.s.block_pool().num_free_blocks();
  h.s.preempt_request(1);
  h.Inv("preempt_request");
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), free_before + 2);
  EXPECT_EQ(h.s.waiting_ids(), (V64{1, 3})) << "a preempted request resumes first";
  EXPECT_EQ(h.s.running_ids(), V64{2});
  EXPECT_EQ(h.s.stats().num_preemptions, 1);
  EXPECT_EQ(h.s.request(1).tokens, Cat(Seq(100, 5), V{10}));
  // Its prompt and token are prefilled again (recompute), the next token follows on.
  auto s2 = h.sched();
  ASSERT_TRUE(s2);
  ASSERT_TRUE(s2->is_prefill);
  const int32_t row = s2->row_of(1);
  ASSERT_GE(row, 0);
  const V all = Cat(Seq(100, 5), V{10});
  EXPECT_EQ(s2->ncached[row], 4) << "its full block is still in the prefix cache";
  EXPECT_EQ(s2->row_tokens(row), V(all.begin() + s2->ncached[row], all.end()));
  V sampled(static_cast<size_t>(s2->num_rows), 30);
  sampled[static_cast<size_t>(row)] = 11;
  auto o2 = h.upd(*s2, sampled);
  EXPECT_EQ(o2.tokens(1), V{11});
}

TEST(SchedulerTest, PreemptRequestWithItsBatchInFlightKeepsThatBatchsToken) {
  H h(Cfg(8));
  h.add(1, Seq(100, 5));
  h.add(2, Seq(200, 5));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  auto s2 = h.sched();  // one step ahead: decode rows while the prefill is in flight
  ASSERT_TRUE(s2);
  h.s.preempt_request(2);  // in both outstanding batches
  h.Inv("preempt_request in flight");
  auto o1 = h.upd(*s1, {10, 20});
  EXPECT_EQ(o1.tokens(2), V{20});
  auto o2 = h.upd(*s2, {11, 21});
  EXPECT_EQ(o2.tokens(2), V{21}) << "computed on KV freed only for later batches: kept";
  EXPECT_EQ(h.s.request(2).tokens, Cat(Seq(200, 5), V{20, 21}));
  auto s3 = h.sched();
  ASSERT_TRUE(s3);
  EXPECT_TRUE(s3->is_prefill);
  EXPECT_EQ(s3->req_ids, V64{2});
  const V all = Cat(Seq(200, 5), V{20, 21});
  EXPECT_EQ(s3->ctx[0], 7);
  EXPECT_EQ(s3->row_tokens(0), V(all.begin() + s3->ncached[0], all.end()));
}

TEST(SchedulerTest, PreemptRequestRefusesWhatIsNotRunningAndChangesNothing) {
  H h(Cfg(8));
  h.add(1, Seq(100, 5), P(1));
  h.add(2, Seq(200, 5));
  const State before = Capture(h.s);
  EXPECT_THROW(h.s.preempt_request(1), InvalidArgument) << "waiting";
  EXPECT_THROW(h.s.preempt_request(7), UnknownRequest);
  EXPECT_THROW(h.s.preempt_request(-1), UnknownRequest);
  ExpectSame(before, Capture(h.s), "preempt_request of waiting or unknown ids");
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  h.upd(*s1, {10, 20});  // 1 finishes (max_tokens 1)
  EXPECT_THROW(h.s.preempt_request(1), UnknownRequest) << "finished";
  try {
    h.s.preempt_request(3);
  } catch (const UnknownRequest& e) {
    EXPECT_NE(std::string(e.what()).find("unknown request id 3"), std::string::npos);
  }
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
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
  ASSERT_NE(h.last_out, nullptr);
  const StepOutput& so = *h.last_out;
  ASSERT_EQ(so.finished_entries.size(), 1u);
  const int32_t e = so.finished_entries[0];
  EXPECT_EQ(so.req_ids[static_cast<size_t>(e)], 1);
  EXPECT_EQ(V(so.finished_tokens.begin(), so.finished_tokens.end()),
            Cat(Seq(100, 9), V{10, 11})) << "the whole sequence of the finished request";
  EXPECT_EQ(st.num_steps, 3);
  EXPECT_EQ(st.num_finished, 1);
  h.s.abort_request(3);
  EXPECT_EQ(st.num_aborted, 1);
  EXPECT_EQ(st.num_preemptions, 0);
  EXPECT_EQ(st.num_spec_steps, 0);
  EXPECT_FALSE(h.sched());
  EXPECT_EQ(st.num_steps, 3) << "a schedule() with nothing to run is not a step";
}

}  // namespace
}  // namespace atom_sched
