// Scheduler contract at the seams (issue 12, "Scheduler contract"): what a None from schedule()
// means, a request that outgrows the whole KV pool, speculative positions at max_model_len, rows
// whose last token is already in flight, ids whose KV waits for a transfer, draft ids.
// Every call goes through the harness H (check_invariants() after each one).
#include <gtest/gtest.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "atom_sched/errors.h"
#include "atom_sched/kv_connector.h"
#include "atom_sched/scheduler.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

// The outputs a fake model gives a batch: token 1000 + position of the row's last input for
// every column, `acc(row)` accepted tokens (1 for prefill rows), drafts 7, 8, ...
struct FakeOut {
  V sampled, acc, drafts;
};
template <typename Acc>
FakeOut Fake(const Snap& b, int32_t k, Acc acc) {
  FakeOut f;
  for (int32_t i = 0; i < b.num_rows; ++i) {
    const int32_t pos = b.ncached[i] + b.nsched[i] - 1;
    for (int32_t j = 0; j <= k; ++j) f.sampled.push_back(1000 + (pos + j) % 500);
    f.acc.push_back(b.prefill_rows[i] ? 1 : acc(i));
    for (int32_t j = 0; j < k; ++j) f.drafts.push_back(7 + j);
  }
  if (k == 0) f.acc.clear();
  return f;
}

// Drives `h` to the end, synchronously or one step ahead, accepting `acc(row)` tokens per decode
// row (clamped to the row's tokens). Returns every batch scheduled and every output.
struct Trace {
  std::vector<Snap> batches;
  std::map<int64_t, V> streamed;
  std::map<int64_t, std::string> why;
};
template <typename Acc>
Trace Drive(H& h, bool async, Acc acc, int32_t max_steps = 1000) {
  const int32_t k = h.s.config().num_speculative_tokens;
  Trace run;
  std::deque<Snap> outstanding;
  auto finish_oldest = [&] {
    const Snap b = outstanding.front();
    outstanding.pop_front();
    FakeOut f = Fake(b, k, [&](int32_t i) { return std::clamp(acc(i), 1, b.nsched[i]); });
    Outs o = h.upd(b, f.sampled, f.acc, f.drafts);
    for (int64_t id : o.order) {
      const ROut& r = o.by_id[id];
      V& s = run.streamed[id];
      s.insert(s.end(), r.tokens.begin(), r.tokens.end());
      if (!r.why.empty()) {
        EXPECT_EQ(run.why.count(id), 0u) << "request " << id << " finished twice";
        run.why[id] = r.why;
      }
    }
  };
  for (int32_t step = 0; step < max_steps; ++step) {
    if (!h.s.has_unfinished_requests() && outstanding.empty()) break;
    std::optional<Snap> b;
    if (static_cast<int32_t>(outstanding.size()) < (async ? 2 : 1)) b = h.sched();
    if (b) {
      run.batches.push_back(*b);
      outstanding.push_back(*b);
      if (async && outstanding.size() < 2) continue;
    }
    if (outstanding.empty()) break;  // None with nothing in flight: the README loop stops here
    finish_oldest();
  }
  return run;
}

int32_t TotalTokens(const Trace& r) {
  int32_t n = 0;
  for (const Snap& b : r.batches) n += b.num_tokens;
  return n;
}

// ---------------------------------------------------------------------------------------------
// Item 1: None means nothing changed; an unschedulable request ends in the same call
// ---------------------------------------------------------------------------------------------

// The README loop (`if batch is None: break`) with one 1-block pool (bs 4) and [1,2,3],
// max_tokens 10: prefill -> 4 tokens; decode pos 3 -> 5 tokens = every position the pool has
// plus the sampled one. It ends there with "kv_capacity" keeping its tokens; before, the next
// schedule() preempted it and returned None, and only the call after rejected it.
TEST(SchedulerContractTest, ReadmeLoopEndsWithEveryRequestFinished) {
  for (bool async : {false, true}) {
    SCOPED_TRACE(async ? "one step ahead" : "synchronous");
    SchedulerConfig c = Cfg(1);
    c.max_model_len = 64;
    H h(c);
    h.add(0, {1, 2, 3}, P(10));
    Trace run = Drive(h, async, [](int32_t) { return 1; });
    EXPECT_FALSE(h.s.has_unfinished_requests()) << "the loop stopped with the request unfinished";
    EXPECT_EQ(run.why[0], "kv_capacity");
    EXPECT_EQ(run.streamed[0].size(), 2u);
    EXPECT_EQ(h.s.stats().num_preemptions, 0);
    EXPECT_TRUE(h.s.take_rejected().empty());
  }
}

// Random streams on small pools, K 0..3, both protocols, random prefill vetoes: every None is a
// fixed point (the state is what it was, but for requests rejected in that call, and calling
// again gives None again), and a None with no batch outstanding, prefill allowed and no connector
// means every request has ended.
TEST(SchedulerContractTest, NoneChangesNothing) {
  std::mt19937 rng(12);
  for (int32_t trial = 0; trial < 300; ++trial) {
    SCOPED_TRACE(testing::Message() << "trial " << trial);
    const int32_t k = static_cast<int32_t>(rng() % 4);
    const bool async = rng() % 2;
    SchedulerConfig c =
        Cfg(1 + static_cast<int32_t>(rng() % 6), 2 + static_cast<int32_t>(rng() % 3));
    c.num_speculative_tokens = k;
    c.max_model_len = 8 + static_cast<int32_t>(rng() % 24);
    c.max_num_batched_tokens = 8 + static_cast<int32_t>(rng() % 16);
    c.max_num_seqs = 1 + static_cast<int32_t>(rng() % 4);
    c.enable_chunked_prefill = rng() % 4 != 0;
    H h(c);
    int64_t next_id = 0;
    std::deque<Snap> outstanding;
    for (int32_t step = 0; step < 200; ++step) {
      if (rng() % 3 == 0 && next_id < 12) {
        SamplingParams p = P(1 + static_cast<int32_t>(rng() % 12));
        p.ignore_eos = true;
        h.add(next_id++, Seq(1, 1 + static_cast<int32_t>(rng() % 14)), p);
      }
      const bool allow_prefill = rng() % 5 != 0;
      if (static_cast<int32_t>(outstanding.size()) < (async ? 2 : 1)) {
        const State before = Capture(h.s);
        auto b = h.sched(0.0, allow_prefill);
        if (b) {
          outstanding.push_back(*b);
        } else {
          std::set<int64_t> rejected;
          for (const RejectedRequest& r : h.s.take_rejected()) rejected.insert(r.req_id);
          State expect = before;
          std::erase_if(expect.waiting, [&](int64_t id) { return rejected.count(id) > 0; });
          for (int64_t id : rejected) {
            expect.tokens.erase(id);
            expect.computed.erase(id);
          }
          expect.free_blocks = h.s.block_pool().num_free_blocks();  // rejected held none
          ExpectSame(expect, Capture(h.s), "a None from schedule()");
          const State after = Capture(h.s);
          EXPECT_FALSE(h.sched(0.0, allow_prefill)) << "a None is not a fixed point";
          ExpectSame(after, Capture(h.s), "a second None");
          if (outstanding.empty() && allow_prefill) {
            ASSERT_FALSE(h.s.has_unfinished_requests())
                << "schedule() gave None with " << h.s.num_waiting() << " waiting and "
                << h.s.num_running() << " running requests and nothing in flight";
          }
        }
      }
      if (!outstanding.empty() && (outstanding.size() == 2 || !async || rng() % 2)) {
        const Snap b = outstanding.front();
        outstanding.pop_front();
        FakeOut f = Fake(b, k, [&](int32_t i) {
          return 1 + static_cast<int32_t>(rng() % static_cast<uint32_t>(b.nsched[i]));
        });
        h.upd(b, f.sampled, f.acc, f.drafts);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Item 2: a lone request that fills the whole pool finishes keeping its tokens
// ---------------------------------------------------------------------------------------------

// bs 4, 2 blocks (8 positions), max_model_len 16, a 6-token prompt, max_tokens 10, ignore_eos.
//   prefill pos 0..5 -> 7 tokens; decode pos 6 -> 8; decode pos 7 -> 9 tokens: positions 0..7
//   fill the pool, the next decode would need position 8: finished "kv_capacity", 3 tokens kept.
// Before: it preempted itself and was rejected with "needs 3 KV blocks for 9 input tokens".
TEST(SchedulerContractTest, LoneRequestOutgrowingThePoolFinishesWithKvCapacity) {
  for (int32_t k : {0, 1, 3}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(testing::Message() << "K " << k << (async ? " one step ahead" : " sync"));
      SchedulerConfig c = Cfg(2);
      c.max_model_len = 16;
      c.num_speculative_tokens = k;
      H h(c);
      SamplingParams p = P(10);
      p.ignore_eos = true;
      h.add(0, Seq(1, 6), p);
      Trace run = Drive(h, async, [](int32_t) { return 1; });
      EXPECT_FALSE(h.s.has_unfinished_requests());
      EXPECT_EQ(run.why[0], "kv_capacity");
      EXPECT_EQ(run.streamed[0].size(), 3u) << "every position of the pool is used";
      EXPECT_EQ(h.s.stats().num_preemptions, 0) << "a lone request never preempts itself";
      EXPECT_TRUE(h.s.take_rejected().empty());
      EXPECT_EQ(h.s.stats().num_finished, 1);
      for (const Snap& b : run.batches)
        for (int64_t pos : b.positions) EXPECT_LT(pos, 8) << "a position past the pool";
    }
  }
}

// A prompt that fills the pool exactly (8 tokens, 2 blocks of 4) yields one token and ends.
TEST(SchedulerContractTest, PromptFillingThePoolYieldsOneToken) {
  H h(Cfg(2));
  h.add(0, Seq(1, 8), P(5));
  Trace run = Drive(h, false, [](int32_t) { return 1; });
  EXPECT_EQ(run.why[0], "kv_capacity");
  EXPECT_EQ(run.streamed[0].size(), 1u);
}

// ---------------------------------------------------------------------------------------------
// Item 3: no position reaches max_model_len, whatever K
// ---------------------------------------------------------------------------------------------

// max_model_len 16, prompts of 12..16 tokens, K 1..8, both protocols, all drafts accepted or
// one: every scheduled position is < 16, decode rows never exceed K+1 tokens, and the requests
// end by max_model_len with exactly 16 tokens (a 16-token prompt: 17, its one token).
TEST(SchedulerContractTest, SpeculativePositionsStayBelowMaxModelLen) {
  for (int32_t k = 1; k <= 8; ++k) {
    for (bool async : {false, true}) {
      for (bool all : {true, false}) {
        for (int32_t prompt = 12; prompt <= 16; ++prompt) {
          SCOPED_TRACE(testing::Message() << "K " << k << (async ? " one step ahead" : " sync")
                                          << (all ? " all accepted" : " one accepted")
                                          << " prompt " << prompt);
          SchedulerConfig c = Cfg(64);
          c.max_model_len = 16;
          c.num_speculative_tokens = k;
          c.max_num_batched_tokens = 64;
          H h(c);
          h.add(0, Seq(1, prompt), P(100));
          Trace run = Drive(h, async, [&](int32_t) { return all ? k + 1 : 1; });
          for (const Snap& b : run.batches) {
            for (int64_t pos : b.positions) EXPECT_LT(pos, 16) << "batch " << b.id;
            EXPECT_LE(b.max_seqlen_k, 16);
            for (int32_t n : b.nsched) EXPECT_LE(n, b.is_prefill ? 16 : k + 1);
          }
          EXPECT_EQ(run.why[0], "max_model_len");
          EXPECT_EQ(prompt + static_cast<int32_t>(run.streamed[0].size()),
                    prompt == 16 ? 17 : 16);
        }
      }
    }
  }
}

// The case: max_model_len 16, K 3, a 14-token prompt: the first decode row is
// positions [14, 15] (2 tokens: the last token and one draft), not [14..17].
TEST(SchedulerContractTest, DraftsAreCappedAtMaxModelLen) {
  SchedulerConfig c = Cfg(64);
  c.max_model_len = 16;
  c.num_speculative_tokens = 3;
  H h(c);
  h.add(0, Seq(1, 14), P(100));
  auto b0 = h.sched();
  ASSERT_TRUE(b0);
  FakeOut f0 = Fake(*b0, 3, [](int32_t) { return 1; });
  h.upd(*b0, f0.sampled, f0.acc, {40, 41, 42});
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(b1->positions, (V64{14, 15}));
  EXPECT_EQ(b1->tokens, (V{1013, 40}));
  EXPECT_EQ(b1->row_drafts(0), (V{40, -1, -1}));
  // Two accepted (the draft and the bonus token): the first reaches 16 tokens and ends it.
  auto o1 = h.upd(*b1, {60, 61, 62, 63}, {2}, {1, 2, 3});
  EXPECT_EQ(o1.tokens(0), (V{60}));
  EXPECT_EQ(o1.why(0), "max_model_len");
  // A row of 2 tokens accepts at most 2.
  H h2(c);
  h2.add(0, Seq(1, 14), P(100));
  auto c0 = h2.sched();
  h2.upd(*c0, f0.sampled, f0.acc, {40, 41, 42});
  auto c1 = h2.sched();
  ASSERT_TRUE(c1);
  ModelOutputs bad;
  const V sampled{60, 61, 62, 63}, acc{3}, drafts{1, 2, 3};
  bad.sampled_token_ids = sampled;
  bad.num_accepted = acc;
  bad.draft_token_ids = drafts;
  const State st = Capture(h2.s);
  EXPECT_THROW(h2.s.update(c1->id, bad), InvalidArgument);
  ExpectSame(st, Capture(h2.s), "3 accepted for a 2-token row");
}

// ---------------------------------------------------------------------------------------------
// Item 4: one step ahead, no row for a request whose last token is already in flight
// ---------------------------------------------------------------------------------------------

// Two requests of 3 tokens, max_tokens m, K 0, one step ahead and synchronous: every scheduled
// token is needed: 2 x (3 + m - 1) in all (the prompts, then m - 1 decode rows each).
TEST(SchedulerContractTest, NoRowForATokenAlreadyInFlight) {
  for (int32_t m : {1, 2, 3, 5}) {
    for (bool async : {false, true}) {
      SCOPED_TRACE(testing::Message() << "max_tokens " << m << (async ? " async" : " sync"));
      H h(Cfg(16));
      h.add(0, {1, 2, 3}, P(m));
      h.add(1, {4, 5, 6}, P(m));
      Trace run = Drive(h, async, [](int32_t) { return 1; });
      EXPECT_EQ(TotalTokens(run), 2 * (3 + m - 1));
      EXPECT_EQ(run.why[0], "max_tokens");
      EXPECT_EQ(run.why[1], "max_tokens");
      EXPECT_EQ(run.streamed[0].size(), static_cast<size_t>(m));
    }
  }
}

// The same through max_model_len (10) and K 2 one step ahead: no row after the one that must
// end the request.
TEST(SchedulerContractTest, NoRowPastMaxModelLenInFlight) {
  for (int32_t k : {0, 2}) {
    SCOPED_TRACE(testing::Message() << "K " << k);
    SchedulerConfig c = Cfg(16);
    c.max_model_len = 10;
    c.num_speculative_tokens = k;
    H h(c);
    h.add(0, Seq(1, 6), P(100));
    Trace run = Drive(h, true, [](int32_t) { return 1; });
    EXPECT_EQ(run.why[0], "max_model_len");
    // K 0: the prompt, then one row per token but the first: 6 + 3.
    if (k == 0) {
      EXPECT_EQ(TotalTokens(run), 6 + 3);
    }
    for (const Snap& b : run.batches)
      for (int64_t pos : b.positions) EXPECT_LT(pos, 10);
  }
}

// The case: bs 4, 3 blocks. Request 0 [1,2,3] max_tokens 2, request 1 6 tokens.
//   b0 prefill both; b1 decodes both (request 0's last token); update(b0);
//   b2 = request 1 only (request 0's last token is in flight): no preemption.
TEST(SchedulerContractTest, InFlightLastTokenPreemptsNobody) {
  H h(Cfg(3));
  h.add(0, {1, 2, 3}, P(2));
  h.add(1, Seq(10, 6), P(10));
  auto b0 = h.sched();
  ASSERT_TRUE(b0);
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(b1->req_ids, (V64{0, 1}));
  h.upd(*b0, {100, 200});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, V64{1});
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
  auto o1 = h.upd(*b1, {101, 201});
  EXPECT_EQ(o1.why(0), "max_tokens");
  EXPECT_EQ(o1.tokens(0), V{101});
  h.upd(*b2, {202});
  EXPECT_EQ(h.s.stats().num_preemptions, 0);
}

// ---------------------------------------------------------------------------------------------
// Item 5: ids whose KV waits for a transfer
// ---------------------------------------------------------------------------------------------

class SendingConnector : public KvConnector {
 public:
  bool is_producer() const override { return true; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest&) override { return match; }
  void update_state_after_alloc(const ConnectorRequest&) override {}
  bool request_finished(const ConnectorRequest&) override { return keep; }
  RemoteMatch match;
  bool keep = true;
};

// request_finished() returns true: the id stays in use (contains, request() with status
// kFinished and its blocks) until finished_sending names it; add_request refuses it until then
// and accepts it after.
TEST(SchedulerContractTest, DeferredFreeIdsAreInUseUntilSent) {
  H h(Cfg(8));
  h.s.set_kv_connector(std::make_shared<SendingConnector>());
  h.add(5, {1, 2, 3}, P(1));
  auto b = h.sched();
  ASSERT_TRUE(b);
  auto o = h.upd(*b, {9});
  EXPECT_EQ(o.why(5), "max_tokens");
  EXPECT_TRUE(h.s.contains(5));
  ASSERT_NO_THROW((void)h.s.request(5));
  EXPECT_EQ(h.s.request(5).status, RequestStatus::kFinished);
  EXPECT_EQ(h.s.request(5).block_table.size(), 1u);
  EXPECT_FALSE(h.s.has_unfinished_requests());
  try {
    h.s.add_request(5, V{1}, P());
    ADD_FAILURE() << "add_request accepted an id whose KV waits to be sent";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("finished_sending"), std::string::npos) << e.what();
  }
  EXPECT_THROW(h.s.abort_request(5), UnknownRequest);
  h.Inv("refused calls");
  const V64 sent{5};
  h.s.update_from_kv_xfer_finished(sent, {});
  h.Inv("finished_sending");
  EXPECT_FALSE(h.s.contains(5));
  EXPECT_THROW((void)h.s.request(5), UnknownRequest);
  h.add(5, {1, 2, 3}, P(1));
  EXPECT_TRUE(h.s.contains(5));
}

// ---------------------------------------------------------------------------------------------
// Item 6: draft ids are validated like prompt tokens
// ---------------------------------------------------------------------------------------------

TEST(SchedulerContractTest, NegativeDraftIdsAreRefusedAndChangeNothing) {
  H h(SpecCfg(8, 2));
  h.add(0, {1, 2, 3}, P());
  auto b = h.sched();
  ASSERT_TRUE(b);
  // (-1 pads a row with fewer drafts: [-1, -1] is valid, a draft after a -1 is not.)
  for (const V& drafts : {V{-7, 5}, V{5, -2147483647 - 1}, V{-1, 4}}) {
    ModelOutputs o;
    const V sampled{5, 0, 0};
    o.sampled_token_ids = sampled;
    o.draft_token_ids = drafts;
    const State st = Capture(h.s);
    EXPECT_THROW(h.s.update(b->id, o), InvalidArgument) << drafts[0] << ", " << drafts[1];
    ExpectSame(st, Capture(h.s), "negative drafts");
    h.Inv("refused update");
  }
  h.upd(*b, {5, 0, 0}, {}, {8, 9});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->tokens, (V{5, 8, 9}));
}

// A connector whose RemoteMatch carries a negative draft or first token is a failed connector
// call: the request is rejected ("kv connector error: ..."), nothing negative reaches a batch.
TEST(SchedulerContractTest, NegativeRemoteMatchIdsAreAConnectorError) {
  for (int32_t bad : {0, 1}) {
    SCOPED_TRACE(bad == 0 ? "draft_tokens [-5]" : "first_token -3");
    H h(SpecCfg(8, 2));
    auto conn = std::make_shared<SendingConnector>();
    conn->keep = false;
    conn->match.load_async = true;
    conn->match.first_token = bad == 0 ? 9 : -3;
    conn->match.draft_tokens = bad == 0 ? V{-5} : V{4};
    h.s.set_kv_connector(conn);
    h.add(0, {1, 2, 3}, P());
    EXPECT_FALSE(h.sched());
    const auto rejected = h.s.take_rejected();
    ASSERT_EQ(rejected.size(), 1u);
    EXPECT_EQ(rejected[0].reason.rfind("kv connector error: ", 0), 0u) << rejected[0].reason;
    EXPECT_EQ(h.s.take_connector_errors().size(), 1u);
    EXPECT_FALSE(h.s.contains(0));
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), 8);
  }
}

// A remote prefill of a max_model_len-token prompt (or one filling the pool) whose first token
// already ends the request: its one row (it streams T0) stays below the position limit.
TEST(SchedulerContractTest, RemoteFirstTokenAtTheLimitStreamsWithoutPassingIt) {
  for (bool pool : {false, true}) {
    SCOPED_TRACE(pool ? "prompt fills the pool" : "prompt of max_model_len tokens");
    SchedulerConfig c = Cfg(pool ? 2 : 8);
    c.max_model_len = pool ? 64 : 8;
    H h(c);
    auto conn = std::make_shared<SendingConnector>();
    conn->keep = false;
    conn->match.load_async = true;
    conn->match.first_token = 9;
    h.s.set_kv_connector(conn);
    h.add(0, Seq(1, 8), P());
    EXPECT_FALSE(h.sched());
    const V64 recv{0};
    h.s.update_from_kv_xfer_finished({}, recv);
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->positions, V64{7});
    EXPECT_EQ(b->tokens, V{8});
    auto o = h.upd(*b, {50});
    EXPECT_EQ(o.tokens(0), V{9});
    EXPECT_EQ(o.why(0), pool ? "kv_capacity" : "max_model_len");
    EXPECT_FALSE(h.s.has_unfinished_requests());
  }
}

// ---------------------------------------------------------------------------------------------
// Item 13: a connector interrupt (the binding's KeyboardInterrupt, SystemExit) judges nothing
// ---------------------------------------------------------------------------------------------

// Throws ConnectorInterrupt once from the named call for the named request.
class InterruptingConnector : public KvConnector {
 public:
  bool is_producer() const override { return false; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    interrupt_if(r, interrupt_match);
    return {};
  }
  void update_state_after_alloc(const ConnectorRequest& r) override {
    interrupt_if(r, interrupt_alloc);
  }
  bool request_finished(const ConnectorRequest& r) override {
    interrupt_if(r, interrupt_finish);
    return true;  // keep the blocks for a send, unless interrupted
  }
  int64_t interrupt_match = -1, interrupt_alloc = -1, interrupt_finish = -1;
  int32_t num_matches = 0;

 private:
  void interrupt_if(const ConnectorRequest& r, int64_t& id) {
    if (&id == &interrupt_match) ++num_matches;
    if (r.id != id) return;
    id = -1;
    throw ConnectorInterrupt();
  }
};

// Interrupted while admitting: the batch holds the requests admitted before; the interrupted one
// waits at the head with no blocks, is neither rejected nor a connector error, and is asked again
// and served at its next admission.
TEST(SchedulerContractTest, ConnectorInterruptWhileAdmittingLeavesTheRequestWaiting) {
  for (bool at_alloc : {false, true}) {
    SCOPED_TRACE(at_alloc ? "update_state_after_alloc" : "get_num_new_matched_tokens");
    H h(Cfg(8));
    auto conn = std::make_shared<InterruptingConnector>();
    h.s.set_kv_connector(conn);
    h.add(0, Seq(1, 8), P(1));
    h.add(1, Seq(20, 8), P(1));
    h.add(2, Seq(40, 4), P(1));
    (at_alloc ? conn->interrupt_alloc : conn->interrupt_match) = 1;
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, V64{0}) << "nothing is admitted after the interrupt";
    EXPECT_EQ(conn->num_matches, 2);
    EXPECT_EQ(h.s.waiting_ids(), (V64{1, 2}));
    EXPECT_TRUE(h.s.request(1).block_table.empty());
    EXPECT_EQ(h.s.block_pool().num_free_blocks(), 6);  // request 0's 2 blocks only
    EXPECT_TRUE(h.s.take_rejected().empty());
    EXPECT_TRUE(h.s.take_connector_errors().empty());
    EXPECT_EQ(h.s.stats().num_connector_errors, 0);
    EXPECT_EQ(h.s.stats().num_rejected, 0);
    h.upd(*b, {7});
    auto b2 = h.sched();
    ASSERT_TRUE(b2);
    EXPECT_EQ(b2->req_ids, (V64{1, 2}));
    EXPECT_EQ(conn->num_matches, 4);
  }
}

// Interrupted in request_finished: the request finishes as if the connector kept nothing (its
// blocks are free at once); the next request's request_finished keeps its blocks as asked.
TEST(SchedulerContractTest, ConnectorInterruptWhileFinishingFreesTheBlocks) {
  H h(Cfg(8));
  auto conn = std::make_shared<InterruptingConnector>();
  h.s.set_kv_connector(conn);
  h.add(0, Seq(1, 8), P(1));
  h.add(1, Seq(20, 4), P(1));
  auto b = h.sched();
  ASSERT_TRUE(b);
  conn->interrupt_finish = 0;
  auto o = h.upd(*b, {7, 8});
  EXPECT_EQ(o.why(0), "max_tokens");
  EXPECT_EQ(o.why(1), "max_tokens");
  EXPECT_FALSE(h.s.contains(0));
  EXPECT_TRUE(h.s.contains(1));  // kept for its send
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 7);
  EXPECT_TRUE(h.s.take_connector_errors().empty());
}

}  // namespace
}  // namespace atom_sched
