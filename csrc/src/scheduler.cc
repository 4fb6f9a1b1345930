#include "atom_sched/scheduler.h"

#include <algorithm>
#include <limits>
#include <string>

#include "atom_sched/errors.h"
#include "atom_sched/xxhash64.h"

namespace atom_sched {

namespace {

int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

void check(bool ok, const std::string& what) {
  if (!ok) throw InvariantViolation("Scheduler: " + what);
}

std::string id_str(int64_t id) { return std::to_string(id); }

}  // namespace

double SchedulerStats::prefix_hit_rate() const noexcept {
  return prefix_query_tokens > 0 ? static_cast<double>(prefix_hit_tokens) / prefix_query_tokens
                                 : 0.0;
}

double SchedulerStats::acceptance_rate() const noexcept {
  return num_draft_tokens > 0 ? static_cast<double>(num_accepted_draft_tokens) / num_draft_tokens
                              : 0.0;
}

// ---------------------------------------------------------------------------------------------
// Construction and request slots

Scheduler::Scheduler(SchedulerConfig config)
    : config_((config.validate(), std::move(config))),
      k_(config_.num_speculative_tokens),
      table_width_(config_.max_blocks_per_request()),
      pool_(config_.num_blocks, config_.block_size, config_.enable_prefix_caching,
            config_.enable_kv_events, config_.num_state_slots) {
  const size_t rows = config_.max_num_seqs;
  const size_t tokens = config_.max_num_batched_tokens;
  for (Batch& b : batches_) {
    b.block_table_width = table_width_;
    b.req_ids.resize(rows);
    b.request_slots.resize(rows);
    b.num_scheduled_tokens.resize(rows);
    b.num_cached_tokens.resize(rows);
    b.context_lens.resize(rows);
    b.last_block_num_tokens.resize(rows);
    b.temperatures.resize(rows);
    b.top_ks.resize(rows);
    b.top_ps.resize(rows);
    b.seeds.resize(rows);
    b.emits_token.resize(rows);
    b.row_exact.resize(rows);
    b.state_slots.resize(rows);
    b.block_tables.assign(rows * table_width_, 0);
    b.spec_draft_tokens.resize(rows * k_);
    b.cu_seqlens_q.assign(rows + 1, 0);
    b.cu_seqlens_k.assign(rows + 1, 0);
    b.scheduled_tokens.resize(tokens);
    b.positions.resize(tokens);
    b.slot_mapping.resize(tokens);
    b.request_index.resize(rows);
    b.slot_reset.resize(rows);
    b.new_block_starts.resize(rows);
    b.new_block_offsets.assign(rows + 1, 0);
    b.new_block_ids.resize(rows * table_width_);
    b.row_owner.assign(rows, 0);
    b.row_filled.assign(rows, 0);
  }
  step_output_.req_ids.reserve(rows);
  step_output_.token_offsets.reserve(rows + 1);
  step_output_.new_tokens.reserve(rows * (k_ + 2));  // + an injected remote first token
  step_output_.finish_reasons.reserve(rows);
  step_output_.stop_tokens.reserve(rows);
  step_output_.prefix_hit_tokens.reserve(rows);
  step_output_.new_logprobs.reserve(rows * (k_ + 2));
  step_output_.wants_logprobs.reserve(rows);
  stats_.acceptance_counts.assign(k_ + 1, 0);
  // Popped from the back: the first admission gets device slot 0.
  for (int32_t s = config_.max_num_seqs - 1; s >= 0; --s) free_device_slots_.push_back(s);
  slot_by_id_.reserve(rows * 2);
}

int32_t Scheduler::new_slot() {
  if (!free_slots_.empty()) {
    int32_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  requests_.emplace_back();
  links_.emplace_back();
  return static_cast<int32_t>(requests_.size()) - 1;
}

void Scheduler::release_slot_if_done(int32_t slot) {
  Request& r = requests_[slot];
  if (r.in_use && r.status == RequestStatus::kFinished && r.num_inflight == 0 &&
      !r.awaiting_send && !r.awaiting_recv) {
    r.in_use = false;
    free_slots_.push_back(slot);
  }
}

int32_t Scheduler::slot_of(int64_t id) const {
  auto it = slot_by_id_.find(id);
  return it == slot_by_id_.end() ? -1 : it->second;
}

bool Scheduler::contains(int64_t id) const { return slot_of(id) >= 0; }

const Request& Scheduler::request(int64_t id) const {
  int32_t s = slot_of(id);
  if (s < 0) throw UnknownRequest("unknown request id " + id_str(id));
  return requests_[s];
}

// ---------------------------------------------------------------------------------------------
// Intrusive lists (waiting, running): O(1) push, pop and removal from the middle.

void Scheduler::list_push_back(List& l, int32_t slot) {
  Link& r = links_[slot];
  r.prev = l.tail;
  r.next = -1;
  (l.tail >= 0 ? links_[l.tail].next : l.head) = slot;
  l.tail = slot;
  ++l.size;
}

void Scheduler::list_push_front(List& l, int32_t slot) {
  Link& r = links_[slot];
  r.prev = -1;
  r.next = l.head;
  (l.head >= 0 ? links_[l.head].prev : l.tail) = slot;
  l.head = slot;
  ++l.size;
}

void Scheduler::list_remove(List& l, int32_t slot) {
  Link& r = links_[slot];
  (r.prev >= 0 ? links_[r.prev].next : l.head) = r.next;
  (r.next >= 0 ? links_[r.next].prev : l.tail) = r.prev;
  r.prev = r.next = -1;
  --l.size;
}

std::vector<int64_t> Scheduler::waiting_ids() const {
  std::vector<int64_t> out;
  for (int32_t s = waiting_.head; s >= 0; s = links_[s].next) out.push_back(requests_[s].id);
  return out;
}

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> out;
  for (int32_t s = running_.head; s >= 0; s = links_[s].next) out.push_back(requests_[s].id);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Adding, aborting, finishing

void Scheduler::add_request(int64_t id, std::span<const int32_t> prompt,
                            const SamplingParams& params, double arrival_time) {
  // Validate everything before touching any state.
  if (id < 0) throw InvalidArgument("request id must be >= 0, got " + id_str(id));
  if (slot_of(id) >= 0 || deferred_.count(id) > 0)
    throw InvalidArgument("request id " + id_str(id) + " is already live");
  if (prompt.empty()) throw InvalidArgument("request " + id_str(id) + ": the prompt is empty");
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0)
      throw InvalidArgument("request " + id_str(id) + ": prompt token " + std::to_string(i) +
                            " is negative (" + std::to_string(prompt[i]) + ")");
  params.validate();
  if (params.n != 1)
    throw InvalidArgument("n > 1 is not supported by the scheduler: the engine fans a request "
                          "out into n requests");

  const int32_t slot = new_slot();
  Request& r = requests_[slot];
  r.id = id;
  r.status = RequestStatus::kWaiting;
  r.in_use = true;
  r.preempted = false;
  r.num_computed_tokens = 0;
  r.prefill_target = 0;
  r.num_inflight = 0;
  r.num_prompt_tokens = static_cast<int32_t>(prompt.size());
  r.prefix_hit_tokens = 0;
  r.state_slot = -1;
  r.epoch = 0;
  r.temperature = params.temperature;
  r.top_k = params.top_k;
  r.top_p = params.top_p;
  r.seed = params.seed;
  r.max_tokens = params.max_tokens;
  r.ignore_eos = params.ignore_eos;
  r.arrival_time = arrival_time;
  // Reserve for the request's whole life once, so decode steps never reallocate.
  const int64_t most_tokens =
      std::min<int64_t>(int64_t{r.num_prompt_tokens} + params.max_tokens,
                        std::max<int64_t>(config_.max_model_len, r.num_prompt_tokens)) +
      k_ + 1;
  r.tokens.clear();
  r.tokens.reserve(most_tokens);
  r.tokens.assign(prompt.begin(), prompt.end());
  r.block_table.clear();
  r.block_table.reserve(table_width_);
  r.block_hashes.clear();
  r.block_hashes.reserve(table_width_);
  r.drafts.assign(k_, -1);
  r.stop_token_ids = config_.stop_token_ids;
  r.stop_token_ids.insert(r.stop_token_ids.end(), params.stop_token_ids.begin(),
                          params.stop_token_ids.end());
  r.stop_sequences = params.stop_token_sequences;
  r.has_stop_lists = !r.stop_token_ids.empty() || !r.stop_sequences.empty();
  r.wants_logprobs = params.logprobs;
  r.finish_reason = FinishReason::kNone;
  r.stop_token = -1;
  r.num_unstreamed = 0;
  r.remote_ready = r.awaiting_send = r.awaiting_recv = false;
  r.remote_first_token = -1;
  r.remote_drafts.clear();
  r.pending_stop = FinishReason::kNone;
  r.pending_stop_token = -1;
  slot_by_id_[id] = slot;
  list_push_back(waiting_, slot);
}

void Scheduler::abort_request(int64_t id) {
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  ++stats_.num_aborted;
  finish(slot, FinishReason::kAborted, -1);
}

void Scheduler::set_computed(Request& r, int32_t num_computed) {
  const bool was_partial = r.is_partial_prefill();
  r.num_computed_tokens = num_computed;
  num_partial_ += static_cast<int32_t>(r.is_partial_prefill()) - static_cast<int32_t>(was_partial);
}

void Scheduler::finish(int32_t slot, FinishReason reason, int32_t stop_token) {
  Request& r = requests_[slot];
  if (r.is_partial_prefill()) --num_partial_;
  if (r.status == RequestStatus::kRunning) {
    list_remove(running_, slot);
  } else {
    list_remove(waiting_, slot);
  }
  r.finish_reason = reason;
  r.stop_token = stop_token;
  // Blocks a transfer may still write (KV arriving) or read (KV being sent) stay allocated until
  // the connector reports the transfer done.
  bool keep_blocks = false;
  if (r.status == RequestStatus::kWaitingForRemoteKv && !r.remote_ready) {
    r.awaiting_recv = keep_blocks = true;
  }
  if (connector_ && !dry_run_) {
    try {
      if (connector_->request_finished(connector_view(r))) r.awaiting_send = keep_blocks = true;
    } catch (const std::exception& e) {
      connector_failed(r, "request_finished", e);
    }
  }
  if (keep_blocks) deferred_[r.id] = slot;
  release_kv(r, keep_blocks);
  r.status = RequestStatus::kFinished;
  slot_by_id_.erase(r.id);
  if (reason != FinishReason::kAborted && reason != FinishReason::kUnschedulable)
    ++stats_.num_finished;
  release_slot_if_done(slot);
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
  // Validate every id first: a bad report changes nothing.
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

std::vector<RejectedRequest> Scheduler::take_rejected() {
  std::vector<RejectedRequest> out;
  out.swap(rejected_);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Scheduling policy

std::optional<std::string> Scheduler::unschedulable_reason(const Request& r) const {
  const int32_t n = r.num_tokens();
  if (n > config_.max_model_len)
    return "input tokens=" + std::to_string(n) + " > max_model_len=" +
           std::to_string(config_.max_model_len) +
           ". Increase --max-model-len or shorten the prompt.";
  // ATOM checked num_tokens here, so a preempted request that had grown past the budget was
  // rejected on readmission (8.9); a preempted request is re-prefilled in chunks instead.
  if (!config_.enable_chunked_prefill && r.num_prompt_tokens > config_.max_num_batched_tokens)
    return "input tokens=" + std::to_string(r.num_prompt_tokens) + " > max_num_batched_tokens=" +
           std::to_string(config_.max_num_batched_tokens) +
           ". Increase --max-num-batched-tokens, enable chunked prefill, or shorten the prompt.";
  const int32_t blocks = ceil_div(n, config_.block_size);
  if (blocks > pool_.num_blocks())
    return "needs " + std::to_string(blocks) + " KV blocks for " + std::to_string(n) +
           " input tokens > total pool blocks=" + std::to_string(pool_.num_blocks()) +
           ". Reduce prompt length or raise --gpu-memory-utilization.";
  return std::nullopt;
}

int32_t Scheduler::probe_blocks(const Request& r) const {
  if (!config_.enable_prefix_caching) return 0;
  const int32_t n = r.num_tokens();
  // Full blocks, but never the last block of the sequence (it is always computed).
  return std::min(n / config_.block_size, ceil_div(n, config_.block_size) - 1);
}

void Scheduler::ensure_block_hashes(Request& r, int32_t num_blocks) {
  // Hashes depend only on tokens, which never change once known: compute each block's once.
  const int32_t bs = config_.block_size;
  for (int32_t i = static_cast<int32_t>(r.block_hashes.size()); i < num_blocks; ++i) {
    std::optional<uint64_t> parent;
    if (i > 0) parent = r.block_hashes[i - 1];
    r.block_hashes.push_back(
        block_hash(std::span<const int32_t>(r.tokens.data() + static_cast<size_t>(i) * bs, bs),
                   parent));
  }
}

bool Scheduler::passed_delay(double now) {
  // ATOM's _passed_delay, evaluated once per schedule() instead of once per admission (8.26).
  if (prev_prompt_) last_prompt_latency_ = now - prev_time_;
  prev_time_ = now;
  prev_prompt_ = false;
  if (waiting_.size == 0) return true;
  double oldest = std::numeric_limits<double>::infinity();
  for (int32_t s = waiting_.head; s >= 0; s = links_[s].next)
    oldest = std::min(oldest, requests_[s].arrival_time);
  return (now - oldest) > config_.scheduler_delay_factor * last_prompt_latency_ ||
         running_.size == 0;
}

void Scheduler::schedule_prefills(Batch& b, double now) {
  const int32_t budget = config_.max_num_batched_tokens;
  const int32_t max_rows = config_.max_num_seqs;

  // Phase 1: resume partial prefills, in running order.
  for (int32_t s = running_.head; s >= 0 && num_partial_ > 0; s = links_[s].next) {
    if (b.num_rows >= max_rows) break;
    const Request& r = requests_[s];
    if (!r.is_partial_prefill()) continue;
    const int32_t chunk = std::min(r.prefill_target - r.num_computed_tokens, budget - b.num_tokens);
    if (chunk <= 0) break;
    add_prefill_row(b, s, chunk);
  }

  // Phase 2: admit from the head of waiting (strict FCFS).
  if (config_.scheduler_delay_factor > 0 && !passed_delay(now)) return;
  const int32_t bs = config_.block_size;
  const bool needs_state = config_.num_state_slots > 0;
  List skipped;  // requests waiting for remote KV: rotated to the tail of waiting (as ATOM)
  while (waiting_.size > 0 && b.num_rows < max_rows && running_.size < max_rows &&
         b.num_tokens < budget) {
    const int32_t s = waiting_.head;
    Request& r = requests_[s];
    if (auto why = unschedulable_reason(r)) {
      reject(s, "unschedulable: " + *why);
      continue;
    }
    if (r.status == RequestStatus::kWaitingForRemoteKv) {
      list_remove(waiting_, s);
      if (r.remote_ready) {
        start_remote_decode(s);  // joins the decode set: no budget, no row this step
      } else {
        list_push_back(skipped, s);
      }
      continue;
    }
    // A preempted request's in-flight output must land before it is re-prefilled. With at most
    // two batches outstanding it always has; this guard keeps the invariant explicit.
    if (r.num_inflight > 0) break;
    ensure_block_hashes(r, probe_blocks(r));
    const int32_t hits = pool_.can_allocate(r.block_hashes, r.tokens, r.num_tokens(), needs_state);
    if (hits < 0) break;  // head-of-line blocking, as ATOM
    r.prefix_hit_tokens = hits * bs;
    // The connector is asked only once the request fits (ATOM asked before, 8.5).
    RemoteMatch match;
    if (connector_) {
      try {
        match = connector_->get_num_new_matched_tokens(connector_view(r));
      } catch (const std::exception& e) {
        connector_failed(r, "get_num_new_matched_tokens", e);
        reject(s, "kv connector error: " + std::string(e.what()));
        continue;
      }
    }
    const int32_t num_new = r.num_tokens() - hits * bs;
    const int32_t left = budget - b.num_tokens;
    int32_t chunk = num_new;
    if (match.load_async) {
      chunk = 0;  // the remote prefill computes it
    } else if (config_.enable_chunked_prefill || r.preempted) {
      chunk = std::min(num_new, left);
    } else if (num_new > left && b.num_tokens > 0) {
      break;
    }
    pool_.allocate(r.block_hashes, hits, r.num_tokens(), r.block_table);
    r.epoch = next_epoch_++;
    r.blocks_shipped = 0;
    r.prefill_target = r.num_tokens();
    if (connector_ && !dry_run_) {
      try {
        connector_->update_state_after_alloc(connector_view(r));
      } catch (const std::exception& e) {
        connector_failed(r, "update_state_after_alloc", e);
        reject(s, "kv connector error: " + std::string(e.what()));
        continue;
      }
    }
    list_remove(waiting_, s);
    if (match.load_async) {
      r.status = RequestStatus::kWaitingForRemoteKv;
      r.remote_ready = false;
      r.remote_first_token = match.first_token;
      r.remote_drafts = std::move(match.draft_tokens);
      list_push_back(skipped, s);
      continue;
    }
    if (config_.enable_prefix_caching) {
      ++stats_.num_prefix_queries;
      stats_.prefix_query_tokens += r.num_tokens();
      stats_.prefix_hit_tokens += hits * bs;
    }
    if (needs_state) r.state_slot = pool_.take_state_slot();
    take_device_slot(r);
    r.num_computed_tokens = hits * bs;
    r.status = RequestStatus::kRunning;
    list_push_back(running_, s);
    num_partial_ += r.is_partial_prefill();  // always: the last block is never a hit
    add_prefill_row(b, s, chunk);
  }
  while (skipped.head >= 0) {
    const int32_t s = skipped.head;
    list_remove(skipped, s);
    list_push_back(waiting_, s);
  }
}

void Scheduler::reject(int32_t slot, std::string reason) {
  rejected_.push_back({requests_[slot].id, std::move(reason)});
  ++stats_.num_rejected;
  finish(slot, FinishReason::kUnschedulable, -1);
}

void Scheduler::take_device_slot(Request& r) {
  r.device_slot = free_device_slots_.back();  // running < max_num_seqs: one is free
  free_device_slots_.pop_back();
}

void Scheduler::start_remote_decode(int32_t slot) {
  Request& r = requests_[slot];
  const int32_t bs = config_.block_size;
  // The remote prefill filled the prompt's blocks: publish its full ones (ATOM never did, 8.15).
  // Only real prompt tokens are hashed, never the injected token or drafts (8.16).
  const int32_t first = r.prefix_hit_tokens / bs;
  const int32_t end = r.num_prompt_tokens / bs;
  if (config_.enable_prefix_caching && first < end) {
    ensure_block_hashes(r, end);
    pool_.publish(r.block_table, r.block_hashes, r.tokens, first, end);
  }
  if (config_.num_state_slots > 0) r.state_slot = pool_.take_state_slot();
  take_device_slot(r);
  if (r.remote_first_token >= 0) {
    // The producer's first token becomes a real token, streamed with the first output.
    r.tokens.push_back(r.remote_first_token);
    r.num_unstreamed = 1;
    // It may already end the request (EOS, max_tokens=1): the first decode's output then only
    // streams it and finishes, whatever the row sampled.
    r.pending_stop = stop_reason(r, r.pending_stop_token);
  }
  for (int32_t j = 0; j < k_; ++j)
    r.drafts[j] = j < static_cast<int32_t>(r.remote_drafts.size()) ? r.remote_drafts[j]
                                                                   : r.tokens.back();
  // Without T0 the first decode re-forwards the last prompt token, whose KV already exists.
  r.num_computed_tokens = r.num_tokens() - 1;
  r.prefill_target = r.num_computed_tokens;
  r.status = RequestStatus::kRunning;
  list_push_back(running_, slot);
  ++stats_.num_remote_prefills;
}

int32_t Scheduler::count_admittable_head_prefills(int32_t limit) {
  if (limit <= 0 || waiting_.size == 0) return 0;
  const int32_t budget = config_.max_num_batched_tokens;
  const int32_t bs = config_.block_size;
  int32_t count = 0, tokens = 0, blocks_taken = 0, probed = 0;
  for (int32_t s = waiting_.head; s >= 0 && probed < 4; s = links_[s].next, ++probed) {
    Request& r = requests_[s];
    if (unschedulable_reason(r) || r.status == RequestStatus::kWaitingForRemoteKv) continue;
    ensure_block_hashes(r, probe_blocks(r));
    const int32_t hits = pool_.can_allocate(r.block_hashes, r.tokens, r.num_tokens(),
                                            config_.num_state_slots > 0);
    if (hits < 0) break;
    const int32_t fresh = ceil_div(r.num_tokens(), bs) - hits;  // upper bound: hits may be shared
    if (blocks_taken + fresh > pool_.num_free_blocks()) break;
    int32_t num_new = r.num_tokens() - hits * bs;
    if (num_new > budget) {
      if (!config_.enable_chunked_prefill) continue;
      num_new = budget;
    }
    if (tokens + num_new > budget && count > 0) break;
    blocks_taken += fresh;
    tokens += num_new;
    if (++count >= limit) break;
  }
  return count;
}

void Scheduler::schedule_decodes(Batch& b) {
  const int32_t n = k_ + 1;
  const int32_t bs = config_.block_size;
  for (int32_t s = running_.head; s >= 0;) {
    if (b.num_rows >= config_.max_num_seqs) break;
    if (b.num_tokens + n > config_.max_num_batched_tokens) break;
    Request& r = requests_[s];
    if (r.is_partial_prefill()) {  // never decode a half-prefilled prompt (8.3)
      s = links_[s].next;
      continue;
    }
    // Exact reservation for this row's positions S .. S+K (ATOM over- or under-reserved, 8.6/8.7).
    const int32_t needed = ceil_div(r.num_computed_tokens + n, bs);
    bool preempted_self = false;
    while (static_cast<int32_t>(r.block_table.size()) < needed &&
           !pool_.grow(r.block_table, needed)) {
      // Recompute preemption, LIFO: the tail of running. Rows already in this batch sit before
      // `s` in the list, so they are never victims.
      const int32_t victim = running_.tail;
      preempt(victim);
      if (victim == s) {
        preempted_self = true;
        break;
      }
    }
    if (preempted_self) break;  // s was the tail: nothing after it
    add_decode_row(b, s);
    s = links_[s].next;
  }
}

void Scheduler::release_kv(Request& r, bool keep_blocks) {
  // Blocks and slots may still be written by a batch in flight; they are handed out again only to
  // batches scheduled later, which run after it on the engine's stream.
  if (!keep_blocks) {
    pool_.free(r.block_table);
    r.block_table.clear();
  }
  if (r.state_slot >= 0) pool_.release_state_slot(r.state_slot);
  r.state_slot = -1;
  if (r.device_slot >= 0) free_device_slots_.push_back(r.device_slot);
  r.device_slot = -1;
}

void Scheduler::preempt(int32_t slot) {
  Request& r = requests_[slot];
  if (r.is_partial_prefill()) --num_partial_;
  list_remove(running_, slot);
  release_kv(r);
  // Only real tokens are ever kept, so nothing needs stripping (ATOM left placeholders, 8.1).
  // Outputs of a batch still in flight are appended when they arrive.
  r.num_computed_tokens = 0;
  r.prefill_target = 0;
  std::fill(r.drafts.begin(), r.drafts.end(), -1);
  r.status = RequestStatus::kWaiting;
  r.preempted = true;
  list_push_front(waiting_, slot);
  ++stats_.num_preemptions;
}

const Batch* Scheduler::schedule(double now, bool allow_prefill) {
  if (num_outstanding_ >= kMaxOutstandingBatches)
    throw InvalidArgument("schedule(): " + std::to_string(kMaxOutstandingBatches) +
                          " batches are outstanding; pass the oldest to update() first");
  if (waiting_.size == 0 && running_.size == 0) return nullptr;
  Batch& b = batches_[next_buffer_];
  begin_batch(b, /*is_prefill=*/true);
  if (allow_prefill) schedule_prefills(b, now);
  if (b.num_rows == 0) {
    begin_batch(b, /*is_prefill=*/false);
    schedule_decodes(b);
  }
  if (b.num_rows == 0) return nullptr;
  b.id = next_batch_id_++;
  if (b.is_prefill) prev_prompt_ = true;
  next_buffer_ = (next_buffer_ + 1) % kMaxOutstandingBatches;
  ++num_outstanding_;
  ++stats_.num_steps;
  return &b;
}

NextBatchInfo Scheduler::next_batch_info(double now, bool allow_prefill) const {
  Scheduler copy = *this;
  copy.dry_run_ = true;
  const Batch* b = copy.schedule(now, allow_prefill);
  if (b == nullptr) return {};
  return {b->is_prefill, b->num_tokens, b->num_rows};
}

// ---------------------------------------------------------------------------------------------
// Batch assembly

void Scheduler::begin_batch(Batch& b, bool is_prefill) {
  b.is_prefill = is_prefill;
  b.num_rows = 0;
  b.num_tokens = 0;
  b.num_spec_tokens = is_prefill ? 0 : k_;
  b.max_seqlen_q = 0;
  b.max_seqlen_k = 0;
  b.cu_seqlens_q[0] = 0;
  b.cu_seqlens_k[0] = 0;
  b.new_block_offsets[0] = 0;
}

// The row helpers are forced inline into the per-row loops: their call overhead was a fifth of a
// decode row's instructions.
[[gnu::always_inline]] inline void Scheduler::fill_block_table_row(Batch& b, int32_t row,
                                                                  const Request& r,
                                                                  bool same_owner) {
  // Rewriting every row in full each step would cost rows x width writes (ATOM's
  // prepare_block_tables); a row that holds the same admission as last time in this buffer
  // only gets the blocks appended since. Tables only grow during one admission.
  const int32_t size = static_cast<int32_t>(r.block_table.size());
  int32_t from = 0;
  if (same_owner) {
    from = b.row_filled[row];
    if (from == size) return;  // the common decode step: nothing new
  }
  int32_t* dst = b.block_tables.data() + static_cast<size_t>(row) * table_width_;
  if (!same_owner && b.row_filled[row] > size) std::fill(dst + size, dst + b.row_filled[row], 0);
  std::copy(r.block_table.begin() + from, r.block_table.end(), dst + from);
  b.row_filled[row] = size;
}

[[gnu::always_inline]] inline void Scheduler::ship_new_blocks(Batch& b, int32_t row,
                                                             Request& r) {
  const int32_t size = static_cast<int32_t>(r.block_table.size());
  const int32_t out = b.new_block_offsets[row];
  const int32_t shipped = r.blocks_shipped;
  b.slot_reset[row] = shipped == 0;
  b.new_block_starts[row] = shipped;
  b.new_block_offsets[row + 1] = out + size - shipped;
  if (shipped == size) return;  // the common decode step: no block crossed
  std::copy(r.block_table.begin() + shipped, r.block_table.end(), b.new_block_ids.begin() + out);
  r.blocks_shipped = size;
}

[[gnu::always_inline]] inline int32_t Scheduler::begin_row(Batch& b, Request& r, int32_t slot,
                                                          int32_t num_tokens) {
  const int32_t row = b.num_rows;
  const int32_t first = b.num_tokens;
  const int32_t start = r.num_computed_tokens;
  const int32_t end = start + num_tokens;
  const int32_t bs = config_.block_size;
  // A row of this buffer that held the same admission two steps ago (steady-state decode keeps
  // the running order) already has the request's constant columns.
  const bool same_owner = b.row_owner[row] == r.epoch;
  if (!same_owner) {
    b.row_owner[row] = r.epoch;
    b.req_ids[row] = r.id;
    b.request_index[row] = slot;
    b.request_slots[row] = r.device_slot;
    b.temperatures[row] = r.temperature;
    b.top_ks[row] = r.top_k;
    b.top_ps[row] = r.top_p;
    b.seeds[row] = r.seed;
    b.state_slots[row] = r.state_slot;
  }
  b.num_scheduled_tokens[row] = num_tokens;
  b.num_cached_tokens[row] = start;
  b.context_lens[row] = end;
  b.last_block_num_tokens[row] = end - ((end - 1) / bs) * bs;
  b.cu_seqlens_q[row + 1] = b.cu_seqlens_q[row] + num_tokens;
  b.cu_seqlens_k[row + 1] = b.cu_seqlens_k[row] + end;
  b.max_seqlen_q = std::max(b.max_seqlen_q, num_tokens);
  b.max_seqlen_k = std::max(b.max_seqlen_k, end);
  // Positions and slots, walking the block table instead of dividing per token.
  int64_t* positions = b.positions.data() + first;
  int64_t* slots = b.slot_mapping.data() + first;
  const int32_t* table = r.block_table.data();
  int32_t block = start / bs;
  int32_t offset = start - block * bs;
  int64_t base = int64_t{table[block]} * bs;
  for (int32_t i = 0; i < num_tokens; ++i) {
    positions[i] = start + i;
    slots[i] = base + offset;
    if (++offset == bs && i + 1 < num_tokens) {
      offset = 0;
      base = int64_t{table[++block]} * bs;
    }
  }
  fill_block_table_row(b, row, r, same_owner);
  ship_new_blocks(b, row, r);
  b.row_exact[row] = r.num_inflight == 0;
  b.num_rows = row + 1;
  return row;
}

void Scheduler::add_prefill_row(Batch& b, int32_t slot, int32_t chunk) {
  Request& r = requests_[slot];
  const int32_t row = begin_row(b, r, slot, chunk);
  std::copy_n(r.tokens.begin() + r.num_computed_tokens, chunk,
              b.scheduled_tokens.begin() + b.num_tokens);
  b.num_tokens += chunk;
  set_computed(r, r.num_computed_tokens + chunk);
  b.emits_token[row] = r.num_computed_tokens == r.prefill_target;
  b.row_exact[row] = 1;  // prompt tokens and positions are always known
  ++r.num_inflight;
}

[[gnu::always_inline]] inline void Scheduler::add_decode_row(Batch& b, int32_t slot) {
  Request& r = requests_[slot];
  const int32_t n = k_ + 1;
  const int32_t row = begin_row(b, r, slot, n);
  const bool known = r.num_inflight == 0;
  // Input: the last real token, then the K drafts. One step ahead they are still on the device.
  int32_t* tokens = b.scheduled_tokens.data() + b.num_tokens;
  int32_t* drafts = b.spec_draft_tokens.data() + static_cast<size_t>(row) * k_;
  tokens[0] = known ? r.tokens.back() : -1;
  for (int32_t j = 0; j < k_; ++j) drafts[j] = tokens[j + 1] = known ? r.drafts[j] : -1;
  b.num_tokens += n;
  b.emits_token[row] = 1;
  r.num_computed_tokens += n;  // upper bound until the accepted count arrives
  ++r.num_inflight;
}

// ---------------------------------------------------------------------------------------------
// Outputs

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
  const int32_t max_accepted = b.is_prefill ? 1 : k_ + 1;
  for (size_t i = 0; i < rows; ++i) {
    const int32_t a = out.num_accepted.empty() ? 1 : out.num_accepted[i];
    if (a < 1 || a > max_accepted)
      throw InvalidArgument("num_accepted[" + std::to_string(i) + "] = " + std::to_string(a) +
                            " is outside 1.." + std::to_string(max_accepted));
    if (!b.emits_token[i]) continue;
    for (int32_t j = 0; j < a; ++j) {
      const int32_t t = out.sampled_token_ids[i * width + j];
      if (t < 0)
        throw InvalidArgument("sampled token [" + std::to_string(i) + ", " + std::to_string(j) +
                              "] is negative (" + std::to_string(t) + ")");
    }
  }
}

FinishReason Scheduler::stop_reason(const Request& r, int32_t& stop_token) const {
  const int32_t tok = r.tokens.back();
  const int32_t generated = r.num_generated();
  if (!r.has_stop_lists) {
    if (!r.ignore_eos && tok == config_.eos_token_id) return FinishReason::kEos;
    if (generated >= r.max_tokens) return FinishReason::kMaxTokens;
    if (r.num_tokens() >= config_.max_model_len) return FinishReason::kMaxModelLen;
    return FinishReason::kNone;
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
  if (generated >= r.max_tokens) return FinishReason::kMaxTokens;
  if (r.num_tokens() >= config_.max_model_len) return FinishReason::kMaxModelLen;  // (8.8)
  return FinishReason::kNone;
}

void Scheduler::apply_row_output(const Batch& b, int32_t row, const ModelOutputs& out,
                                 int32_t width) {
  const int32_t slot = b.request_index[row];
  Request& r = requests_[slot];
  --r.num_inflight;
  if (r.status == RequestStatus::kFinished) {  // finished meanwhile: this output is discarded
    release_slot_if_done(slot);
    return;
  }
  const bool running = r.status == RequestStatus::kRunning;
  int32_t accepted = 1;
  if (b.is_prefill) {
    // Publish the blocks this chunk completed, now that their KV exists. A preempted request's
    // blocks are gone, so there is nothing to publish.
    if (running && config_.enable_prefix_caching) {
      const int32_t bs = config_.block_size;
      const int32_t start = b.num_cached_tokens[row];
      const int32_t first = start / bs;
      const int32_t end = (start + b.num_scheduled_tokens[row]) / bs;
      if (first < end) {
        ensure_block_hashes(r, end);
        pool_.publish(r.block_table, r.block_hashes, r.tokens, first, end);
      }
    }
    if (!b.emits_token[row]) return;  // an intermediate chunk samples garbage
  } else {
    if (!out.num_accepted.empty()) accepted = out.num_accepted[row];
    // Roll back the upper bound by the rejected drafts (a preempted request restarts from 0).
    if (running) r.num_computed_tokens -= (k_ + 1) - accepted;
    if (k_ > 0) {
      ++stats_.num_spec_steps;
      stats_.num_draft_tokens += k_;
      stats_.num_accepted_draft_tokens += accepted - 1;
      ++stats_.acceptance_counts[accepted - 1];
    }
  }
  if (k_ > 0 && running)
    std::copy_n(out.draft_token_ids.begin() + static_cast<size_t>(row) * k_, k_, r.drafts.begin());

  // Append the accepted tokens one by one; the earliest stop wins and later tokens are dropped.
  // Tokens known but not streamed yet (a remote prefill's first token) go out with them.
  const int32_t stream_from = r.num_tokens() - r.num_unstreamed;
  const int32_t* sampled = out.sampled_token_ids.data() + static_cast<size_t>(row) * width;
  FinishReason reason = r.pending_stop;
  int32_t stop_token = r.pending_stop_token;
  int32_t kept = 0;
  while (kept < accepted && reason == FinishReason::kNone) {
    r.tokens.push_back(sampled[kept++]);
    reason = stop_reason(r, stop_token);
  }
  // Entries are written by index into arrays update() sized for the worst case.
  StepOutput& so = step_output_;
  const int32_t e = so_entries_++;
  so.req_ids[e] = r.id;
  int32_t* tokens_out = so.new_tokens.data() + so_tokens_;
  const int32_t* known = r.tokens.data();
  const int32_t total = r.num_tokens();
  for (int32_t i = stream_from; i < total; ++i) *tokens_out++ = known[i];
  if (!out.logprobs.empty()) {
    float* lp_out = so.new_logprobs.data() + so_tokens_;
    const float* lp = out.logprobs.data() + static_cast<size_t>(row) * width;
    for (int32_t j = 0; j < r.num_unstreamed; ++j)
      *lp_out++ = std::numeric_limits<float>::quiet_NaN();
    for (int32_t j = 0; j < kept; ++j) *lp_out++ = lp[j];
  }
  so_tokens_ += total - stream_from;
  r.num_unstreamed = 0;
  so.token_offsets[e + 1] = so_tokens_;
  so.finish_reasons[e] = reason;
  so.stop_tokens[e] = stop_token;
  so.prefix_hit_tokens[e] = r.prefix_hit_tokens;
  so.wants_logprobs[e] = r.wants_logprobs;
  if (reason != FinishReason::kNone) finish(slot, reason, stop_token);
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
  so_entries_ = 0;
  so_tokens_ = 0;
  const int32_t width =
      b.num_rows > 0 ? static_cast<int32_t>(out.sampled_token_ids.size()) / b.num_rows : 1;
  for (int32_t row = 0; row < b.num_rows; ++row) apply_row_output(b, row, out, width);
  so.req_ids.resize(so_entries_);
  so.token_offsets.resize(so_entries_ + 1);
  so.new_tokens.resize(so_tokens_);
  if (!out.logprobs.empty()) so.new_logprobs.resize(so_tokens_);
  so.finish_reasons.resize(so_entries_);
  so.stop_tokens.resize(so_entries_);
  so.prefix_hit_tokens.resize(so_entries_);
  so.wants_logprobs.resize(so_entries_);
  --num_outstanding_;
  return step_output_;
}

// ---------------------------------------------------------------------------------------------
// Invariants

void Scheduler::check_invariants() const {
  const int32_t bs = config_.block_size;
  std::vector<int32_t> refs(pool_.num_blocks(), 0);
  std::vector<int32_t> inflight(requests_.size(), 0);
  for (int32_t i = 0; i < num_outstanding_; ++i) {
    const Batch& b = batches_[(next_buffer_ - num_outstanding_ + i + kMaxOutstandingBatches) %
                              kMaxOutstandingBatches];
    check(b.num_rows <= config_.max_num_seqs, "batch has more rows than max_num_seqs");
    check(b.num_tokens <= config_.max_num_batched_tokens, "batch exceeds the token budget");
    for (int32_t row = 0; row < b.num_rows; ++row) ++inflight[b.request_index[row]];
  }
  int32_t live = 0, partial = 0;
  std::vector<uint8_t> device_slot_used(config_.max_num_seqs, 0);
  for (int32_t d : free_device_slots_) {
    check(d >= 0 && d < config_.max_num_seqs && !device_slot_used[d], "device slot list corrupt");
    device_slot_used[d] = 1;
  }
  std::vector<uint8_t> seen_in_table(pool_.num_blocks(), 0);
  auto count_blocks = [&](const Request& r, const std::string& who) {
    check(static_cast<int32_t>(r.block_table.size()) <= table_width_,
          who + "block table wider than a batch row");
    for (int32_t blk : r.block_table) {
      check(blk >= 0 && blk < pool_.num_blocks(), who + "block id out of range");
      check(!seen_in_table[blk], who + "holds block " + std::to_string(blk) + " twice");
      seen_in_table[blk] = 1;
      ++refs[blk];
    }
    for (int32_t blk : r.block_table) seen_in_table[blk] = 0;
  };
  int32_t deferred = 0;
  for (size_t s = 0; s < requests_.size(); ++s) {
    const Request& r = requests_[s];
    const std::string who = "request " + id_str(r.id) + ": ";
    check(r.num_inflight == inflight[s], who + "in-flight count disagrees with the batches");
    if (!r.in_use) continue;
    if (r.status == RequestStatus::kFinished) {
      const bool held = r.awaiting_send || r.awaiting_recv;
      check(held || r.block_table.empty(), who + "finished but holds blocks");
      check(held || r.num_inflight > 0, who + "finished slot not released");
      check(r.device_slot < 0 && r.state_slot < 0, who + "finished but holds a slot");
      if (held) {
        auto it = deferred_.find(r.id);
        check(it != deferred_.end() && it->second == static_cast<int32_t>(s),
              who + "holds blocks for a transfer but is not in the deferred map");
        ++deferred;
      }
      count_blocks(r, who);
      continue;
    }
    ++live;
    check(slot_of(r.id) == static_cast<int32_t>(s), who + "id map disagrees");
    check(r.num_tokens() >= r.num_prompt_tokens, who + "lost prompt tokens");
    if (r.status != RequestStatus::kRunning) {
      const bool remote = r.status == RequestStatus::kWaitingForRemoteKv;
      check(remote || r.block_table.empty(), who + "waiting but holds KV");
      check(remote != r.block_table.empty(), who + "waiting for remote KV without blocks");
      check(r.state_slot < 0 && r.device_slot < 0, who + "waiting but holds a slot");
      check(r.num_computed_tokens == 0, who + "waiting with computed tokens");
      count_blocks(r, who);
      continue;
    }
    partial += r.is_partial_prefill();
    check(r.num_computed_tokens <= r.num_tokens() + r.num_inflight * (k_ + 1),
          who + "computed tokens beyond what is known or in flight");
    check(static_cast<int32_t>(r.block_table.size()) >= ceil_div(r.num_computed_tokens, bs),
          who + "block table does not cover the computed tokens");
    check((r.state_slot >= 0) == (config_.num_state_slots > 0), who + "state slot mismatch");
    check(r.device_slot >= 0 && r.device_slot < config_.max_num_seqs &&
              !device_slot_used[r.device_slot],
          who + "device slot missing or shared");
    device_slot_used[r.device_slot] = 1;
    check(r.blocks_shipped <= static_cast<int32_t>(r.block_table.size()),
          who + "shipped more blocks than it holds");
    count_blocks(r, who);
  }
  check(deferred == static_cast<int32_t>(deferred_.size()), "deferred map holds stale ids");
  check(live == static_cast<int32_t>(slot_by_id_.size()), "id map holds dead requests");
  check(partial == num_partial_, "partial prefill count is off");
  check(running_.size <= config_.max_num_seqs, "running set exceeds max_num_seqs");
  auto walk = [&](const List& l, bool running, const char* name) {
    int32_t count = 0, prev = -1;
    for (int32_t s = l.head; s >= 0; s = links_[s].next) {
      check(requests_[s].in_use && (requests_[s].status == RequestStatus::kRunning) == running &&
                requests_[s].status != RequestStatus::kFinished,
            std::string(name) + " list holds a request in another state");
      check(links_[s].prev == prev, std::string(name) + " list back link broken");
      prev = s;
      check(++count <= static_cast<int32_t>(requests_.size()), std::string(name) + " list cycles");
    }
    check(prev == l.tail && count == l.size, std::string(name) + " list size or tail is wrong");
  };
  walk(waiting_, /*running=*/false, "waiting");
  walk(running_, /*running=*/true, "running");
  check(waiting_.size + running_.size == live, "a live request is in no queue");
  check(std::count(device_slot_used.begin(), device_slot_used.end(), 1) == config_.max_num_seqs,
        "a device slot leaked");
  pool_.check_invariants(refs);
}

}  // namespace atom_sched
