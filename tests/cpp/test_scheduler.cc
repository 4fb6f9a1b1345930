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

namespace atom_sched {
namespace {

using V = std::vector<int32_t>;
using V64 = std::vector<int64_t>;

V Seq(int32_t start, int32_t n) {
  V v(n);
  for (int32_t i = 0; i < n; ++i) v[i] = start + i;
  return v;
}
V Cat(V a, const V& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

SchedulerConfig Cfg(int32_t num_blocks, int32_t block_size = 4) {
  SchedulerConfig c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.max_num_seqs = 16;
  c.max_num_batched_tokens = 256;
  c.max_model_len = 256;
  return c;
}

SamplingParams P(int32_t max_tokens = 64) {
  SamplingParams p;
  p.max_tokens = max_tokens;
  return p;
}

template <typename T>
std::vector<T> Head(const std::vector<T>& v, size_t n, const char* what) {
  if (v.size() < n) {
    ADD_FAILURE() << "batch array " << what << " has " << v.size() << " entries, need " << n;
    std::vector<T> out(v);
    out.resize(n);
    return out;
  }
  return std::vector<T>(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(n));
}

// A copy of a batch, trimmed to its rows and tokens (the scheduler's buffers are reused).
struct Snap {
  uint64_t id = 0;
  bool is_prefill = false;
  int32_t num_rows = 0, num_tokens = 0, num_spec_tokens = 0, max_seqlen_q = 0, max_seqlen_k = 0;
  int32_t width = 0;
  V64 req_ids;
  V nsched, ncached, ctx, last_block, top_ks, state_slots, tables, drafts, cu_q, cu_k, tokens;
  std::vector<uint8_t> emits, exact;
  std::vector<float> temps, top_ps;
  V64 positions, slots;

  explicit Snap(const Batch& b) {
    id = b.id;
    is_prefill = b.is_prefill;
    num_rows = b.num_rows;
    num_tokens = b.num_tokens;
    num_spec_tokens = b.num_spec_tokens;
    max_seqlen_q = b.max_seqlen_q;
    max_seqlen_k = b.max_seqlen_k;
    width = b.block_table_width;
    const size_t n = static_cast<size_t>(num_rows), t = static_cast<size_t>(num_tokens);
    req_ids = Head(b.req_ids, n, "req_ids");
    nsched = Head(b.num_scheduled_tokens, n, "num_scheduled_tokens");
    ncached = Head(b.num_cached_tokens, n, "num_cached_tokens");
    ctx = Head(b.context_lens, n, "context_lens");
    last_block = Head(b.last_block_num_tokens, n, "last_block_num_tokens");
    top_ks = Head(b.top_ks, n, "top_ks");
    state_slots = Head(b.state_slots, n, "state_slots");
    tables = Head(b.block_tables, n * static_cast<size_t>(width), "block_tables");
    drafts = Head(b.spec_draft_tokens, n * static_cast<size_t>(num_spec_tokens), "spec_draft");
    cu_q = Head(b.cu_seqlens_q, n + 1, "cu_seqlens_q");
    cu_k = Head(b.cu_seqlens_k, n + 1, "cu_seqlens_k");
    tokens = Head(b.scheduled_tokens, t, "scheduled_tokens");
    emits = Head(b.emits_token, n, "emits_token");
    exact = Head(b.row_exact, n, "row_exact");
    temps = Head(b.temperatures, n, "temperatures");
    top_ps = Head(b.top_ps, n, "top_ps");
    positions = Head(b.positions, t, "positions");
    slots = Head(b.slot_mapping, t, "slot_mapping");
  }
  int32_t row_of(int64_t req) const {
    for (int32_t i = 0; i < num_rows; ++i)
      if (req_ids[i] == req) return i;
    return -1;
  }
  // Row r's first n block-table entries, or the whole row.
  V table(int32_t r, int32_t n = -1) const {
    if (n < 0) n = width;
    return V(tables.begin() + static_cast<std::ptrdiff_t>(r) * width,
             tables.begin() + static_cast<std::ptrdiff_t>(r) * width + n);
  }
  V row_tokens(int32_t r) const {
    return V(tokens.begin() + cu_q[r], tokens.begin() + cu_q[r + 1]);
  }
  V64 row_positions(int32_t r) const {
    return V64(positions.begin() + cu_q[r], positions.begin() + cu_q[r + 1]);
  }
  V64 row_slots(int32_t r) const { return V64(slots.begin() + cu_q[r], slots.begin() + cu_q[r + 1]); }
  V row_drafts(int32_t r) const {
    return V(drafts.begin() + static_cast<std::ptrdiff_t>(r) * num_spec_tokens,
             drafts.begin() + static_cast<std::ptrdiff_t>(r + 1) * num_spec_tokens);
  }
};

struct ROut {
  V tokens;
  FinishReason reason = FinishReason::kNone;
  std::string why;  // finish_reason_string, "" while running
  int32_t hit_tokens = 0;
};

struct Outs {
  V64 order;
  std::map<int64_t, ROut> by_id;
  size_t size() const { return order.size(); }
  bool has(int64_t id) const { return by_id.count(id) > 0; }
  V tokens(int64_t id) const {
    auto it = by_id.find(id);
    return it == by_id.end() ? V{-999} : it->second.tokens;
  }
  std::string why(int64_t id) const {
    auto it = by_id.find(id);
    return it == by_id.end() ? std::string("<absent>") : it->second.why;
  }
};

// The harness: schedule()/update() + check_invariants() + per-batch checks.
class H {
 public:
  explicit H(SchedulerConfig c) : s(std::move(c)) { Inv("constructor"); }

  void add(int64_t id, const V& prompt, const SamplingParams& p = P()) {
    s.add_request(id, prompt, p);
    Inv("add_request");
  }

  std::optional<Snap> sched(double now = 0.0, bool allow_prefill = true) {
    std::optional<NextBatchInfo> info;
    if (check_next_info) info = s.next_batch_info(now, allow_prefill);
    const Batch* b = s.schedule(now, allow_prefill);
    Inv("schedule");
    if (b == nullptr) {
      if (info) {
        EXPECT_EQ(info->num_rows, 0) << "next_batch_info predicted rows, schedule() gave none";
        EXPECT_EQ(info->num_tokens, 0);
      }
      return std::nullopt;
    }
    Snap snap(*b);
    if (info) {
      EXPECT_EQ(info->is_prefill, snap.is_prefill) << "next_batch_info vs schedule()";
      EXPECT_EQ(info->num_tokens, snap.num_tokens) << "next_batch_info vs schedule()";
      EXPECT_EQ(info->num_rows, snap.num_rows) << "next_batch_info vs schedule()";
    }
    CheckBatch(snap);
    return snap;
  }

  // sampled: one per row (K = 0) or rows * (K + 1); acc: [rows] or empty; drafts: rows * K.
  Outs upd(const Snap& b, const V& sampled, const V& acc = {}, const V& drafts = {}) {
    ModelOutputs o;
    o.sampled_token_ids = sampled;
    o.num_accepted = acc;
    o.draft_token_ids = drafts;
    const StepOutput& out = s.update(b.id, o);
    Inv("update");
    return Convert(out);
  }

  Outs Convert(const StepOutput& out) {
    Outs r;
    EXPECT_EQ(out.token_offsets.size(), static_cast<size_t>(out.size()) + 1);
    if (out.token_offsets.size() < static_cast<size_t>(out.size()) + 1) return r;
    EXPECT_EQ(out.token_offsets[0], 0);
    for (int32_t i = 0; i < out.size(); ++i) {
      ROut o;
      const int32_t lo = out.token_offsets[i], hi = out.token_offsets[i + 1];
      EXPECT_LE(lo, hi);
      EXPECT_LE(static_cast<size_t>(hi), out.new_tokens.size());
      o.tokens.assign(out.new_tokens.begin() + lo, out.new_tokens.begin() + hi);
      o.reason = out.finish_reasons.at(i);
      o.why = o.reason == FinishReason::kNone ? ""
                                              : finish_reason_string(o.reason, out.stop_tokens.at(i));
      o.hit_tokens = out.prefix_hit_tokens.at(i);
      const int64_t id = out.req_ids[i];
      EXPECT_TRUE(r.by_id.emplace(id, o).second) << "request " << id << " twice in one output";
      r.order.push_back(id);
      EXPECT_TRUE(!o.tokens.empty() || o.reason != FinishReason::kNone)
          << "request " << id << " in the output with no token and no finish";
      if (o.reason == FinishReason::kNone) {
        EXPECT_TRUE(s.contains(id)) << "running request " << id << " not live";
        if (s.contains(id)) {
          const V& t = s.request(id).tokens;
          ASSERT_GE(t.size(), o.tokens.size());
          EXPECT_TRUE(std::equal(o.tokens.begin(), o.tokens.end(), t.end() - o.tokens.size()))
              << "streamed tokens of " << id << " are not the tail of its tokens";
        }
      } else {
        EXPECT_FALSE(s.contains(id)) << "finished request " << id << " still live";
      }
    }
    return r;
  }

  void Inv(const char* where) {
    try {
      s.check_invariants();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "check_invariants() after " << where << ": " << e.what();
    }
    // In the synchronous protocol a running, fully prefilled request with nothing in flight has
    // computed every token but the last (S == R - 1).
    for (int64_t id : s.running_ids()) {
      const Request& r = s.request(id);
      EXPECT_EQ(r.status, RequestStatus::kRunning) << id;
      if (r.num_inflight == 0 && !r.is_partial_prefill()) {
        EXPECT_EQ(r.num_computed_tokens, r.num_tokens() - 1)
            << "request " << id << " after " << where;
      }
    }
    for (int64_t id : s.waiting_ids()) {
      EXPECT_EQ(s.request(id).status, RequestStatus::kWaiting) << id;
      EXPECT_TRUE(s.request(id).block_table.empty()) << "waiting request " << id << " holds KV";
    }
    EXPECT_LE(s.num_running(), s.config().max_num_seqs);
  }

  void CheckBatch(const Snap& b) {
    const SchedulerConfig& c = s.config();
    const int32_t bs = c.block_size;
    const int32_t k = c.num_speculative_tokens;
    EXPECT_GT(b.num_rows, 0);
    EXPECT_LE(b.num_rows, c.max_num_seqs);
    EXPECT_LE(b.num_tokens, c.max_num_batched_tokens);
    EXPECT_EQ(b.width, c.max_blocks_per_request());
    EXPECT_EQ(b.num_spec_tokens, b.is_prefill ? 0 : k);
    EXPECT_EQ(std::set<int64_t>(b.req_ids.begin(), b.req_ids.end()).size(), b.req_ids.size())
        << "a request twice in one batch";
    if (b.cu_q.empty() || b.cu_k.empty()) return;
    EXPECT_EQ(b.cu_q[0], 0);
    EXPECT_EQ(b.cu_k[0], 0);
    int32_t max_q = 0, max_k = 0;
    for (int32_t i = 0; i < b.num_rows; ++i) {
      SCOPED_TRACE(testing::Message() << "batch " << b.id << " row " << i << " req " << b.req_ids[i]);
      EXPECT_EQ(b.cu_q[i + 1] - b.cu_q[i], b.nsched[i]);
      EXPECT_EQ(b.cu_k[i + 1] - b.cu_k[i], b.ctx[i]);
      EXPECT_EQ(b.ctx[i], b.ncached[i] + b.nsched[i]);
      EXPECT_GT(b.nsched[i], 0);
      if (!b.is_prefill) EXPECT_EQ(b.nsched[i], k + 1);
      max_q = std::max(max_q, b.nsched[i]);
      max_k = std::max(max_k, b.ctx[i]);
      if (!s.contains(b.req_ids[i])) {
        ADD_FAILURE() << "scheduled request not live";
        continue;
      }
      const Request& r = s.request(b.req_ids[i]);
      EXPECT_EQ(r.status, RequestStatus::kRunning);
      EXPECT_EQ(r.num_computed_tokens, b.ctx[i]) << "S after scheduling = context length";
      EXPECT_FLOAT_EQ(b.temps[i], r.temperature);
      EXPECT_EQ(b.top_ks[i], r.top_k);
      EXPECT_FLOAT_EQ(b.top_ps[i], r.top_p);
      EXPECT_EQ(b.state_slots[i], r.state_slot);
      // Block-table row: the request's blocks (at least those covering the context), then 0.
      const int32_t need = (b.ctx[i] + bs - 1) / bs;
      const int32_t have = static_cast<int32_t>(r.block_table.size());
      EXPECT_GE(have, need) << "blocks do not cover the context";
      const V row = b.table(i);
      for (int32_t j = 0; j < b.width; ++j) {
        if (j < std::min(need, have)) {
          EXPECT_EQ(row[j], r.block_table[j]) << "block_tables col " << j;
        } else if (j >= have) {
          EXPECT_EQ(row[j], 0) << "block_tables padding col " << j;
        }
      }
      // Per token: consecutive positions from num_cached_tokens; slot = block * bs + offset.
      for (int32_t j = 0; j < b.nsched[i]; ++j) {
        const int32_t t = b.cu_q[i] + j;
        const int64_t pos = b.ncached[i] + j;
        EXPECT_EQ(b.positions[t], pos) << "token " << j;
        const int64_t blk = pos / bs;
        if (blk < have) {
          EXPECT_EQ(b.slots[t], static_cast<int64_t>(r.block_table[blk]) * bs + pos % bs)
              << "slot_mapping token " << j;
        }
        if (pos < r.num_tokens()) {
          EXPECT_EQ(b.tokens[t], r.tokens[pos]) << "known input token at pos " << pos;
        } else if (r.num_inflight > 1) {
          EXPECT_EQ(b.tokens[t], -1) << "in-flight input token at pos " << pos;
        }
      }
      const bool in_flight_before = r.num_inflight > 1;
      if (b.is_prefill) {
        EXPECT_EQ(b.emits[i] != 0, b.ctx[i] == r.prefill_target) << "emits_token";
        EXPECT_EQ(b.exact[i], 1) << "prefill rows are exact";
        EXPECT_LE(b.ctx[i], r.prefill_target);
      } else {
        EXPECT_EQ(b.emits[i], 1);
        if (!in_flight_before) {
          // Synchronous row: input = [last token, drafts...], all exact.
          EXPECT_EQ(b.exact[i], 1) << "synchronous decode row must be exact";
          EXPECT_EQ(b.ncached[i], r.num_tokens() - 1);
          if (k > 0 && static_cast<int32_t>(r.drafts.size()) == k) {
            EXPECT_EQ(b.row_drafts(i), r.drafts) << "spec_draft_tokens row";
            for (int32_t j = 0; j < k; ++j) EXPECT_EQ(b.tokens[b.cu_q[i] + 1 + j], r.drafts[j]);
          }
        }
      }
      if (!b.is_prefill || b.emits[i]) {
        EXPECT_EQ(b.last_block[i], (b.ctx[i] - 1) % bs + 1) << "last_block_num_tokens";
      }
    }
    EXPECT_EQ(b.cu_q[b.num_rows], b.num_tokens);
    EXPECT_EQ(b.max_seqlen_q, max_q);
    EXPECT_EQ(b.max_seqlen_k, max_k);
  }

  Scheduler s;
  bool check_next_info = false;
};

// Observable state that a rejected call must leave unchanged.
struct State {
  V64 waiting, running;
  int32_t free_blocks = 0, outstanding = 0;
  int64_t steps = 0;
  std::map<int64_t, V> tokens;
  std::map<int64_t, int32_t> computed;
};
State Capture(const Scheduler& s) {
  State st;
  st.waiting = s.waiting_ids();
  st.running = s.running_ids();
  st.free_blocks = s.block_pool().num_free_blocks();
  st.outstanding = s.num_outstanding_batches();
  st.steps = s.stats().num_steps;
  for (const V64* ids : {&st.waiting, &st.running}) {
    for (int64_t id : *ids) {
      st.tokens[id] = s.request(id).tokens;
      st.computed[id] = s.request(id).num_computed_tokens;
    }
  }
  return st;
}
void ExpectSame(const State& a, const State& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.waiting, b.waiting);
  EXPECT_EQ(a.running, b.running);
  EXPECT_EQ(a.free_blocks, b.free_blocks);
  EXPECT_EQ(a.outstanding, b.outstanding);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.computed, b.computed);
}

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
              "unschedulable: input tokens=17 > max_model_len=16. Increase --max-model-len or "
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
              "--max-num-batched-tokens, enable chunked prefill, or shorten the prompt.");
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
              "unschedulable: needs 5 KV blocks for 17 input tokens > total pool blocks=4. Reduce "
              "prompt length or raise --gpu-memory-utilization.");
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

