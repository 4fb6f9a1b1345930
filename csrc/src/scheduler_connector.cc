// The scheduler's KV-connector side: the views a connector sees, transfer reports, and the move
// of a remotely prefilled request into the decode set.
#include <algorithm>
#include <array>
#include <string>
#include <vector>
#include <unordered_set>

#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "scheduler_internal.h"

namespace atom_sched {

using detail::id_str;

void RemoteMatch::validate() const {
  if (retry_later) return;  // nothing else is read
  if (num_tokens < 0)
    throw InvalidArgument("RemoteMatch.num_tokens must be >= 0, got " +
                          std::to_string(num_tokens));
  if (first_token < -1)
    throw InvalidArgument("RemoteMatch.first_token must be >= 0, or -1 for none, got " +
                          std::to_string(first_token));
  for (size_t i = 0; i < draft_tokens.size(); ++i)
    if (draft_tokens[i] < 0)
      throw InvalidArgument("RemoteMatch.draft_tokens[" + std::to_string(i) + "] is negative (" +
                            std::to_string(draft_tokens[i]) + ")");
  if (load_async && num_tokens == 0 && first_token < 0)
    throw InvalidArgument("RemoteMatch: load_async with nothing to load (num_tokens 0, no "
                          "first_token)");
}

ConnectorRequest Scheduler::connector_view(const Request& r) const {
  ConnectorRequest v;
  v.id = r.id;
  v.token_ids = r.tokens;
  v.num_prompt_tokens = r.num_prompt_tokens;
  v.block_ids = r.block_table;
  v.num_cached_tokens = r.prefix_hit_tokens;
  v.draft_token_ids = r.drafts;
  v.finish_reason = r.finish_reason;
  v.stop_token = r.stop_token;
  return v;
}

void Scheduler::connector_failed(const Request& r, const char* call, const std::exception& e) {
  ++stats_.num_connector_errors;
  connector_errors_.push_back("request " + id_str(r.id) + ": " + call + ": " + e.what());
}

std::vector<std::string> Scheduler::take_connector_errors() {
  std::vector<std::string> out;
  out.swap(connector_errors_);
  return out;
}

void Scheduler::update_from_kv_xfer_finished(std::span<const int64_t> finished_sending,
                                             std::span<const int64_t> finished_recving) {
  // Validate every id first: a bad report changes nothing. An id named twice (in one list or in
  // both) is a bad report too: applying it twice would free blocks twice.
  std::unordered_set<int64_t> seen;
  for (auto ids : {finished_recving, finished_sending})
    for (int64_t id : ids)
      if (!seen.insert(id).second)
        throw InvalidArgument("update_from_kv_xfer_finished: request " + id_str(id) +
                              " is reported twice");
  for (int64_t id : finished_recving) {
    auto it = deferred_.find(id);
    if (it != deferred_.end() && requests_[it->second].awaiting_recv) continue;
    const int32_t s = slot_of(id);
    if (s < 0) throw UnknownRequest("finished_recving names unknown request " + id_str(id));
    if (requests_[s].status != RequestStatus::kWaitingForRemoteKv || requests_[s].remote_ready)
      throw InvalidArgument("finished_recving: request " + id_str(id) +
                            " is not waiting for remote KV");
  }
  for (int64_t id : finished_sending) {
    auto it = deferred_.find(id);
    if (it == deferred_.end() || !requests_[it->second].awaiting_send)
      throw UnknownRequest("finished_sending names request " + id_str(id) +
                           ", which has no KV waiting to be sent");
  }
  auto release = [&](int32_t s) {
    Request& r = requests_[s];
    if (r.awaiting_send || r.awaiting_recv) return;
    pool_.free(r.block_table);
    r.block_table.clear();
    r.table_changed();
    deferred_.erase(r.id);
    release_slot_if_done(s);
  };
  for (int64_t id : finished_recving) {
    auto it = deferred_.find(id);
    if (it != deferred_.end()) {  // aborted while its KV was arriving: now the blocks can go
      const int32_t s = it->second;
      requests_[s].awaiting_recv = false;
      release(s);
    } else {
      requests_[slot_of(id)].remote_ready = true;
    }
  }
  for (int64_t id : finished_sending) {
    const int32_t s = deferred_.at(id);
    requests_[s].awaiting_send = false;
    release(s);
  }
}


void Scheduler::recompute_kv_from(int64_t id, int32_t position) {
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  const std::string call = "recompute_kv_from(" + id_str(id) + ", " + std::to_string(position) +
                           "): ";
  Request& r = requests_[slot];
  if (position < 0) throw InvalidArgument(call + "the position must be >= 0");
  const int32_t served = r.blocks_published * config_.block_size;
  if (position < served)
    throw InvalidArgument(call + "the prefix cache serves its KV up to position " +
                          std::to_string(served));
  if (r.status == RequestStatus::kWaitingForRemoteKv) {
    if (position >= r.remote_computed && r.remote_first_token < 0) return;
    r.remote_computed = std::min(r.remote_computed, position);
    // A producer's first token stood for the whole prompt's KV: without it, it prefills.
    r.remote_first_token = -1;
    r.remote_drafts.clear();
    return;
  }
  if (r.status != RequestStatus::kRunning)
    throw InvalidArgument(call + "the request is neither running nor waiting for remote KV");
  // What its landed rows computed: its rows in flight are not counted (their outputs go).
  int32_t landed = r.num_computed_tokens;
  std::array<std::vector<int32_t>, kMaxOutstandingBatches> rows;
  for (int32_t i = 0; i < num_outstanding_; ++i) {
    const int32_t buffer =
        (next_buffer_ - num_outstanding_ + i + kMaxOutstandingBatches) % kMaxOutstandingBatches;
    const Batch& b = batches_[buffer];
    const auto& voided = voided_rows_[buffer];
    for (int32_t row = 0; row < b.num_rows; ++row)
      if (b.request_index[row] == slot &&
          std::find(voided.begin(), voided.end(), row) == voided.end()) {
        rows[buffer].push_back(row);
        landed -= b.num_scheduled_tokens[row];
      }
  }
  if (position >= landed) return;  // the failed KV is past what it has computed
  for (int32_t buffer = 0; buffer < kMaxOutstandingBatches; ++buffer)
    voided_rows_[buffer].insert(voided_rows_[buffer].end(), rows[buffer].begin(),
                                rows[buffer].end());
  const bool was_partial = r.is_partial_prefill();
  r.num_computed_tokens = position;
  // Its known tokens are a prompt again: the last chunk samples its next token.
  r.prefill_target = std::max(r.prefill_target, r.num_tokens());
  std::fill(r.drafts.begin(), r.drafts.end(), -1);
  r.num_drafts = 0;
  if (!was_partial) track_partial(slot);
  if (k_ == 0) sync_steady(r);
}

void Scheduler::start_remote_decode(int32_t slot) {
  Request& r = requests_[slot];
  // ATOM's remote prefill (a first token) or a load covering every token: the request decodes.
  // Otherwise it prefills what the load did not cover.
  const bool decodes = r.remote_first_token >= 0 || r.remote_computed >= r.num_tokens();
  // The loaded KV is local now: publish its full blocks (ATOM never did, 8.15). Only real prompt
  // tokens are hashed in ATOM's case, never the injected token or drafts (8.16).
  const int32_t present = r.remote_first_token >= 0 ? r.num_prompt_tokens : r.remote_computed;
  const int32_t end = present / config_.block_size;
  if (config_.enable_prefix_caching && r.blocks_published < end) publish_blocks(r, end);
  if (config_.num_state_slots > 0) r.state_slot = pool_.take_state_slot();
  take_device_slot(r);
  r.status = RequestStatus::kRunning;
  ++stats_.num_remote_prefills;
  if (!decodes) {
    r.num_computed_tokens = r.remote_computed;
    r.loaded_tokens = r.remote_computed - r.prefix_hit_tokens;
    add_running(slot);
    track_partial(slot);
    return;
  }
  if (r.remote_first_token >= 0) {
    // The producer's first token becomes a real token, streamed with the first output.
    r.append_token(r.remote_first_token);
    r.num_unstreamed = 1;
    // It may already end the request (EOS, max_tokens=1): the first decode's output then only
    // streams it and finishes, whatever the row sampled.
    r.pending_stop = stop_reason(r, r.pending_stop_token);
  }
  // The producer's drafts (as many as it proposed, at most K); the rest are missing.
  r.num_drafts = std::min(k_, static_cast<int32_t>(r.remote_drafts.size()));
  for (int32_t j = 0; j < k_; ++j) r.drafts[j] = j < r.num_drafts ? r.remote_drafts[j] : -1;
  // Without T0 the first decode re-forwards the last prompt token, whose KV already exists.
  r.num_computed_tokens = r.num_tokens() - 1;
  // T0 already ends it and its position would reach the limit (a prompt of max_model_len tokens,
  // or one filling the pool): the one row that streams T0 re-forwards the last prompt token
  // instead, rewriting KV that exists (its output is ignored).
  if (r.pending_stop != FinishReason::kNone && r.num_computed_tokens >= position_limit_)
    r.num_computed_tokens = r.num_prompt_tokens - 1;
  r.prefill_target = r.num_computed_tokens;
  // Its prompt's KV came from elsewhere but for its local hits (the re-forwarded token too).
  r.loaded_tokens = std::max(0, r.num_computed_tokens - r.prefix_hit_tokens);
  add_running(slot);
}

}  // namespace atom_sched
