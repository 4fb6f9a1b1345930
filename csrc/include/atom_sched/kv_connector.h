// The scheduler side of a KV connector, for prefill/decode disaggregation: ATOM's
// KVConnectorSchedulerBase, called by the C++ scheduler and implementable in Python.
//
// Call order within one step (ATOM's, with its bugs 8.5 and 8.34 fixed):
//  * schedule(): for each waiting request it tries to admit, after the prefix probe said it fits,
//    get_num_new_matched_tokens(); then, once its KV blocks are allocated,
//    update_state_after_alloc(). A request whose KV arrives asynchronously waits (its blocks
//    allocated) until the engine reports it in Scheduler::update_from_kv_xfer_finished().
//  * every finish, whatever its reason and whether or not it streams: request_finished(). If it
//    returns true the request's blocks stay allocated until finished_sending names it.
// A connector call that throws costs only its request: schedule() rejects the request with the
// error as its reason; a throwing request_finished() frees the blocks at once. A connector that
// throws ConnectorInterrupt instead is not failing its request (below).
#pragma once

#include <cstdint>
#include <exception>
#include <span>
#include <vector>

#include "atom_sched/step_output.h"

namespace atom_sched {

/// What a connector sees of a request. Spans point into the scheduler and are valid for the call.
struct ConnectorRequest {
  int64_t id = -1;
  std::span<const int32_t> token_ids;  // real tokens: the prompt, then generated tokens
  int32_t num_prompt_tokens = 0;
  std::span<const int32_t> block_ids;  // the request's KV blocks (empty before allocation)
  int32_t num_cached_tokens = 0;       // prefix-cache hit tokens of the current admission
  std::span<const int32_t> draft_token_ids;  // drafts proposed with the last output (K or empty)
  FinishReason finish_reason = FinishReason::kNone;  // set for request_finished()
  int32_t stop_token = -1;                           // the stop token of a kStopToken finish
};

/// get_num_new_matched_tokens()'s answer. Two shapes:
///  * ATOM's remote prefill: load_async with first_token >= 0. The whole prompt is remote
///    (num_tokens is informational); once the KV arrives the request decodes, first_token being
///    its first real token.
///  * External KV (vLLM's connectors), first_token == -1: num_tokens tokens after the local
///    prefix hit (ConnectorRequest::num_cached_tokens) have KV the connector supplies. With
///    load_async the request waits for it; once it arrives the request prefills what is left
///    (re-forwarding the last token when nothing is). Without, the KV loads during the step that
///    admits the request, which computes from there; at least one token is always computed.
///    More tokens than the request has is read as all of them.
/// retry_later (vLLM's None): the connector cannot tell yet; the request stays waiting, skipped
/// in this step's admission (the requests behind it are still considered).
struct RemoteMatch {
  int32_t num_tokens = 0;
  bool load_async = false;   // the request waits for that KV instead of prefilling
  int32_t first_token = -1;  // the producer's first sampled token (ATOM's T0), -1 if none
  std::vector<int32_t> draft_tokens;  // the producer's drafts for the first decode (<= K used)
  bool retry_later = false;

  /// num_tokens >= 0; token ids are checked as prompt tokens are: first_token >= -1, every draft
  /// >= 0; load_async needs something to load (num_tokens > 0 or a first_token). Throws
  /// InvalidArgument naming the bad value. The scheduler calls it on every answer (a bad answer
  /// is a failed connector call); a binding may call it on construction.
  void validate() const;
};

/// Thrown by a connector to interrupt the scheduler call it is in without judging the request
/// (the Python binding throws it for KeyboardInterrupt and SystemExit, which must reach the
/// engine). The scheduler finishes the call consistently: a request being admitted stays at the
/// head of `waiting` as it was (its blocks, if just allocated, are freed; it is asked again at its
/// next admission) and no further request is admitted in that call; a request being finished
/// finishes as if request_finished() had returned false. Nothing is rejected or counted as a
/// connector error.
struct ConnectorInterrupt : std::exception {
  [[nodiscard]] const char* what() const noexcept override {
    return "a KV connector interrupted the scheduler call";
  }
};

class KvConnector {
 public:
  virtual ~KvConnector() = default;
  /// True on the prefill (producer) side. ATOM's interface; the scheduler itself decides from
  /// request_finished()'s answer whether blocks wait for a send.
  [[nodiscard]] virtual bool is_producer() const = 0;
  /// Must not change the connector's state in a way a repeated call would see (ATOM's MoRIIO
  /// tagged requests here, 8.5): next_batch_info() calls it on a dry run.
  virtual RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& request) = 0;
  virtual void update_state_after_alloc(const ConnectorRequest& request) = 0;
  /// Returns true to keep the request's blocks until finished_sending reports it.
  virtual bool request_finished(const ConnectorRequest& request) = 0;
};

}  // namespace atom_sched
