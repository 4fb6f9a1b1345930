// Streaming-input sessions (SamplingParams::resumable, vLLM's resumable requests): a stop ends
// the turn, the session keeps its KV and its device slot while it waits for input, and a
// continuation resumes it where its KV ends, its last sampled token dropped.
//
// Every schedule() and update() goes through the harness H (check_invariants() after each call,
// every batch checked against the request table, the device plan replayed).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "scheduler_harness.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

SamplingParams Session(int32_t max_tokens) {
  SamplingParams p = P(max_tokens);
  p.resumable = true;
  return p;
}

// Runs the request's rows synchronously, sampling `next` then next + 1..., until its entry
// reports a stop (a turn's end or a finish); returns that step's outputs.
Outs RunTurn(H& h, int64_t id, int32_t next) {
  for (int32_t step = 0; step < 64; ++step) {
    auto b = h.sched();
    if (!b) break;
    V sampled(b->num_rows, 0);
    const int32_t row = b->row_of(id);
    if (row >= 0) sampled[row] = next++;
    Outs o = h.upd(*b, sampled);
    if (o.has(id) && o.by_id[id].reason != FinishReason::kNone) return o;
  }
  ADD_FAILURE() << "request " << id << " never stopped";
  return {};
}

TEST(SessionTest, ATurnEndsKeepingItsKvAndTheNextResumesWhereItEnds) {
  H h(Cfg(16));  // blocks of 4 tokens
  const V prompt = Seq(100, 6);
  h.add(1, prompt, Session(3));
  const Outs end = RunTurn(h, 1, 500);
  EXPECT_EQ(end.why(1), "max_tokens");
  EXPECT_TRUE(end.by_id.at(1).awaiting_input);
  const Request& r = h.s.request(1);
  EXPECT_EQ(r.status, RequestStatus::kWaitingForInput);
  EXPECT_EQ(r.tokens, Cat(prompt, V{500, 501, 502}));
  EXPECT_EQ(r.num_computed_tokens, 8) << "every token but the last sampled one";
  const V table = r.block_table;
  EXPECT_EQ(table.size(), 2u) << "the KV of its 8 computed tokens";
  // Between turns nothing runs and nothing is unfinished, but its KV and its slot are held.
  EXPECT_EQ(h.s.num_waiting_for_input(), 1);
  EXPECT_EQ(h.s.num_waiting(), 0);
  EXPECT_FALSE(h.s.has_unfinished_requests());
  EXPECT_FALSE(h.sched().has_value());
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16 - 2);

  // The next turn: the last sampled token (502) is dropped, the new tokens follow the KV.
  h.s.continue_session(1, V{7, 8, 9}, Session(2));
  h.Inv("continue_session");
  EXPECT_EQ(h.s.num_waiting(), 1);
  EXPECT_EQ(h.s.num_waiting_for_input(), 0);
  EXPECT_TRUE(h.s.has_unfinished_requests());
  const Request& c = h.s.request(1);
  EXPECT_EQ(c.num_prompt_tokens, 11);
  EXPECT_EQ(c.tokens, Cat(Cat(prompt, V{500, 501}), V{7, 8, 9}));
  auto b = h.sched();
  ASSERT_TRUE(b);
  ASSERT_EQ(b->num_rows, 1);
  EXPECT_EQ(b->ncached[0], 8) << "its KV is reused, not recomputed";
  EXPECT_EQ(b->row_tokens(0), (V{7, 8, 9}));
  EXPECT_EQ(b->row_positions(0), (V64{8, 9, 10}));
  EXPECT_EQ(b->slot_reset[0], 1) << "a resume ships its slot's table afresh";
  ASSERT_EQ(b->new_block_ids.size(), 3u) << "11 tokens: its 2 blocks and a fresh one";
  EXPECT_EQ(V(b->new_block_ids.begin(), b->new_block_ids.begin() + 2), table)
      << "its own blocks first, in order";
  EXPECT_EQ(b->emits[0], 1);
  Outs o = h.upd(*b, V{600});
  EXPECT_EQ(o.tokens(1), V{600});
  o = RunTurn(h, 1, 601);
  EXPECT_EQ(o.why(1), "max_tokens") << "max_tokens counts from the new prompt";
  EXPECT_EQ(h.s.request(1).tokens, Cat(Cat(Cat(prompt, V{500, 501}), V{7, 8, 9}), V{600, 601}));

  // No more input: the session ends, every block back in the pool.
  h.s.end_session(1);
  h.Inv("end_session");
  EXPECT_FALSE(h.s.contains(1));
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16);
  EXPECT_EQ(h.s.stats().num_aborted, 1);
}

TEST(SessionTest, EveryStopRuleEndsATurnAndAnEndedSessionFinishesAtItsNextStop) {
  SchedulerConfig c = Cfg(16);
  c.eos_token_id = 2;
  H h(c);
  SamplingParams p = Session(8);
  p.stop_token_ids = {77};
  h.add(1, Seq(10, 5), p);
  auto b = h.sched();
  h.upd(*b, V{2});  // EOS
  EXPECT_EQ(h.s.request(1).status, RequestStatus::kWaitingForInput);
  h.s.continue_session(1, V{11}, p);
  b = h.sched();
  Outs o = h.upd(*b, V{77});  // a stop token
  EXPECT_EQ(o.why(1), "stop_77");
  EXPECT_TRUE(o.by_id.at(1).awaiting_input);
  // A continuation whose params are not resumable is the last turn; so is end_session().
  h.s.continue_session(1, V{12}, p);
  h.s.end_session(1);
  b = h.sched();
  o = h.upd(*b, V{2});
  EXPECT_EQ(o.why(1), "eos");
  EXPECT_FALSE(o.by_id.at(1).awaiting_input) << "its last turn: it finishes";
  EXPECT_FALSE(h.s.contains(1));
  ASSERT_EQ(h.last_out->finished_entries.size(), 1u);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16);
  // end_session() on a request that is not a session changes nothing.
  h.add(2, Seq(10, 3), P(4));
  h.s.end_session(2);
  EXPECT_EQ(h.s.request(2).status, RequestStatus::kWaiting);
}

TEST(SessionTest, ASessionBetweenTurnsHoldsItsSeat) {
  SchedulerConfig c = Cfg(32);
  c.max_num_seqs = 2;
  H h(c);
  h.add(1, Seq(10, 4), Session(1));
  h.add(2, Seq(20, 4), P(8));
  auto b = h.sched();
  h.upd(*b, V{50, 60});  // 1's turn ends at once (max_tokens 1)
  EXPECT_EQ(h.s.request(1).status, RequestStatus::kWaitingForInput);
  h.add(3, Seq(30, 4), P(8));
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->req_ids, (V64{2})) << "two seats: one running, one held by the session";
  h.upd(*b, V{61});
  h.s.abort_request(1);  // the seat frees with the session
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_GE(b->row_of(3), 0) << "admitted once the session's seat is free";
}

TEST(SessionTest, RowsInFlightAtTheTurnsEndAreDroppedAndTheResumeWaitsForThem) {
  H h(Cfg(16));
  SamplingParams p = Session(8);
  p.stop_token_ids = {51};  // a stop no row in flight can foresee
  h.add(1, Seq(10, 4), p);
  auto b1 = h.sched();
  h.upd(*b1, V{50});
  auto b2 = h.sched();  // decode: samples 51, the last token of the turn
  auto b3 = h.sched();  // one step ahead: a row whose input is 51
  ASSERT_TRUE(b2 && b3);
  Outs o = h.upd(*b2, V{51});
  EXPECT_EQ(o.why(1), "stop_51");
  EXPECT_EQ(h.s.request(1).num_computed_tokens, 5);
  h.s.continue_session(1, V{7, 8}, Session(2));
  EXPECT_FALSE(h.sched().has_value()) << "its row in flight lands first";
  o = h.upd(*b3, V{52});
  EXPECT_FALSE(o.has(1)) << "the stale row's token is dropped";
  EXPECT_EQ(h.s.request(1).tokens, Cat(Seq(10, 4), V{50, 7, 8}));
  auto b4 = h.sched();
  ASSERT_TRUE(b4);
  EXPECT_EQ(b4->ncached[0], 5);
  EXPECT_EQ(b4->row_tokens(0), (V{7, 8}));
}

// Found by the fuzz target: a session preempted while the row that ends its turn is in flight
// has no KV to keep. It waits for input holding nothing (no seat either), and its next turn is
// admitted as a preempted request is, its context computed again (its prefix hits aside).
TEST(SessionTest, ASessionPreemptedWhenItsTurnEndsWaitsWithoutKv) {
  SchedulerConfig c = Cfg(16);
  c.max_num_seqs = 1;
  H h(c);
  SamplingParams p = Session(8);
  p.stop_token_ids = {51};
  h.add(1, Seq(10, 4), p);
  auto b = h.sched();
  h.upd(*b, V{50});
  b = h.sched();  // its decode row, in flight
  h.s.preempt_request(1);
  Outs o = h.upd(*b, V{51});  // that row's token ends the turn
  EXPECT_EQ(o.why(1), "stop_51");
  EXPECT_TRUE(o.by_id.at(1).awaiting_input);
  const Request& r = h.s.request(1);
  EXPECT_EQ(r.status, RequestStatus::kWaitingForInput);
  EXPECT_TRUE(r.block_table.empty());
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16);
  h.add(2, Seq(30, 4), P(1));  // the one seat is free
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->req_ids, V64{2});
  h.upd(*b, V{60});
  h.s.continue_session(1, V{7}, Session(1));
  EXPECT_EQ(h.s.request(1).status, RequestStatus::kWaiting);
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->ncached[0], 4) << "nothing kept but what the prefix cache holds";
  EXPECT_EQ(b->row_tokens(0), (V{50, 7}));
  o = h.upd(*b, V{61});
  EXPECT_EQ(o.tokens(1), V{61});
  EXPECT_TRUE(o.by_id.at(1).awaiting_input) << "max_tokens 1: its next turn ended";
}

TEST(SessionTest, SpeculativeTurnsDropTheTokensAfterTheStopAndKeepAllButTheLast) {
  H h(SpecCfg(16, /*k=*/2));
  SamplingParams p = Session(16);
  p.stop_token_ids = {70};
  h.add(1, Seq(10, 4), p);
  auto b = h.sched();
  h.upd(*b, V{50, 0, 0}, V{1}, V{60, 70});
  b = h.sched();
  ASSERT_EQ(b->row_tokens(0), (V{50, 60, 70}));
  // All accepted: 60, then the stop token 70; the bonus token after it is dropped.
  Outs o = h.upd(*b, V{60, 70, 99}, V{3}, V{0, 0});
  EXPECT_EQ(o.tokens(1), (V{60, 70}));
  EXPECT_TRUE(o.by_id.at(1).awaiting_input);
  const Request& r = h.s.request(1);
  EXPECT_EQ(r.tokens, Cat(Seq(10, 4), V{50, 60, 70}));
  EXPECT_EQ(r.num_computed_tokens, 6);
  h.s.continue_session(1, V{5}, p);
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->ncached[0], 6);
  EXPECT_EQ(b->row_tokens(0), V{5});
}

TEST(SessionTest, TheResumedTurnsBlocksArePublishedUnderTheirNewTokens) {
  SchedulerConfig c = Cfg(32);
  c.enable_prefix_caching = true;
  H h(c);
  h.add(1, Seq(10, 6), Session(3));
  RunTurn(h, 1, 500);  // tokens 10..15, 500, 501, 502; 8 computed
  h.s.continue_session(1, Seq(40, 7), Session(1));
  const V turn2 = h.s.request(1).tokens;  // 15 tokens: 3 whole blocks
  ASSERT_EQ(turn2.size(), 15u);
  auto b = h.sched();
  h.upd(*b, V{600});  // the turn ends: the prompt's blocks are published
  // A new request with the same prompt hits the session's 3 whole blocks.
  h.add(2, turn2, P(1));
  b = h.sched();
  ASSERT_TRUE(b);
  EXPECT_EQ(b->ncached[b->row_of(2)], 12);
  EXPECT_EQ(h.s.request(2).prefix_hit_tokens, 12);
}

TEST(SessionTest, AContinuationPastTheLimitsIsRejectedAndFreesTheSession) {
  SchedulerConfig c = Cfg(16);
  c.max_model_len = 12;
  H h(c);
  h.add(1, Seq(10, 6), Session(2));
  RunTurn(h, 1, 500);
  h.s.continue_session(1, Seq(40, 7), Session(1));  // 7 kept + 7 new > 12
  EXPECT_FALSE(h.sched().has_value());
  const auto rejected = h.s.take_rejected();
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_EQ(rejected[0].req_id, 1);
  EXPECT_NE(rejected[0].reason.find("max_model_len"), std::string::npos) << rejected[0].reason;
  EXPECT_FALSE(h.s.contains(1));
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 16);
}

TEST(SessionTest, BadContinuationsAreRefusedAndChangeNothing) {
  H h(Cfg(16));
  SamplingParams p = Session(2);
  p.lora_name = "a";
  h.add(1, Seq(10, 4), p);
  EXPECT_THROW(h.s.continue_session(1, V{1}, p), InvalidArgument) << "still waiting to run";
  EXPECT_THROW(h.s.continue_session(9, V{1}, p), UnknownRequest);
  RunTurn(h, 1, 500);
  const Request before = h.s.request(1);
  const int32_t free_before = h.s.block_pool().num_free_blocks();
  SamplingParams other = p;
  other.lora_name = "b";
  SamplingParams salted = p;
  salted.cache_salt = "s";
  SamplingParams bad = p;
  bad.max_tokens = 0;
  EXPECT_THROW(h.s.continue_session(1, V{}, p), InvalidArgument) << "no tokens";
  EXPECT_THROW(h.s.continue_session(1, V{1, -3}, p), InvalidArgument) << "a negative id";
  EXPECT_THROW(h.s.continue_session(1, V{1}, other), InvalidArgument) << "another LoRA";
  EXPECT_THROW(h.s.continue_session(1, V{1}, salted), InvalidArgument) << "another salt";
  EXPECT_THROW(h.s.continue_session(1, V{1}, bad), InvalidArgument) << "invalid params";
  EXPECT_THROW(h.s.continue_session(1, V{1}, p, std::nan("")), InvalidArgument);
  EXPECT_THROW(h.s.preempt_request(1), InvalidArgument) << "not running";
  h.Inv("refused calls");
  const Request& after = h.s.request(1);
  EXPECT_EQ(after.status, RequestStatus::kWaitingForInput);
  EXPECT_EQ(after.tokens, before.tokens);
  EXPECT_EQ(after.num_prompt_tokens, before.num_prompt_tokens);
  EXPECT_EQ(after.max_tokens, before.max_tokens);
  EXPECT_EQ(after.block_table, before.block_table);
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), free_before);
  h.s.continue_session(1, V{1}, p);
  EXPECT_THROW(h.s.continue_session(1, V{2}, p), InvalidArgument) << "its input already came";
  // Per-request state slots cannot be rewound by a token: no sessions with them.
  SchedulerConfig with_state = Cfg(16);
  with_state.num_state_slots = 4;
  Scheduler s(with_state);
  EXPECT_THROW(s.add_request(1, Seq(10, 4), Session(2)), InvalidArgument);
}

}  // namespace
}  // namespace atom_sched
