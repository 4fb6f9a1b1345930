#include "atom_sched/step_output.h"

namespace atom_sched {

std::string finish_reason_string(FinishReason reason, int32_t stop_token) {
  switch (reason) {
    case FinishReason::kEos: return "eos";
    case FinishReason::kStopToken: return "stop_" + std::to_string(stop_token);
    case FinishReason::kStopSequence: return "stop_sequence";
    case FinishReason::kMaxTokens: return "max_tokens";
    case FinishReason::kMaxModelLen: return "max_model_len";
    case FinishReason::kAborted: return "abort";
    case FinishReason::kUnschedulable: return "unschedulable";
    case FinishReason::kKvCapacity: return "kv_capacity";
    case FinishReason::kNone: break;
  }
  return "";
}

}  // namespace atom_sched
