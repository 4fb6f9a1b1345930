// Per-row and per-token rules shared by the kernels and their CPU references, so both compute
// every integer the same way; only the parallel decomposition (scans, grid loops) differs, and
// that is what the parity tests check. Internal: included by hip/*.cc and hip/*.hip only.
#pragma once

#include <cstdint>

#include "atom_sched_kernels.h"

#if defined(__CUDACC__) || defined(__HIP__)
#define ATOM_SCHED_HD ATOM_SCHED_HOST_DEVICE __forceinline__
#else
#define ATOM_SCHED_HD inline
#endif

namespace atom_sched::device::detail {

/// A plan's header, validated against the launch's padded sizes and the buffer's capacity.
struct PlanView {
  int32_t num_rows = 0;
  int32_t num_block_updates = 0;
  int32_t num_host_tokens = 0;
  int32_t num_tokens = 0;  // as the host claims it; checked against the sum of q
  int32_t errors = 0;
  const int32_t* rows = nullptr;
  const int32_t* blocks = nullptr;
  const int32_t* tokens = nullptr;
};

ATOM_SCHED_HD PlanView read_plan(const int32_t* plan, int32_t padded_rows, int64_t capacity) {
  PlanView v;
  const int32_t n = plan[kPlanNumRows];
  const int32_t nb = plan[kPlanNumBlockUpdates];
  const int32_t nt = plan[kPlanNumHostTokens];
  // Counts are int32 and checked >= 0 first, so plan_words cannot overflow int64.
  if (plan[kPlanMagicWord] != kPlanMagic || n < 0 || n > padded_rows || nb < 0 || nt < 0 ||
      plan_words(n, nb, nt) > capacity) {
    v.errors = kErrPlan;
    v.rows = v.blocks = v.tokens = plan + kPlanHeaderWords;
    return v;
  }
  v.num_rows = n;
  v.num_block_updates = nb;
  v.num_host_tokens = nt;
  v.num_tokens = plan[kPlanNumTokens];
  v.rows = plan + kPlanHeaderWords;
  v.blocks = v.rows + static_cast<int64_t>(kPlanRowWords) * n;
  v.tokens = v.blocks + static_cast<int64_t>(kPlanBlockWords) * nb;
  return v;
}

struct Row {
  int32_t slot = -1;
  int32_t q = 0;
  int32_t flags = 0;
  int32_t start = 0;         // prefill rows: first position
  int32_t token_offset = 0;  // prefill rows: first token in the plan's token section
  bool valid = false;        // slot in range
};

ATOM_SCHED_HD Row read_row(const PlanView& p, int32_t r, int32_t num_slots) {
  Row row;
  if (r >= p.num_rows) return row;
  const int32_t* w = p.rows + static_cast<int64_t>(kPlanRowWords) * r;
  row.slot = w[0];
  row.q = w[1] & kRowQMask;
  row.flags = static_cast<int32_t>(static_cast<uint32_t>(w[1]) >> kRowFlagShift);
  row.start = w[2];
  row.token_offset = w[3];
  row.valid = row.slot >= 0 && row.slot < num_slots;
  return row;
}

/// The row's context length after this step. Reads the slot's computed length for a decode row.
/// An invalid row counts as a row of q tokens starting at 0 (its tokens become padding).
ATOM_SCHED_HD int32_t row_seq_len(const Row& row, const SlotState& s) {
  if (!row.valid) return row.q;
  if (row.flags & (kRowPrefill | kRowHostInput)) return row.start + row.q;
  return s.computed[row.slot] + row.q;
}

/// Errors a row carries by itself (independent of other rows).
ATOM_SCHED_HD int32_t row_errors(const Row& row, int32_t r, const PlanView& p,
                                 const SlotState& s) {
  if (r >= p.num_rows) return 0;
  if (!row.valid) return kErrSlot;
  int32_t e = 0;
  if (row.flags & (kRowPrefill | kRowHostInput)) {
    if (row.token_offset < 0 || row.q > p.num_host_tokens - row.token_offset) e |= kErrHostToken;
  }
  if (!(row.flags & kRowPrefill) && row.q > s.k + 1) e |= kErrDecodeWidth;
  return e;
}

/// A kRowHostInput row (errors already excluded): the slot's last token and drafts become the
/// row's host tokens [last, d1..dq-1], as if a decode step had left them there; the drafts the
/// row does not carry are missing (-1).
ATOM_SCHED_HD void seed_decode_slot(const Row& row, const PlanView& p, const SlotState& s) {
  const int32_t* t = p.tokens + row.token_offset;
  s.last_token[row.slot] = t[0];
  for (int32_t j = 0; j < s.k; ++j)
    s.drafts[static_cast<int64_t>(row.slot) * s.k + j] = j + 1 < row.q ? t[j + 1] : -1;
}

/// Index of the row whose tokens contain token t: the last r in [0, n) with qsl[r] <= t.
ATOM_SCHED_HD int32_t row_of_token(const int32_t* qsl, int32_t n, int32_t t) {
  int32_t lo = 0, hi = n;  // qsl[lo] <= t < qsl[hi]
  while (hi - lo > 1) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (qsl[mid] <= t) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

struct TokenOut {
  int32_t input_id = 0;
  int64_t position = 0;
  int64_t slot_mapping = -1;
  int32_t errors = 0;
};

/// Token j of row `row`, whose context length after this step is seq_len.
ATOM_SCHED_HD TokenOut token_out(const Row& row, int32_t j, int32_t seq_len, const PlanView& p,
                                 const SlotState& s) {
  TokenOut o;
  const int32_t pos = seq_len - row.q + j;
  o.position = pos;
  if (!row.valid) return o;
  if (row.flags & (kRowPrefill | kRowHostInput)) {
    const int64_t at = static_cast<int64_t>(row.token_offset) + j;
    if (at >= 0 && at < p.num_host_tokens) {
      o.input_id = p.tokens[at];
    } else {
      o.errors |= kErrHostToken;
    }
  } else if (j == 0) {
    o.input_id = s.last_token[row.slot];
  } else if (j <= s.k) {
    // A missing draft (-1: the drafter proposed fewer than K) is padded with the last token, a
    // valid input id; accept_row never accepts it.
    const int32_t d = s.drafts[static_cast<int64_t>(row.slot) * s.k + (j - 1)];
    o.input_id = d >= 0 ? d : s.last_token[row.slot];
  } else {
    o.errors |= kErrDecodeWidth;
  }
  const int32_t blk = pos >= 0 ? pos / s.block_size : -1;
  if (blk >= 0 && blk < s.width) {
    const int32_t id = s.block_table[static_cast<int64_t>(row.slot) * s.width + blk];
    o.slot_mapping = static_cast<int64_t>(id) * s.block_size + pos % s.block_size;
  } else {
    o.errors |= kErrPosition;
  }
  return o;
}

/// Writes the logits and spec-verification indices of row r, given its query range [q0, q1).
/// A row without tokens (padding, where q0 == q1 == the batch's token count) points at the token
/// before it, so a padded gather stays in bounds and reads real data.
ATOM_SCHED_HD void write_logits_indices(const StepInputs& out, int32_t r, int32_t k, int32_t q0,
                                        int32_t q1, bool prefill) {
  const int32_t last = q1 > q0 ? q1 - 1 : (q0 > 0 ? q0 - 1 : 0);
  out.logits_indices[r] = last;
  int32_t* spec = out.spec_logits_indices + static_cast<int64_t>(r) * (k + 1);
  for (int32_t j = 0; j <= k; ++j) {
    const int32_t at = q0 + j;
    spec[j] = (prefill || q1 <= q0 || at > last) ? last : at;
  }
}

/// Block record i: applies it to the slot tables; returns its error bits.
ATOM_SCHED_HD int32_t apply_block_update(const PlanView& p, int32_t i, const SlotState& s) {
  const int32_t* w = p.blocks + static_cast<int64_t>(kPlanBlockWords) * i;
  const int32_t slot = w[0], index = w[1], id = w[2];
  if (slot < 0 || slot >= s.num_slots || index < 0 || index >= s.width) return kErrBlockUpdate;
  s.block_table[static_cast<int64_t>(slot) * s.width + index] = id;
  return 0;
}

/// The accept rule for row r (see launch_accept). Touches only the row's slot and result rows.
ATOM_SCHED_HD void accept_row(const PlanView& p, int32_t r, const SlotState& s,
                              const AcceptInputs& in, int32_t* result) {
  const int32_t n = p.num_rows;
  const int32_t k = s.k;
  int32_t* tokens = result + kResultHeaderWords + static_cast<int64_t>(r) * (k + 1);
  int32_t* accepted = result + kResultHeaderWords + static_cast<int64_t>(n) * (k + 1) + r;
  int32_t* drafts_out =
      result + kResultHeaderWords + static_cast<int64_t>(n) * (k + 2) + static_cast<int64_t>(r) * k;
  const Row row = read_row(p, r, s.num_slots);
  for (int32_t j = 0; j <= k; ++j) tokens[j] = -1;
  *accepted = 1;
  if (in.next_drafts != nullptr) {
    for (int32_t j = 0; j < k; ++j) drafts_out[j] = in.next_drafts[static_cast<int64_t>(r) * k + j];
  }
  if (!row.valid || !(row.flags & kRowEmits)) return;
  const bool decode = !(row.flags & kRowPrefill);
  if (decode && row.q > k + 1) return;  // flagged by apply_plan (kErrDecodeWidth)
  const int32_t kr = decode ? row.q - 1 : 0;  // drafts this row verifies
  const int32_t* target = in.target_tokens + static_cast<int64_t>(r) * (k + 1);
  const int32_t* drafts = s.drafts + static_cast<int64_t>(row.slot) * k;
  const bool probabilistic =
      in.target_probs != nullptr && in.draft_probs != nullptr && in.uniform != nullptr;
  int32_t a = 1;
  for (int32_t j = 0; j < kr; ++j) {
    const int32_t d = drafts[j];
    if (d < 0) break;  // no draft here: the row's drafts end (variable-length drafts)
    bool ok;
    if (probabilistic) {
      const int64_t at = static_cast<int64_t>(r) * k + j;
      ok = in.uniform[at] * in.draft_probs[at] < in.target_probs[at];
    } else {
      ok = d == target[j];
    }
    if (!ok) break;
    tokens[j] = d;
    ++a;
  }
  tokens[a - 1] = target[a - 1];
  *accepted = a;
  if (decode) s.computed[row.slot] -= row.q - a;
  s.last_token[row.slot] = tokens[a - 1];
  if (in.next_drafts != nullptr) {
    int32_t* dst = s.drafts + static_cast<int64_t>(row.slot) * k;
    for (int32_t j = 0; j < k; ++j) dst[j] = drafts_out[j];
  }
}

/// store_drafts for row r.
ATOM_SCHED_HD void store_drafts_row(const PlanView& p, int32_t r, const SlotState& s,
                                    const int32_t* next_drafts, int32_t* result) {
  const int32_t k = s.k;
  const int32_t* src = next_drafts + static_cast<int64_t>(r) * k;
  int32_t* drafts_out = result + kResultHeaderWords + static_cast<int64_t>(p.num_rows) * (k + 2) +
                        static_cast<int64_t>(r) * k;
  for (int32_t j = 0; j < k; ++j) drafts_out[j] = src[j];
  const Row row = read_row(p, r, s.num_slots);
  if (!row.valid || !(row.flags & kRowEmits)) return;
  int32_t* dst = s.drafts + static_cast<int64_t>(row.slot) * k;
  for (int32_t j = 0; j < k; ++j) dst[j] = src[j];
}

/// The result header (written by one thread).
ATOM_SCHED_HD void write_result_header(const PlanView& p, const SlotState& s, int32_t* result) {
  result[0] = p.num_rows;
  result[1] = *s.errors | p.errors;
  result[2] = s.k;
  result[3] = 0;
}

}  // namespace atom_sched::device::detail
