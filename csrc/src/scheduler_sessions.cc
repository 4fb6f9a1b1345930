// Streaming-input sessions (SamplingParams::resumable, vLLM's resumable requests): a turn that
// ends keeps the session's KV, a continuation extends its prompt, and it resumes where its KV
// ends. scheduler.h documents the contract.
#include <algorithm>
#include <cmath>
#include <string>

#include "atom_sched/errors.h"
#include "atom_sched/policy.h"
#include "atom_sched/scheduler.h"
#include "scheduler_internal.h"

namespace atom_sched {

using detail::ceil_div;
using detail::id_str;

void Scheduler::end_turn(int32_t slot) {
  Request& r = requests_[slot];
  if (r.status == RequestStatus::kRunning) {
    remove_running(r);  // (a stop follows a sampled token: never mid-prompt)
    // Every token's KV but the last sampled one's, which no row has input yet (a row in flight
    // that does is discarded when it lands: apply_row_output()).
    r.num_computed_tokens = r.num_tokens() - 1;
  } else {
    list_remove(waiting_, slot);  // preempted: it holds no KV (num_computed_tokens 0)
  }
  std::fill(r.drafts.begin(), r.drafts.end(), -1);
  r.num_drafts = 0;
  r.status = RequestStatus::kWaitingForInput;
  r.input_ready = false;
  list_insert_after(sessions_waiting_, sessions_waiting_.tail, slot);
}

void Scheduler::continue_session(int64_t id, std::span<const int32_t> tokens,
                                 const SamplingParams& params, double arrival_time) {
  // Validate everything before touching any state.
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  const std::string call = "continue_session(" + id_str(id) + "): ";
  Request& r = requests_[slot];
  if (r.status != RequestStatus::kWaitingForInput || r.input_ready)
    throw InvalidArgument(call + (r.status == RequestStatus::kWaitingForInput
                                      ? "its next input has already arrived"
                                      : "the request is not a session waiting for input"));
  if (tokens.empty()) throw InvalidArgument(call + "no new tokens");
  if (!std::isfinite(arrival_time))
    throw InvalidArgument(call + "arrival_time must be finite, got " +
                          std::to_string(arrival_time));
  for (size_t i = 0; i < tokens.size(); ++i)
    if (tokens[i] < 0)
      throw InvalidArgument(call + "token " + std::to_string(i) + " is negative (" +
                            std::to_string(tokens[i]) + ")");
  params.validate();
  if (params.n != 1) throw InvalidArgument(call + "n must be 1");
  if (params.lora_name != r.lora_name || params.cache_salt != r.cache_salt)
    throw InvalidArgument(call + "lora_name and cache_salt must be the session's (its KV was "
                          "computed under them)");

  // The prompt: its tokens but the last it sampled (no row ever input it), then the new ones.
  const int32_t kept = r.num_tokens() - 1;
  std::vector<int32_t> prompt(r.tokens.begin(), r.tokens.begin() + kept);
  prompt.insert(prompt.end(), tokens.begin(), tokens.end());
  r.num_prompt_tokens = static_cast<int32_t>(prompt.size());
  r.tokens.clear();
  r.tokens.reserve(lifetime_tokens(r.num_prompt_tokens, params.max_tokens));
  r.set_tokens(prompt.data(), prompt.size());
  // Hashes of whole blocks within the kept tokens stand; the rest are recomputed on demand.
  const size_t whole = static_cast<size_t>(kept / config_.block_size);
  if (r.block_hashes.size() > whole) r.block_hashes.resize(whole);
  set_sampling(r, params, arrival_time);
  list_remove(sessions_waiting_, slot);
  if (r.device_slot < 0) {
    // Without KV (preempted when its turn ended) it is admitted as any preempted request is.
    r.status = RequestStatus::kWaiting;
    enqueue(waiting_, slot, /*preempted=*/true);
    return;
  }
  r.input_ready = true;
  list_insert_after(sessions_resuming_, sessions_resuming_.tail, slot);
}

void Scheduler::end_session(int64_t id) {
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  Request& r = requests_[slot];
  if (r.status == RequestStatus::kWaitingForInput && !r.input_ready) {
    ++stats_.num_aborted;
    finish(slot, FinishReason::kAborted, -1);
    return;
  }
  r.resumable = false;
}

bool Scheduler::resume_sessions(Batch& b, const PrefillChunk& chunk_of) {
  const int32_t bs = config_.block_size;
  const AdmissionHeadroom headroom{config_.admission_watermark_blocks};
  for (int32_t s = sessions_resuming_.head;
       s >= 0 && b.num_rows < config_.max_num_seqs && row_token_room(b) > 0;) {
    const int32_t next = links_[s].next;
    Request& r = requests_[s];
    if (r.num_inflight > 0) {  // its last turn's rows land first (their outputs are dropped)
      s = next;
      continue;
    }
    if (auto why = unschedulable_reason(r)) {
      reject(s, "unschedulable: " + *why);
      s = next;
      continue;
    }
    // Its KV for the new tokens (and the drafter's lookahead), from the pool: the tokens it
    // kept are its own, and the new ones follow its own KV, which no cached block continues.
    const int32_t target = ceil_div(kv_slots_for(r.num_tokens()), bs);
    const int32_t fresh = std::max(0, target - r.table_size);
    if (fresh + headroom(num_running()) > pool_.num_free_blocks()) return false;
    const int32_t chunk = chunk_of(r.num_tokens() - r.num_computed_tokens, row_token_room(b),
                                   /*must_chunk=*/false);
    if (chunk == 0) return false;
    pool_.grow(r.block_table, target);
    r.table_changed();
    // A new admission for the device: its slot's table is shipped afresh.
    r.epoch = next_epoch_++;
    r.blocks_shipped = 0;
    r.prefill_target = r.num_tokens();
    r.prefix_hit_tokens = r.loaded_tokens = 0;
    r.kept_tokens = r.num_computed_tokens;
    r.input_ready = false;
    list_remove(sessions_resuming_, s);
    r.status = RequestStatus::kRunning;
    add_running(s);
    track_partial(s);  // its new tokens are all to compute
    add_prefill_row(b, s, chunk);
    s = next;
  }
  return true;
}

}  // namespace atom_sched
