// prepare: the step plan and the per-slot state -> the model's inputs, in two launches.
//
//  apply_plan_kernel   one block: reset tables, per-row lengths and the slots' computed lengths,
//                      the row scans (query_start_loc, cu_seqlens_k), logits indices, then the
//                      new block ids. One block keeps the scans free of a grid-wide sync; it loops
//                      over tiles of kApplyThreads rows, so any row count works.
//  build_inputs_kernel grid-stride over every padded token (input_ids, positions, slot_mapping)
//                      and every padded block-table entry (a gather in batch order).
//
// Both read the row and token counts from device memory (the plan and meta), never from kernel
// arguments, so a captured graph replays any batch within its padded sizes.
#include "atom_sched_hip.h"

#include "atom_sched_device_common.h"
#include "atom_sched_kernels.h"

namespace atom_sched::device {
namespace {

using detail::PlanView;
using detail::Row;

constexpr int kApplyThreads = 1024;
constexpr int kBuildThreads = 256;
constexpr int kMaxBuildBlocks = 8192;
constexpr int kMaxWarps = kApplyThreads / 32;  // enough for 32- and 64-lane warps

/// Block-wide inclusive scan of two values; `total_*` receive the block's sums. Every thread of
/// the block must call it.
__device__ __forceinline__ void block_scan2(int32_t& a, int32_t& b, int32_t& total_a,
                                            int32_t& total_b, int32_t* sh_a, int32_t* sh_b) {
  const int lane = threadIdx.x % ATOM_SCHED_WARP_SIZE;
  const int warp = threadIdx.x / ATOM_SCHED_WARP_SIZE;
  const int num_warps = blockDim.x / ATOM_SCHED_WARP_SIZE;
  a = detail::warp_inclusive_scan(a, lane);
  b = detail::warp_inclusive_scan(b, lane);
  if (lane == ATOM_SCHED_WARP_SIZE - 1) {
    sh_a[warp] = a;
    sh_b[warp] = b;
  }
  __syncthreads();
  if (warp == 0) {
    int32_t x = lane < num_warps ? sh_a[lane] : 0;
    int32_t y = lane < num_warps ? sh_b[lane] : 0;
    x = detail::warp_inclusive_scan(x, lane);
    y = detail::warp_inclusive_scan(y, lane);
    if (lane < num_warps) {
      sh_a[lane] = x;
      sh_b[lane] = y;
    }
  }
  __syncthreads();
  if (warp > 0) {
    a += sh_a[warp - 1];
    b += sh_b[warp - 1];
  }
  total_a = sh_a[num_warps - 1];
  total_b = sh_b[num_warps - 1];
  __syncthreads();  // the shared words are reused by the next call
}

__global__ void __launch_bounds__(kApplyThreads)
    apply_plan_kernel(const int32_t* plan, SlotState s, StepInputs out, int32_t padded_rows,
                      int32_t padded_tokens) {
  __shared__ int32_t sh_a[kMaxWarps];
  __shared__ int32_t sh_b[kMaxWarps];
  __shared__ int32_t reset_slots[kApplyThreads];
  __shared__ int32_t num_resets;
  __shared__ int32_t sh_errors;
  __shared__ int32_t sh_max_q;
  __shared__ int32_t sh_max_k;

  const int tid = threadIdx.x;
  const int threads = blockDim.x;
  const PlanView p = detail::read_plan(plan, padded_rows, s.plan_words);
  const int32_t n = p.num_rows;
  if (tid == 0) {
    num_resets = 0;
    sh_errors = p.errors;
    sh_max_q = 0;
    sh_max_k = 0;
    out.query_start_loc[0] = 0;
    out.cu_seqlens_k[0] = 0;
  }
  __syncthreads();

  int32_t errors = 0, max_q = 0, max_k = 0;
  int32_t carry_q = 0, carry_k = 0;
  for (int32_t base = 0; base < padded_rows; base += threads) {
    const int32_t r = base + tid;
    const Row row = detail::read_row(p, r, s.num_slots);  // r >= n: an empty row
    int32_t q = 0, seq = 0;
    if (r < n) {
      errors |= detail::row_errors(row, r, p, s);
      q = row.q;
      seq = detail::row_seq_len(row, s);
      if (row.valid) {
        s.computed[row.slot] = seq;
        if ((row.flags & kRowHostInput) && !detail::row_errors(row, r, p, s))
          detail::seed_decode_slot(row, p, s);
        if (row.flags & kRowReset) reset_slots[atomicAdd(&num_resets, 1)] = row.slot;
      }
    }
    int32_t inc_q = q, inc_k = seq, tile_q, tile_k;
    block_scan2(inc_q, inc_k, tile_q, tile_k, sh_a, sh_b);
    if (r < padded_rows) {
      const int32_t q1 = carry_q + inc_q;
      out.seq_lens[r] = seq;
      out.query_start_loc[r + 1] = q1;
      out.cu_seqlens_k[r + 1] = carry_k + inc_k;
      detail::write_logits_indices(out, r, s.k, q1 - q, q1, (row.flags & kRowPrefill) != 0);
      max_q = q > max_q ? q : max_q;
      max_k = seq > max_k ? seq : max_k;
    }
    carry_q += tile_q;
    carry_k += tile_k;
    // Reset this tile's reset slots' tables to kNullBlock, all threads together (rare: admissions
    // only).
    // block_scan2 ended with a barrier, so every reset slot of the tile is listed.
    const int64_t zero_words = static_cast<int64_t>(num_resets) * s.width;
    for (int64_t i = tid; i < zero_words; i += threads)
      s.block_table[static_cast<int64_t>(reset_slots[i / s.width]) * s.width + i % s.width] =
          kNullBlock;
    __syncthreads();
    if (tid == 0) num_resets = 0;
    __syncthreads();
  }
  // New block ids, after every reset of this step.
  for (int32_t i = tid; i < p.num_block_updates; i += threads)
    errors |= detail::apply_block_update(p, i, s);
  if (tid == 0 && (carry_q != p.num_tokens || carry_q > padded_tokens)) errors |= kErrPlan;
  if (errors != 0) atomicOr(&sh_errors, errors);
  atomicMax(&sh_max_q, max_q);
  atomicMax(&sh_max_k, max_k);
  __syncthreads();
  if (tid == 0) {
    out.meta[kMetaNumRows] = n;
    out.meta[kMetaNumTokens] = carry_q;
    out.meta[kMetaMaxSeqlenQ] = sh_max_q;
    out.meta[kMetaMaxSeqlenK] = sh_max_k;
    for (int i = kMetaMaxSeqlenK + 1; i < kMetaWords; ++i) out.meta[i] = 0;
    if (sh_errors != 0) atomicOr(s.errors, sh_errors);
  }
}

__global__ void __launch_bounds__(kBuildThreads)
    build_inputs_kernel(const int32_t* plan, SlotState s, StepInputs out, int32_t padded_rows,
                        int32_t padded_tokens) {
  const PlanView p = detail::read_plan(plan, padded_rows, s.plan_words);
  const int32_t meta_rows = out.meta[kMetaNumRows];
  const int32_t meta_tokens = out.meta[kMetaNumTokens];
  const int32_t n = meta_rows < p.num_rows ? meta_rows : p.num_rows;
  const int32_t ntok =
      meta_tokens < 0 ? 0 : (meta_tokens > padded_tokens ? padded_tokens : meta_tokens);
  const int64_t width = s.width;
  const int64_t total = padded_tokens + static_cast<int64_t>(padded_rows) * width;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int32_t errors = 0;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += stride) {
    if (idx < padded_tokens) {
      const int32_t t = static_cast<int32_t>(idx);
      if (t < ntok) {
        const int32_t r = detail::row_of_token(out.query_start_loc, n, t);
        const Row row = detail::read_row(p, r, s.num_slots);
        const detail::TokenOut o =
            detail::token_out(row, t - out.query_start_loc[r], out.seq_lens[r], p, s);
        out.input_ids[t] = o.input_id;
        out.positions[t] = o.position;
        out.slot_mapping[t] = o.slot_mapping;
        errors |= o.errors;
      } else {
        out.input_ids[t] = 0;
        out.positions[t] = 0;
        out.slot_mapping[t] = -1;
      }
    } else {
      const int64_t e = idx - padded_tokens;
      const int32_t r = static_cast<int32_t>(e / width);
      int32_t v = kNullBlock;
      if (r < n) {
        const int32_t slot = p.rows[static_cast<int64_t>(kPlanRowWords) * r];
        if (slot >= 0 && slot < s.num_slots) v = s.block_table[slot * width + e % width];
      }
      out.block_table[e] = v;
    }
  }
  if (errors != 0) atomicOr(s.errors, errors);
}

/// Devices, counted once per process (the runtime caches it anyway).
Status require_device() {
  static const int32_t count = device_count();
  if (count > 0) return {};
  return make_status(StatusCode::kNoDevice, "no %s device is available", ATOM_SCHED_BACKEND_NAME);
}

}  // namespace

Status launch_apply_plan(const int32_t* plan, const SlotState& state, const StepInputs& out,
                         int32_t padded_rows, int32_t padded_tokens, void* stream) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  if (Status s = require_device(); !s.ok()) return s;
  return detail::launch("apply_plan_kernel", apply_plan_kernel, 1, kApplyThreads, stream, plan,
                        state, out, padded_rows, padded_tokens);
}

Status launch_build_inputs(const int32_t* plan, const SlotState& state, const StepInputs& out,
                           int32_t padded_rows, int32_t padded_tokens, void* stream) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  if (Status s = require_device(); !s.ok()) return s;
  const int64_t total = padded_tokens + static_cast<int64_t>(padded_rows) * state.width;
  int64_t blocks = (total + kBuildThreads - 1) / kBuildThreads;
  if (blocks < 1) blocks = 1;
  if (blocks > kMaxBuildBlocks) blocks = kMaxBuildBlocks;
  return detail::launch("build_inputs_kernel", build_inputs_kernel,
                        static_cast<unsigned>(blocks), kBuildThreads, stream, plan, state, out,
                        padded_rows, padded_tokens);
}

Status launch_prepare(const int32_t* plan, const SlotState& state, const StepInputs& out,
                      int32_t padded_rows, int32_t padded_tokens, void* stream) {
  if (Status s = launch_apply_plan(plan, state, out, padded_rows, padded_tokens, stream); !s.ok())
    return s;
  return launch_build_inputs(plan, state, out, padded_rows, padded_tokens, stream);
}

}  // namespace atom_sched::device
