// The scheduler test harness shared by the scheduler suites: configs, the batch snapshot Snap,
// the harness H (schedule()/update() + check_invariants() + per-batch checks after every call)
// and State/Capture/ExpectSame for "a rejected call changes nothing".
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "atom_sched/batch.h"
#include "atom_sched/config.h"
#include "atom_sched/errors.h"
#include "atom_sched/request.h"
#include "atom_sched/scheduler.h"
#include "atom_sched/step_output.h"
#include "test_tokens.h"

namespace atom_sched {
namespace {

using test::Cat;
using test::Seq;
using test::V;
using V64 = std::vector<int64_t>;

/// `usable_blocks`: blocks requests can hold; the pool has one more id, the null block 0, so the
/// ids handed out are 1..usable_blocks (docs/design.md, "block-table contract").
inline SchedulerConfig Cfg(int32_t usable_blocks, int32_t block_size = 4) {
  SchedulerConfig c;
  c.num_blocks = usable_blocks + 1;
  c.block_size = block_size;
  c.max_num_seqs = 16;
  c.max_num_batched_tokens = 256;
  c.max_model_len = 256;
  return c;
}

inline SchedulerConfig SpecCfg(int32_t num_blocks, int32_t k = 2) {
  SchedulerConfig c = Cfg(num_blocks);
  c.num_speculative_tokens = k;
  return c;
}

inline SamplingParams P(int32_t max_tokens = 64) {
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
  std::vector<uint8_t> prefill_rows, emits, exact;
  std::vector<float> temps, top_ps;
  V64 positions, slots, seeds;
  // Device plan (docs/api.md "The device plan").
  V request_slots, new_block_starts, new_block_offsets, new_block_ids;
  std::vector<uint8_t> slot_reset;

  Snap() = default;
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
    // (None with SchedulerConfig::host_block_tables off: CheckBatch() expects none then.)
    if (!b.block_tables.empty())
      tables = Head(b.block_tables, n * static_cast<size_t>(width), "block_tables");
    drafts = Head(b.spec_draft_tokens, n * static_cast<size_t>(num_spec_tokens), "spec_draft");
    cu_q = Head(b.cu_seqlens_q, n + 1, "cu_seqlens_q");
    cu_k = Head(b.cu_seqlens_k, n + 1, "cu_seqlens_k");
    tokens = Head(b.scheduled_tokens, t, "scheduled_tokens");
    prefill_rows = Head(b.row_is_prefill, n, "row_is_prefill");
    emits = Head(b.emits_token, n, "emits_token");
    exact = Head(b.row_exact, n, "row_exact");
    temps = Head(b.temperatures, n, "temperatures");
    top_ps = Head(b.top_ps, n, "top_ps");
    seeds = Head(b.seeds, n, "seeds");
    positions = Head(b.positions, t, "positions");
    slots = Head(b.slot_mapping, t, "slot_mapping");
    request_slots = Head(b.request_slots, n, "request_slots");
    slot_reset = Head(b.slot_reset, n, "slot_reset");
    new_block_starts = Head(b.new_block_starts, n, "new_block_starts");
    new_block_offsets = Head(b.new_block_offsets, n + 1, "new_block_offsets");
    const size_t num_new = new_block_offsets.empty() || new_block_offsets.back() < 0
                               ? 0
                               : static_cast<size_t>(new_block_offsets.back());
    new_block_ids = Head(b.new_block_ids, num_new, "new_block_ids");
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
  V64 row_slots(int32_t r) const {
    return V64(slots.begin() + cu_q[r], slots.begin() + cu_q[r + 1]);
  }
  V row_drafts(int32_t r) const {
    return V(drafts.begin() + static_cast<std::ptrdiff_t>(r) * num_spec_tokens,
             drafts.begin() + static_cast<std::ptrdiff_t>(r + 1) * num_spec_tokens);
  }
};

struct ROut {
  V tokens;
  std::vector<float> logprobs;  // empty unless the step output carries them
  FinishReason reason = FinishReason::kNone;
  std::string why;  // finish_reason_string, "" while running
  int32_t hit_tokens = 0;
  bool awaiting_input = false;  // a session's turn ended (reason says why): not finished
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

  const StepOutput* last_out = nullptr;  // the last update()'s, valid until the next one

  void add(int64_t id, const V& prompt, const SamplingParams& p = P()) {
    s.add_request(id, prompt, p);
    Inv("add_request");
  }

  std::optional<Snap> sched(double now = 0.0, bool allow_prefill = true,
                            bool admit_waiting = true) {
    std::optional<NextBatchInfo> info;
    if (check_next_info) info = s.next_batch_info(now, allow_prefill, admit_waiting);
    V64 running_before = s.running_ids();
    std::erase_if(running_before, [&](int64_t id) { return s.request(id).blocks_shipped == 0; });
    const int64_t preemptions_before = s.stats().num_preemptions;
    const Batch* b = s.schedule(now, allow_prefill, admit_waiting);
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
    CheckAdmissions(snap, running_before, s.stats().num_preemptions - preemptions_before);
    return snap;
  }

  // A step that preempted admits no request from waiting (as vLLM): above all, a request is never
  // preempted and re-admitted in one step (its KV recomputed at once). An admission is a row
  // whose device slot starts afresh (a prompt row, or a padded first decode row:
  // pad_first_decode_rows); a request preempted by the step was running before it.
  // (A request whose remote KV arrived may join the running set a step before its first row: it
  // had shipped no block then, and is left out of running_before.)
  void CheckAdmissions(const Snap& b, const V64& running_before, int64_t preemptions) {
    for (int32_t i = 0; i < b.num_rows; ++i) {
      if (!b.slot_reset[i]) continue;
      EXPECT_EQ(std::count(running_before.begin(), running_before.end(), b.req_ids[i]), 0)
          << "batch " << b.id << ": request " << b.req_ids[i]
          << " preempted and re-admitted in one step";
      EXPECT_EQ(preemptions, 0) << "batch " << b.id << " admits request " << b.req_ids[i]
                                << " in a step that preempted";
    }
  }

  // sampled: one per row (K = 0) or rows * (K + 1); acc: [rows] or empty; drafts: rows * K.
  Outs upd(const Snap& b, const V& sampled, const V& acc = {}, const V& drafts = {},
           const std::vector<float>& logprobs = {}) {
    ModelOutputs o;
    o.sampled_token_ids = sampled;
    o.num_accepted = acc;
    o.draft_token_ids = drafts;
    o.logprobs = logprobs;
    const StepOutput& out = s.update(b.id, o);
    last_out = &out;
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
      if (out.new_logprobs.size() == out.new_tokens.size()) {
        o.logprobs.assign(out.new_logprobs.begin() + lo, out.new_logprobs.begin() + hi);
      }
      o.reason = out.finish_reasons.at(i);
      if (o.reason != FinishReason::kNone) {
        o.why = finish_reason_string(o.reason, out.stop_tokens.at(i));
      }
      o.hit_tokens = out.prefix_hit_tokens.at(i);
      const auto& ai = out.awaiting_input_entries;
      o.awaiting_input = std::binary_search(ai.begin(), ai.end(), i);
      const int64_t id = out.req_ids[i];
      EXPECT_TRUE(r.by_id.emplace(id, o).second) << "request " << id << " twice in one output";
      r.order.push_back(id);
      EXPECT_TRUE(!o.tokens.empty() || o.reason != FinishReason::kNone)
          << "request " << id << " in the output with no token and no finish";
      if (o.reason == FinishReason::kNone) {
        EXPECT_TRUE(s.contains(id)) << "running request " << id << " not live";
        if (s.contains(id)) {
          const V& t = s.request(id).tokens;
          EXPECT_GE(t.size(), o.tokens.size());
          if (t.size() >= o.tokens.size()) {
            EXPECT_TRUE(std::equal(o.tokens.begin(), o.tokens.end(), t.end() - o.tokens.size()))
                << "streamed tokens of " << id << " are not the tail of its tokens";
          }
        }
      } else if (o.awaiting_input) {
        // A session's turn ended: live, waiting for input, its last token the entry's last.
        EXPECT_EQ(std::count(out.finished_entries.begin(), out.finished_entries.end(), i), 0)
            << "session " << id << " ended a turn but is listed as finished";
        EXPECT_TRUE(s.contains(id) && s.request(id).status == RequestStatus::kWaitingForInput)
            << "session " << id << " ended a turn but does not wait for input";
        if (s.contains(id) && !o.tokens.empty()) {
          EXPECT_EQ(s.request(id).tokens.back(), o.tokens.back());
        }
      } else {
        // Its whole sequence is in the output, ending with this step's tokens.
        const auto& fe = out.finished_entries;
        const auto at = std::find(fe.begin(), fe.end(), i);
        EXPECT_NE(at, fe.end()) << "finished request " << id << " has no final tokens";
        if (at != fe.end() && out.finished_offsets.size() == fe.size() + 1) {
          const size_t j = static_cast<size_t>(at - fe.begin());
          const V all(out.finished_tokens.begin() + out.finished_offsets[j],
                      out.finished_tokens.begin() + out.finished_offsets[j + 1]);
          EXPECT_GE(all.size(), o.tokens.size());
          if (all.size() >= o.tokens.size()) {
            EXPECT_TRUE(std::equal(o.tokens.begin(), o.tokens.end(), all.end() - o.tokens.size()))
                << "final tokens of " << id << " do not end with its new tokens";
          }
        }
        // Gone, or finished with its KV kept for a transfer (the id stays in use until then).
        EXPECT_TRUE(!s.contains(id) || s.request(id).status == RequestStatus::kFinished)
            << "finished request " << id << " still live";
      }
    }
    EXPECT_EQ(out.finished_entries.size() + 1, out.finished_offsets.size());
    EXPECT_TRUE(std::is_sorted(out.finished_entries.begin(), out.finished_entries.end()));
    EXPECT_TRUE(std::is_sorted(out.awaiting_input_entries.begin(),
                               out.awaiting_input_entries.end()));
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
      const RequestStatus st = s.request(id).status;
      // These hold their KV: remote KV arriving, a session whose next input arrived.
      if (st == RequestStatus::kWaitingForRemoteKv || st == RequestStatus::kWaitingForInput)
        continue;
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
    // Row kinds: an ATOM batch is all prefill or all decode; a mixed batch has its decode rows
    // first. is_prefill says every row is a prefill row; drafts are carried when a row decodes.
    const int32_t num_prefill =
        static_cast<int32_t>(std::count(b.prefill_rows.begin(), b.prefill_rows.end(), 1));
    EXPECT_EQ(b.is_prefill, num_prefill == b.num_rows);
    EXPECT_EQ(b.num_spec_tokens, b.is_prefill ? 0 : k);
    if (c.policy == BatchPolicy::kAtom) {
      EXPECT_TRUE(num_prefill == 0 || num_prefill == b.num_rows) << "ATOM's policy mixed kinds";
    }
    EXPECT_TRUE(std::is_sorted(b.prefill_rows.begin(), b.prefill_rows.end()))
        << "a prefill row before a decode row";
    EXPECT_EQ(std::set<int64_t>(b.req_ids.begin(), b.req_ids.end()).size(), b.req_ids.size())
        << "a request twice in one batch";
    if (b.cu_q.empty() || b.cu_k.empty()) return;
    EXPECT_EQ(b.cu_q[0], 0);
    EXPECT_EQ(b.cu_k[0], 0);
    int32_t max_q = 0, max_k = 0;
    for (int32_t i = 0; i < b.num_rows; ++i) {
      SCOPED_TRACE(testing::Message()
                   << "batch " << b.id << " row " << i << " req " << b.req_ids[i]);
      EXPECT_EQ(b.cu_q[i + 1] - b.cu_q[i], b.nsched[i]);
      EXPECT_EQ(b.cu_k[i + 1] - b.cu_k[i], b.ctx[i]);
      EXPECT_EQ(b.ctx[i], b.ncached[i] + b.nsched[i]);
      EXPECT_GT(b.nsched[i], 0);
      const bool prefill_row = b.prefill_rows[i] != 0;
      if (!prefill_row) {  // K+1, or fewer where the drafts would pass max_model_len
        EXPECT_LE(b.nsched[i], k + 1);
      } else if (b.num_spec_tokens > 0) {
        EXPECT_EQ(b.row_drafts(i), V(k, -1)) << "a prefill row has no drafts";
      }
      EXPECT_LE(b.ctx[i], c.max_model_len) << "a position at or past max_model_len";
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
      EXPECT_EQ(b.seeds[i], r.seed);
      EXPECT_EQ(b.state_slots[i], r.state_slot);
      // Block-table row: the request's blocks (at least those covering the context), then 0.
      const int32_t need = (b.ctx[i] + bs - 1) / bs;
      const int32_t have = static_cast<int32_t>(r.block_table.size());
      EXPECT_GE(have, need) << "blocks do not cover the context";
      // And the drafter's lookahead past it, up to the position limit (computed independently
      // of the core's kv_slots_for()).
      const int64_t limit = std::min<int64_t>(c.max_model_len, int64_t{c.num_blocks - 1} * bs);
      const int64_t ahead = std::max<int64_t>(
          b.ctx[i], std::min<int64_t>(int64_t{b.ctx[i]} + c.num_lookahead_tokens, limit));
      EXPECT_GE(have, (ahead + bs - 1) / bs) << "blocks do not cover the drafter's lookahead";
      EXPECT_EQ(b.tables.size(), c.host_block_tables ? b.num_rows * size_t(b.width) : 0u);
      const V row = c.host_block_tables ? b.table(i) : V{};
      for (int32_t j = 0; j < static_cast<int32_t>(row.size()); ++j) {
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
      if (prefill_row) {
        EXPECT_EQ(b.emits[i] != 0, b.ctx[i] == r.prefill_target) << "emits_token";
        // (A continuation chunk scheduled while the previous chunk is in flight is exact too; that
        // case has its own test, OneStepAheadPrefillChunkRowIsExact.)
        if (!in_flight_before) {
          EXPECT_EQ(b.exact[i], 1) << "prefill rows are exact";
        }
        EXPECT_LE(b.ctx[i], r.prefill_target);
      } else {
        EXPECT_EQ(b.emits[i], 1);
        if (!in_flight_before) {
          // Synchronous row: input = [last token, drafts...], all exact.
          EXPECT_EQ(b.exact[i], 1) << "synchronous decode row must be exact";
          // (A remote request whose first token ends it at the position limit re-forwards its
          // last prompt token instead.)
          EXPECT_EQ(b.ncached[i], r.pending_stop == FinishReason::kNone ? r.num_tokens() - 1
                                                                         : r.num_prompt_tokens - 1);
          if (k > 0 && static_cast<int32_t>(r.drafts.size()) == k) {
            // The row's drafts, then -1 for the drafts a capped row leaves out.
            V want(r.drafts.begin(), r.drafts.begin() + (b.nsched[i] - 1));
            want.resize(k, -1);
            EXPECT_EQ(b.row_drafts(i), want) << "spec_draft_tokens row";
            for (int32_t j = 0; j + 1 < b.nsched[i]; ++j)
              EXPECT_EQ(b.tokens[b.cu_q[i] + 1 + j], r.drafts[j]);
          }
        }
      }
      if (!prefill_row || b.emits[i]) {
        EXPECT_EQ(b.last_block[i], (b.ctx[i] - 1) % bs + 1) << "last_block_num_tokens";
      }
    }
    EXPECT_EQ(b.cu_q[b.num_rows], b.num_tokens);
    EXPECT_EQ(b.max_seqlen_q, max_q);
    EXPECT_EQ(b.max_seqlen_k, max_k);
    if (check_device_plan) CheckDevicePlan(b);
  }

  // Replays the batch's device plan on a model of the per-slot device block tables (in schedule
  // order, as the device would) and compares every row's slot table with the request's table.
  void CheckDevicePlan(const Snap& b) {
    const int32_t max_seqs = s.config().max_num_seqs;
    EXPECT_EQ(b.new_block_offsets[0], 0);
    std::set<int32_t> seen;
    for (int32_t i = 0; i < b.num_rows; ++i) {
      SCOPED_TRACE(testing::Message() << "device plan: batch " << b.id << " row " << i << " req "
                                      << b.req_ids[i]);
      const int64_t id = b.req_ids[i];
      const int32_t slot = b.request_slots[i];
      EXPECT_GE(slot, 0);
      EXPECT_LT(slot, max_seqs);
      if (slot < 0 || slot >= max_seqs) continue;
      EXPECT_TRUE(seen.insert(slot).second) << "device slot " << slot << " twice in one batch";
      V& dev = dev_tables_[slot];
      if (b.slot_reset[i]) {
        dev.clear();
        slot_owner_[slot] = id;
        EXPECT_EQ(b.new_block_starts[i], 0) << "a reset slot starts at index 0";
      } else {
        EXPECT_EQ(slot_owner_.count(slot) ? slot_owner_[slot] : -1, id)
            << "slot " << slot << " used without a reset by another request";
      }
      const int32_t lo = b.new_block_offsets[i], hi = b.new_block_offsets[i + 1];
      EXPECT_LE(lo, hi);
      const int32_t start = b.new_block_starts[i];
      EXPECT_LE(start, static_cast<int32_t>(dev.size())) << "gap in the device table";
      if (lo > hi || start < 0 || start > static_cast<int32_t>(dev.size())) continue;
      dev.resize(std::max<size_t>(dev.size(), static_cast<size_t>(start + hi - lo)));
      for (int32_t j = lo; j < hi; ++j) dev[start + j - lo] = b.new_block_ids[j];
      if (s.contains(id)) {
        const V& table = s.request(id).block_table;
        EXPECT_GE(dev.size(), table.size());
        EXPECT_TRUE(dev.size() >= table.size() &&
                    std::equal(table.begin(), table.end(), dev.begin()))
            << "device table of slot " << slot << " differs from the request's block table";
        EXPECT_EQ(s.request(id).device_slot, slot);
      }
    }
    // Running requests never share a device slot.
    std::set<int32_t> running_slots;
    for (int64_t id : s.running_ids()) {
      const int32_t d = s.request(id).device_slot;
      EXPECT_TRUE(running_slots.insert(d).second) << "device slot " << d << " held twice";
    }
  }

  Scheduler s;
  bool check_next_info = false;
  bool check_device_plan = false;

 private:
  std::map<int32_t, V> dev_tables_;
  std::map<int32_t, int64_t> slot_owner_;
};

// What a run streamed: each request's tokens, and why it finished (absent while it runs).
struct Streams {
  std::map<int64_t, V> tokens;
  std::map<int64_t, std::string> why;

  // Updates batch `b` with model(id, n) as each row's token (n: the tokens the row's request
  // streamed so far) and records what the update streamed; a request finishes once.
  template <class Model>
  void Apply(H& h, const Snap& b, Model&& model) {
    V sampled;
    for (int64_t id : b.req_ids) {
      const auto it = tokens.find(id);
      const size_t streamed = it == tokens.end() ? 0 : it->second.size();
      sampled.push_back(model(id, static_cast<int32_t>(streamed)));
    }
    const Outs o = h.upd(b, sampled);
    for (int64_t id : o.order) {
      const ROut& r = o.by_id.at(id);
      V& all = tokens[id];
      all.insert(all.end(), r.tokens.begin(), r.tokens.end());
      if (r.reason == FinishReason::kNone) continue;
      EXPECT_EQ(why.count(id), 0u) << "request " << id << " finished twice";
      why[id] = r.why;
    }
  }
};

// Observable state that a rejected call must leave unchanged.
struct State {
  V64 waiting, running;
  int32_t free_blocks = 0, outstanding = 0;
  int64_t steps = 0;
  std::map<int64_t, V> tokens;
  std::map<int64_t, int32_t> computed;
};
inline State Capture(const Scheduler& s) {
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
inline void ExpectSame(const State& a, const State& b, const char* what) {
  SCOPED_TRACE(what);
  EXPECT_EQ(a.waiting, b.waiting);
  EXPECT_EQ(a.running, b.running);
  EXPECT_EQ(a.free_blocks, b.free_blocks);
  EXPECT_EQ(a.outstanding, b.outstanding);
  EXPECT_EQ(a.steps, b.steps);
  EXPECT_EQ(a.tokens, b.tokens);
  EXPECT_EQ(a.computed, b.computed);
}

// A scenario several suites continue from.
// Three requests of 7 tokens fill a 6-block pool (bs 4):
//   A = [100..107) {0,1}   B = [200..207) {2,3}   C = [300..307) {4,5}   free {}
//   step 1: prefill A, B, C            -> A 110, B 210, C 310
//   step 2: decode pos 7 (no growth)   -> A 111, B 211, C 311     (returned)
inline Snap ThreeFillThePool(H& h, int32_t a_max_tokens) {
  SamplingParams pa = P(a_max_tokens);
  pa.temperature = 0.5f;
  pa.top_k = 5;
  pa.top_p = 0.9f;
  SamplingParams pc = P();
  pc.temperature = 0.0f;
  h.add(1, Seq(100, 7), pa);
  h.add(2, Seq(200, 7));
  h.add(3, Seq(300, 7), pc);
  auto s1 = h.sched();
  if (!s1 || s1->num_rows != 3) {
    ADD_FAILURE() << "step 1 should prefill 3 rows";
    return Snap();
  }
  h.upd(*s1, {110, 210, 310});
  EXPECT_EQ(h.s.block_pool().num_free_blocks(), 0);
  auto s2 = h.sched();
  if (!s2 || s2->num_rows != 3) {
    ADD_FAILURE() << "step 2 should decode 3 rows";
    return Snap();
  }
  h.upd(*s2, {111, 211, 311});
  return *s2;
}

}  // namespace
}  // namespace atom_sched
