// scheduling=kFairShare: weighted fair share of tokens between tenants (tenant_shares.h). The
// accounting on its own, then through the scheduler: admission serves the tenant with the least
// counter, a tenant's weight scales its share, an idle tenant comes back at the least counter,
// and preemption takes from the tenant with the most. Every schedule() and update() goes through
// the harness H (check_invariants(), the tenants' counts included, after each call).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "atom_sched/tenant_shares.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

constexpr double kNone = std::numeric_limits<double>::infinity();

SamplingParams Of(const std::string& tenant, int32_t max_tokens = 64) {
  SamplingParams p = P(max_tokens);
  p.tenant = tenant;
  return p;
}

SchedulerConfig FairCfg(int32_t usable_blocks) {
  SchedulerConfig c = Cfg(usable_blocks);
  c.scheduling = SchedulingPolicy::kFairShare;
  c.enable_prefix_caching = false;  // every prompt token is computed, so charged
  return c;
}

TEST(TenantSharesTest, JoinLiftsLeaveForgetsAndIdsAreReused) {
  TenantShares t({{"a", 2.0}});
  const int32_t a = t.join("a", kNone);
  EXPECT_EQ(t.weight(a), 2.0);
  EXPECT_EQ(t.charged(a), 0.0) << "the first tenant starts at 0";
  EXPECT_EQ(t.join("a", 123.0), a) << "a known tenant keeps its id and charge";
  EXPECT_EQ(t.live(a), 2);
  t.charge(a, 40);
  const int32_t b = t.join("b", 20.0);  // the least counter of the others: 40 / 2
  EXPECT_NE(b, a);
  EXPECT_EQ(t.weight(b), 1.0) << "unlisted tenants weigh 1";
  EXPECT_EQ(t.charged(b), 20.0) << "lifted: its counter starts at the others' least";
  EXPECT_EQ(t.num_active(), 2);
  t.leave(b);
  EXPECT_FALSE(t.active(b));
  EXPECT_FALSE(t.has("b"));
  EXPECT_EQ(t.num_active(), 1);
  EXPECT_EQ(t.join("c", 5.0), b) << "a forgotten tenant's id is reused";
  EXPECT_EQ(t.charged(b), 5.0);
  t.leave(a);
  EXPECT_TRUE(t.active(a)) << "one of its two requests is still live";
  t.leave(a);
  EXPECT_FALSE(t.active(a));
}

// Non-chunked, budget 8 (two prompts of 4 a step). Tenant a sends 1..4, then b sends 5. FCFS
// admits 1, 2, then 3, 4, then 5; fair share admits 1 (both at 0: the first waiting), then 5
// (b at 0 < a at 4), then 2, 3.
TEST(SchedulerTest, FairShareAdmitsTheLeastServedTenantFirst) {
  for (const SchedulingPolicy policy : {SchedulingPolicy::kFcfs, SchedulingPolicy::kFairShare}) {
    const bool fair = policy == SchedulingPolicy::kFairShare;
    SCOPED_TRACE(fair ? "fair" : "fcfs");
    SchedulerConfig c = FairCfg(32);
    c.scheduling = policy;
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 8;
    H h(c);
    for (int64_t id = 1; id <= 4; ++id) h.add(id, Seq(100 * static_cast<int32_t>(id), 4), Of("a"));
    h.add(5, Seq(500, 4), Of("b"));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, fair ? (V64{1, 5}) : (V64{1, 2}));
    EXPECT_EQ(h.s.count_admittable_head_prefills(4), 2) << "the probe follows the same picks";
    h.upd(*s1, {110, 510});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->req_ids, fair ? (V64{2, 3}) : (V64{3, 4}));
  }
}

// One admission a step (16-token prompts, budget 16, max_tokens 1: each ends with its prefill),
// tenants a (weight 3) and b (weight 1) both backlogged: of 40 admissions a gets 30, b 10.
TEST(SchedulerTest, FairShareServesTokensInProportionToTheWeights) {
  SchedulerConfig c = FairCfg(64);
  c.tenant_weights = {{"a", 3.0}};
  c.max_num_batched_tokens = 16;
  H h(c);
  for (int64_t id = 0; id < 80; ++id)
    h.add(id, Seq(1000 + 100 * static_cast<int32_t>(id), 16), Of(std::string(id < 40 ? "a" : "b"), 1));
  int32_t a = 0, b = 0;
  for (int step = 0; step < 40; ++step) {
    auto s = h.sched();
    ASSERT_TRUE(s);
    ASSERT_EQ(s->num_rows, 1);
    (s->req_ids[0] < 40 ? a : b) += 1;
    h.upd(*s, {7});
  }
  EXPECT_EQ(a, 30);
  EXPECT_EQ(b, 10);
}

// Tenant a alone is served 10 prompts of 16 tokens; then b arrives. b starts at a's counter
// (lifted), not at 0: it does not take the next 10 admissions for itself but alternates with a.
TEST(SchedulerTest, FairShareGivesAnIdleTenantNoBankedCredit) {
  SchedulerConfig c = FairCfg(64);
  c.max_num_batched_tokens = 16;
  H h(c);
  for (int64_t id = 0; id < 30; ++id)
    h.add(id, Seq(1000 + 100 * static_cast<int32_t>(id), 16), Of("a", 1));
  for (int step = 0; step < 10; ++step) {
    auto s = h.sched();
    ASSERT_TRUE(s);
    h.upd(*s, {7});
  }
  for (int64_t id = 100; id < 110; ++id)
    h.add(id, Seq(1000 + 100 * static_cast<int32_t>(id), 16), Of("b", 1));
  V64 order;
  for (int step = 0; step < 8; ++step) {
    auto s = h.sched();
    ASSERT_TRUE(s);
    order.push_back(s->req_ids[0] >= 100 ? 1 : 0);
    h.upd(*s, {7});
  }
  EXPECT_EQ(order, (V64{0, 1, 0, 1, 0, 1, 0, 1}));
}

// 7 usable blocks of 4. a1, a2 (8 tokens, 2 blocks each) and b1 (4 tokens) are added, then
// b2 (4 tokens) after the first step; one block is left free and every decode row needs one.
//   FCFS: running a1, a2, b1, b2. Row a1 takes the free block; a2 preempts the tail b2; b1,
//   now the tail, preempts itself.
//   fair share: admitted a1, b1 (b at 0 < a at 8), a2, then b2 (b was live: no lift). Row a1
//   takes the free block; b1 needs one and a's counter (17) exceeds b's (8): a2 is preempted,
//   not the tail b2, and its two blocks let b1 and b2 grow.
TEST(SchedulerTest, FairShareVictimIsFromTheTenantWithTheLargestShare) {
  for (const SchedulingPolicy policy : {SchedulingPolicy::kFcfs, SchedulingPolicy::kFairShare}) {
    const bool fair = policy == SchedulingPolicy::kFairShare;
    SCOPED_TRACE(fair ? "fair" : "fcfs");
    SchedulerConfig c = FairCfg(7);
    c.scheduling = policy;
    H h(c);
    h.add(1, Seq(100, 8), Of("a"));
    h.add(2, Seq(200, 8), Of("a"));
    h.add(3, Seq(300, 4), Of("b"));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, fair ? (V64{1, 3, 2}) : (V64{1, 2, 3}));
    h.upd(*s1, fair ? V{110, 310, 210} : V{110, 210, 310});
    h.add(4, Seq(400, 4), Of("b"));
    auto s2 = h.sched();  // ATOM's policy: a prefill step for 4
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->req_ids, V64{4});
    h.upd(*s2, {410});
    auto s3 = h.sched();
    ASSERT_TRUE(s3);
    EXPECT_FALSE(s3->is_prefill);
    EXPECT_EQ(s3->req_ids, fair ? (V64{1, 3, 4}) : (V64{1, 2}));
    EXPECT_EQ(h.s.waiting_ids(), fair ? V64{2} : (V64{3, 4}));
    h.upd(*s3, fair ? V{111, 311, 411} : V{111, 211});
  }
}

TEST(SchedulerTest, FairShareConfigAndTenantAreValidated) {
  for (const double bad : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SchedulerConfig c = FairCfg(8);
    c.tenant_weights = {{"a", bad}};
    EXPECT_THROW(c.validate(), InvalidArgument) << bad;
  }
  SchedulerConfig c = FairCfg(8);
  const std::string long_name(kMaxExtraKeyBytes + 1, 'x');
  c.tenant_weights = {{long_name, 1.0}};
  EXPECT_THROW(c.validate(), InvalidArgument);
  SamplingParams p = P();
  p.tenant.assign(kMaxExtraKeyBytes + 1, 't');
  EXPECT_THROW(p.validate(), InvalidArgument);
  H h(FairCfg(8));
  EXPECT_THROW(h.s.add_request(1, Seq(100, 4), p), InvalidArgument);
  h.Inv("refused add_request");
  EXPECT_FALSE(h.s.contains(1));
}

}  // namespace
}  // namespace atom_sched
