// Scheduler scenarios: the steady K = 0 rows, which schedule() writes and update() applies as
// columns of the running set (docs/perf.md), against the per-row path that serves every other
// row. Every schedule() and update() goes through the harness H, which runs check_invariants()
// after each call (it compares the columns with the requests).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/request.h"
#include "atom_sched/scheduler.h"
#include "atom_sched/step_output.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

constexpr int32_t kEos = 2;
constexpr int32_t kStopToken = 3;

// The "model": request id's n-th output token. Some requests sample EOS or the stop token early
// (some of them before their min_tokens), so rows of one run stop for every reason.
int32_t ModelToken(int64_t id, int32_t n) {
  if (id % 4 == 1 && n == 3 + id % 7) return kEos;
  if (id % 5 == 2 && n == 2 + id % 6) return kStopToken;
  return 10 + static_cast<int32_t>((id * 31 + n * 7) % 89);
}

SchedulerConfig SteadyCfg(int32_t usable_blocks) {
  SchedulerConfig c = Cfg(usable_blocks, /*block_size=*/4);
  c.max_num_seqs = 48;  // runs longer than 32 rows: a hole does not squeeze the set at once
  c.max_num_batched_tokens = 1024;
  c.eos_token_id = kEos;
  return c;
}

SamplingParams Params(int64_t id) {
  SamplingParams p = P(4 + static_cast<int32_t>(id % 11));
  p.ignore_eos = id % 8 == 5;                                 // EOS does not end it
  if (id % 10 == 7) p.stop_token_ids = {kStopToken};          // a stop list: every row looks
  if (id % 6 == 3) p.min_tokens = std::min(8, p.max_tokens);  // EOS before: a token
  if (id % 9 == 4) p.stop_token_sequences = {{kEos, kEos}};   // a stop list never matched
  // Sampling columns of its own, so a row that takes another request's columns shows.
  p.temperature = 0.25f * static_cast<float>(id % 5);
  p.top_k = 1 + static_cast<int32_t>(id % 7);
  p.top_p = 0.5f + 0.05f * static_cast<float>(id % 9);
  p.seed = 1000 + id;
  return p;
}

// Runs `requests` requests to the end, synchronously (steady rows) or one step ahead (no row is
// steady: each has a batch in flight), with `abort_at(step)` aborting a request between a
// schedule() and its update(). With fewer blocks than they need at once, some are preempted.
template <class AbortAt>
Streams RunToTheEnd(bool one_step_ahead, AbortAt abort_at, int32_t usable_blocks = 400,
                    int64_t requests = 48, int64_t* preemptions = nullptr,
                    bool host_tables = true) {
  SchedulerConfig c = SteadyCfg(usable_blocks);
  c.host_block_tables = host_tables;
  H h(c);
  h.check_device_plan = true;
  for (int64_t id = 0; id < requests; ++id) {
    V prompt = Seq(static_cast<int32_t>(100 + id), 5 + static_cast<int32_t>(id % 9));
    h.add(id, prompt, Params(id));
  }
  Streams res;
  std::deque<Snap> q;
  int step = 0;
  for (int guard = 0; guard < 4000; ++guard) {
    if (static_cast<int32_t>(q.size()) < (one_step_ahead ? 2 : 1)) {
      if (auto b = h.sched()) {
        q.push_back(*b);
        continue;
      }
    }
    if (q.empty()) break;
    for (int64_t id : abort_at(step)) {
      if (!h.s.contains(id) || h.s.request(id).status != RequestStatus::kRunning) continue;
      h.s.abort_request(id);
      h.Inv("abort_request");
      res.why[id] = "aborted";
    }
    res.Apply(h, q.front(), ModelToken);
    q.pop_front();
    // Synchronously, every running request has published the blocks its verified KV fills.
    for (int64_t id : one_step_ahead ? std::vector<int64_t>{} : h.s.running_ids()) {
      const Request& r = h.s.request(id);
      if (r.num_inflight > 0 || r.is_partial_prefill()) continue;
      EXPECT_GE(r.blocks_published, (r.num_tokens() - 1) / 4) << "request " << id;
    }
    ++step;
  }
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), usable_blocks);
  if (preemptions != nullptr) *preemptions = h.s.stats().num_preemptions;
  return res;
}

std::vector<int64_t> NoAborts(int) { return {}; }

TEST(SteadyRowsTest, StopRulesAndPublishingMatchTheRowPath) {
  const Streams sync = RunToTheEnd(false, NoAborts);
  const Streams ahead = RunToTheEnd(true, NoAborts);
  EXPECT_EQ(sync.tokens, ahead.tokens);
  EXPECT_EQ(sync.why, ahead.why);
  // Every reason occurred, so the runs applied each (and EOS before min_tokens was a token).
  std::map<std::string, int> reasons;
  for (const auto& [id, why] : sync.why) ++reasons[why];
  EXPECT_GT(reasons["eos"], 0);
  EXPECT_GT(reasons["stop_3"], 0);
  EXPECT_GT(reasons["max_tokens"], 0);
  // Request 9 samples EOS as its 6th token, before its min_tokens (8): it runs to max_tokens.
  EXPECT_EQ(sync.tokens.at(9).size(), 13u);
  EXPECT_EQ(sync.why.at(9), "max_tokens");
}

TEST(SteadyRowsTest, WithoutHostBlockTablesShiftedRowsStreamTheSame) {
  // Aborts shift the rows after them (each takes another request's row), and too few blocks
  // preempt: with no host tables to rewrite, the owner columns and the device plan still follow
  // (the harness checks both every step), and every request streams the same.
  const auto aborts = [](int step) -> std::vector<int64_t> {
    if (step == 4) return {3};
    if (step == 9) return {11, 12, 25};
    return {};
  };
  for (bool one_step_ahead : {false, true}) {
    int64_t preemptions = 0;
    const Streams with = RunToTheEnd(one_step_ahead, aborts, 120, 48, nullptr, true);
    const Streams without = RunToTheEnd(one_step_ahead, aborts, 120, 48, &preemptions, false);
    EXPECT_GT(preemptions, 0);
    EXPECT_EQ(with.tokens, without.tokens);
    EXPECT_EQ(with.why, without.why);
  }
}

TEST(SteadyRowsTest, AbortsBetweenScheduleAndUpdateLeaveTheRunIntact) {
  // One abort (a hole, the set not squeezed) and then three at once (squeezed: the run's
  // requests moved), each between a steady batch and its update.
  const auto aborts = [](int step) -> std::vector<int64_t> {
    if (step == 3) return {20};
    if (step == 5) return {8, 18, 30};
    return {};
  };
  const std::vector<int64_t> aborted = {8, 18, 20, 30};  // none ends before step 6
  const auto others = [&](Streams s) {
    for (int64_t id : aborted) {
      EXPECT_EQ(s.why.at(id), "aborted") << id;
      s.tokens.erase(id);
      s.why.erase(id);
    }
    return s;
  };
  // The others stream what they would have without the aborts.
  const Streams plain = RunToTheEnd(false, NoAborts);
  for (bool one_step_ahead : {false, true}) {
    const Streams rest = others(RunToTheEnd(one_step_ahead, aborts));
    for (const auto& [id, tokens] : rest.tokens) EXPECT_EQ(tokens, plain.tokens.at(id)) << id;
    for (const auto& [id, why] : rest.why) EXPECT_EQ(why, plain.why.at(id)) << id;
    EXPECT_EQ(rest.why.size() + aborted.size(), plain.why.size());
  }
}

TEST(SteadyRowsTest, PreemptionsAndAdmissionsBetweenRunsStreamTheSame) {
  // 144 requests queued for 48 rows and a pool too small for all 48 at once: rows finish,
  // requests are preempted and admitted while others run steady, so runs split, holes appear and
  // the set is squeezed between a batch and its update (one step ahead).
  int64_t preemptions = 0;
  const Streams sync =
      RunToTheEnd(false, NoAborts, /*usable_blocks=*/120, /*requests=*/144, &preemptions);
  const Streams ahead = RunToTheEnd(true, NoAborts, /*usable_blocks=*/120, /*requests=*/144);
  EXPECT_GT(preemptions, 0) << "the pool should be too small for every running request";
  EXPECT_EQ(sync.why.size(), 144u);
  EXPECT_EQ(sync.tokens, ahead.tokens);
  EXPECT_EQ(sync.why, ahead.why);
  for (const auto& [id, tokens] : sync.tokens) {
    for (size_t n = 0; n < tokens.size(); ++n)
      EXPECT_EQ(tokens[n], ModelToken(id, static_cast<int32_t>(n))) << id;
  }
}

}  // namespace
}  // namespace atom_sched
