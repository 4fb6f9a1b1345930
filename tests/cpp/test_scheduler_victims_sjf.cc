// Preemption victims (policy.h's VictimChoice: the request served last, or the one with the least
// computed) and shortest-job-first with aging (ServiceOrder under SchedulingPolicy::kSjf).
//
// Every schedule() and update() goes through the harness H, which runs check_invariants() (queues
// in service order included) after each call and checks every batch against the request table.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/policy.h"
#include "atom_sched/scheduler.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

constexpr auto kServiceOrder = PreemptionVictim::kServiceOrder;
constexpr auto kLeastComputed = PreemptionVictim::kLeastComputed;

// bs 4, no prefix caching (a victim's blocks are then all freed).
SchedulerConfig VictimCfg(int32_t usable_blocks, PreemptionVictim victim,
                          SchedulingPolicy scheduling = SchedulingPolicy::kFcfs) {
  SchedulerConfig c = Cfg(usable_blocks);
  c.enable_prefix_caching = false;
  c.preemption_victim = victim;
  c.scheduling = scheduling;
  return c;
}

const char* Name(PreemptionVictim v) {
  return v == kLeastComputed ? "least computed" : "service order";
}

SamplingParams Job(int32_t max_tokens, int32_t length_hint = 0) {
  SamplingParams p = P(max_tokens);
  p.length_hint = length_hint;
  return p;
}

// ---------------------------------------------------------------------------------------------
// The rule types
// ---------------------------------------------------------------------------------------------

TEST(PolicyTest, VictimChoiceIsLowerPriorityThenFewerComputedTokens) {
  auto req = [](int32_t priority, int32_t computed) {
    Request r;
    r.priority = priority;
    r.num_computed_tokens = computed;
    return r;
  };
  EXPECT_TRUE((VictimChoice{kServiceOrder, SchedulingPolicy::kFcfs}.takes_tail()));
  EXPECT_TRUE((VictimChoice{kServiceOrder, SchedulingPolicy::kPriority}.takes_tail()));
  const VictimChoice fcfs{kLeastComputed, SchedulingPolicy::kFcfs};
  EXPECT_FALSE(fcfs.takes_tail());
  EXPECT_TRUE(fcfs.before(req(0, 4), req(0, 8)));
  EXPECT_FALSE(fcfs.before(req(0, 8), req(0, 4)));
  EXPECT_FALSE(fcfs.before(req(0, 4), req(0, 4))) << "a tie is no better: the later one stays";
  const VictimChoice prio{kLeastComputed, SchedulingPolicy::kPriority};
  EXPECT_TRUE(prio.before(req(1, 800), req(0, 4))) << "the lower priority first";
  EXPECT_FALSE(prio.before(req(0, 4), req(1, 800)));
  EXPECT_TRUE(prio.before(req(1, 4), req(1, 8))) << "then the fewer computed";
  const VictimChoice sjf{kLeastComputed, SchedulingPolicy::kSjf};
  EXPECT_TRUE(sjf.before(req(0, 4), req(0, 8)));
  // Fair share: the tenant with the larger counter first; equal counters, then the rule.
  const double counters[] = {10.0, 5.0, 5.0};
  auto of = [&](int32_t tenant, int32_t computed) {
    Request r = req(0, computed);
    r.tenant = tenant;
    return r;
  };
  const VictimChoice fair{kLeastComputed, SchedulingPolicy::kFairShare, counters};
  EXPECT_FALSE(fair.takes_tail());
  EXPECT_FALSE((VictimChoice{kServiceOrder, SchedulingPolicy::kFairShare}.takes_tail()));
  EXPECT_TRUE(fair.before(of(0, 800), of(1, 4))) << "the larger share first";
  EXPECT_FALSE(fair.before(of(1, 4), of(0, 800)));
  EXPECT_TRUE(fair.before(of(1, 4), of(2, 8))) << "equal counters: the fewer computed";
  const VictimChoice fair_last{kServiceOrder, SchedulingPolicy::kFairShare, counters};
  EXPECT_FALSE(fair_last.before(of(1, 4), of(2, 8))) << "equal counters: the one served last";
}

TEST(PolicyTest, SjfOrderIsKeyThenAddOrder) {
  auto req = [](double key, uint64_t seq) {
    Request r;
    r.sjf_key = key;
    r.arrival_seq = seq;
    r.priority = static_cast<int32_t>(seq);  // ignored under SJF
    return r;
  };
  const ServiceOrder order{SchedulingPolicy::kSjf};
  EXPECT_TRUE(order.sorted());
  EXPECT_TRUE(order(req(1.0, 9), req(2.0, 0)));
  EXPECT_TRUE(order(req(1.0, 3), req(1.0, 4)));
  EXPECT_FALSE(order(req(1.0, 4), req(1.0, 4)));
}

// ---------------------------------------------------------------------------------------------
// Least-computed victims
// ---------------------------------------------------------------------------------------------

// 6 usable blocks. Running 1 (8 tokens, 2 blocks), 2 (4, 1 block), 3 (8, 2 blocks) after the
// prefill: one block free, and every decode row needs a new block.
//   service order: row 1 takes the free block; row 2 preempts the tail, 3 (8 computed).
//   least computed: row 1 takes it; row 2 has the fewest computed of 2 and 3: it preempts itself,
//   and its block lets row 3 grow (the loop goes on past a row that preempted itself).
TEST(SchedulerTest, LeastComputedVictimMayBeTheRowThatNeedsTheBlock) {
  for (const PreemptionVictim victim : {kServiceOrder, kLeastComputed}) {
    SCOPED_TRACE(Name(victim));
    const bool lcf = victim == kLeastComputed;
    H h(VictimCfg(6, victim));
    h.add(1, Seq(100, 8));
    h.add(2, Seq(200, 4));
    h.add(3, Seq(300, 8));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, (V64{1, 2, 3}));
    h.upd(*s1, {110, 210, 310});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_FALSE(s2->is_prefill);
    EXPECT_EQ(s2->req_ids, lcf ? (V64{1, 3}) : (V64{1, 2}));
    EXPECT_EQ(h.s.waiting_ids(), lcf ? V64{2} : V64{3});
    EXPECT_EQ(h.s.stats().num_preemptions, 1);
    h.upd(*s2, {111, lcf ? 311 : 211});
  }
}

// 8 usable blocks. Running 1 (8), 2 (8), 3 (4), 4 (8): 7 blocks, one free.
//   service order: row 1 takes the free block; row 2 preempts the tail, 4 (2 blocks); row 3
//   takes the second. Waiting: 4.
//   least computed: row 1 takes it; row 2 preempts 3 (4 computed: not the tail, a hole in the
//   running set); row 4 has no candidate but itself. Waiting: 3, 4, in service order (a victim
//   goes back to the head of waiting behind the victims served before it).
TEST(SchedulerTest, LeastComputedVictimNeedNotBeTheTail) {
  for (const PreemptionVictim victim : {kServiceOrder, kLeastComputed}) {
    SCOPED_TRACE(Name(victim));
    const bool lcf = victim == kLeastComputed;
    H h(VictimCfg(8, victim));
    h.add(1, Seq(100, 8));
    h.add(2, Seq(200, 8));
    h.add(3, Seq(300, 4));
    h.add(4, Seq(400, 8));
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    h.upd(*s1, {110, 210, 310, 410});
    h.add(5, Seq(500, 12));  // an arrival (3 blocks: it waits); victims go back before it
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_FALSE(s2->is_prefill);
    EXPECT_EQ(s2->req_ids, lcf ? (V64{1, 2}) : (V64{1, 2, 3}));
    EXPECT_EQ(h.s.waiting_ids(), lcf ? (V64{3, 4, 5}) : (V64{4, 5}));
    EXPECT_EQ(h.s.stats().num_preemptions, lcf ? 2 : 1);
    h.upd(*s2, lcf ? V{111, 211} : V{111, 211, 311});
  }
}

// Priority, 7 usable blocks. Running A (p 0, 8 tokens), B (p 0, 4), C (p 1, 4), D (p 1, 8): one
// block free.
//   service order: row A takes it; row B preempts the tail, D; row C takes D's second block.
//   least computed: row A takes it; row B preempts the fewest computed of the lowest priority,
//   C (not B itself, though B has as few: it has the higher priority); row D preempts itself.
TEST(SchedulerTest, LeastComputedVictimUnderPriorityIsTheLowestPriorityFirst) {
  for (const PreemptionVictim victim : {kServiceOrder, kLeastComputed}) {
    SCOPED_TRACE(Name(victim));
    const bool lcf = victim == kLeastComputed;
    H h(VictimCfg(7, victim, SchedulingPolicy::kPriority));
    SamplingParams p0 = P(), p1 = P();
    p1.priority = 1;
    h.s.add_request(1, Seq(100, 8), p0, 0.0);
    h.s.add_request(2, Seq(200, 4), p0, 1.0);
    h.s.add_request(3, Seq(300, 4), p1, 2.0);
    h.s.add_request(4, Seq(400, 8), p1, 3.0);
    h.Inv("add_request");
    auto s1 = h.sched();
    ASSERT_TRUE(s1);
    EXPECT_EQ(s1->req_ids, (V64{1, 2, 3, 4}));
    h.upd(*s1, {110, 210, 310, 410});
    auto s2 = h.sched();
    ASSERT_TRUE(s2);
    EXPECT_EQ(s2->req_ids, lcf ? (V64{1, 2}) : (V64{1, 2, 3}));
    EXPECT_EQ(h.s.waiting_ids(), lcf ? (V64{3, 4}) : V64{4});
    h.upd(*s2, lcf ? V{111, 211} : V{111, 211, 311});
  }
}

// ---------------------------------------------------------------------------------------------
// Shortest job first, with aging
// ---------------------------------------------------------------------------------------------

// Non-chunked, budget 8: two prompts of 4 a step. All arrive at 0; job tokens: 1 max_tokens 50,
// 2 max_tokens 5, 3 length hint 2 (max_tokens 60), 4 max_tokens 10.
TEST(SchedulerTest, SjfAdmitsTheShortestJobsFirst) {
  SchedulerConfig c = Cfg(32);
  c.scheduling = SchedulingPolicy::kSjf;
  c.enable_chunked_prefill = false;
  c.max_num_batched_tokens = 8;
  H h(c);
  h.add(1, Seq(100, 4), Job(50));
  h.add(2, Seq(200, 4), Job(5));
  h.add(3, Seq(300, 4), Job(60, /*length_hint=*/2));
  h.add(4, Seq(400, 4), Job(10));
  EXPECT_EQ(h.s.waiting_ids(), (V64{3, 2, 4, 1}));
  auto s1 = h.sched();
  ASSERT_TRUE(s1);
  EXPECT_EQ(s1->req_ids, (V64{3, 2}));
  EXPECT_EQ(h.s.running_ids(), (V64{3, 2})) << "running is kept in service order too";
  h.upd(*s1, {310, 210});
}

// Aging at 1 token a second: a job of J tokens arriving at T is served as if it arrived at T + J.
//   1: 10 tokens at 0 (key 10); 2: 1 token at 9.5 (key 10.5): the long job aged past it;
//   3: 1 token at 8 (key 9): arrived within 1's 10 seconds, and is shorter: it overtakes 1.
TEST(SchedulerTest, SjfAgingLetsALongJobPassLaterShortOnes) {
  SchedulerConfig c = Cfg(32);
  c.scheduling = SchedulingPolicy::kSjf;
  c.sjf_aging_rate = 1.0;
  H h(c);
  h.s.add_request(1, Seq(100, 4), Job(10), 0.0);
  h.s.add_request(2, Seq(200, 4), Job(1), 9.5);
  h.s.add_request(3, Seq(300, 4), Job(1), 8.0);
  h.Inv("add_request");
  EXPECT_EQ(h.s.waiting_ids(), (V64{3, 1, 2}));
}

TEST(SchedulerTest, SjfAgingRateAndLengthHintAreValidated) {
  for (double rate : {0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    SchedulerConfig c = Cfg(8);
    c.scheduling = SchedulingPolicy::kSjf;
    c.sjf_aging_rate = rate;
    EXPECT_THROW(c.validate(), InvalidArgument) << rate;
    EXPECT_THROW(Scheduler{c}, InvalidArgument) << rate;
  }
  SamplingParams p = P();
  p.length_hint = -1;
  EXPECT_THROW(p.validate(), InvalidArgument);
  SchedulerConfig c = Cfg(8);
  c.scheduling = SchedulingPolicy::kSjf;
  H h(c);
  EXPECT_THROW(h.s.add_request(1, Seq(100, 4), p), InvalidArgument);
  SamplingParams prio = P();
  prio.priority = 1;
  EXPECT_THROW(h.s.add_request(1, Seq(100, 4), prio), InvalidArgument)
      << "priorities need scheduling=priority";
  h.Inv("refused add_request");
  EXPECT_FALSE(h.s.contains(1));
}

// The starvation bound, on random streams: a request of J job tokens arriving at T is admitted
// (first scheduled) no later than any request that arrived after T + J / sjf_aging_rate, whatever
// arrives, under both batch policies and both victim rules (preemptions included).
TEST(SchedulerTest, SjfWaitIsBoundedByTheAgingRate) {
  for (uint32_t seed = 0; seed < 40 && !testing::Test::HasFailure(); ++seed) {
    SCOPED_TRACE(testing::Message() << "seed " << seed);
    std::mt19937 rng(seed);
    auto pick = [&](int32_t lo, int32_t hi) {
      return lo + static_cast<int32_t>(rng() % static_cast<uint32_t>(hi - lo + 1));
    };
    SchedulerConfig c = Cfg(pick(8, 24));
    c.scheduling = SchedulingPolicy::kSjf;
    c.sjf_aging_rate = pick(1, 8);
    c.max_num_seqs = pick(1, 4);
    c.max_num_batched_tokens = pick(4, 24);
    c.max_model_len = 48;
    c.enable_chunked_prefill = rng() % 3 != 0;
    c.policy = rng() % 2 == 0 ? BatchPolicy::kMixed : BatchPolicy::kAtom;
    c.preemption_victim = rng() % 2 == 0 ? kLeastComputed : kServiceOrder;
    H h(c);
    struct Info {
      double arrival, deadline;  // deadline: T + J / rate
      int64_t admitted_at = -1;  // the step of its first row
    };
    std::map<int64_t, Info> info;
    int64_t next_id = 0;
    double now = 0.0;
    // Arrivals for 150 steps, faster than they are served for a while; then every request runs
    // to its end.
    for (int64_t step = 0; step < 150 || h.s.num_running() + h.s.num_waiting() > 0;
         ++step, now += 0.25) {
      ASSERT_LT(step, 20'000) << "the requests never finished";
      if (step < 150) {
        for (int32_t n = pick(0, 1); n > 0; --n) {
          SamplingParams p = Job(pick(1, 16), rng() % 2 == 0 ? pick(1, 16) : 0);
          p.ignore_eos = true;
          const int32_t job = p.length_hint > 0 ? p.length_hint : p.max_tokens;
          h.s.add_request(next_id, Seq(100, pick(1, 12)), p, now);
          info[next_id++] = {now, now + job / c.sjf_aging_rate};
        }
        h.Inv("add_request");
      }
      auto b = h.sched(now);
      // (A prompt over the budget with chunked prefill off is refused: it is never admitted.)
      for (const auto& rejected : h.s.take_rejected()) info.erase(rejected.req_id);
      if (!b) continue;
      for (int64_t id : b->req_ids)
        if (info[id].admitted_at < 0) info[id].admitted_at = step;
      V sampled(static_cast<size_t>(b->num_rows), 7);
      h.upd(*b, sampled);
    }
    for (const auto& [x, xi] : info) {
      ASSERT_GE(xi.admitted_at, 0) << "request " << x << " never admitted";
      for (const auto& [y, yi] : info) {
        if (yi.admitted_at < xi.admitted_at) {
          EXPECT_LE(yi.arrival, xi.deadline)
              << "request " << y << " (arrived " << yi.arrival << ") was admitted before " << x
              << " (arrived " << xi.arrival << ", deadline " << xi.deadline << ")";
        }
      }
    }
  }
}

}  // namespace
}  // namespace atom_sched
