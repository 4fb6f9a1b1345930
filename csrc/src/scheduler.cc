#include "atom_sched/scheduler.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "atom_sched/errors.h"
#include "atom_sched/policy.h"
#include "atom_sched/xxhash64.h"
#include "scheduler_internal.h"

namespace atom_sched {

using detail::ceil_div;
using detail::for_each_marked;
using detail::id_str;
using detail::inclusive_sums;

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
      pool_positions_(static_cast<int32_t>(std::min<int64_t>(
          int64_t{config_.num_blocks - 1} * config_.block_size,
          std::numeric_limits<int32_t>::max()))),
      position_limit_(std::min(config_.max_model_len, pool_positions_)),
      block_shift_(std::has_single_bit(static_cast<uint32_t>(config_.block_size))
                       ? std::countr_zero(static_cast<uint32_t>(config_.block_size))
                       : -1),
      cache_decode_blocks_(config_.cache_decode_blocks && config_.enable_prefix_caching),
      pool_(config_.num_blocks, config_.block_size, config_.enable_prefix_caching,
            config_.enable_kv_events, config_.num_state_slots, config_.recompute_last_hit_block),
      tenants_(config_.tenant_weights) {
  const size_t rows = config_.max_num_seqs;
  // The per-token arrays have K slack entries past the token budget: a steady speculative row
  // writes all K+1 of its slots at once (add_steady_decode_rows()), also when it schedules fewer.
  const size_t tokens = config_.max_num_batched_tokens + k_;
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
    b.row_is_prefill.resize(rows);
    b.emits_token.resize(rows);
    b.row_exact.resize(rows);
    b.state_slots.resize(rows);
    if (config_.host_block_tables) b.block_tables.assign(rows * table_width_, kNullBlock);
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
  step_output_.finished_entries.reserve(rows);
  step_output_.finished_offsets.reserve(rows + 1);
  stats_.acceptance_counts.assign(k_ + 1, 0);
  // Popped from the back: the first admission gets device slot 0.
  for (int32_t s = config_.max_num_seqs - 1; s >= 0; --s) free_device_slots_.push_back(s);
  slot_by_id_.reserve(rows * 2);
  victim_refs_.assign(config_.num_blocks, 0);
  partial_.reserve(rows);
  // Room for the holes a step leaves (squeeze_running() keeps them under a 32nd).
  running_.reserve(2 * static_cast<size_t>(rows));
  steady_.resize(running_.capacity());
  for (auto& runs : steady_runs_) runs.reserve(rows);
  for (auto& victims : step_victims_) victims.reserve(rows);  // at most the running set
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

int32_t Scheduler::slot_in_use(int64_t id) const {
  const int32_t s = slot_of(id);
  if (s >= 0) return s;
  auto it = deferred_.find(id);
  return it == deferred_.end() ? -1 : it->second;
}

bool Scheduler::contains(int64_t id) const { return slot_in_use(id) >= 0; }

const Request& Scheduler::request(int64_t id) const {
  const int32_t s = slot_in_use(id);
  if (s < 0) throw UnknownRequest("unknown request id " + id_str(id));
  return requests_[s];
}

// ---------------------------------------------------------------------------------------------
// Intrusive lists (the waiting queues): O(1) push, pop and removal from the middle.

void Scheduler::list_insert_after(List& l, int32_t after, int32_t slot) {
  Link& r = links_[slot];
  r.prev = after;
  r.next = after >= 0 ? links_[after].next : l.head;
  (after >= 0 ? links_[after].next : l.head) = slot;
  (r.next >= 0 ? links_[r.next].prev : l.tail) = slot;
  ++l.size;
}

void Scheduler::enqueue(List& l, int32_t slot, bool preempted) {
  const ServiceOrder order{config_.scheduling};
  const Request& r = requests_[slot];
  if (!order.sorted()) {
    int32_t after = preempted ? -1 : l.tail;
    // A preempted request goes back to the head. Victims taken from the tail come in reverse
    // service order, so each goes first; others (least computed) go behind the victims at the
    // head served before them.
    if (preempted && !VictimChoice{config_.preemption_victim, config_.scheduling}.takes_tail())
      for (int32_t e = l.head;
           e >= 0 && requests_[e].preempted && requests_[e].arrival_seq < r.arrival_seq;
           e = links_[e].next)
        after = e;
    list_insert_after(l, after, slot);
    return;
  }
  // Sorted: walk from the end the request most likely belongs near (a preempted request was
  // admitted before most of what waits; an arrival or admission comes after most of the queue).
  if (preempted) {
    int32_t after = -1;
    for (int32_t e = l.head; e >= 0 && !order(r, requests_[e]); e = links_[e].next) after = e;
    list_insert_after(l, after, slot);
  } else {
    int32_t after = l.tail;
    while (after >= 0 && order(r, requests_[after])) after = links_[after].prev;
    list_insert_after(l, after, slot);
  }
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
  for (const List* l : {&waiting_, &remote_waiting_, &sessions_resuming_})
    for (int32_t s = l->head; s >= 0; s = links_[s].next) out.push_back(requests_[s].id);
  return out;
}

std::vector<int64_t> Scheduler::running_ids() const {
  std::vector<int64_t> out;
  out.reserve(num_running());
  for (int32_t s : running_)
    if (s != kRunningHole) out.push_back(requests_[s].id);
  return out;
}

// ---------------------------------------------------------------------------------------------
// The running set: an array in service order, walked by index on the step path.

void Scheduler::add_running(int32_t slot) {
  Request& r = requests_[slot];
  const ServiceOrder order{config_.scheduling};
  // Within the capacity reserved at construction, and the copies' (a copy of the scheduler
  // reserves none): at most max_num_seqs live entries, and the holes go first when it is full.
  if (order.sorted() || running_.size() == running_.capacity() ||
      running_.size() == steady_.bound.size())
    squeeze_running(/*always=*/true);
  size_t at = running_.size();
  // Sorted: from the back (an admission comes after most of the running set), in an array
  // without holes; the requests after it move up one. FCFS: at the back.
  if (order.sorted())
    while (at > 0 && order(r, requests_[running_[at - 1]])) --at;
  running_.insert(running_.begin() + static_cast<std::ptrdiff_t>(at), slot);
  for (size_t i = running_.size() - 1; i > at; --i) {
    steady_.move(i - 1, i);
    requests_[running_[i]].run_pos = static_cast<int32_t>(i);
  }
  r.run_pos = static_cast<int32_t>(at);
  sync_steady(r);
}

void Scheduler::remove_running(Request& r) {
  // The admission ends: what it computed counts against its tenant's share (hits were free).
  if (fair_share())
    tenants_.charge(r.tenant, r.computed_here());
  const int32_t pos = r.run_pos;
  r.run_pos = -1;
  if (pos + 1 < static_cast<int32_t>(running_.size())) {
    running_[pos] = kRunningHole;
    steady_.bound[pos] = steady_.reach[pos] = 0;  // a steady run stops at a hole
    ++running_holes_;
    return;
  }
  running_.pop_back();  // the tail (a preemption's victim): no hole, nor any before it
  while (!running_.empty() && running_.back() == kRunningHole) {
    running_.pop_back();
    --running_holes_;
  }
}

ATOM_SCHED_AVX2_CLONES void Scheduler::squeeze_running(bool always) {
  const bool sparse = running_holes_ * 32 < static_cast<int32_t>(running_.size());
  if (running_holes_ == 0 || (!always && sparse)) return;
  // The entries before the first hole stay; each run of entries after it moves up over the
  // holes, with its steady columns (which only K = 0 keeps) column by column.
  const size_t size = running_.size();
  size_t n = static_cast<size_t>(std::find(running_.begin(), running_.end(), kRunningHole) -
                                 running_.begin());
  for (size_t i = n; i < size;) {
    if (running_[i] == kRunningHole) {
      ++i;
      continue;
    }
    size_t end = i;
    while (end < size && running_[end] != kRunningHole) ++end;
    if (k_ == 0) steady_.move_run(i, n, end - i);
    for (; i < end; ++i, ++n) {
      running_[n] = running_[i];
      requests_[running_[n]].run_pos = static_cast<int32_t>(n);
    }
  }
  running_.resize(n);
  running_holes_ = 0;
}

void Scheduler::SteadyRows::move_run(size_t from, size_t to, size_t n) {
  for_each_column([&](auto& column) {  // to < from: a forward copy may overlap
    std::copy(column.begin() + static_cast<std::ptrdiff_t>(from),
              column.begin() + static_cast<std::ptrdiff_t>(from + n),
              column.begin() + static_cast<std::ptrdiff_t>(to));
  });
}

void Scheduler::SteadyRows::resize(size_t n) {
  for_each_column([n](auto& column) { column.resize(n); });
  marks.resize(n + 8);  // whole 8-byte words past the last row
}

void Scheduler::sync_steady(const Request& r) {
  if (k_ == 0) steady_.set(static_cast<size_t>(r.run_pos), steady_entry(r));
}

// ---------------------------------------------------------------------------------------------
// Adding, aborting, finishing

void Scheduler::add_request(int64_t id, std::span<const int32_t> prompt,
                            const SamplingParams& params, double arrival_time) {
  // Validate everything before touching any state.
  if (id < 0) throw InvalidArgument("request id must be >= 0, got " + id_str(id));
  if (slot_of(id) >= 0) throw InvalidArgument("request id " + id_str(id) + " is already live");
  if (deferred_.count(id) > 0)
    throw InvalidArgument("request id " + id_str(id) + " is finished but its KV blocks wait for "
                          "a transfer; it can be reused once update_from_kv_xfer_finished() "
                          "reports it (finished_sending / finished_recving)");
  if (prompt.empty()) throw InvalidArgument("request " + id_str(id) + ": the prompt is empty");
  if (!std::isfinite(arrival_time))
    throw InvalidArgument("request " + id_str(id) + ": arrival_time must be finite, got " +
                          std::to_string(arrival_time));
  for (size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0)
      throw InvalidArgument("request " + id_str(id) + ": prompt token " + std::to_string(i) +
                            " is negative (" + std::to_string(prompt[i]) + ")");
  params.validate();
  if (params.n != 1)
    throw InvalidArgument("n > 1 is not supported by the scheduler: the engine fans a request "
                          "out into n requests");
  if (params.priority != 0 && config_.scheduling != SchedulingPolicy::kPriority)
    throw InvalidArgument("request " + id_str(id) + " has priority " +
                          std::to_string(params.priority) +
                          " but priority scheduling is not enabled (scheduling=\"priority\")");
  if (params.resumable && config_.num_state_slots > 0)
    throw InvalidArgument("request " + id_str(id) + ": a streaming-input session (resumable) "
                          "needs KV it can rewind by a token, and per-request state slots "
                          "(num_state_slots > 0) cannot be rewound");

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
  r.loaded_tokens = 0;
  r.kept_tokens = 0;
  r.input_ready = false;
  r.state_slot = -1;
  r.epoch = 0;
  set_sampling(r, params, arrival_time);
  r.priority = params.priority;
  r.lora_name = params.lora_name;
  r.cache_salt = params.cache_salt;
  r.hash_namespace = hash_namespace(params.lora_name, params.cache_salt);
  r.arrival_seq = next_arrival_seq_++;
  r.tokens.clear();
  r.tokens.reserve(lifetime_tokens(r.num_prompt_tokens, params.max_tokens));
  r.set_tokens(prompt.data(), prompt.size());
  r.block_table.clear();
  r.block_table.reserve(table_width_);
  r.table_changed();
  r.block_hashes.clear();
  r.block_hashes.reserve(table_width_);
  // The prompt's block hashes now, as vLLM hashes a request when it is created: admission only
  // looks them up, so a step that admits prompts makes its running requests wait for no hashing.
  ensure_block_hashes(r, probe_blocks(r));
  r.drafts.assign(k_, -1);
  r.num_drafts = 0;
  r.finish_reason = FinishReason::kNone;
  r.stop_token = -1;
  r.num_unstreamed = 0;
  r.remote_ready = r.awaiting_send = r.awaiting_recv = false;
  r.remote_first_token = -1;
  r.remote_computed = 0;
  r.remote_drafts.clear();
  r.pending_stop = FinishReason::kNone;
  r.pending_stop_token = -1;
  r.tenant = -1;
  if (fair_share()) {
    // A tenant with no live request starts at the least counter of those with some.
    double floor = std::numeric_limits<double>::infinity();
    if (!tenants_.has(params.tenant)) {
      update_tenant_counters();
      for (int32_t t = 0; t < tenants_.size(); ++t)
        if (tenants_.active(t)) floor = std::min(floor, tenant_counters_[t]);
    }
    r.tenant = tenants_.join(params.tenant, floor);
  }
  slot_by_id_[id] = slot;
  enqueue(waiting_, slot);
}

void Scheduler::set_sampling(Request& r, const SamplingParams& params, double arrival_time) {
  r.temperature = params.temperature;
  r.top_k = params.top_k;
  r.top_p = params.top_p;
  r.seed = params.seed;
  r.max_tokens = params.max_tokens;
  r.stop_length = final_length(r);
  r.min_tokens = params.min_tokens;
  r.ignore_eos = params.ignore_eos;
  r.wants_logprobs = params.logprobs;
  r.stop_token_ids = config_.stop_token_ids;
  r.stop_token_ids.insert(r.stop_token_ids.end(), params.stop_token_ids.begin(),
                          params.stop_token_ids.end());
  r.stop_sequences = params.stop_token_sequences;
  r.has_stop_lists = !r.stop_token_ids.empty() || !r.stop_sequences.empty();
  r.resumable = params.resumable;
  r.arrival_time = arrival_time;
  const int32_t job_tokens = params.length_hint > 0 ? params.length_hint : params.max_tokens;
  r.sjf_key = arrival_time + job_tokens / config_.sjf_aging_rate;
}

void Scheduler::abort_request(int64_t id) {
  const int32_t slot = slot_of(id);
  if (slot < 0 && deferred_.count(id) > 0)
    throw UnknownRequest("request " + id_str(id) + " is already finished (its KV blocks wait for "
                         "a transfer)");
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  ++stats_.num_aborted;
  finish(slot, FinishReason::kAborted, -1);
  squeeze_running();
}

void Scheduler::preempt_request(int64_t id) {
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  const RequestStatus status = requests_[slot].status;
  if (status != RequestStatus::kRunning) {
    const char* what = status == RequestStatus::kWaiting               ? "waiting"
                       : status == RequestStatus::kWaitingForRemoteKv ? "waiting for remote KV"
                       : status == RequestStatus::kWaitingForInput    ? "waiting for input"
                                                                       : "finished";
    throw InvalidArgument("preempt_request(" + id_str(id) + "): the request is " + what +
                          ", not running");
  }
  preempt(slot);
  squeeze_running();
}

void Scheduler::set_drafts(int64_t id, std::span<const int32_t> drafts) {
  const int32_t slot = slot_of(id);
  if (slot < 0) throw UnknownRequest("unknown request id " + id_str(id));
  const std::string call = "set_drafts(" + id_str(id) + "): ";
  if (k_ == 0)
    throw InvalidArgument(call + "speculative decoding is off (num_speculative_tokens = 0)");
  const auto n = static_cast<int64_t>(drafts.size());
  if (n > k_)
    throw InvalidArgument(call + std::to_string(n) + " drafts, more than num_speculative_tokens"
                          " (" + std::to_string(k_) + ")");
  for (int64_t j = 0; j < n; ++j)
    if (drafts[j] < 0)
      throw InvalidArgument(call + "draft " + std::to_string(j) + " is negative (" +
                            std::to_string(drafts[j]) + ")");
  Request& r = requests_[slot];
  // Decoding with nothing in flight: its next row starts at its last token, which it inputs,
  // and nothing scheduled yet has read its drafts.
  if (r.status != RequestStatus::kRunning || r.num_inflight > 0 || r.num_unstreamed > 0 ||
      r.num_computed_tokens != r.num_tokens() - 1)
    throw InvalidArgument(call + "the request is not decoding with nothing in flight (waiting, "
                          "mid-prompt, or a row of it not yet updated)");
  for (int32_t j = 0; j < k_; ++j) r.drafts[j] = j < n ? drafts[j] : -1;
  r.num_drafts = static_cast<int32_t>(n);
}

void Scheduler::track_partial(int32_t slot) {
  // In running order: FCFS appends (admissions join the back of running), priority sorts.
  const ServiceOrder order{config_.scheduling};
  auto at = partial_.end();
  if (order.sorted())
    at = std::upper_bound(partial_.begin(), partial_.end(), slot, [&](int32_t a, int32_t b) {
      return order(requests_[a], requests_[b]);
    });
  partial_.insert(at, slot);  // within the capacity reserved at construction
}

void Scheduler::untrack_partial(int32_t slot) {
  partial_.erase(std::find(partial_.begin(), partial_.end(), slot));
}

void Scheduler::finish(int32_t slot, FinishReason reason, int32_t stop_token) {
  Request& r = requests_[slot];
  if (r.is_partial_prefill()) untrack_partial(slot);
  if (r.status == RequestStatus::kRunning) {
    remove_running(r);
  } else if (r.status == RequestStatus::kWaitingForRemoteKv) {
    list_remove(remote_waiting_, slot);
  } else if (r.status == RequestStatus::kWaitingForInput) {
    list_remove(r.input_ready ? sessions_resuming_ : sessions_waiting_, slot);
  } else {
    list_remove(waiting_, slot);
  }
  if (r.tenant >= 0) tenants_.leave(r.tenant);
  r.tenant = -1;
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
    } catch (const ConnectorInterrupt&) {
      // Not the request's failure: it finishes as if the connector kept nothing.
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
           ". Increase max_model_len or shorten the prompt.";
  // ATOM checked num_tokens here, so a preempted request that had grown past the budget was
  // rejected on readmission (8.9); a preempted request is re-prefilled in chunks instead.
  // (A row also takes its drafter's input slots: token_room().)
  // (A resuming session computes only its new tokens.)
  const int32_t to_compute = r.num_prompt_tokens - r.num_computed_tokens;
  if (!config_.enable_chunked_prefill && to_compute > token_room(0, 0))
    return "input tokens=" + std::to_string(to_compute) +
           (config_.draft_slots_per_row ? " and the drafter's inputs" : "") +
           " > max_num_batched_tokens=" +
           std::to_string(config_.max_num_batched_tokens) +
           ". Increase max_num_batched_tokens, enable chunked prefill, or shorten the prompt.";
  // (A drafter's lookahead never needs more: kv_slots_for() stops at the pool's positions.)
  const int32_t blocks = ceil_div(n, config_.block_size);
  if (blocks > pool_.num_usable_blocks())
    return "needs " + std::to_string(blocks) + " KV blocks for " + std::to_string(n) +
           " input tokens > the pool's " + std::to_string(pool_.num_usable_blocks()) +
           " (num_blocks=" + std::to_string(pool_.num_blocks()) +
           " less the null block). Shorten the prompt or increase num_blocks.";
  return std::nullopt;
}

int32_t Scheduler::lookahead_blocks(const Request& r) const {
  const int32_t bs = config_.block_size;
  return ceil_div(kv_slots_for(r.num_tokens()), bs) - ceil_div(r.num_tokens(), bs);
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
    const std::optional<uint64_t> parent = i > 0 ? r.block_hashes[i - 1] : r.hash_namespace;
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
         num_running() == 0;
}

PrefillChunk Scheduler::prefill_chunk() const {
  // The cap keeps a long prompt from starving other requests; a lone request has none to starve.
  const int32_t requests = num_running() + num_waiting();
  int32_t cap = requests > 1 ? config_.long_prefill_token_threshold : 0;
  if (cap > 0 && config_.long_prefill_token_threshold_adaptive)
    cap = std::max(cap, config_.max_num_batched_tokens / requests);
  return {config_.enable_chunked_prefill, cap, config_.prefill_lookahead_tokens};
}

bool Scheduler::pads_first_decode(const Request& r, int32_t computed, bool chunk_continued,
                                  bool decodes) const {
  // (config.h, pad_first_decode_rows.) A decode row publishes the prompt's last block only with
  // cache_decode_blocks: without it, a row that completes that block stays a prompt row.
  return config_.pad_first_decode_rows && r.num_tokens() - computed == 1 && !chunk_continued &&
         (decodes || computed > 0) && computed + k_ + 2 <= position_limit_ &&
         (cache_decode_blocks_ || r.num_tokens() % config_.block_size != 0);
}

int32_t Scheduler::schedule_prefills(Batch& b, double now, bool admit_waiting) {
  const int32_t max_rows = config_.max_num_seqs;
  const PrefillChunk chunk_of = prefill_chunk();
  const int32_t decode_rows = b.num_rows;  // (a mixed step decodes first)
  int32_t padded_rows = 0;

  // Phase 1: resume partial prefills, in running order (partial_ keeps it, so a mixed step
  // does not walk every running request to find them).
  for (size_t i = 0; i < partial_.size() && b.num_rows < max_rows;) {
    const int32_t s = partial_[i];
    const Request& r = requests_[s];
    const int32_t chunk = chunk_of(r.prefill_target - r.num_computed_tokens, row_token_room(b),
                                   /*must_chunk=*/true);
    if (chunk <= 0) break;
    add_prefill_row(b, s, chunk);
    if (i < partial_.size() && partial_[i] == s) ++i;  // still partial; else it left partial_
  }
  const bool chunk_continued = b.num_rows > decode_rows;

  // Phase 2: admit from the head of waiting, in service order, until one does not fit. Not in a
  // step that preempted (as vLLM): the pool is short of blocks, and a victim (the head of
  // waiting under FCFS, possibly the request whose row preempted itself) would be re-admitted to
  // recompute the KV the step has just freed. Only a mixed step decodes, so preempts, before
  // it admits; Phase 1 rows hold their blocks already.
  const bool preempted = !step_victims_[next_buffer_].empty();
  // Sessions whose next input arrived hold their KV already, like requests whose remote KV
  // arrived: they go first, whatever admit_waiting and the delay factor say (vLLM drains its
  // KV-holding queue first, under PAUSED_NEW too).
  if (!preempted && sessions_resuming_.size > 0 && !resume_sessions(b, chunk_of)) return 0;
  if (!admit_waiting) return 0;
  if (config_.scheduler_delay_factor > 0 && !passed_delay(now)) return 0;
  if (preempted) return 0;
  const int32_t bs = config_.block_size;
  const bool needs_state = config_.num_state_slots > 0;
  const AdmissionHeadroom headroom{config_.admission_watermark_blocks};
  const bool fair = fair_share();
  if (fair) update_tenant_counters();  // with this step's rows so far
  // Requests whose connector cannot answer yet stay in `waiting`, skipped in this call. In
  // service order they are a prefix of what is left: the next pick follows the last skipped.
  std::vector<int32_t>& skipped = admission_skipped_;
  skipped.clear();
  while (waiting_.size > static_cast<int32_t>(skipped.size()) && b.num_rows < max_rows &&
         num_seated() < max_rows && row_token_room(b) > 0) {
    const int32_t s = fair            ? fair_pick(tenant_counters_, skipped)
                      : skipped.empty() ? waiting_.head
                                        : links_[skipped.back()].next;
    if (s < 0) break;
    Request& r = requests_[s];
    if (auto why = unschedulable_reason(r)) {
      reject(s, "unschedulable: " + *why);
      continue;
    }
    // A preempted request's in-flight output must land before it is re-prefilled. With at most
    // two batches outstanding it always has; this guard keeps the invariant explicit.
    if (r.num_inflight > 0) break;
    ensure_block_hashes(r, probe_blocks(r));
    // The lookahead's blocks count as reserved: its prompt's last block is still never a hit.
    const int32_t ahead = lookahead_blocks(r);
    const int32_t hits = pool_.can_allocate(r.block_hashes, r.tokens, r.num_tokens(), needs_state,
                                            headroom(num_running()) + ahead);
    if (hits < 0) break;  // head-of-line blocking, as ATOM
    r.prefix_hit_tokens = hits * bs;
    r.kept_tokens = 0;  // (a preempted session recomputes its turns like any prompt)
    // The connector is asked only once the request fits (ATOM asked before, 8.5).
    RemoteMatch match;
    if (connector_) {
      try {
        match = connector_->get_num_new_matched_tokens(connector_view(r));
        match.validate();  // a negative id in the answer is a failed call, like a throw
      } catch (const ConnectorInterrupt&) {
        break;  // the request waits at the head, untouched
      } catch (const std::exception& e) {
        connector_failed(r, "get_num_new_matched_tokens", e);
        reject(s, "kv connector error: " + std::string(e.what()));
        continue;
      }
    }
    if (match.retry_later) {
      skipped.push_back(s);
      continue;
    }
    const int32_t computed = hits * bs + external_tokens(r, hits * bs, match);
    // A request waiting for its KV computes nothing yet: it takes no budget.
    const int32_t chunk =
        match.load_async ? 0
                         : chunk_of(r.num_tokens() - computed, row_token_room(b), r.preempted);
    if (chunk == 0 && !match.load_async) break;
    bool pad = !match.load_async && pads_first_decode(r, computed, chunk_continued,
                                                      decode_rows > 0);
    if (pad && k_ + 1 > row_token_room(b)) break;  // it waits rather than go unpadded (vLLM)
    pool_.allocate(r.block_hashes, hits, r.num_tokens(), r.block_table);
    if (ahead > 0) pool_.grow(r.block_table, static_cast<int32_t>(r.block_table.size()) + ahead);
    // The padded positions' KV beyond the admission's reservation: short of it, one token.
    if (pad) pad = pool_.grow(r.block_table, ceil_div(kv_slots_for(computed + k_ + 1), bs));
    r.table_changed();
    r.epoch = next_epoch_++;
    r.blocks_shipped = 0;
    r.blocks_published = hits;
    r.prefill_target = r.num_tokens();
    if (connector_ && !dry_run_) {
      try {
        connector_->update_state_after_alloc(connector_view(r));
      } catch (const ConnectorInterrupt&) {
        release_kv(r, /*keep_blocks=*/false);  // undo the allocation: it waits at the head again
        break;
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
      r.remote_computed = computed;
      list_insert_after(remote_waiting_, remote_waiting_.tail, s);
      continue;
    }
    if (config_.enable_prefix_caching) {
      ++stats_.num_prefix_queries;
      stats_.prefix_query_tokens += r.num_tokens();
      stats_.prefix_hit_tokens += hits * bs;
    }
    if (needs_state) r.state_slot = pool_.take_state_slot();
    take_device_slot(r);
    r.num_computed_tokens = computed;  // the external tokens' KV loads before this step runs
    r.loaded_tokens = computed - hits * bs;
    r.status = RequestStatus::kRunning;
    add_running(s);
    if (pad) {
      add_padded_first_decode_row(b, s);
      ++padded_rows;
    } else {
      track_partial(s);  // always partial here: the last token is always computed
      add_prefill_row(b, s, chunk);
    }
    if (fair) tenant_counters_[r.tenant] += (pad ? k_ + 1 : chunk) / tenants_.weight(r.tenant);
  }
  return padded_rows;
}

int32_t Scheduler::external_tokens(const Request& r, int32_t local, const RemoteMatch& m) {
  if (m.first_token >= 0) return 0;  // ATOM's remote prefill: the prompt, decoded from T0
  // Loaded before this step's forward, the KV of the tokens after the local hit; a load this
  // step waits for may cover every token (the last is re-forwarded once it lands).
  const int32_t room = r.num_tokens() - local - (m.load_async ? 0 : 1);
  return std::clamp(m.num_tokens, 0, std::max(room, 0));
}

void Scheduler::update_tenant_counters() {
  tenant_counters_.assign(static_cast<size_t>(tenants_.size()), 0.0);
  for (int32_t s : running_)
    if (s != kRunningHole) {
      const Request& r = requests_[s];
      tenant_counters_[r.tenant] += r.computed_here();
    }
  for (int32_t t = 0; t < tenants_.size(); ++t)
    tenant_counters_[t] = (tenant_counters_[t] + tenants_.charged(t)) / tenants_.weight(t);
}

int32_t Scheduler::fair_pick(const std::vector<double>& counters,
                             std::span<const int32_t> skip) const {
  int32_t best = -1;
  for (int32_t s = waiting_.head; s >= 0; s = links_[s].next) {
    if (std::find(skip.begin(), skip.end(), s) != skip.end()) continue;
    if (best < 0 || counters[requests_[s].tenant] < counters[requests_[best].tenant]) best = s;
  }
  return best;
}

void Scheduler::admit_remote_ready() {
  // Not part of Phase 2: a request whose KV has arrived needs no budget and no prefill, so it
  // joins the decode set whatever the delayer or the delay factor say, and whatever blocks the
  // head of `waiting` (ATOM rotated such requests through `waiting`, where a blocked head could
  // hold them back forever while they held the very blocks it needed).
  for (int32_t s = remote_waiting_.head; s >= 0 && num_seated() < config_.max_num_seqs;) {
    const int32_t next = links_[s].next;
    if (requests_[s].remote_ready) {
      list_remove(remote_waiting_, s);
      start_remote_decode(s);
    }
    s = next;
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

int32_t Scheduler::count_admittable_head_prefills(int32_t limit) {
  // The admission loop's own steps (schedule_prefills, Phase 2), on the first 4 waiting requests
  // it would take (fair share: the first 4 picks) and without changing anything: KV and budget
  // taken by the requests counted before are accounted as the loop would take them.
  if (limit <= 0 || waiting_.size == 0) return 0;
  const int32_t budget = config_.max_num_batched_tokens;
  const int32_t bs = config_.block_size;
  const PrefillChunk chunk_of = prefill_chunk();
  const AdmissionHeadroom headroom{config_.admission_watermark_blocks};
  const bool fair = fair_share();
  if (fair) update_tenant_counters();
  std::array<int32_t, 4> probed_slots{};
  int32_t count = 0, tokens = 0, blocks_taken = 0, probed = 0;
  auto next = [&](int32_t s) {
    probed_slots[probed] = s;
    return fair ? fair_pick(tenant_counters_, std::span(probed_slots.data(), probed + 1))
                : links_[s].next;
  };
  for (int32_t s = fair ? fair_pick(tenant_counters_) : waiting_.head;
       s >= 0 && probed < 4 && count < limit && tokens < budget; s = next(s), ++probed) {
    Request& r = requests_[s];
    if (num_seated() + count >= config_.max_num_seqs) break;
    if (unschedulable_reason(r)) continue;  // the loop rejects it: it blocks nothing
    if (r.num_inflight > 0) break;
    ensure_block_hashes(r, probe_blocks(r));
    const int32_t reserve = headroom(num_running() + count);
    const int32_t ahead = lookahead_blocks(r);
    const int32_t hits = pool_.can_allocate(r.block_hashes, r.tokens, r.num_tokens(),
                                            config_.num_state_slots > 0, reserve + ahead);
    if (hits < 0) break;
    // Upper bound: hits may be shared.
    const int32_t fresh = ceil_div(r.num_tokens(), bs) - hits + ahead;
    if (blocks_taken + fresh + reserve > pool_.num_free_blocks()) break;
    const int32_t chunk = chunk_of(r.num_tokens() - hits * bs, token_room(tokens, count),
                                   r.preempted);
    if (chunk == 0) break;
    blocks_taken += fresh;
    tokens += chunk;
    if (fair) tenant_counters_[r.tenant] += chunk / tenants_.weight(r.tenant);
    ++count;
  }
  return count;
}

int32_t Scheduler::final_length(const Request& r) const {
  // The stop rules that depend on the length alone (length_stop()): the request ends as soon as
  // it holds this many tokens.
  const int64_t max_tokens = int64_t{r.num_prompt_tokens} + r.max_tokens;
  return static_cast<int32_t>(std::min<int64_t>(
      {max_tokens, config_.max_model_len, int64_t{pool_positions_} + 1}));
}

template <bool kSpec>
[[gnu::always_inline]] inline int32_t Scheduler::decode_row_tokens(const Request& r) const {
  const int32_t k = kSpec ? k_ : 0;
  // A remote request whose injected first token already ends it: one row streams that token.
  // (num_unstreamed, a hot field, guards the read of the cold pending_stop.)
  if (r.num_unstreamed > 0 && r.pending_stop != FinishReason::kNone)
    return r.num_inflight > 0 ? 0 : 1;
  if (r.num_inflight > 0 && !config_.schedule_ahead) return 0;  // it waits for its output
  // Outputs in flight (each emits at least one token) that will end the request: a row now
  // would be discarded, and could preempt another request for nothing.
  if (r.num_inflight > 0 && r.num_tokens() + r.num_inflight >= r.stop_length) return 0;
  // Every position < max_model_len (a model's rotary table has that many rows) and inside the
  // pool: drafts past the limit are not scheduled (as vLLM). S is an upper bound one step ahead,
  // so the device's exact positions are below the limit too.
  const int32_t n = std::clamp(position_limit_ - r.num_computed_tokens, 0, k + 1);
  if (kSpec && config_.uniform_decode_rows) return r.num_inflight > 0 && n <= k ? 0 : n;
  // With its drafts known (nothing in flight), a row verifies only those the drafter proposed,
  // and reserves KV for them only. One step ahead they are not known yet: K+1, an upper bound
  // (the device pads missing drafts and never accepts them).
  if constexpr (!kSpec) return n;  // no drafts
  return r.num_inflight == 0 ? std::min(n, r.num_drafts + 1) : n;
}

int32_t Scheduler::preemption_victim(size_t from) {
  // The candidates are running_[from..]: the rows before `from` are already in the batch.
  VictimChoice choice{config_.preemption_victim, config_.scheduling};
  // Running is kept in service order (add_running): the request served last is its tail (never
  // a hole).
  if (choice.takes_tail()) return running_.back();
  if (fair_share()) {
    update_tenant_counters();
    choice.tenant_counters = tenant_counters_.data();
  }
  int32_t victim = running_.back();
  for (size_t i = running_.size() - 1; i-- > from;) {
    const int32_t s = running_[i];
    if (s != kRunningHole && choice.before(requests_[s], requests_[victim])) victim = s;
  }
  return victim;
}

bool Scheduler::preemption_can_free(size_t at, int32_t missing) {
  // Whether preempting them all would do: the order victims are taken in does not matter.
  int32_t room = pool_.num_free_blocks();
  size_t v = running_.size();
  for (; v > at + 1 && room < missing; --v) {
    if (running_[v - 1] == kRunningHole) continue;
    for (int32_t blk : requests_[running_[v - 1]].block_table)
      if (++victim_refs_[blk] == pool_.ref_count(blk)) ++room;  // held by victims only
  }
  for (size_t u = v; u < running_.size(); ++u) {
    if (running_[u] == kRunningHole) continue;
    for (int32_t blk : requests_[running_[u]].block_table) victim_refs_[blk] = 0;
  }
  return room >= missing;
}

int32_t Scheduler::schedule_decodes(Batch& b) {
  const bool pow2 = block_shift_ >= 0;
  if (k_ > 0)
    return pow2 ? schedule_decode_rows<true, true>(b) : schedule_decode_rows<true, false>(b);
  return pow2 ? schedule_decode_rows<false, true>(b) : schedule_decode_rows<false, false>(b);
}

template <bool kSpec, bool kPow2>
int32_t Scheduler::schedule_decode_rows(Batch& b) {
  const int32_t first_row = b.num_rows;
  // running_ may shrink inside the loop (preemptions take its tail): its size is read each time.
  for (size_t i = 0; i < running_.size(); ++i) {
    if (running_[i] == kRunningHole) continue;
    bool steady;
    if constexpr (kSpec)  // (the steady path knows no drafter's lookahead or input slots)
      steady = (config_.num_lookahead_tokens | config_.draft_slots_per_row) == 0 &&
               steady_spec_row_tokens<kPow2>(requests_[running_[i]]) > 0;
    else
      steady = steady_.takes_row(i);
    if (b.num_rows < config_.max_num_seqs && steady) {
      // The run of steady rows from here.
      i = kSpec ? add_steady_spec_rows<kPow2>(b, i) : add_steady_rows(b, i);
      if (i == running_.size()) break;
      if (running_[i] == kRunningHole) continue;
    }
    if (b.num_rows >= config_.max_num_seqs) break;
    const int32_t s = running_[i];
    Request& r = requests_[s];
    if (r.is_partial_prefill()) continue;  // never decode a half-prefilled prompt (8.3)
    const int32_t n = decode_row_tokens<kSpec>(r);
    if (n == 0) continue;
    if (n > row_token_room(b)) break;
    // Exact reservation for this row's positions S .. S+n-1 and the drafter's lookahead (ATOM
    // over- or under-reserved, 8.6/8.7).
    const int32_t needed = blocks_in<kPow2>(kv_slots_for(r.num_computed_tokens + n));
    const int32_t have = r.table_size;
    if (have < needed && !pool_.grow(r.block_table, needed)) {
      // A victim's blocks would stay fenced while its rows fly: preempting frees nothing now,
      // so the row waits for the batches in flight (their outputs free or advance requests).
      if (config_.fence_freed_blocks && num_outstanding_ > 0) continue;
      // Blocks held where no preemption reaches (rows before it, requests waiting for a
      // transfer): with an empty batch, preempting would change the state and still schedule
      // nothing, so the request keeps its blocks and waits; later requests may still run.
      if (b.num_rows == 0 && !preemption_can_free(i, needed - have)) continue;
      // Recompute preemption (policy.h's VictimChoice), among `s` and the requests after it:
      // rows already in this batch sit before `s` in the set, so they are never victims.
      bool preempted_self = false;
      while (!pool_.grow(r.block_table, needed)) {
        const int32_t victim = preemption_victim(i);
        step_victims_[next_buffer_].push_back(requests_[victim].id);
        preempt(victim);
        if (victim == s) {
          preempted_self = true;
          break;
        }
      }
      // Its blocks freed, the requests after it may still fit (taking the tail, none are left).
      if (preempted_self) continue;
    }
    if (have < needed) r.table_changed();  // it grew (had it preempted itself, the loop left)
    add_decode_row<kSpec, kPow2>(b, s, n);
  }
  // Every decode row emits a token: the kind columns in one pass, not a store each per row.
  std::fill(b.row_is_prefill.begin() + first_row, b.row_is_prefill.begin() + b.num_rows, 0);
  std::fill(b.emits_token.begin() + first_row, b.emits_token.begin() + b.num_rows, 1);
  return b.num_rows - first_row;
}

void Scheduler::release_kv(Request& r, bool keep_blocks) {
  // Blocks and slots may still be written by a batch in flight; they are handed out again only to
  // batches scheduled later, which run after it on the engine's stream.
  if (!keep_blocks) {
    if (config_.fence_freed_blocks && r.num_inflight > 0) {  // a batch in flight writes them
      const int32_t newest = (next_buffer_ - 1 + kMaxOutstandingBatches) % kMaxOutstandingBatches;
      auto& fenced = fenced_blocks_[newest];
      fenced.insert(fenced.end(), r.block_table.begin(), r.block_table.end());
    } else {
      pool_.free(r.block_table);
    }
    r.block_table.clear();
    r.table_changed();
  }
  if (r.state_slot >= 0) pool_.release_state_slot(r.state_slot);
  r.state_slot = -1;
  if (r.device_slot >= 0) free_device_slots_.push_back(r.device_slot);
  r.device_slot = -1;
}

void Scheduler::preempt(int32_t slot) {
  Request& r = requests_[slot];
  if (r.is_partial_prefill()) untrack_partial(slot);
  remove_running(r);
  release_kv(r);
  // Only real tokens are ever kept, so nothing needs stripping (ATOM left placeholders, 8.1).
  // Outputs of a batch still in flight are appended when they arrive.
  r.num_computed_tokens = 0;
  r.prefill_target = 0;
  std::fill(r.drafts.begin(), r.drafts.end(), -1);
  r.num_drafts = 0;
  r.status = RequestStatus::kWaiting;
  r.preempted = true;
  enqueue(waiting_, slot, /*preempted=*/true);
  ++stats_.num_preemptions;
}

const Batch* Scheduler::schedule(double now, bool allow_prefill, bool admit_waiting) {
  if (num_outstanding_ >= kMaxOutstandingBatches)
    throw InvalidArgument("schedule(): " + std::to_string(kMaxOutstandingBatches) +
                          " batches are outstanding; pass the oldest to update() first");
  admit_remote_ready();
  if (waiting_.size == 0 && sessions_resuming_.size == 0 && num_running() == 0) return nullptr;
  // The buffer still holds the batch before the outstanding one, whose views stay valid until
  // this call returns a batch: keep its header if this call returns none.
  Batch& b = batches_[next_buffer_];
  const Batch::Header kept = b.header();
  b.id = 0;  // while it is rebuilt, views of the batch it held raise (a connector may read one)
  begin_batch(b);
  steady_runs_[next_buffer_].clear();
  step_victims_[next_buffer_].clear();
  int32_t decode_rows = 0;
  if (config_.policy == BatchPolicy::kMixed) {
    // Stall-free: no running request waits for a prefill; prompts take the budget left.
    decode_rows = schedule_decodes(b);
    if (allow_prefill) decode_rows += schedule_prefills(b, now, admit_waiting);
  } else {
    if (allow_prefill) schedule_prefills(b, now, admit_waiting);
    if (b.num_rows == 0) decode_rows = schedule_decodes(b);
  }
  if (b.num_rows == 0) {
    b.set_header(kept);
    return nullptr;
  }
  derive_row_columns(b);
  b.id = next_batch_id_++;
  b.is_prefill = decode_rows == 0;
  b.num_spec_tokens = decode_rows > 0 ? k_ : 0;
  if (b.num_rows > decode_rows) prev_prompt_ = true;
  next_buffer_ = (next_buffer_ + 1) % kMaxOutstandingBatches;
  ++num_outstanding_;
  ++stats_.num_steps;
  return &b;
}

NextBatchInfo Scheduler::next_batch_info(double now, bool allow_prefill,
                                         bool admit_waiting) const {
  Scheduler copy = *this;
  copy.dry_run_ = true;
  const Batch* b = copy.schedule(now, allow_prefill, admit_waiting);
  if (b == nullptr) return {};
  return {b->is_prefill, b->num_tokens, b->num_rows};
}

// ---------------------------------------------------------------------------------------------
// Batch assembly

void Scheduler::begin_batch(Batch& b) {
  b.num_rows = 0;
  b.num_tokens = 0;
  b.max_seqlen_q = 0;
  b.max_seqlen_k = 0;
  b.cu_seqlens_q[0] = 0;
  b.cu_seqlens_k[0] = 0;
  b.new_block_offsets[0] = 0;
}

namespace {

// Positions and KV slots of a row's tokens. The values run in 64 bits, so the vector stores add
// to int64 lanes instead of widening int32 ones.
//
// store_ramp: dst[i] = first + i for i < n, four lanes a store (one AVX2 store, or two SSE2
// ones in the baseline build). Written with a vector type: the loop vectoriser, given a block's
// 16 slots, unrolls them into scalar stores or pays a prologue and an epilogue per block.
using I64x4 = int64_t __attribute__((vector_size(32)));
[[gnu::always_inline]] inline void store_ramp(int64_t* __restrict dst, int64_t first,
                                              int64_t n) {
  I64x4 v = I64x4{0, 1, 2, 3} + first;
  int64_t i = 0;
  for (; i + 16 <= n; i += 16, v += 16) {  // a whole block of the usual size a pass
    const I64x4 v4 = v + 4, v8 = v + 8, v12 = v + 12;
    __builtin_memcpy(dst + i, &v, sizeof v);
    __builtin_memcpy(dst + i + 4, &v4, sizeof v);
    __builtin_memcpy(dst + i + 8, &v8, sizeof v);
    __builtin_memcpy(dst + i + 12, &v12, sizeof v);
  }
  for (; i + 4 <= n; i += 4, v += 4) __builtin_memcpy(dst + i, &v, sizeof v);
  for (; i < n; ++i) dst[i] = first + i;
}

// fill_positions: any row, block by block (a prompt chunk's thousands of tokens). Out of line: a
// one-token decode row never calls it. An admission writes 16 bytes of positions and slots per
// prompt token: with AVX2 (ATOM_SCHED_AVX2_CLONES) 4 int64 lanes a store, else 2.
ATOM_SCHED_AVX2_CLONES [[gnu::noinline]] void fill_positions(
    int64_t* __restrict positions, int64_t* __restrict slots, int32_t start, int32_t n,
    const int32_t* table, int32_t offset, int64_t base, int32_t bs) {
  store_ramp(positions, start, n);  // positions run on across blocks
  for (int32_t i = 0;;) {
    const int32_t run = std::min(bs - offset, n - i);
    if (run == 16)  // a whole block of the usual size: its count fixed, four stores
      store_ramp(slots + i, base + offset, 16);
    else
      store_ramp(slots + i, base + offset, run);
    i += run;
    if (i == n) return;
    offset = 0;
    base = int64_t{*++table} * bs;
  }
}

}  // namespace

// The row helpers are forced inline into the per-row loops: their call overhead was a fifth of a
// decode row's instructions.
[[gnu::always_inline]] inline void Scheduler::fill_block_table_row(Batch& b, int32_t row,
                                                                  const Request& r,
                                                                  bool same_owner) {
  // Rewriting every row in full each step would cost rows x width writes (ATOM's
  // prepare_block_tables); a row that holds the same admission as last time in this buffer
  // only gets the blocks appended since. Tables only grow during one admission.
  const int32_t size = r.table_size;
  if (!config_.host_block_tables) {  // no table: the row counts as filled, not looked at again
    b.row_filled[row] = size;
    return;
  }
  int32_t from = 0;
  if (same_owner) {
    from = b.row_filled[row];
    if (from == size) return;  // the common decode step: nothing new
  }
  int32_t* dst = b.block_tables.data() + static_cast<size_t>(row) * table_width_;
  if (!same_owner && b.row_filled[row] > size)
    std::fill(dst + size, dst + b.row_filled[row], kNullBlock);
  if (size - from == 1)  // the usual change: one block appended (no memmove call for one entry)
    dst[from] = r.last_block;
  else
    std::copy(r.block_table.begin() + from, r.block_table.end(), dst + from);
  b.row_filled[row] = size;
}

[[gnu::always_inline]] inline bool Scheduler::ship_new_blocks(Batch& b, int32_t row,
                                                             Request& r) {
  const int32_t size = r.table_size;
  const int32_t out = b.new_block_offsets[row];
  const int32_t shipped = r.blocks_shipped;
  b.new_block_starts[row] = shipped;
  b.new_block_offsets[row + 1] = out + size - shipped;
  if (shipped != size) {  // not the common decode step: blocks to ship
    std::copy(r.block_table.begin() + shipped, r.block_table.end(),
              b.new_block_ids.begin() + out);
    r.blocks_shipped = size;
  }
  return shipped == 0;
}

[[gnu::always_inline]] inline void Scheduler::write_owner_columns(Batch& b, int32_t row,
                                                                 const Request& r,
                                                                 int32_t slot) {
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

template <bool kPow2>
[[gnu::always_inline]] inline int32_t Scheduler::begin_row(Batch& b, Request& r, int32_t slot,
                                                          int32_t num_tokens) {
  const int32_t row = b.num_rows;
  const int32_t first = b.num_tokens;
  const int32_t start = r.num_computed_tokens;
  const int32_t bs = config_.block_size;
  // A row of this buffer that held the same admission two steps ago (steady-state decode keeps
  // the running order) already has the request's constant columns.
  const bool same_owner = b.row_owner[row] == r.epoch;
  if (!same_owner) write_owner_columns(b, row, r, slot);
  // Only what the request gives: the columns that follow from these two are derived for all
  // rows at once (derive_row_columns()).
  b.num_scheduled_tokens[row] = num_tokens;
  b.num_cached_tokens[row] = start;
  // Positions and slots, walking the block table instead of dividing per token.
  int64_t* positions = b.positions.data() + first;
  int64_t* slots = b.slot_mapping.data() + first;
  const int32_t block = block_in<kPow2>(start);
  const int32_t offset = kPow2 ? start & (bs - 1) : start - block * bs;
  // The row's first position is in its last block unless it crosses one (or is a prompt
  // chunk): a steady row reads no block table, only the cached last block.
  const bool in_last = block == r.table_size - 1;
  const int64_t block_id = in_last ? r.last_block : r.block_table[block];
  const int64_t base = kPow2 ? block_id << block_shift_ : block_id * bs;
  if (num_tokens == 1) {  // a decode row without drafts: no loop (its setup costs more)
    positions[0] = start;
    slots[0] = base + offset;
  } else if (offset + num_tokens <= bs) {  // a decode row with drafts, within one block
    store_ramp(positions, start, num_tokens);
    store_ramp(slots, base + offset, num_tokens);
  } else if (num_tokens <= bs) {  // one with drafts crossing into the next block: two runs
    const int32_t first_run = bs - offset;
    const int64_t next_id = r.block_table[block + 1];
    store_ramp(positions, start, num_tokens);
    store_ramp(slots, base + offset, first_run);
    store_ramp(slots + first_run, kPow2 ? next_id << block_shift_ : next_id * bs,
               num_tokens - first_run);
  } else {
    fill_positions(positions, slots, start, num_tokens, r.block_table.data() + block, offset, base,
                   bs);
  }
  fill_block_table_row(b, row, r, same_owner);
  const bool reset = ship_new_blocks(b, row, r);
  // The byte columns last: a byte store may alias anything, so the compiler reloads what it
  // reads after one.
  b.slot_reset[row] = reset;
  b.row_exact[row] = r.num_inflight == 0;
  b.num_rows = row + 1;
  return row;
}

ATOM_SCHED_AVX2_CLONES void Scheduler::derive_row_columns(Batch& b) const {
  const int32_t rows = b.num_rows;
  const int32_t* __restrict cached = b.num_cached_tokens.data();
  const int32_t* __restrict scheduled = b.num_scheduled_tokens.data();
  int32_t* __restrict context = b.context_lens.data();
  int32_t* __restrict last_fill = b.last_block_num_tokens.data();
  const int32_t bs = config_.block_size;
  int32_t max_q = 0, max_k = 0;
  for (int32_t i = 0; i < rows; ++i) {  // vectorised
    const int32_t end = cached[i] + scheduled[i];  // >= 1: a row schedules a token at least
    context[i] = end;
    max_q = std::max(max_q, scheduled[i]);
    max_k = std::max(max_k, end);
  }
  // The tokens in the block holding position end - 1.
  if (block_shift_ >= 0) {
    for (int32_t i = 0; i < rows; ++i) last_fill[i] = ((context[i] - 1) & (bs - 1)) + 1;
  } else {
    for (int32_t i = 0; i < rows; ++i)
      last_fill[i] = context[i] - (context[i] - 1) / bs * bs;
  }
  b.max_seqlen_q = max_q;
  b.max_seqlen_k = max_k;
  inclusive_sums(scheduled, b.cu_seqlens_q.data() + 1, rows);
  inclusive_sums(context, b.cu_seqlens_k.data() + 1, rows);
}

void Scheduler::add_prefill_row(Batch& b, int32_t slot, int32_t chunk) {
  Request& r = requests_[slot];
  const int32_t row = block_shift_ >= 0 ? begin_row<true>(b, r, slot, chunk)
                                        : begin_row<false>(b, r, slot, chunk);
  std::copy_n(r.tokens.begin() + r.num_computed_tokens, chunk,
              b.scheduled_tokens.data() + b.num_tokens);
  b.num_tokens += chunk;
  r.num_computed_tokens += chunk;
  if (!r.is_partial_prefill()) untrack_partial(slot);  // its prompt is fully scheduled
  if (config_.publish_prompt_blocks_at_schedule && config_.enable_prefix_caching &&
      r.loaded_tokens == 0) {
    const int32_t end = r.num_computed_tokens / config_.block_size;
    if (r.blocks_published < end) publish_blocks(r, end);  // (config.h: why this is safe)
  }
  b.row_is_prefill[row] = 1;
  b.emits_token[row] = r.num_computed_tokens == r.prefill_target;
  b.row_exact[row] = 1;  // prompt tokens and positions are always known
  // A prefill row has no drafts: in a mixed batch its spec_draft_tokens read -1.
  std::fill_n(b.spec_draft_tokens.data() + static_cast<size_t>(row) * k_, k_, -1);
  ++r.num_inflight;
  sync_steady(r);
}

void Scheduler::add_padded_first_decode_row(Batch& b, int32_t slot) {
  // Its K drafts read -1: placeholders, never accepted (a request holds no drafts at
  // admission; cleared here all the same).
  Request& r = requests_[slot];
  std::fill(r.drafts.begin(), r.drafts.end(), -1);
  r.num_drafts = 0;
  if (block_shift_ >= 0)
    add_decode_row<true, true>(b, slot, k_ + 1);
  else
    add_decode_row<true, false>(b, slot, k_ + 1);
  b.row_is_prefill[b.num_rows - 1] = 0;
  b.emits_token[b.num_rows - 1] = 1;
}

template <bool kPow2>
[[gnu::always_inline]] inline int32_t Scheduler::steady_spec_row_tokens(const Request& r) const {
  const int32_t start = r.num_computed_tokens;
  const int32_t size = r.table_size;
  // Its prompt all scheduled, synchronous (nothing in flight or to stream: the input is its last
  // token, then its drafts), every block shipped to its device slot, and its positions in the
  // block of its first position, which it holds, and at most the next, which it may have to
  // take. (Every request in the running set is running.)
  const bool synchronous = start >= r.prefill_target &&
                           (r.num_inflight | r.num_unstreamed) == 0 &&
                           start == r.token_count - 1 && r.blocks_shipped == size;
  if (!synchronous) return 0;
  // decode_row_tokens(), which with nothing in flight caps the tokens at the position limit and
  // at the drafts proposed. Without drafts the first block is the last; with drafts it may be
  // the one before, when rejected drafts left the last block reserved but empty.
  const int32_t n = decode_row_tokens<true>(r);
  const int32_t block = block_in<kPow2>(start);
  const int32_t end_block = block_in<kPow2>(start + n - 1);
  return n > 0 && block < size && end_block <= block + 1 && end_block <= size ? n : 0;
}

ATOM_SCHED_AVX2_CLONES size_t Scheduler::steady_run_end(size_t at, size_t limit) const {
  const SteadyRows& h = steady_;
  const int32_t* __restrict reach = h.reach.data();
  const int32_t* __restrict computed = h.computed.data();
  const int32_t* __restrict count = h.token_count.data();
  constexpr size_t kTest = 32;  // entries a test (a loop the vectoriser takes), then one by one
  size_t end = at;
  for (; end + kTest <= limit; end += kTest) {
    // takes_row() in lanes: nonzero where an entry does not (computed >= reach: the sign of
    // reach - computed - 1; or not synchronous).
    int32_t not_taken = 0;
    for (size_t j = end; j < end + kTest; ++j)
      not_taken |= ((reach[j] - computed[j] - 1) & std::numeric_limits<int32_t>::min()) |
                   ((computed[j] + 1) ^ count[j]);
    if (not_taken != 0) break;
  }
  while (end < limit && h.takes_row(end)) ++end;
  return end;
}

ATOM_SCHED_AVX2_CLONES int32_t Scheduler::take_next_blocks(Batch& b, size_t at, int32_t n) {
  // In order, as the general path would take them: the pool hands out the same blocks. The
  // shipped-block offsets run on from the batch's so far, one more after each such row.
  SteadyRows& h = steady_;
  const int32_t row0 = b.num_rows;
  int32_t* __restrict offsets = b.new_block_offsets.data() + row0 + 1;
  int32_t shipped = offsets[-1];
  const int32_t* __restrict bound = h.bound.data() + at;
  const int32_t* __restrict computed = h.computed.data() + at;
  int32_t at_bound = 0;  // its sign: a row of the run is at its bound (a test of them all first)
  for (int32_t i = 0; i < n; ++i) at_bound |= bound[i] - computed[i] - 1;
  int32_t offsets_to = 0;  // offsets written below this row
  if (at_bound < 0) {
    uint8_t* __restrict marks = h.marks.data();
    for (int32_t i = 0; i < n; ++i) marks[i] = computed[i] == bound[i];
    bool out_of_blocks = false;
    for_each_marked(marks, n, [&](int32_t i) {
      if (out_of_blocks) return;
      Request& r = requests_[running_[at + i]];
      if (!pool_.grow(r.block_table, r.table_size + 1)) {
        out_of_blocks = true;
        n = i;
        return;
      }
      r.table_changed();
      std::fill(offsets + offsets_to, offsets + i, shipped);
      b.new_block_ids[shipped++] = r.last_block;
      r.blocks_shipped = r.table_size;
      sync_steady(r);  // its size, slot offset and bound with the block
      offsets_to = i;
    });
  }
  std::fill(offsets + offsets_to, offsets + n, shipped);
  return n;
}

ATOM_SCHED_AVX2_CLONES void Scheduler::refresh_changed_rows(Batch& b, size_t at, int32_t n) {
  // Rows that held another admission in this buffer (they shifted: a request before them left)
  // take this one's constant columns and block table; a row whose table grew, its new blocks.
  // A test of them all first (vectorised). Shifted rows come many at once (every row after the
  // one that left), so with any, every row is checked; without, the rows whose table grew (a
  // few: those that took a block this step or the last) are flagged in a pass and fixed one by
  // one.
  SteadyRows& h = steady_;
  const int32_t row0 = b.num_rows;
  const uint64_t* __restrict epoch = h.epoch.data() + at;
  const int32_t* __restrict size = h.table_size.data() + at;
  const uint64_t* __restrict owner = b.row_owner.data() + row0;
  const int32_t* __restrict filled = b.row_filled.data() + row0;
  uint64_t owners_differ = 0;
  int32_t fills_differ = 0;
  for (int32_t i = 0; i < n; ++i) owners_differ |= owner[i] ^ epoch[i];
  for (int32_t i = 0; i < n; ++i) fills_differ |= filled[i] ^ size[i];
  const auto refresh = [&](int32_t i) {
    const int32_t row = row0 + i;
    const bool same_owner = owner[i] == epoch[i];
    if (same_owner && filled[i] == size[i]) return;
    const int32_t s = running_[at + i];
    if (!same_owner) write_owner_columns(b, row, requests_[s], s);
    fill_block_table_row(b, row, requests_[s], same_owner);
  };
  if (owners_differ != 0) {
    for (int32_t i = 0; i < n; ++i) refresh(i);
  } else if (fills_differ != 0) {
    uint8_t* __restrict marks = h.marks.data();
    for (int32_t i = 0; i < n; ++i) marks[i] = filled[i] != size[i];
    for_each_marked(marks, n, refresh);
  }
}

ATOM_SCHED_AVX2_CLONES size_t Scheduler::add_steady_rows(Batch& b, size_t at) {
  // The run: the entries from `at` whose columns say steady, or steady after a block more (a
  // hole or another request ends it), one row and one token each, within both budgets.
  const int32_t row0 = b.num_rows;
  const int32_t t0 = b.num_tokens;
  const size_t room = static_cast<size_t>(std::min(config_.max_num_seqs - row0,
                                                   config_.max_num_batched_tokens - t0));
  int32_t n = static_cast<int32_t>(steady_run_end(at, std::min(running_.size(), at + room)) - at);
  if (n == 0) return at;
  // Every block the request held is on its device slot: a row's new blocks start at its size.
  SteadyRows& h = steady_;
  std::copy_n(h.table_size.begin() + static_cast<std::ptrdiff_t>(at), n,
              b.new_block_starts.begin() + row0);
  n = take_next_blocks(b, at, n);
  if (n == 0) return at;
  // The run's columns, each a pass over the steady columns (these vectorise). A row's other
  // columns hold from the last time its buffer held the same admission.
  int32_t* __restrict computed = h.computed.data() + at;
  const int32_t* __restrict last = h.last_token.data() + at;
  const int64_t* __restrict delta = h.slot_delta.data() + at;
  int32_t* __restrict scheduled = b.num_scheduled_tokens.data() + row0;
  int32_t* __restrict cached = b.num_cached_tokens.data() + row0;
  int32_t* __restrict tokens = b.scheduled_tokens.data() + t0;
  int64_t* __restrict positions = b.positions.data() + t0;
  int64_t* __restrict slots = b.slot_mapping.data() + t0;
  for (int32_t i = 0; i < n; ++i) scheduled[i] = 1;
  for (int32_t i = 0; i < n; ++i) cached[i] = computed[i];
  for (int32_t i = 0; i < n; ++i) tokens[i] = last[i];
  for (int32_t i = 0; i < n; ++i) positions[i] = computed[i];
  for (int32_t i = 0; i < n; ++i) slots[i] = computed[i] + delta[i];
  std::fill_n(b.slot_reset.begin() + row0, n, 0);  // no slot starts afresh
  std::fill_n(b.row_exact.begin() + row0, n, 1);   // every input is known
  refresh_changed_rows(b, at, n);
  // A position each, and the token in flight: the columns, then the requests themselves.
  for (int32_t i = 0; i < n; ++i) computed[i] += 1;
  const int32_t* __restrict running = running_.data() + at;
  for (int32_t i = 0; i < n; ++i) {
    Request& r = requests_[running[i]];
    r.num_computed_tokens = computed[i];
    r.num_inflight = 1;
  }
  b.num_rows = row0 + n;
  b.num_tokens = t0 + n;
  steady_runs_[next_buffer_].push_back({row0, static_cast<int32_t>(at), n});
  return at + static_cast<size_t>(n);
}

template <bool kPow2>
size_t Scheduler::add_steady_spec_rows(Batch& b, size_t at) {
  static_assert(kMaxSpeculativeTokens == 8, "one case per K below");
  switch (k_) {
    case 1: return add_steady_decode_rows<1, kPow2>(b, at);
    case 2: return add_steady_decode_rows<2, kPow2>(b, at);
    case 3: return add_steady_decode_rows<3, kPow2>(b, at);
    case 4: return add_steady_decode_rows<4, kPow2>(b, at);
    case 5: return add_steady_decode_rows<5, kPow2>(b, at);
    case 6: return add_steady_decode_rows<6, kPow2>(b, at);
    case 7: return add_steady_decode_rows<7, kPow2>(b, at);
    case 8: return add_steady_decode_rows<8, kPow2>(b, at);
    default: return at;  // config validation keeps K in 0..8
  }
}

template <int K, bool kPow2>
ATOM_SCHED_AVX2_CLONES size_t Scheduler::add_steady_decode_rows(Batch& b, size_t at) {
  // A tight loop: the columns and limits in locals (no byte store inside, so nothing is
  // reloaded), the byte columns and the batch's counts written at the end.
  static_assert(K > 0, "K = 0 steady rows: add_steady_rows()");
  const int32_t max_rows = config_.max_num_seqs;
  const int32_t max_tokens = config_.max_num_batched_tokens;
  const int32_t bs = config_.block_size;
  const int32_t shift = block_shift_;
  const int32_t* __restrict entry = running_.data() + at;
  const int32_t* const entries_end = running_.data() + running_.size();
  Request* __restrict requests = requests_.data();
  int32_t* __restrict scheduled = b.num_scheduled_tokens.data();
  int32_t* __restrict cached = b.num_cached_tokens.data();
  int32_t* __restrict tokens = b.scheduled_tokens.data();
  int64_t* __restrict positions = b.positions.data();
  int64_t* __restrict slots = b.slot_mapping.data();
  int32_t* __restrict block_starts = b.new_block_starts.data();
  int32_t* __restrict block_offsets = b.new_block_offsets.data();
  int32_t* __restrict draft_rows = b.spec_draft_tokens.data();
  int32_t* __restrict shipped_ids = b.new_block_ids.data();
  const int32_t first_row = b.num_rows;
  int32_t shipped = block_offsets[first_row];  // the run's rows ship only the blocks taken here
  int32_t row = first_row;
  int32_t t = b.num_tokens;
  for (; entry != entries_end && row < max_rows; ++entry) {
    const int32_t s = *entry;
    if (s == kRunningHole) break;  // the caller steps over it
    Request& r = requests[s];
    const int32_t n = steady_spec_row_tokens<kPow2>(r);
    if (n == 0) break;
    if (t + n > max_tokens) break;
    const int32_t start = r.num_computed_tokens;
    const int32_t block = block_in<kPow2>(start);
    const int32_t end_block = block_in<kPow2>(start + n - 1);
    // Its last positions in the block after its last: that block taken and shipped, in row order
    // as the general path takes them. With none free the general path takes the row (it
    // preempts).
    block_starts[row] = r.table_size;
    if (end_block == r.table_size) {
      if (!pool_.grow(r.block_table, r.table_size + 1)) break;
      r.table_changed();
      shipped_ids[shipped++] = r.last_block;
      r.blocks_shipped = r.table_size;
    }
    block_offsets[row + 1] = shipped;
    const int32_t size = r.table_size;
    // A row that held another admission in this buffer (the rows shifted: a request before it
    // finished or was preempted) takes this one's constant columns and block table first.
    if (b.row_owner[row] != r.epoch) {
      write_owner_columns(b, row, r, s);
      fill_block_table_row(b, row, r, /*same_owner=*/false);
    } else if (b.row_filled[row] != size) {
      fill_block_table_row(b, row, r, /*same_owner=*/true);
    }
    // What begin_row() and add_decode_row() write for such a row; its other columns hold.
    const int32_t offset = kPow2 ? start & (bs - 1) : start % bs;
    // The last block, or the one before (steady_spec_row_tokens()).
    const int64_t block_id = block == size - 1 ? r.last_block : r.block_table[block];
    const int64_t base = kPow2 ? block_id << shift : block_id * bs;
    scheduled[row] = n;
    cached[row] = start;
    tokens[t] = r.last_token;
    // Positions in one block or two; the input is the last token, then the drafts it verifies
    // (all K but near the position limit), which the draft row repeats, -1 padded. K is fixed at
    // compile time and all K+1 token slots are written, whether the row schedules them or not:
    // straight-line code, no branch a token. (Slots past the row belong to the next row, which
    // overwrites them, or lie past the batch's tokens, in the slack.)
    const int32_t* __restrict proposed = r.drafts.data();
    int32_t* __restrict drafts = draft_rows + static_cast<size_t>(row) * K;
    store_ramp(positions + t, start, K + 1);
    store_ramp(slots + t, base + offset, K + 1);
    if (end_block != block) {  // the positions from the next block's first on, in that block
      const int32_t first_run = bs - offset;
      const int64_t next_id = block + 1 == size - 1 ? r.last_block : r.block_table[block + 1];
      store_ramp(slots + t + first_run, kPow2 ? next_id << shift : next_id * bs, n - first_run);
    }
    for (int32_t j = 0; j < K; ++j) {
      tokens[t + 1 + j] = proposed[j];
      drafts[j] = j < n - 1 ? proposed[j] : -1;
    }
    r.num_computed_tokens = start + n;
    r.num_inflight = 1;
    ++row;
    t += n;
  }
  // Its byte columns after the loop: no slot starts afresh, every row is exact.
  std::fill(b.slot_reset.begin() + first_row, b.slot_reset.begin() + row, 0);
  std::fill(b.row_exact.begin() + first_row, b.row_exact.begin() + row, 1);
  b.num_rows = row;
  b.num_tokens = t;
  return static_cast<size_t>(entry - running_.data());
}

template <bool kSpec, bool kPow2>
[[gnu::always_inline]] inline void Scheduler::add_decode_row(Batch& b, int32_t slot,
                                                            int32_t n) {
  Request& r = requests_[slot];
  const int32_t row = begin_row<kPow2>(b, r, slot, n);
  const bool known = r.num_inflight == 0;
  // Input: the last real token, then n-1 of the K drafts (all K but near the position limit).
  // One step ahead they are still on the device. Drafts not scheduled read -1.
  int32_t* tokens = b.scheduled_tokens.data() + b.num_tokens;
  // S == R - 1 when known, but for a remote request whose injected first token already ends it
  // at the position limit: its one row re-forwards the last prompt token (start_remote_decode).
  if (!known)
    tokens[0] = -1;
  else if (r.num_computed_tokens == r.num_tokens() - 1)
    tokens[0] = r.last_token;
  else
    tokens[0] = r.tokens[r.num_computed_tokens];
  if constexpr (kSpec) {
    int32_t* drafts = b.spec_draft_tokens.data() + static_cast<size_t>(row) * k_;
    for (int32_t j = 0; j < n - 1; ++j) drafts[j] = tokens[j + 1] = known ? r.drafts[j] : -1;
    for (int32_t j = n - 1; j < k_; ++j) drafts[j] = -1;
  }
  b.num_tokens += n;
  r.num_computed_tokens += n;  // upper bound until the accepted count arrives
  ++r.num_inflight;
  sync_steady(r);
}

}  // namespace atom_sched
