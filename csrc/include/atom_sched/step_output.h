// What update() returns: the tokens each request gained this step and which requests finished.
// Flat arrays, reused every step (valid until the next update()).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace atom_sched {

enum class FinishReason : uint8_t {
  kNone = 0,
  kEos,           // "eos"
  kStopToken,     // "stop_<id>"
  kStopSequence,  // "stop_sequence"
  kMaxTokens,     // "max_tokens"
  kMaxModelLen,   // "max_model_len"
  kAborted,       // "abort"
  kUnschedulable, // "unschedulable: <why>" (reported by take_rejected())
  kKvCapacity,    // "kv_capacity": its next position would not fit in the whole KV pool
};

/// ATOM's leave_reason string ("eos", "stop_99", ...). `stop_token` is used by kStopToken.
[[nodiscard]] std::string finish_reason_string(FinishReason reason, int32_t stop_token);

/// The outputs of one update(). Entry i describes request req_ids[i]: its new tokens are
/// new_tokens[token_offsets[i] .. token_offsets[i+1]) (their log-probabilities in new_logprobs when
/// the engine passed them; new_logprobs stays aligned with new_tokens, and wants_logprobs[i] says
/// whether request i asked for them), and it finished this step if finish_reasons[i] != kNone
/// (a streaming-input session's turn ended instead if i is in awaiting_input_entries).
struct StepOutput {
  uint64_t batch_id = 0;
  std::vector<int64_t> req_ids;
  std::vector<int32_t> token_offsets{0};
  std::vector<int32_t> new_tokens;
  std::vector<float> new_logprobs;
  std::vector<FinishReason> finish_reasons;
  std::vector<int32_t> stop_tokens;          // the stop token id for kStopToken, else -1
  std::vector<int32_t> prefix_hit_tokens;    // prompt tokens served by the prefix cache
  std::vector<uint8_t> wants_logprobs;       // the request asked for log-probabilities
  // The whole token sequence (prompt and outputs) of each entry that finished this step, in
  // entry order: entry finished_entries[j]'s is finished_tokens[finished_offsets[j] ..
  // finished_offsets[j+1]) (what an engine writes into its finished sequence; the scheduler
  // forgets the request once it finishes).
  std::vector<int32_t> finished_entries;
  // The entries whose session ended a turn (their finish reason says why) and waits for input
  // instead of finishing (SamplingParams::resumable), ascending; never in finished_entries.
  std::vector<int32_t> awaiting_input_entries;
  std::vector<int32_t> finished_offsets{0};
  std::vector<int32_t> finished_tokens;

  [[nodiscard]] int32_t size() const noexcept { return static_cast<int32_t>(req_ids.size()); }
};

/// A request that can never run (ATOM's static rejection), drained by Scheduler::take_rejected().
struct RejectedRequest {
  int64_t req_id;
  std::string reason;  // "unschedulable: ..."
};

}  // namespace atom_sched
