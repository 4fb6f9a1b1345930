// The device side of atom_sched: persistent per-slot state on the device, the step plan the host
// uploads, and the kernels that turn them into model inputs and do the speculative bookkeeping
// (DESIGN.md section 6). Plain C++17: no GPU runtime header, so it is included by the CPU
// references, the bindings and the .hip kernels alike.
//
// Every kernel has a CPU reference with the same signature (`*_ref`, same arguments, the stream
// ignored) that produces identical integers. Launchers (`launch_*`) take raw device pointers and a
// stream (cudaStream_t / hipStream_t as void*), never throw and never abort: they return a Status.
// A build without a GPU back end links launchers that return kNotCompiled.
//
// One step on one stream (the only ordering the kernels rely on):
//   H2D(plan t) -> prepare(t) -> model -> sampling -> accept(t) [-> store_drafts(t)] -> D2H(result)
//   -> H2D(plan t+1) -> prepare(t+1) ...
// accept(t) reads the device copy of plan t, so it must be enqueued before plan t+1 is uploaded.
// Nothing in a step waits for the host.
#pragma once

#include <cstddef>
#include <cstdint>

// Functions the host packing and the kernels both call. Under nvcc a plain constexpr function is
// host-only: a kernel calling it is undefined (nvcc 13 warns, then folded such a call into "plan
// invalid" on an H200: every kernel wrote padding), so both sides must be named.
#if defined(__CUDACC__) || defined(__HIP__)
#define ATOM_SCHED_HOST_DEVICE __host__ __device__
#else
#define ATOM_SCHED_HOST_DEVICE
#endif

namespace atom_sched::device {

// ---- Status ------------------------------------------------------------------------------------

enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  // a null pointer or an impossible size: nothing was launched
  kLaunchFailed = 2,     // the runtime refused the launch (message says why)
  kNoDevice = 3,         // a GPU back end is compiled in but no device is usable
  kNotCompiled = 4,      // this build has no GPU back end
};

/// The outcome of a launcher or reference. `message` is empty when ok().
struct [[nodiscard]] Status {
  StatusCode code = StatusCode::kOk;
  char message[192] = {};
  [[nodiscard]] bool ok() const noexcept { return code == StatusCode::kOk; }
};

/// A Status with a printf-style message (truncated to fit).
Status make_status(StatusCode code, const char* format, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

// ---- The step plan (host -> device, one copy per step) ------------------------------------------
//
// One int32 buffer: a header, one 16-byte record per row, one 12-byte record per new block id,
// then the prompt tokens of prefill rows. A decode row costs 16 bytes; it gets no token (its
// inputs are on the device) and a new block id only every block_size tokens.

inline constexpr int32_t kPlanMagic = 0x41534450;  // "ASDP"
inline constexpr int32_t kPlanHeaderWords = 8;
// Header words.
inline constexpr int32_t kPlanNumRows = 0;
inline constexpr int32_t kPlanNumBlockUpdates = 1;
inline constexpr int32_t kPlanNumHostTokens = 2;
inline constexpr int32_t kPlanNumTokens = 3;  // sum of q over rows (checked on the device)
inline constexpr int32_t kPlanMagicWord = 4;
// Row record: {slot, q | flags << kRowFlagShift, start, token_offset}.
inline constexpr int32_t kPlanRowWords = 4;
inline constexpr int32_t kRowFlagShift = 24;
inline constexpr int32_t kRowQMask = (1 << kRowFlagShift) - 1;
/// The row's tokens and start position come from the plan (a prefill chunk). Otherwise the row
/// decodes: start = the slot's computed length, inputs = [last token, drafts...] of the slot.
inline constexpr int32_t kRowPrefill = 1;
/// The slot starts a new admission: its block-table row is zeroed before new blocks land.
inline constexpr int32_t kRowReset = 2;
/// The row samples a token (a decode row, or the prefill chunk that completes the prompt).
inline constexpr int32_t kRowEmits = 4;
/// A decode row whose inputs only the host knows: the first decode on a fresh slot after a remote
/// prefill (the slot never saw this request's prompt). Its start and tokens come from the plan as
/// for a prefill row, and the slot's last token and drafts are set from those tokens, so the
/// row is verified like any decode row.
inline constexpr int32_t kRowHostInput = 8;
// Block record: {slot, index in the slot's table row, block id}.
inline constexpr int32_t kPlanBlockWords = 3;

/// Words of a plan with these counts.
[[nodiscard]] ATOM_SCHED_HOST_DEVICE constexpr int64_t plan_words(int64_t num_rows,
                                                                  int64_t num_block_updates,
                                                                  int64_t num_host_tokens) {
  return kPlanHeaderWords + kPlanRowWords * num_rows + kPlanBlockWords * num_block_updates +
         num_host_tokens;
}

/// The batch fields a plan is packed from (all host memory, row order; see batch.h). Pointers are
/// borrowed for the call.
struct PlanSource {
  int32_t num_rows = 0;
  const int32_t* request_slots = nullptr;         // [num_rows]
  const int32_t* num_scheduled_tokens = nullptr;  // [num_rows] q
  const int32_t* num_cached_tokens = nullptr;     // [num_rows] start position of prefill rows
  const uint8_t* is_prefill = nullptr;            // [num_rows] per-row prefill flag
  const uint8_t* slot_reset = nullptr;            // [num_rows]
  const uint8_t* emits_token = nullptr;           // [num_rows]
  const int32_t* new_block_starts = nullptr;      // [num_rows]
  const int32_t* new_block_offsets = nullptr;     // [num_rows + 1] into new_block_ids
  const int32_t* new_block_ids = nullptr;
  const int32_t* scheduled_tokens = nullptr;      // [cu_seqlens_q[num_rows]]
  const int32_t* cu_seqlens_q = nullptr;          // [num_rows + 1]
};

/// Writes the plan of `src` into `out` (capacity `capacity_words`); `*words` receives its size.
/// kInvalidArgument (nothing written past the header) when it does not fit, a q is outside
/// 1..kRowQMask, or offsets are not non-decreasing.
Status pack_plan(const PlanSource& src, int32_t* out, int64_t capacity_words, int64_t* words);

// ---- Persistent per-slot device state ----------------------------------------------------------

/// The block every table entry past a request's blocks holds: the scheduler's null block, never
/// allocated (atom_sched::kNullBlock, block_pool.h; docs/design.md "block-table contract").
inline constexpr int32_t kNullBlock = 0;

/// Device pointers (owned by the caller) to the state of num_slots request slots.
struct SlotState {
  int32_t* block_table = nullptr;  // [num_slots, width] block ids, kNullBlock past a request's
  int32_t* computed = nullptr;     // [num_slots] KV positions computed, exact on the device
  int32_t* last_token = nullptr;   // [num_slots] the last accepted token (next decode input)
  int32_t* drafts = nullptr;       // [num_slots, k] draft tokens (next decode inputs 1..k)
  int32_t* errors = nullptr;       // [1] sticky kErr* bits, never cleared by a kernel
  int32_t num_slots = 0;
  int32_t width = 0;       // block-table columns (Batch::block_table_width)
  int32_t k = 0;           // speculative tokens per decode row, 0..kMaxSpecTokens
  int32_t block_size = 0;  // tokens per KV block
  // Words of every plan buffer launched with this state (the builder sizes them all alike): the
  // kernels bound the plan's header counts by it, so a corrupt count cannot send them past it.
  int64_t plan_words = 0;
};

inline constexpr int32_t kMaxSpecTokens = 8;

// Error bits (SlotState::errors and the accept result header). A bad plan never makes a kernel
// read or write out of bounds: the offending row or entry is skipped (rows then look like padding).
inline constexpr int32_t kErrPlan = 1;  // bad magic, row count or token count, or counts past
                                        // the plan buffer (SlotState::plan_words)
inline constexpr int32_t kErrSlot = 2;          // a row's slot is outside 0..num_slots-1
inline constexpr int32_t kErrBlockUpdate = 4;   // a block record's slot or index is out of range
inline constexpr int32_t kErrPosition = 8;      // a position's block is past the table width
inline constexpr int32_t kErrDecodeWidth = 16;  // a decode row has q > k + 1
inline constexpr int32_t kErrHostToken = 32;    // a prefill row's tokens are outside the upload

// ---- prepare: plan + state -> model inputs -----------------------------------------------------

/// Device output buffers of prepare, sized for the largest padded batch (owned by the caller).
struct StepInputs {
  int32_t* input_ids = nullptr;            // [padded_tokens]; pad 0
  int64_t* positions = nullptr;            // [padded_tokens]; pad 0
  int64_t* slot_mapping = nullptr;         // [padded_tokens]; pad -1
  int32_t* seq_lens = nullptr;             // [padded_rows] context lengths; pad 0
  int32_t* query_start_loc = nullptr;      // [padded_rows + 1] cu_seqlens_q; pad repeats the total
  int32_t* cu_seqlens_k = nullptr;         // [padded_rows + 1]; pad repeats the total
  int32_t* block_table = nullptr;          // [padded_rows, width] batch order; kNullBlock pads
  int32_t* logits_indices = nullptr;       // [padded_rows] last token of each row
  int32_t* spec_logits_indices = nullptr;  // [padded_rows, k + 1] tokens whose logits verify
  int32_t* meta = nullptr;                 // [kMetaWords]
};

// meta words written by apply_plan.
inline constexpr int32_t kMetaWords = 8;
inline constexpr int32_t kMetaNumRows = 0;
inline constexpr int32_t kMetaNumTokens = 1;
inline constexpr int32_t kMetaMaxSeqlenQ = 2;
inline constexpr int32_t kMetaMaxSeqlenK = 3;

/// Kernel 1 of prepare (one block): zeroes the tables of reset slots, appends the new block ids,
/// sets each slot's computed length (prefill rows: start + q; decode rows: computed + q), and
/// writes seq_lens, query_start_loc, cu_seqlens_k, logits_indices, spec_logits_indices and meta
/// for `padded_rows` rows. `plan` is device memory; the row and token counts are read from it so
/// that a captured graph replays any batch up to the padded sizes given here.
Status launch_apply_plan(const int32_t* plan, const SlotState& state, const StepInputs& out,
                         int32_t padded_rows, int32_t padded_tokens, void* stream);
Status apply_plan_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                      int32_t padded_rows, int32_t padded_tokens, void* stream);

/// Kernel 2 of prepare (grid-wide, after apply_plan): input_ids, positions, slot_mapping for
/// `padded_tokens` tokens and the batch-ordered block_table for `padded_rows` rows.
Status launch_build_inputs(const int32_t* plan, const SlotState& state, const StepInputs& out,
                           int32_t padded_rows, int32_t padded_tokens, void* stream);
Status build_inputs_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                        int32_t padded_rows, int32_t padded_tokens, void* stream);

/// apply_plan then build_inputs: one step's inputs in two launches.
Status launch_prepare(const int32_t* plan, const SlotState& state, const StepInputs& out,
                      int32_t padded_rows, int32_t padded_tokens, void* stream);
Status prepare_ref(const int32_t* plan, const SlotState& state, const StepInputs& out,
                   int32_t padded_rows, int32_t padded_tokens, void* stream);

// ---- accept: after sampling ---------------------------------------------------------------------

/// The compact result of one step, int32, copied to host memory for Scheduler::update:
/// header [kResultHeaderWords] = {num_rows, errors, k, 0}, then sampled tokens [num_rows, k + 1]
/// (-1 past the accepted ones), num_accepted [num_rows], next drafts [num_rows, k].
inline constexpr int32_t kResultHeaderWords = 4;
[[nodiscard]] constexpr int64_t result_words(int64_t num_rows, int64_t k) {
  return kResultHeaderWords + num_rows * (2 * k + 2);
}

/// Inputs of the accept kernel (device pointers; rows past the plan's row count are ignored).
struct AcceptInputs {
  /// [rows, k + 1]: the target model's token at each of a row's positions (greedy), or with
  /// probabilities the recovered token at a rejected position and the bonus token at position k.
  const int32_t* target_tokens = nullptr;
  /// [rows, k] next drafts, or null to leave drafts to store_drafts.
  const int32_t* next_drafts = nullptr;
  /// Probabilistic verification when all three are given, [rows, k] each: draft j + 1 is accepted
  /// iff uniform * draft_probs < target_probs, i.e. with probability min(1, p_target / p_draft).
  const float* target_probs = nullptr;
  const float* draft_probs = nullptr;
  const float* uniform = nullptr;
};

/// One thread per row: verifies the row's drafts (those in the slot state, i.e. this step's
/// inputs) until the first rejection, writes the accepted tokens, -1 padded, and their count a
/// (1..q; 1 for prefill rows), rolls a decode row's computed length back by q - a, stores the
/// slot's last token and (if given) next drafts. Rows that emit no token are left alone (a = 1,
/// tokens -1). `result` is device memory of result_words(padded_rows, k) words.
Status launch_accept(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                     int32_t* result, int32_t padded_rows, void* stream);
Status accept_ref(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                  int32_t* result, int32_t padded_rows, void* stream);

/// Stores next drafts [rows, k] after the drafter ran (when accept got none): the slot state of
/// emitting rows and the result's draft section.
Status launch_store_drafts(const int32_t* plan, const SlotState& state, const int32_t* next_drafts,
                           int32_t* result, int32_t padded_rows, void* stream);
Status store_drafts_ref(const int32_t* plan, const SlotState& state, const int32_t* next_drafts,
                        int32_t* result, int32_t padded_rows, void* stream);

// ---- Runtime ------------------------------------------------------------------------------------

/// "cuda", "hip" or "none" (this build's GPU back end).
[[nodiscard]] const char* backend_name() noexcept;
/// Usable devices; 0 without a back end, without a driver or without a device (never fails).
[[nodiscard]] int32_t device_count() noexcept;
/// Lanes per warp (wavefront) of the kernels: 32 for CUDA, 64 for AMD CDNA, 0 without a back end.
[[nodiscard]] int32_t warp_size() noexcept;

// ---- Argument checks shared by launchers and references -----------------------------------------

/// kInvalidArgument when a pointer prepare needs is null or a size is impossible.
Status check_prepare_args(const int32_t* plan, const SlotState& state, const StepInputs& out,
                          int32_t padded_rows, int32_t padded_tokens);
Status check_accept_args(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                         const int32_t* result, int32_t padded_rows);
Status check_store_drafts_args(const int32_t* plan, const SlotState& state,
                               const int32_t* next_drafts, const int32_t* result,
                               int32_t padded_rows);

}  // namespace atom_sched::device
