// CPU references of the device kernels (atom_sched_kernels.h): the same rules as the kernels
// (atom_sched_device_common.h), applied sequentially. They are also the CPU path of
// DeviceBatchBuilder, so they are written to be cheap per row, not only obviously right.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstring>

#include "atom_sched_device_common.h"
#include "atom_sched_kernels.h"

namespace atom_sched::device {

using detail::PlanView;
using detail::Row;

Status make_status(StatusCode code, const char* format, ...) {
  Status s;
  s.code = code;
  va_list args;
  va_start(args, format);
  std::vsnprintf(s.message, sizeof(s.message), format, args);
  va_end(args);
  return s;
}

// Every launch reads the plan's header: the buffer must at least hold one.
static Status check_plan_capacity(const char* what, const SlotState& state) {
  if (state.plan_words < kPlanHeaderWords)
    return make_status(StatusCode::kInvalidArgument,
                       "%s: state.plan_words=%lld, a plan buffer holds at least %d words", what,
                       static_cast<long long>(state.plan_words), kPlanHeaderWords);
  return {};
}

Status check_prepare_args(const int32_t* plan, const SlotState& state, const StepInputs& out,
                          int32_t padded_rows, int32_t padded_tokens) {
  if (plan == nullptr) return make_status(StatusCode::kInvalidArgument, "prepare: plan is null");
  if (state.block_table == nullptr || state.computed == nullptr || state.last_token == nullptr ||
      state.errors == nullptr || (state.k > 0 && state.drafts == nullptr))
    return make_status(StatusCode::kInvalidArgument, "prepare: a slot-state pointer is null");
  if (out.input_ids == nullptr || out.positions == nullptr || out.slot_mapping == nullptr ||
      out.seq_lens == nullptr || out.query_start_loc == nullptr || out.cu_seqlens_k == nullptr ||
      out.block_table == nullptr || out.logits_indices == nullptr ||
      out.spec_logits_indices == nullptr || out.meta == nullptr)
    return make_status(StatusCode::kInvalidArgument, "prepare: an output pointer is null");
  if (state.num_slots < 1 || state.width < 1 || state.block_size < 1 || state.k < 0 ||
      state.k > kMaxSpecTokens)
    return make_status(StatusCode::kInvalidArgument,
                       "prepare: bad state sizes (num_slots=%d width=%d block_size=%d k=%d)",
                       state.num_slots, state.width, state.block_size, state.k);
  if (padded_rows < 1 || padded_tokens < 0)
    return make_status(StatusCode::kInvalidArgument,
                       "prepare: padded_rows=%d padded_tokens=%d (need rows >= 1, tokens >= 0)",
                       padded_rows, padded_tokens);
  return check_plan_capacity("prepare", state);
}

Status check_accept_args(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                         const int32_t* result, int32_t padded_rows) {
  if (plan == nullptr || result == nullptr || in.target_tokens == nullptr)
    return make_status(StatusCode::kInvalidArgument,
                       "accept: plan, result and target_tokens must not be null");
  if (state.computed == nullptr || state.last_token == nullptr || state.errors == nullptr ||
      (state.k > 0 && state.drafts == nullptr))
    return make_status(StatusCode::kInvalidArgument, "accept: a slot-state pointer is null");
  const int given = (in.target_probs != nullptr) + (in.draft_probs != nullptr) +
                    (in.uniform != nullptr);
  if (given != 0 && given != 3)
    return make_status(StatusCode::kInvalidArgument,
                       "accept: give all of target_probs, draft_probs and uniform, or none");
  if (state.num_slots < 1 || state.k < 0 || state.k > kMaxSpecTokens || padded_rows < 1)
    return make_status(StatusCode::kInvalidArgument,
                       "accept: bad sizes (num_slots=%d k=%d padded_rows=%d)", state.num_slots,
                       state.k, padded_rows);
  return check_plan_capacity("accept", state);
}

Status check_store_drafts_args(const int32_t* plan, const SlotState& state,
                               const int32_t* next_drafts, const int32_t* result,
                               int32_t padded_rows) {
  if (plan == nullptr || result == nullptr || next_drafts == nullptr)
    return make_status(StatusCode::kInvalidArgument,
                       "store_drafts: plan, next_drafts and result must not be null");
  if (state.k < 1 || state.k > kMaxSpecTokens || state.drafts == nullptr)
    return make_status(StatusCode::kInvalidArgument,
                       "store_drafts: needs k in 1..%d and a drafts buffer (k=%d)", kMaxSpecTokens,
                       state.k);
  if (state.num_slots < 1 || padded_rows < 1)
    return make_status(StatusCode::kInvalidArgument, "store_drafts: bad sizes");
  return check_plan_capacity("store_drafts", state);
}

Status pack_plan(const PlanSource& src, int32_t* out, int64_t capacity_words, int64_t* words) {
  *words = 0;
  const int32_t n = src.num_rows;
  if (n < 0) return make_status(StatusCode::kInvalidArgument, "pack_plan: num_rows=%d", n);
  if (n > 0 && (src.request_slots == nullptr || src.num_scheduled_tokens == nullptr ||
                src.num_cached_tokens == nullptr || src.is_prefill == nullptr ||
                src.slot_reset == nullptr || src.emits_token == nullptr ||
                src.new_block_starts == nullptr || src.new_block_offsets == nullptr ||
                src.cu_seqlens_q == nullptr))
    return make_status(StatusCode::kInvalidArgument, "pack_plan: a row array is null");
  // Sizes first, so nothing is written when the plan does not fit.
  int64_t host_tokens = 0;
  const int32_t num_updates = n > 0 ? src.new_block_offsets[n] - src.new_block_offsets[0] : 0;
  for (int32_t r = 0; r < n; ++r) {
    const int32_t q = src.num_scheduled_tokens[r];
    if (q < 1 || q > kRowQMask)
      return make_status(StatusCode::kInvalidArgument, "pack_plan: row %d has q=%d", r, q);
    if (src.new_block_offsets[r + 1] < src.new_block_offsets[r] ||
        src.cu_seqlens_q[r + 1] - src.cu_seqlens_q[r] != q)
      return make_status(StatusCode::kInvalidArgument,
                         "pack_plan: row %d: offsets disagree with the row's sizes", r);
    if (src.is_prefill[r] || src.slot_reset[r]) host_tokens += q;
  }
  if (host_tokens > 0 && src.scheduled_tokens == nullptr)
    return make_status(StatusCode::kInvalidArgument, "pack_plan: scheduled_tokens is null");
  if (num_updates > 0 && src.new_block_ids == nullptr)
    return make_status(StatusCode::kInvalidArgument, "pack_plan: new_block_ids is null");
  const int64_t total = plan_words(n, num_updates, host_tokens);
  if (total > capacity_words)
    return make_status(StatusCode::kInvalidArgument,
                       "pack_plan: the plan needs %lld words, the buffer holds %lld",
                       static_cast<long long>(total), static_cast<long long>(capacity_words));

  int32_t* rows = out + kPlanHeaderWords;
  int32_t* blocks = rows + static_cast<int64_t>(kPlanRowWords) * n;
  int32_t* tokens = blocks + static_cast<int64_t>(kPlanBlockWords) * num_updates;
  int32_t tok = 0;
  int32_t upd = 0;
  const int32_t off0 = n > 0 ? src.new_block_offsets[0] : 0;
  for (int32_t r = 0; r < n; ++r) {
    const int32_t slot = src.request_slots[r];
    const int32_t q = src.num_scheduled_tokens[r];
    const bool prefill = src.is_prefill[r] != 0;
    // A decode row on a fresh slot (after a remote prefill) carries its inputs like a prefill.
    const bool host_input = !prefill && src.slot_reset[r] != 0;
    const bool carries_tokens = prefill || host_input;
    const int32_t flags = (prefill ? kRowPrefill : 0) | (src.slot_reset[r] ? kRowReset : 0) |
                          (src.emits_token[r] ? kRowEmits : 0) |
                          (host_input ? kRowHostInput : 0);
    int32_t* w = rows + static_cast<int64_t>(kPlanRowWords) * r;
    w[0] = slot;
    w[1] = q | (flags << kRowFlagShift);
    w[2] = carries_tokens ? src.num_cached_tokens[r] : 0;
    w[3] = carries_tokens ? tok : 0;
    if (carries_tokens) {
      std::memcpy(tokens + tok, src.scheduled_tokens + src.cu_seqlens_q[r],
                  sizeof(int32_t) * static_cast<size_t>(q));
      tok += q;
    }
    const int32_t b0 = src.new_block_offsets[r] - off0, b1 = src.new_block_offsets[r + 1] - off0;
    for (int32_t b = b0; b < b1; ++b, ++upd) {
      int32_t* bw = blocks + static_cast<int64_t>(kPlanBlockWords) * upd;
      bw[0] = slot;
      bw[1] = src.new_block_starts[r] + (b - b0);
      bw[2] = src.new_block_ids[off0 + b];
    }
  }
  out[kPlanNumRows] = n;
  out[kPlanNumBlockUpdates] = num_updates;
  out[kPlanNumHostTokens] = tok;
  out[kPlanNumTokens] = n > 0 ? src.cu_seqlens_q[n] - src.cu_seqlens_q[0] : 0;
  out[kPlanMagicWord] = kPlanMagic;
  for (int32_t i = kPlanMagicWord + 1; i < kPlanHeaderWords; ++i) out[i] = 0;
  *words = total;
  return {};
}

// ---- prepare ------------------------------------------------------------------------------------

Status apply_plan_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                      int32_t padded_rows, int32_t padded_tokens, void* /*stream*/) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  const PlanView p = detail::read_plan(plan, padded_rows, state.plan_words);
  int32_t errors = p.errors;
  const int32_t n = p.num_rows;
  const int32_t k = state.k;
  // Reset tables first: the block records of this step land after every reset.
  for (int32_t r = 0; r < n; ++r) {
    const Row row = detail::read_row(p, r, state.num_slots);
    if (row.valid && (row.flags & kRowReset))
      std::fill_n(state.block_table + static_cast<int64_t>(row.slot) * state.width, state.width,
                  kNullBlock);
  }
  int32_t q_total = 0, k_total = 0, max_q = 0, max_k = 0;
  out.query_start_loc[0] = 0;
  out.cu_seqlens_k[0] = 0;
  for (int32_t r = 0; r < n; ++r) {
    const Row row = detail::read_row(p, r, state.num_slots);
    errors |= detail::row_errors(row, r, p, state);
    const int32_t seq = detail::row_seq_len(row, state);
    if (row.valid) state.computed[row.slot] = seq;
    if (row.valid && (row.flags & kRowHostInput) && !detail::row_errors(row, r, p, state))
      detail::seed_decode_slot(row, p, state);
    out.seq_lens[r] = seq;
    q_total += row.q;
    k_total += seq;
    out.query_start_loc[r + 1] = q_total;
    out.cu_seqlens_k[r + 1] = k_total;
    max_q = std::max(max_q, row.q);
    max_k = std::max(max_k, seq);
  }
  for (int32_t r = n; r < padded_rows; ++r) {
    out.seq_lens[r] = 0;
    out.query_start_loc[r + 1] = q_total;
    out.cu_seqlens_k[r + 1] = k_total;
  }
  if (q_total != p.num_tokens || q_total > padded_tokens) errors |= kErrPlan;
  for (int32_t r = 0; r < padded_rows; ++r) {
    const Row row = detail::read_row(p, r, state.num_slots);
    detail::write_logits_indices(out, r, k, out.query_start_loc[r], out.query_start_loc[r + 1],
                                 (row.flags & kRowPrefill) != 0);
  }
  for (int32_t i = 0; i < p.num_block_updates; ++i)
    errors |= detail::apply_block_update(p, i, state);
  out.meta[kMetaNumRows] = n;
  out.meta[kMetaNumTokens] = q_total;
  out.meta[kMetaMaxSeqlenQ] = max_q;
  out.meta[kMetaMaxSeqlenK] = max_k;
  for (int32_t i = kMetaMaxSeqlenK + 1; i < kMetaWords; ++i) out.meta[i] = 0;
  *state.errors |= errors;
  return {};
}

Status build_inputs_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                        int32_t padded_rows, int32_t padded_tokens, void* /*stream*/) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  const PlanView p = detail::read_plan(plan, padded_rows, state.plan_words);
  const int32_t n = std::min(out.meta[kMetaNumRows], p.num_rows);
  const int32_t ntok = std::clamp(out.meta[kMetaNumTokens], 0, padded_tokens);
  int32_t errors = 0;
  for (int32_t r = 0; r < n; ++r) {
    const Row row = detail::read_row(p, r, state.num_slots);
    const int32_t q0 = out.query_start_loc[r];
    const int32_t q1 = std::min(out.query_start_loc[r + 1], ntok);
    const int32_t seq = out.seq_lens[r];
    for (int32_t t = q0; t < q1; ++t) {
      const detail::TokenOut o = detail::token_out(row, t - q0, seq, p, state);
      out.input_ids[t] = o.input_id;
      out.positions[t] = o.position;
      out.slot_mapping[t] = o.slot_mapping;
      errors |= o.errors;
    }
    int32_t* dst = out.block_table + static_cast<int64_t>(r) * state.width;
    if (row.valid) {
      std::copy_n(state.block_table + static_cast<int64_t>(row.slot) * state.width, state.width,
                  dst);
    } else {
      std::fill_n(dst, state.width, kNullBlock);
    }
  }
  for (int32_t t = ntok; t < padded_tokens; ++t) {
    out.input_ids[t] = 0;
    out.positions[t] = 0;
    out.slot_mapping[t] = -1;
  }
  std::fill(out.block_table + static_cast<int64_t>(n) * state.width,
            out.block_table + static_cast<int64_t>(padded_rows) * state.width, kNullBlock);
  *state.errors |= errors;
  return {};
}

Status prepare_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                   int32_t padded_rows, int32_t padded_tokens, void* stream) {
  if (Status s = apply_plan_ref(plan, state, out, padded_rows, padded_tokens, stream); !s.ok())
    return s;
  return build_inputs_ref(plan, state, out, padded_rows, padded_tokens, stream);
}

// ---- accept -------------------------------------------------------------------------------------

Status accept_ref(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                  int32_t* result, int32_t padded_rows, void* /*stream*/) {
  if (Status s = check_accept_args(plan, state, in, result, padded_rows); !s.ok()) return s;
  const PlanView p = detail::read_plan(plan, padded_rows, state.plan_words);
  detail::write_result_header(p, state, result);
  for (int32_t r = 0; r < p.num_rows; ++r) detail::accept_row(p, r, state, in, result);
  return {};
}

Status store_drafts_ref(const int32_t* plan, const SlotState& state, const int32_t* next_drafts,
                        int32_t* result, int32_t padded_rows, void* /*stream*/) {
  if (Status s = check_store_drafts_args(plan, state, next_drafts, result, padded_rows); !s.ok())
    return s;
  const PlanView p = detail::read_plan(plan, padded_rows, state.plan_words);
  for (int32_t r = 0; r < p.num_rows; ++r)
    detail::store_drafts_row(p, r, state, next_drafts, result);
  return {};
}

}  // namespace atom_sched::device
