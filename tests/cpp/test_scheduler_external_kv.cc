// External KV from a connector (vLLM's KV connectors: offloading, a shared store, a prefill
// engine without ATOM's first token): tokens after the local prefix hit whose KV the connector
// supplies, loaded during the admitting step or waited for; "cannot tell yet"; and PAUSED_NEW
// (admit_waiting = false), which lets requests whose KV arrived run.
#include <gtest/gtest.h>

#include <map>
#include <memory>

#include "scheduler_harness.h"

namespace atom_sched {
namespace {

// Answers per request id (default: nothing external); records what it was shown.
class ExternalConnector : public KvConnector {
 public:
  bool is_producer() const override { return false; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    asked_with_cached[r.id] = r.num_cached_tokens;
    auto it = answers.find(r.id);
    return it == answers.end() ? RemoteMatch{} : it->second;
  }
  void update_state_after_alloc(const ConnectorRequest& r) override {
    blocks_at_alloc[r.id] = V(r.block_ids.begin(), r.block_ids.end());
  }
  bool request_finished(const ConnectorRequest&) override { return false; }

  std::map<int64_t, RemoteMatch> answers;
  std::map<int64_t, int32_t> asked_with_cached;
  std::map<int64_t, V> blocks_at_alloc;
};

RemoteMatch Ext(int32_t n, bool async) {
  RemoteMatch m;
  m.num_tokens = n;
  m.load_async = async;
  return m;
}

struct Fixture {
  explicit Fixture(int32_t blocks = 16) : h(Cfg(blocks)) {
    h.s.set_kv_connector(conn);
  }
  std::shared_ptr<ExternalConnector> conn = std::make_shared<ExternalConnector>();
  H h;
};

// A load during the admitting step: the row computes from the end of the external tokens.
TEST(ExternalKvTest, SyncLoadComputesTheRestInTheAdmittingStep) {
  Fixture f;
  f.conn->answers[0] = Ext(8, false);
  f.h.add(0, Seq(1, 11), P(2));
  auto b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), (V64{8, 9, 10}));
  EXPECT_EQ(b->row_tokens(0), (V{9, 10, 11}));
  EXPECT_EQ(f.conn->asked_with_cached[0], 0);
  EXPECT_EQ(f.conn->blocks_at_alloc[0].size(), 3u);  // every block of the prompt
  auto o = f.h.upd(*b, {50});
  EXPECT_EQ(o.tokens(0), V{50});
}

// Claiming every token (or more) of a synchronous load still leaves the last one to compute: the
// step must sample the next token.
TEST(ExternalKvTest, SyncLoadAlwaysComputesTheLastToken) {
  for (int32_t claim : {12, 13, 1000}) {
    SCOPED_TRACE(claim);
    Fixture f;
    f.conn->answers[0] = Ext(claim, false);
    f.h.add(0, Seq(1, 12), P(2));
    auto b = f.h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->row_positions(0), V64{11});
    f.h.upd(*b, {50});
  }
}

// The connector is shown the local (block-aligned) hit and its tokens count after it.
TEST(ExternalKvTest, ExternalTokensFollowTheLocalHit) {
  Fixture f;
  f.h.add(0, Seq(1, 9), P(1));
  auto b = f.h.sched();
  ASSERT_TRUE(b);
  f.h.upd(*b, {50});  // finished: blocks [1..4] and [5..8] are cached
  f.conn->answers[1] = Ext(4, false);
  f.h.add(1, Seq(1, 14), P(1));
  b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(f.conn->asked_with_cached[1], 8);
  EXPECT_EQ(b->row_positions(0), (V64{12, 13}));
  f.h.upd(*b, {51});
}

// An asynchronous load of part of the prompt: the request holds its blocks and waits; once the
// load is reported it prefills the rest (chunked like any prefill), its loaded blocks published.
TEST(ExternalKvTest, AsyncPartialLoadPrefillsTheRestOnceReported) {
  SchedulerConfig c = Cfg(16);
  c.enable_prefix_caching = true;
  c.enable_chunked_prefill = true;
  c.max_num_batched_tokens = 2;
  H h(c);
  auto conn = std::make_shared<ExternalConnector>();
  h.s.set_kv_connector(conn);
  conn->answers[0] = Ext(8, true);
  h.add(0, Seq(1, 11), P(1));
  EXPECT_FALSE(h.sched());
  EXPECT_EQ(h.s.request(0).status, RequestStatus::kWaitingForRemoteKv);
  EXPECT_EQ(conn->blocks_at_alloc[0].size(), 3u);
  EXPECT_TRUE(h.s.block_pool().num_cached_hashes() == 0);
  EXPECT_FALSE(h.sched());  // nothing reported yet
  const V64 recv{0};
  h.s.update_from_kv_xfer_finished({}, recv);
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), (V64{8, 9}));  // the budget's chunk
  EXPECT_EQ(h.s.block_pool().num_cached_hashes(), 2);
  h.upd(*b, {0});  // a partial prefill row: its sample is ignored
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), V64{10});
  auto o = h.upd(*b, {50});
  EXPECT_EQ(o.tokens(0), V{50});
  EXPECT_EQ(o.why(0), "max_tokens");
}

// An asynchronous load of every token: once reported the request re-forwards its last token.
TEST(ExternalKvTest, AsyncFullLoadReforwardsTheLastToken) {
  Fixture f;
  f.conn->answers[0] = Ext(12, true);
  f.h.add(0, Seq(1, 12), P(2));
  EXPECT_FALSE(f.h.sched());
  const V64 recv{0};
  f.h.s.update_from_kv_xfer_finished({}, recv);
  auto b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), V64{11});
  EXPECT_EQ(b->row_tokens(0), V{12});
  auto o = f.h.upd(*b, {50});
  EXPECT_EQ(o.tokens(0), V{50});
}

// "Cannot tell yet": the request stays waiting and the requests behind it are admitted; asked
// again next step, it is admitted when the connector answers.
TEST(ExternalKvTest, RetryLaterSkipsOnlyThatRequest) {
  for (bool fair : {false, true}) {
    SCOPED_TRACE(fair ? "fair share" : "fcfs");
    SchedulerConfig c = Cfg(16);
    if (fair) c.scheduling = SchedulingPolicy::kFairShare;
    H h(c);
    auto conn = std::make_shared<ExternalConnector>();
    h.s.set_kv_connector(conn);
    RemoteMatch later;
    later.retry_later = true;
    conn->answers[0] = later;
    conn->answers[2] = later;
    h.add(0, Seq(1, 4), P(1));
    h.add(1, Seq(10, 4), P(1));
    h.add(2, Seq(20, 4), P(1));
    h.add(3, Seq(30, 4), P(1));
    auto b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, (V64{1, 3}));
    EXPECT_EQ(h.s.waiting_ids(), (V64{0, 2}));
    h.upd(*b, {5, 6});
    conn->answers.erase(0);
    b = h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, V64{0});
    EXPECT_TRUE(h.s.take_rejected().empty());
    EXPECT_TRUE(h.s.take_connector_errors().empty());
  }
}

// A negative count, or an asynchronous load with nothing to load, is a failed connector call.
TEST(ExternalKvTest, ImpossibleAnswersAreConnectorErrors) {
  for (RemoteMatch bad : {Ext(-1, false), Ext(0, true)}) {
    Fixture f;
    f.conn->answers[0] = bad;
    f.h.add(0, Seq(1, 6), P(1));
    f.h.add(1, Seq(10, 6), P(1));
    auto b = f.h.sched();
    ASSERT_TRUE(b);
    EXPECT_EQ(b->req_ids, V64{1});
    const auto rejected = f.h.s.take_rejected();
    ASSERT_EQ(rejected.size(), 1u);
    EXPECT_EQ(rejected[0].reason.rfind("kv connector error: RemoteMatch", 0), 0u)
        << rejected[0].reason;
    EXPECT_EQ(f.h.s.take_connector_errors().size(), 1u);
  }
}

// admit_waiting = false (vLLM's PAUSED_NEW): nothing new is admitted, but a running request's
// prompt chunks go on and a request whose KV has arrived joins the running set.
TEST(PausedNewTest, OnlyRequestsAlreadyHoldingKvAreServed) {
  SchedulerConfig c = Cfg(16);
  c.enable_chunked_prefill = true;
  c.max_num_batched_tokens = 4;
  c.policy = BatchPolicy::kMixed;
  H h(c);
  auto conn = std::make_shared<ExternalConnector>();
  h.s.set_kv_connector(conn);
  conn->answers[1] = Ext(8, true);
  h.add(1, Seq(20, 11), P(1));
  h.add(0, Seq(1, 10), P(1));
  auto b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->req_ids, V64{0});  // request 0's first chunk; request 1 waits for its KV
  EXPECT_EQ(h.s.request(1).status, RequestStatus::kWaitingForRemoteKv);
  h.upd(*b, {0});
  h.add(2, Seq(40, 3), P(1));
  const V64 recv{1};
  h.s.update_from_kv_xfer_finished({}, recv);
  for (int step = 0; step < 8 && h.s.has_unfinished_requests(); ++step) {
    b = h.sched(0.0, true, /*admit_waiting=*/false);
    if (!b) break;
    EXPECT_EQ(std::count(b->req_ids.begin(), b->req_ids.end(), 2), 0) << "admitted while paused";
    h.upd(*b, V(static_cast<size_t>(b->num_rows), 5));
  }
  EXPECT_EQ(h.s.waiting_ids(), V64{2});
  EXPECT_EQ(h.s.num_running(), 0);
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->req_ids, V64{2});
}

// Fair share charges a tenant what this engine computed for it: not the tokens a connector
// loaded. Tenant a's prompt of 12 tokens has 11 loaded (1 computed here), b's 4 tokens are all
// computed: with one slot left, a is the less served and its next request goes first.
TEST(ExternalKvTest, FairShareDoesNotChargeLoadedTokens) {
  SchedulerConfig c = Cfg(32);
  c.scheduling = SchedulingPolicy::kFairShare;
  c.enable_prefix_caching = false;
  c.max_num_seqs = 3;
  H h(c);
  auto conn = std::make_shared<ExternalConnector>();
  h.s.set_kv_connector(conn);
  auto of = [](const char* tenant) {
    SamplingParams p = P(8);
    p.tenant = tenant;
    return p;
  };
  conn->answers[1] = Ext(11, false);
  h.add(1, Seq(1, 12), of("a"));
  h.add(2, Seq(100, 4), of("b"));
  auto b1 = h.sched();
  ASSERT_TRUE(b1);
  EXPECT_EQ(b1->req_ids, (V64{1, 2}));
  EXPECT_EQ(b1->nsched, (V{1, 4}));
  h.add(3, Seq(200, 4), of("b"));  // b's first, in arrival order
  h.add(4, Seq(300, 4), of("a"));
  h.upd(*b1, {5, 6});
  auto b2 = h.sched();
  ASSERT_TRUE(b2);
  EXPECT_EQ(b2->req_ids, (V64{4}));
}

}  // namespace
}  // namespace atom_sched

namespace atom_sched {
namespace {

// kv_load_failure_policy "recompute": a synchronous load fails past its first block. The row
// that loaded it is dropped when it lands; the request computes its prompt again from the
// failed block, keeping its blocks, and the connector is not asked again.
TEST(RecomputeKvTest, AFailedSyncLoadRewindsToTheFirstInvalidBlock) {
  Fixture f;
  f.conn->answers[0] = Ext(8, false);
  f.h.add(0, Seq(1, 11), P(2));
  auto b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), (V64{8, 9, 10}));
  const V table = f.h.s.request(0).block_table;
  f.h.s.recompute_kv_from(0, 4);  // the second loaded block failed
  f.h.Inv("recompute_kv_from");
  EXPECT_EQ(f.h.s.request(0).num_computed_tokens, 4);
  auto o = f.h.upd(*b, {50});
  EXPECT_FALSE(o.has(0)) << "the row computed on KV that never arrived: its token is dropped";
  b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), (V64{4, 5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(b->slot_reset[0], 0) << "the same blocks: nothing to ship again";
  EXPECT_EQ(f.h.s.request(0).block_table, table);
  o = f.h.upd(*b, {51});
  EXPECT_EQ(o.tokens(0), V{51});
  EXPECT_EQ(f.conn->asked_with_cached.size(), 1u) << "asked once";
  // KV valid up to a position it has not passed: nothing changes.
  f.h.s.recompute_kv_from(0, 11);
  EXPECT_EQ(f.h.s.request(0).num_computed_tokens, 11);
}

// One step ahead a decoding request's rows in flight are all dropped, and it recomputes its known
// tokens (outputs too) as a prompt, then samples its next token.
TEST(RecomputeKvTest, EveryRowInFlightOfARewoundRequestIsDropped) {
  for (int32_t k : {0, 2}) {
    SCOPED_TRACE(k);
    H h(k == 0 ? Cfg(16) : SpecCfg(16, k));
    h.add(0, Seq(1, 6), P(8));
    h.add(1, Seq(20, 3), P(8));
    const V none(2 * k, -1);
    const V one = k == 0 ? V{50, 60} : Cat(V{50, 0, 0}, V{60, 0, 0});
    auto b = h.sched();
    h.upd(*b, one, k ? V{1, 1} : V{}, none);
    auto b1 = h.sched();
    auto b2 = h.sched();
    ASSERT_TRUE(b1 && b2);
    h.s.recompute_kv_from(0, 4);
    h.Inv("recompute_kv_from");
    const V two = k == 0 ? V{51, 61} : Cat(V{51, 0, 0}, V{61, 0, 0});
    auto o = h.upd(*b1, two, k ? V{1, 1} : V{}, none);
    EXPECT_FALSE(o.has(0));
    EXPECT_EQ(o.tokens(1), V{61}) << "the other request's row is applied";
    o = h.upd(*b2, two, k ? V{1, 1} : V{}, none);
    EXPECT_FALSE(o.has(0));
    EXPECT_EQ(h.s.request(0).tokens, Cat(Seq(1, 6), V{50}));
    auto b3 = h.sched();
    ASSERT_TRUE(b3);
    const int32_t row = b3->row_of(0);
    ASSERT_GE(row, 0);
    EXPECT_EQ(b3->row_positions(row), (V64{4, 5, 6}));
    EXPECT_EQ(b3->row_tokens(row), (V{5, 6, 50}));
  }
}

// A load still arriving: the request computes from the failed block once it is reported.
TEST(RecomputeKvTest, AFailedAsyncLoadComputesFromTheFirstInvalidBlock) {
  Fixture f;
  f.conn->answers[0] = Ext(8, true);
  f.h.add(0, Seq(1, 11), P(1));
  EXPECT_FALSE(f.h.sched());
  f.h.s.recompute_kv_from(0, 4);
  f.h.Inv("recompute_kv_from");
  const V64 recv{0};
  f.h.s.update_from_kv_xfer_finished({}, recv);
  auto b = f.h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->row_positions(0), (V64{4, 5, 6, 7, 8, 9, 10}));
  f.h.upd(*b, {50});
}

TEST(RecomputeKvTest, BadCallsAreRefusedAndChangeNothing) {
  SchedulerConfig c = Cfg(16);
  c.enable_prefix_caching = true;
  H h(c);
  h.add(0, Seq(1, 9), P(1));
  auto b = h.sched();
  h.upd(*b, {50});  // blocks [1..4], [5..8] cached
  h.add(1, Seq(1, 14), P(4));
  h.add(2, Seq(40, 4), P(4));
  EXPECT_THROW(h.s.recompute_kv_from(1, 0), InvalidArgument) << "waiting";
  EXPECT_THROW(h.s.recompute_kv_from(9, 0), UnknownRequest);
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(h.s.request(1).blocks_published, 2);
  EXPECT_THROW(h.s.recompute_kv_from(1, 7), InvalidArgument) << "the cache serves it";
  EXPECT_THROW(h.s.recompute_kv_from(1, -1), InvalidArgument);
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 14);
  h.Inv("refused calls");
  h.upd(*b, V(b->num_rows, 51));
}

}  // namespace
}  // namespace atom_sched
