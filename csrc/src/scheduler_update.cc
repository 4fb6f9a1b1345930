// Scheduler::update(): validating a batch's outputs, appending tokens, stop conditions.
#include <algorithm>
#include <limits>
#include <span>
#include <string>

#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "atom_sched/xxhash64.h"
#include "scheduler_internal.h"

namespace atom_sched {

using detail::for_each_marked;

// ---------------------------------------------------------------------------------------------
// Outputs

namespace {

// validate_outputs()'s token and draft rules as one branch-free pass, for K drafts a row (a
// compile-time K, so the inner loops unroll): an emitting row's accepted tokens >= 0, its drafts
// >= -1 and a prefix (no draft after a -1). `accepted` may be null (all 1); the counts are in
// range (accepted_in_range()).
template <int K>
bool rows_look_valid(const Batch& b, const int32_t* sampled, const int32_t* accepted,
                     const int32_t* drafts) {
  const int32_t rows = b.num_rows;
  const uint8_t* emits = b.emits_token.data();
  bool bad = false;
  for (int32_t i = 0; i < rows; ++i) {
    const int32_t a = accepted != nullptr ? accepted[i] : 1;
    const int32_t* t = sampled + static_cast<size_t>(i) * (K + 1);
    const int32_t* d = drafts + static_cast<size_t>(i) * K;
    bool row_bad = false;
    for (int32_t j = 0; j <= K; ++j) row_bad |= (t[j] < 0) & (j < a);
    for (int32_t j = 0; j < K; ++j) row_bad |= d[j] < -1;
    for (int32_t j = 1; j < K; ++j) row_bad |= (d[j] >= 0) & (d[j - 1] < 0);
    bad |= row_bad & (emits[i] != 0);
  }
  return !bad;
}

// Whether no value of v is negative: the sign bits OR-ed (a form the compiler vectorises).
bool none_negative(std::span<const int32_t> v) {
  int32_t signs = 0;
  for (const int32_t x : v) signs |= x;
  return signs >= 0;
}

// Whether every row's accepted count is in 1..max: its scheduled tokens, 1 for a prompt chunk
// (`accepted` may be null: all 1, always in range). Two passes, each vectorised (one with a
// conditional maximum is not).
bool accepted_in_range(const Batch& b, const int32_t* accepted) {
  if (accepted == nullptr) return true;
  const uint8_t* prefill = b.row_is_prefill.data();
  const int32_t* scheduled = b.num_scheduled_tokens.data();
  int32_t out_of_range = 0, chunk_over_one = 0;
  for (int32_t i = 0; i < b.num_rows; ++i)
    out_of_range |= (accepted[i] < 1) | (accepted[i] > scheduled[i]);
  for (int32_t i = 0; i < b.num_rows; ++i) chunk_over_one |= (accepted[i] > 1) & (prefill[i] != 0);
  return (out_of_range | chunk_over_one) == 0;
}

}  // namespace

ATOM_SCHED_AVX2_CLONES bool Scheduler::outputs_look_valid(const Batch& b,
                                                          const ModelOutputs& out) const {
  const int32_t* sampled = out.sampled_token_ids.data();
  const int32_t* accepted = out.num_accepted.empty() ? nullptr : out.num_accepted.data();
  const int32_t* drafts = out.draft_token_ids.data();
  if (k_ == 0 && accepted == nullptr) {  // one token a row (the common decode step)
    // The sign bits of the emitting rows' tokens, OR-ed (a form the compiler vectorises).
    const uint8_t* emits = b.emits_token.data();
    const int32_t rows = b.num_rows;
    int32_t signs = 0;
    for (int32_t i = 0; i < rows; ++i) signs |= sampled[i] & -static_cast<int32_t>(emits[i] != 0);
    return signs >= 0;
  }
  if (!accepted_in_range(b, accepted)) return false;
  // The common step: no negative token or draft at all. The rules allow some (a row's tokens
  // past its accepted count, -1 padding its drafts, a prompt chunk that emits nothing), so
  // otherwise every row is checked by them.
  if (none_negative(out.sampled_token_ids) && none_negative(out.draft_token_ids)) return true;
  static_assert(kMaxSpeculativeTokens == 8, "one case per K below");
  switch (k_) {
    case 0: return rows_look_valid<0>(b, sampled, accepted, drafts);
    case 1: return rows_look_valid<1>(b, sampled, accepted, drafts);
    case 2: return rows_look_valid<2>(b, sampled, accepted, drafts);
    case 3: return rows_look_valid<3>(b, sampled, accepted, drafts);
    case 4: return rows_look_valid<4>(b, sampled, accepted, drafts);
    case 5: return rows_look_valid<5>(b, sampled, accepted, drafts);
    case 6: return rows_look_valid<6>(b, sampled, accepted, drafts);
    case 7: return rows_look_valid<7>(b, sampled, accepted, drafts);
    case 8: return rows_look_valid<8>(b, sampled, accepted, drafts);
    default: return false;  // config validation keeps K in 0..8; the slow path words it
  }
}

void Scheduler::validate_outputs(const Batch& b, const ModelOutputs& out) const {
  const size_t rows = b.num_rows;
  const size_t full = k_ + 1;
  const size_t n = out.sampled_token_ids.size();
  const size_t width = rows > 0 ? n / rows : 0;
  const bool width_ok = n == rows * width && width == full;
  if (!width_ok)
    throw InvalidArgument("sampled_token_ids has " + std::to_string(n) + " values for a batch of " +
                          std::to_string(rows) + " rows; expected " + std::to_string(rows) +
                          " x " + std::to_string(full));
  if (!out.num_accepted.empty() && out.num_accepted.size() != rows)
    throw InvalidArgument("num_accepted has " + std::to_string(out.num_accepted.size()) +
                          " values for a batch of " + std::to_string(rows) + " rows");
  if (out.num_accepted.empty() && !b.is_prefill && k_ > 0)
    throw InvalidArgument("num_accepted is required for a speculative decode batch");
  if (k_ > 0 && out.draft_token_ids.size() != rows * k_)
    throw InvalidArgument("draft_token_ids must hold " + std::to_string(rows) + " x " +
                          std::to_string(k_) + " values, got " +
                          std::to_string(out.draft_token_ids.size()));
  if (k_ == 0 && !out.draft_token_ids.empty())
    throw InvalidArgument("draft_token_ids given but num_speculative_tokens is 0");
  if (!out.logprobs.empty() && out.logprobs.size() != n)
    throw InvalidArgument("logprobs must have the shape of sampled_token_ids");
  if (outputs_look_valid(b, out)) return;
  // Something is wrong: find the first bad value and say which.
  for (size_t i = 0; i < rows; ++i) {
    // A decode row accepts at most its tokens: K+1, fewer where drafts were capped.
    const int32_t max_accepted = b.row_is_prefill[i] ? 1 : b.num_scheduled_tokens[i];
    const int32_t a = out.num_accepted.empty() ? 1 : out.num_accepted[i];
    if (a < 1 || a > max_accepted)
      throw InvalidArgument("num_accepted[" + std::to_string(i) + "] = " + std::to_string(a) +
                            " is outside 1.." + std::to_string(max_accepted));
    if (!b.emits_token[i]) continue;
    // The drafts an emitting row stores are next step's input tokens: checked as prompt tokens.
    // Fewer than K are a prefix padded with -1 (none: all -1).
    bool missing = false;
    for (int32_t j = 0; j < k_; ++j) {
      const int32_t d = out.draft_token_ids[i * k_ + j];
      if (d < -1 || (d >= 0 && missing)) {
        const std::string at =
            "draft token [" + std::to_string(i) + ", " + std::to_string(j) + "]";
        throw InvalidArgument(d < -1 ? at + " is negative (" + std::to_string(d) +
                                           "); -1 pads a row with fewer than K drafts"
                                     : at + " follows a missing draft (-1): a row's drafts are "
                                            "a prefix, padded with -1");
      }
      missing = missing || d == -1;
    }
    for (int32_t j = 0; j < a; ++j) {
      const int32_t t = out.sampled_token_ids[i * width + j];
      if (t < 0)
        throw InvalidArgument("sampled token [" + std::to_string(i) + ", " + std::to_string(j) +
                              "] is negative (" + std::to_string(t) + ")");
    }
  }
}

namespace {

// Keeps the `k` drafts a row proposed for its request's next step. K is small: a plain loop, not
// a memcpy call. The drafts are a prefix (validated), so the proposed ones are those >= 0.
[[gnu::always_inline]] inline void keep_drafts(Request& r, const int32_t* d, int32_t k) {
  int32_t* kept = r.drafts.data();
  int32_t proposed = 0;
  for (int32_t j = 0; j < k; ++j) {
    kept[j] = d[j];
    proposed += d[j] >= 0;
  }
  r.num_drafts = proposed;
}

}  // namespace

void Scheduler::publish_blocks(Request& r, int32_t end) {
  ensure_block_hashes(r, end);
  pool_.publish(r.block_table, r.block_hashes, r.tokens, r.blocks_published, end, r.lora_name,
                r.cache_salt);
  r.blocks_published = end;
}

FinishReason Scheduler::length_stop(const Request& r) const {
  if (r.num_tokens() < r.stop_length) return FinishReason::kNone;  // final_length(): all three
  if (r.num_generated() >= r.max_tokens) return FinishReason::kMaxTokens;
  if (r.num_tokens() >= config_.max_model_len) return FinishReason::kMaxModelLen;  // (8.8)
  // Its KV fills every position of the pool: the next decode could never be scheduled, even
  // alone. It ends keeping its tokens (before, it preempted itself and was then rejected).
  if (r.num_tokens() > pool_positions_) return FinishReason::kKvCapacity;
  return FinishReason::kNone;
}

// The stop rule. stop_after_append() inlines its case without stop lists (EOS past min_tokens,
// then the length limit): a change here changes that one too.
FinishReason Scheduler::stop_reason(const Request& r, int32_t& stop_token) const {
  const int32_t tok = r.tokens.back();
  const int32_t generated = r.num_generated();
  // min_tokens (vLLM's semantics): before that many tokens only the length rules end a request.
  if (generated < r.min_tokens) return length_stop(r);
  if (!r.has_stop_lists) {
    if (!r.ignore_eos && tok == config_.eos_token_id) return FinishReason::kEos;
    return length_stop(r);
  }
  for (const auto& seq : r.stop_sequences) {
    const int32_t len = static_cast<int32_t>(seq.size());
    if (generated >= len && std::equal(seq.begin(), seq.end(), r.tokens.end() - len))
      return FinishReason::kStopSequence;  // matched within generated tokens only (8.11)
  }
  if (!r.ignore_eos && tok == config_.eos_token_id) return FinishReason::kEos;
  for (int32_t id : r.stop_token_ids) {
    if (tok == id) {  // stop tokens stop even with ignore_eos (8.12)
      stop_token = id;
      return FinishReason::kStopToken;
    }
  }
  return length_stop(r);
}

[[gnu::always_inline]] inline FinishReason Scheduler::stop_after_append(
    const Request& r, int32_t& stop_token) const {
  if (r.has_stop_lists) return stop_reason(r, stop_token);
  // stop_reason() without stop lists: EOS once past min_tokens, then the length rules, whose
  // earliest limit is cached (stop_length).
  if (r.last_token == config_.eos_token_id && !r.ignore_eos && r.num_generated() >= r.min_tokens)
    return FinishReason::kEos;
  return r.num_tokens() < r.stop_length ? FinishReason::kNone : length_stop(r);
}

void Scheduler::finish_entry(int32_t entry, int32_t slot, FinishReason reason,
                             int32_t stop_token) {
  StepOutput& so = step_output_;
  const Request& r = requests_[slot];
  if (r.resumable) {  // a session's turn ends: it waits for its next input
    so.awaiting_input_entries.push_back(entry);
    end_turn(slot);
    return;
  }
  so.finished_entries.push_back(entry);
  so.finished_tokens.insert(so.finished_tokens.end(), r.tokens.begin(), r.tokens.end());
  so.finished_offsets.push_back(static_cast<int32_t>(so.finished_tokens.size()));
  finish(slot, reason, stop_token);
}

[[gnu::always_inline]] inline bool Scheduler::has_blocks_to_publish(const Request& r) const {
  // Every position but the last token's now holds verified KV (the row's input was the last
  // token and the drafts now accepted). (steady_entry()'s watch_count is the first token count
  // this holds at.)
  return cache_decode_blocks_ && r.num_tokens() > (r.blocks_published + 1) * config_.block_size;
}

[[gnu::always_inline]] inline int32_t Scheduler::decode_publish_end(const Request& r) const {
  return has_blocks_to_publish(r) ? (r.num_tokens() - 1) / config_.block_size : 0;
}

[[gnu::always_inline]] inline bool Scheduler::publish_decode_blocks(Request& r) {
  // The blocks a row fills are published before a finish frees them, so a follow-up turn finds
  // them.
  const int32_t end = decode_publish_end(r);
  if (end == 0) return false;
  publish_blocks(r, end);
  return true;
}

void Scheduler::hash_ahead(const int32_t* slots, const uint8_t* marks, int32_t n) {
  // Row by row, a block's hash (its request's hash list, then 150 instructions of XXH64) and
  // the prefix cache's probe for it are misses no other row overlaps: a row's few hundred
  // instructions fill the core's reorder window. In a pass of their own the hashes overlap,
  // and the probe's slot is requested while the next rows hash: the step where every row
  // completes a block ran 1.7x faster at 1,024 running.
  if (!cache_decode_blocks_) return;
  // The usual row completes one block whose parent is hashed: eight such blocks are hashed at
  // once (block_hashes()); any other row on its own (ensure_block_hashes()).
  constexpr int32_t kGroup = 8;
  const size_t bs = static_cast<size_t>(config_.block_size);
  Request* group[kGroup];
  const int32_t* tokens[kGroup];
  uint64_t parents[kGroup], hashes[kGroup];
  int32_t grouped = 0;
  const auto hash_group = [&] {
    block_hashes(tokens, parents, static_cast<size_t>(grouped), bs, hashes);
    for (int32_t g = 0; g < grouped; ++g) {
      group[g]->block_hashes.push_back(hashes[g]);
      pool_.prefetch_publish(hashes[g]);
    }
    grouped = 0;
  };
  for_each_marked(marks, n, [&](int32_t i) {
    Request& r = requests_[slots[i]];
    const int32_t end = decode_publish_end(r);
    const size_t hashed = r.block_hashes.size();
    if (static_cast<size_t>(end) <= hashed) return;  // nothing to publish, or hashed already
    if (hashed > 0 && hashed + 1 == static_cast<size_t>(end)) {
      group[grouped] = &r;
      tokens[grouped] = r.tokens.data() + hashed * bs;
      parents[grouped] = r.block_hashes.back();
      if (++grouped == kGroup) hash_group();
      return;
    }
    ensure_block_hashes(r, end);
    pool_.prefetch_publish(r.block_hashes[static_cast<size_t>(end) - 1]);
  });
  if (grouped > 0) hash_group();
}

[[gnu::always_inline]] inline void Scheduler::write_one_token_entries(const Batch& b,
                                                                     const ModelOutputs& out,
                                                                     int32_t first, int32_t n,
                                                                     OutputCursor& cursor) {
  StepOutput& so = step_output_;
  const int32_t e0 = cursor.entries, t0 = cursor.tokens;
  std::copy_n(b.req_ids.data() + first, n, so.req_ids.data() + e0);
  std::copy_n(out.sampled_token_ids.data() + first, n, so.new_tokens.data() + t0);
  int32_t* __restrict offsets = so.token_offsets.data() + e0 + 1;
  for (int32_t i = 0; i < n; ++i) offsets[i] = t0 + i + 1;
  cursor = {e0 + n, t0 + n};
}

[[gnu::always_inline]] inline void Scheduler::apply_stop_rules(Request& r, int32_t slot,
                                                              int32_t p, int32_t entry) {
  int32_t stop_token = -1;
  const FinishReason reason = stop_after_append(r, stop_token);
  if (publish_decode_blocks(r)) steady_.watch_count[p] = watch_count_of(r);  // the next
  StepOutput& so = step_output_;
  so.finish_reasons[entry] = reason;
  so.stop_tokens[entry] = stop_token;
  if (reason != FinishReason::kNone) finish_entry(entry, slot, reason, stop_token);
}

ATOM_SCHED_AVX2_CLONES bool Scheduler::apply_steady_run(const Batch& b, const ModelOutputs& out,
                                                        const SteadyRun& run,
                                                        OutputCursor& cursor) {
  const int32_t n = run.n;
  const size_t at = static_cast<size_t>(run.at);
  if (at + static_cast<size_t>(n) > running_.size()) return false;
  SteadyRows& h = steady_;
  const int32_t* __restrict slots = b.request_index.data() + run.row0;
  // Its requests still hold the run's positions (an abort leaves a hole, a preemption or a
  // squeeze moves requests), so they are running, and so plain rows (apply_plain_decode_rows()):
  // a request has something to stream besides only after a remote prefill, never with a row in
  // flight. (One readmitted meanwhile is plain too: the row's token is appended, as there.)
  const int32_t* __restrict running = running_.data() + at;
  int32_t slots_differ = 0;
  for (int32_t i = 0; i < n; ++i) slots_differ |= running[i] ^ slots[i];
  if (slots_differ != 0) return false;

  // The new tokens into the columns (the bound holds: a token more, a row in flight less), and
  // the rows whose token needs a look flagged.
  const int32_t* __restrict sampled = out.sampled_token_ids.data() + run.row0;
  int32_t* __restrict counts = h.token_count.data() + at;
  int32_t* __restrict last = h.last_token.data() + at;
  const int32_t* __restrict watch_tokens = h.watch_token.data() + at;
  const int32_t* __restrict watch_counts = h.watch_count.data() + at;
  uint8_t* __restrict marks = h.marks.data();
  for (int32_t i = 0; i < n; ++i) {
    counts[i] += 1;
    last[i] = sampled[i];
  }
  for (int32_t i = 0; i < n; ++i)
    marks[i] = (sampled[i] == watch_tokens[i]) | (counts[i] >= watch_counts[i]);
  // The requests themselves, and the entry columns they decide.
  StepOutput& so = step_output_;
  const int32_t e0 = cursor.entries;
  int32_t* __restrict prefix_hits = so.prefix_hit_tokens.data() + e0;
  uint8_t* __restrict wants = so.wants_logprobs.data() + e0;
  for (int32_t i = 0; i < n; ++i) {
    Request& r = requests_[slots[i]];
    --r.num_inflight;
    r.append_token(sampled[i]);
    prefix_hits[i] = r.prefix_hit_tokens;
    wants[i] = r.wants_logprobs;
  }
  // The other entry columns in passes: no row stopped, unless flagged below.
  std::fill_n(so.finish_reasons.data() + e0, n, FinishReason::kNone);
  std::fill_n(so.stop_tokens.data() + e0, n, -1);
  write_one_token_entries(b, out, run.row0, n, cursor);
  // The flagged rows, in order (finished entries stay sorted), their blocks hashed first.
  hash_ahead(slots, marks, n);
  for_each_marked(marks, n, [&](int32_t i) {
    apply_stop_rules(requests_[slots[i]], slots[i], run.at + i, e0 + i);
  });
  return true;
}

int32_t Scheduler::apply_plain_decode_rows(const Batch& b, const ModelOutputs& out, int32_t row,
                                           int32_t end, OutputCursor& cursor) {
  const int32_t first = row;
  const int32_t* __restrict slots = b.request_index.data();
  const uint8_t* __restrict prefill = b.row_is_prefill.data();
  const int32_t* __restrict sampled = out.sampled_token_ids.data();
  StepOutput& so = step_output_;
  const int32_t shift = cursor.entries - first;  // row + shift: the row's entry
  int32_t* __restrict prefix_hits = so.prefix_hit_tokens.data();
  uint8_t* __restrict wants = so.wants_logprobs.data();
  int32_t* __restrict last_tokens = steady_.last_token.data();
  int32_t* __restrict token_counts = steady_.token_count.data();
  for (; row < end; ++row) {
    const int32_t slot = slots[row];
    Request& r = requests_[slot];
    // Finished or preempted meanwhile, a token to stream besides (num_unstreamed), or a prompt
    // chunk: apply_row_output().
    if (r.status != RequestStatus::kRunning || r.num_unstreamed > 0 || prefill[row]) break;
    --r.num_inflight;
    r.append_token(sampled[row]);
    // Its steady columns: the new token (the bound holds: sync_steady()).
    const int32_t p = r.run_pos;
    last_tokens[p] = r.last_token;
    token_counts[p] = r.token_count;
    const int32_t e = row + shift;
    prefix_hits[e] = r.prefix_hit_tokens;
    wants[e] = r.wants_logprobs;
    apply_stop_rules(r, slot, p, e);
  }
  write_one_token_entries(b, out, first, row - first, cursor);
  return row;
}

[[gnu::always_inline]] inline void Scheduler::apply_k0_row_output(const Batch& b, int32_t row,
                                                                 const ModelOutputs& out,
                                                                 OutputCursor& cursor) {
  apply_row_output<false>(b, row, out, /*width=*/1, cursor);
  // Its request changed more than the plain rows' columns: its steady columns again.
  const Request& r = requests_[b.request_index[row]];
  if (r.run_pos >= 0) sync_steady(r);
}

[[gnu::always_inline]] inline void Scheduler::apply_decode_rows(const Batch& b,
                                                               const ModelOutputs& out,
                                                               int32_t row, int32_t end,
                                                               OutputCursor& cursor) {
  while (row < end) {
    row = apply_plain_decode_rows(b, out, row, end, cursor);
    if (row < end) apply_k0_row_output(b, row++, out, cursor);
  }
}

void Scheduler::apply_k0_rows(const Batch& b, const ModelOutputs& out,
                              std::span<const SteadyRun> runs, OutputCursor& cursor) {
  // The passes cost a few hundred instructions however short the run (calls, vector loops'
  // set-up); a run of fewer rows than this goes row by row.
  constexpr int32_t kMinColumnRun = 8;
  int32_t row = 0;
  for (const SteadyRun& run : runs) {
    if (run.n < kMinColumnRun) continue;
    apply_decode_rows(b, out, row, run.row0, cursor);
    // A run whose requests moved: its rows one by one, with the rows after it.
    row = apply_steady_run(b, out, run, cursor) ? run.row0 + run.n : run.row0;
  }
  apply_decode_rows(b, out, row, b.num_rows, cursor);
}

template <int K>
ATOM_SCHED_AVX2_CLONES void Scheduler::apply_plain_spec_rows(const Batch& b,
                                                             const ModelOutputs& out,
                                                             OutputCursor& cursor) {
  const int32_t rows = b.num_rows;
  constexpr int32_t k = K;  // the draft loops unroll
  const int32_t* __restrict slots = b.request_index.data();
  const uint8_t* __restrict prefill = b.row_is_prefill.data();
  const int32_t* __restrict scheduled = b.num_scheduled_tokens.data();
  const int32_t* __restrict sampled = out.sampled_token_ids.data();
  const int32_t* __restrict accepted = out.num_accepted.data();
  const int32_t* __restrict drafts = out.draft_token_ids.data();
  // The entry columns through local pointers: through so.column[row], a byte store (a finish
  // reason) would reload every column's pointer. (update() sized them: nothing reallocates.)
  StepOutput& so = step_output_;
  int32_t* __restrict tokens_out = so.new_tokens.data();
  int64_t* __restrict ids_out = so.req_ids.data();
  int32_t* __restrict offsets_out = so.token_offsets.data();
  FinishReason* __restrict reasons_out = so.finish_reasons.data();
  int32_t* __restrict stop_tokens_out = so.stop_tokens.data();
  int32_t* __restrict prefix_hits_out = so.prefix_hit_tokens.data();
  uint8_t* __restrict wants_out = so.wants_logprobs.data();
  int64_t* __restrict acceptance_counts = stats_.acceptance_counts.data();
  uint8_t* __restrict marks = steady_.marks.data();  // the rows to publish or finish
  int32_t row = 0, num_tokens = 0;
  int64_t drafted = 0, accepted_drafts = 0;
  for (; row < rows; ++row) {
    const int32_t slot = slots[row];
    Request& r = requests_[slot];
    // As apply_plain_decode_rows(): apply_row_output() from the first row that is not plain.
    // (A decode row of a K > 0 batch always has its accepted count: validate_outputs().)
    if (r.status != RequestStatus::kRunning || r.num_unstreamed > 0 || prefill[row]) break;
    const int32_t a = accepted[row];
    const int32_t n = scheduled[row];  // K+1, or fewer near the limit
    --r.num_inflight;
    r.num_computed_tokens -= n - a;  // roll back the rejected drafts
    drafted += n - 1;
    accepted_drafts += a - 1;
    ++acceptance_counts[a - 1];
    keep_drafts(r, drafts + static_cast<size_t>(row) * k, k);
    // The accepted tokens one by one; the earliest stop wins and later tokens are dropped.
    const int32_t* t = sampled + static_cast<size_t>(row) * (k + 1);
    FinishReason reason = FinishReason::kNone;
    int32_t stop_token = -1, kept = 0;
    while (kept < a && reason == FinishReason::kNone) {
      r.append_token(t[kept]);
      tokens_out[num_tokens + kept++] = r.last_token;
      reason = stop_after_append(r, stop_token);
    }
    num_tokens += kept;
    ids_out[row] = r.id;
    offsets_out[row + 1] = num_tokens;
    reasons_out[row] = reason;
    stop_tokens_out[row] = stop_token;
    prefix_hits_out[row] = r.prefix_hit_tokens;
    wants_out[row] = r.wants_logprobs;
    // Publishing and finishing after the pass, in row order, as if done here: neither changes
    // what a later row of the pass reads (its own request, the batch, the outputs).
    marks[row] = reason != FinishReason::kNone || has_blocks_to_publish(r);
  }
  hash_ahead(slots, marks, row);
  for_each_marked(marks, row, [&](int32_t i) {
    publish_decode_blocks(requests_[slots[i]]);
    if (reasons_out[i] != FinishReason::kNone)
      finish_entry(i, slots[i], reasons_out[i], stop_tokens_out[i]);
  });
  stats_.num_spec_steps += row;
  stats_.num_draft_tokens += drafted;
  stats_.num_accepted_draft_tokens += accepted_drafts;
  cursor = {row, num_tokens};
}

template <bool kSpec>
[[gnu::always_inline]] inline void Scheduler::apply_row_output(const Batch& b, int32_t row,
                                                              const ModelOutputs& out,
                                                              int32_t width,
                                                              OutputCursor& cursor) {
  const int32_t slot = b.request_index[row];
  Request& r = requests_[slot];
  --r.num_inflight;
  if (r.status == RequestStatus::kFinished) {  // finished meanwhile: this output is discarded
    release_slot_if_done(slot);
    return;
  }
  // A session whose turn ended meanwhile: the row input its last sampled token, which its next
  // turn drops.
  if (r.status == RequestStatus::kWaitingForInput) return;
  const bool running = r.status == RequestStatus::kRunning;
  if (!running && config_.drop_preempted_outputs) return;  // preempted meanwhile: recomputed
  int32_t accepted = 1;
  const bool prefill_row = b.row_is_prefill[row] != 0;
  if (prefill_row) {
    // Publish the blocks this chunk completed, now that their KV exists. A preempted request's
    // blocks are gone, so there is nothing to publish.
    if (running && config_.enable_prefix_caching) {
      const int32_t end =
          (b.num_cached_tokens[row] + b.num_scheduled_tokens[row]) / config_.block_size;
      if (r.blocks_published < end) publish_blocks(r, end);
    }
    if (!b.emits_token[row]) return;  // an intermediate chunk samples garbage
  } else {
    // Without drafts a decode row schedules one token and accepts it: nothing to roll back.
    if constexpr (kSpec) {
      if (!out.num_accepted.empty()) accepted = out.num_accepted[row];
      // Roll back the upper bound by the rejected drafts (a preempted request restarts from 0).
      const int32_t scheduled = b.num_scheduled_tokens[row];  // K+1, or fewer near the limit
      if (running) r.num_computed_tokens -= scheduled - accepted;
      ++stats_.num_spec_steps;
      stats_.num_draft_tokens += scheduled - 1;
      stats_.num_accepted_draft_tokens += accepted - 1;
      ++stats_.acceptance_counts[accepted - 1];
    }
  }
  if (kSpec && running)
    keep_drafts(r, out.draft_token_ids.data() + static_cast<size_t>(row) * k_, k_);

  // Append the accepted tokens one by one; the earliest stop wins and later tokens are dropped.
  // Tokens known but not streamed yet (a remote prefill's first token) go out with them.
  const int32_t stream_from = r.num_tokens() - r.num_unstreamed;
  const int32_t* sampled = out.sampled_token_ids.data() + static_cast<size_t>(row) * width;
  // An injected first token that already ends it (only ever set with num_unstreamed > 0, which
  // keeps the cold fields off the common path).
  const bool injected = r.num_unstreamed > 0;
  FinishReason reason = injected ? r.pending_stop : FinishReason::kNone;
  int32_t stop_token = injected ? r.pending_stop_token : -1;
  int32_t kept = 0;
  while (kept < accepted && reason == FinishReason::kNone) {
    r.append_token(sampled[kept++]);
    reason = stop_after_append(r, stop_token);
  }
  if (!prefill_row && running) publish_decode_blocks(r);
  // Entries are written by index into arrays update() sized for the worst case.
  StepOutput& so = step_output_;
  const int32_t e = cursor.entries++;
  so.req_ids[e] = r.id;
  int32_t* tokens_out = so.new_tokens.data() + cursor.tokens;
  const int32_t* known = r.tokens.data();
  const int32_t total = r.num_tokens();
  if (total - stream_from == 1) {  // one new token (a decode row without drafts): no loop
    *tokens_out = known[stream_from];
  } else {
    for (int32_t i = stream_from; i < total; ++i) *tokens_out++ = known[i];
  }
  if (!out.logprobs.empty()) {
    float* lp_out = so.new_logprobs.data() + cursor.tokens;
    const float* lp = out.logprobs.data() + static_cast<size_t>(row) * width;
    for (int32_t j = 0; j < r.num_unstreamed; ++j)
      *lp_out++ = std::numeric_limits<float>::quiet_NaN();
    for (int32_t j = 0; j < kept; ++j) *lp_out++ = lp[j];
  }
  cursor.tokens += total - stream_from;
  r.num_unstreamed = 0;
  so.token_offsets[e + 1] = cursor.tokens;
  so.finish_reasons[e] = reason;
  so.stop_tokens[e] = stop_token;
  so.prefix_hit_tokens[e] = r.prefix_hit_tokens;
  so.wants_logprobs[e] = r.wants_logprobs;
  if (reason != FinishReason::kNone) finish_entry(e, slot, reason, stop_token);
}

void Scheduler::apply_rows_with_voids(const Batch& b, const ModelOutputs& out, int32_t width,
                                      std::vector<int32_t>& voided, OutputCursor& cursor) {
  std::sort(voided.begin(), voided.end());
  for (int32_t row = 0; row < b.num_rows; ++row) {
    if (std::binary_search(voided.begin(), voided.end(), row)) {
      const int32_t slot = b.request_index[row];
      --requests_[slot].num_inflight;
      release_slot_if_done(slot);  // (finished meanwhile)
    } else if (k_ > 0) {
      apply_row_output<true>(b, row, out, width, cursor);
    } else {
      apply_k0_row_output(b, row, out, cursor);
    }
  }
  voided.clear();
}

const StepOutput& Scheduler::update(uint64_t batch_id, const ModelOutputs& out) {
  if (num_outstanding_ == 0)
    throw InvalidArgument("update(): no batch is outstanding (batch " + std::to_string(batch_id) +
                          " was already updated or never scheduled)");
  const int32_t oldest = (next_buffer_ - num_outstanding_ + kMaxOutstandingBatches) %
                         kMaxOutstandingBatches;
  const Batch& b = batches_[oldest];
  if (b.id != batch_id)
    throw InvalidArgument("update() must receive the oldest outstanding batch (id " +
                          std::to_string(b.id) + "), got batch " + std::to_string(batch_id));
  validate_outputs(b, out);
  // Size the outputs for the worst case (within the capacity reserved at construction), fill
  // them by index, then trim: no allocation, no per-entry push_back.
  StepOutput& so = step_output_;
  const size_t rows = b.num_rows;
  const size_t max_tokens = rows * (k_ + 2);  // K+1 accepted + an injected remote first token
  so.batch_id = b.id;
  so.req_ids.resize(rows);
  so.token_offsets.resize(rows + 1);
  so.token_offsets[0] = 0;
  so.new_tokens.resize(max_tokens);
  so.new_logprobs.resize(out.logprobs.empty() ? 0 : max_tokens);
  so.finish_reasons.resize(rows);
  so.stop_tokens.resize(rows);
  so.prefix_hit_tokens.resize(rows);
  so.wants_logprobs.resize(rows);
  so.finished_entries.clear();
  so.awaiting_input_entries.clear();
  so.finished_offsets.resize(1);
  so.finished_tokens.clear();
  // Filled so far; a local (not a member), so the column stores cannot alias it.
  OutputCursor cursor;
  const int32_t width =
      b.num_rows > 0 ? static_cast<int32_t>(out.sampled_token_ids.size()) / b.num_rows : 1;
  // Compiled per kind of step (as schedule_decode_rows()): no draft logic when K = 0, and the
  // plain rows of a K = 0 step without log-probabilities first, in passes.
  if (!voided_rows_[oldest].empty()) {
    apply_rows_with_voids(b, out, width, voided_rows_[oldest], cursor);
  } else if (k_ > 0) {
    if (out.logprobs.empty()) {
      static_assert(kMaxSpeculativeTokens == 8, "one case per K below");
      switch (k_) {
        case 1: apply_plain_spec_rows<1>(b, out, cursor); break;
        case 2: apply_plain_spec_rows<2>(b, out, cursor); break;
        case 3: apply_plain_spec_rows<3>(b, out, cursor); break;
        case 4: apply_plain_spec_rows<4>(b, out, cursor); break;
        case 5: apply_plain_spec_rows<5>(b, out, cursor); break;
        case 6: apply_plain_spec_rows<6>(b, out, cursor); break;
        case 7: apply_plain_spec_rows<7>(b, out, cursor); break;
        case 8: apply_plain_spec_rows<8>(b, out, cursor); break;
        default: break;  // config validation keeps K in 0..8
      }
    }
    for (int32_t row = cursor.entries; row < b.num_rows; ++row)
      apply_row_output<true>(b, row, out, width, cursor);
  } else if (out.logprobs.empty()) {
    apply_k0_rows(b, out, steady_runs_[oldest], cursor);
  } else {
    for (int32_t row = 0; row < b.num_rows; ++row) apply_k0_row_output(b, row, out, cursor);
  }
  so.req_ids.resize(cursor.entries);
  so.token_offsets.resize(cursor.entries + 1);
  so.new_tokens.resize(cursor.tokens);
  if (!out.logprobs.empty()) so.new_logprobs.resize(cursor.tokens);
  so.finish_reasons.resize(cursor.entries);
  so.stop_tokens.resize(cursor.entries);
  so.prefix_hit_tokens.resize(cursor.entries);
  so.wants_logprobs.resize(cursor.entries);
  squeeze_running();
  --num_outstanding_;
  if (!fenced_blocks_[oldest].empty()) {  // no batch in flight can write them any more
    pool_.free(fenced_blocks_[oldest]);
    fenced_blocks_[oldest].clear();
  }
  return step_output_;
}

}  // namespace atom_sched
