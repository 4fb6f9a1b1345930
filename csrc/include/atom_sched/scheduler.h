// The scheduler: ATOM's scheduling policy (shared/spec/atom-scheduler-behaviour.md sections 3-5)
// with ATOM's bugs fixed (DESIGN.md section 5), at C++ speed.
//
// Step protocol (DESIGN.md section 4):
//  * synchronous:   b = schedule(); run the model; update(b->id, outputs of b)
//  * one step ahead: schedule() for step t+1 may be called while batch t is still in flight (at
//    most kMaxOutstandingBatches outstanding); update() always names the oldest outstanding batch.
//    KV is reserved for the worst case (K+1 tokens per in-flight decode row) and reconciled when
//    the accepted counts arrive. Outputs for a request that finished meanwhile are discarded; a
//    request preempted while a batch holding it is in flight keeps the tokens that batch produces.
//
// Block reuse ordering: blocks freed by update() or by a preemption may still be written by a
// forward already launched. They are handed out again only to batches scheduled later, so an
// engine that runs its forwards in order on one stream is safe (ATOM's contract too).
//
// Not thread-safe: one thread drives a Scheduler (the Python binding serialises calls).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "atom_sched/batch.h"
#include "atom_sched/block_pool.h"
#include "atom_sched/config.h"
#include "atom_sched/kv_connector.h"
#include "atom_sched/policy.h"
#include "atom_sched/request.h"
#include "atom_sched/step_output.h"
#include "atom_sched/tenant_shares.h"

namespace atom_sched {

inline constexpr int32_t kMaxOutstandingBatches = 2;

/// The batch buffers, in storage a caller may share (batch_storage(): the Python binding's
/// cached views keep it alive). A copy of a Scheduler (next_batch_info()) copies the buffers,
/// never shares them.
class BatchBuffers {
 public:
  using Array = std::array<Batch, kMaxOutstandingBatches>;
  BatchBuffers() : p_(std::make_shared<Array>()) {}
  BatchBuffers(const BatchBuffers& o) : p_(std::make_shared<Array>(*o.p_)) {}
  BatchBuffers& operator=(const BatchBuffers& o) {
    p_ = std::make_shared<Array>(*o.p_);
    return *this;
  }
  BatchBuffers(BatchBuffers&&) noexcept = default;
  BatchBuffers& operator=(BatchBuffers&&) noexcept = default;
  Batch& operator[](size_t i) { return (*p_)[i]; }
  const Batch& operator[](size_t i) const { return (*p_)[i]; }
  Array::iterator begin() { return p_->begin(); }
  Array::iterator end() { return p_->end(); }
  [[nodiscard]] std::shared_ptr<const void> storage() const { return p_; }

 private:
  std::shared_ptr<Array> p_;
};

/// The sampled outputs of one batch, row-aligned with it. Spans are not retained.
struct ModelOutputs {
  /// [num_rows, K + 1] row-major (prefill batches too). Row i's first
  /// num_accepted[i] entries are its accepted tokens (the rest is ignored). A row that does not
  /// emit a token (a prefill chunk that does not finish its prompt) is ignored entirely.
  std::span<const int32_t> sampled_token_ids;
  /// [num_rows] in 1..K+1; may be empty for a prefill batch or when K == 0 (all 1).
  std::span<const int32_t> num_accepted;
  /// [num_rows, K]: drafts proposed for each row's next step. Required when K > 0.
  std::span<const int32_t> draft_token_ids;
  /// Empty, or [num_rows, W] log-probabilities aligned with sampled_token_ids.
  std::span<const float> logprobs;
};

struct SchedulerStats {
  int64_t num_steps = 0;           // batches scheduled
  int64_t num_preemptions = 0;
  int64_t num_prefix_queries = 0;  // admissions that probed the prefix cache
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t num_spec_steps = 0;           // decode rows verified
  int64_t num_draft_tokens = 0;         // K per verified row
  int64_t num_accepted_draft_tokens = 0;
  std::vector<int64_t> acceptance_counts;  // [K+1]: rows that accepted a = index + 1 tokens
  int64_t num_finished = 0;
  int64_t num_aborted = 0;
  int64_t num_rejected = 0;
  int64_t num_remote_prefills = 0;   // requests whose prompt KV came from a remote prefill
  int64_t num_connector_errors = 0;

  [[nodiscard]] double prefix_hit_rate() const noexcept;
  [[nodiscard]] double acceptance_rate() const noexcept;  // accepted drafts / drafts
};

/// What the next schedule() would do, without doing it.
struct NextBatchInfo {
  bool is_prefill = false;
  int32_t num_tokens = 0;
  int32_t num_rows = 0;
};

class Scheduler {
 public:
  /// Validates `config` (InvalidArgument on a bad field) and sizes every buffer once.
  explicit Scheduler(SchedulerConfig config);

  /// Queues a request. InvalidArgument: id < 0 or already live, empty prompt, a negative token
  /// id, invalid params. An oversized prompt is not an error: schedule() rejects it with ATOM's
  /// reason (take_rejected()). `arrival_time` (seconds) orders priority and SJF
  /// scheduling (policy.h) and feeds scheduler_delay_factor.
  void add_request(int64_t id, std::span<const int32_t> prompt, const SamplingParams& params,
                   double arrival_time = 0.0);

  /// Ends a live request now and frees its KV. UnknownRequest if `id` is not live.
  void abort_request(int64_t id);

  /// Preempts a running request now, as the scheduler does under KV pressure (recompute): its KV
  /// is freed, it keeps its tokens and goes back to the head of waiting; a batch in flight that
  /// holds it still delivers its tokens. UnknownRequest if `id` is not live, InvalidArgument if it
  /// is not running (waiting, or waiting for remote KV). For engines that choose a victim
  /// themselves (ATOM's `Scheduler.preempt(seq)`).
  void preempt_request(int64_t id);

  /// Gives a running request the drafts a drafter proposed after the update that returned its
  /// last token, replacing those that update kept (vLLM's n-gram proposer runs after that
  /// update, not with it): its next decode row verifies them, and reserves KV for them only.
  /// At most K drafts, each >= 0 (fewer than K: the rest are not proposed). UnknownRequest if
  /// `id` is not live; InvalidArgument if K = 0, more than K drafts, a negative draft, or the
  /// request is not decoding with nothing in flight (waiting, mid-prompt, or a row of it not
  /// yet updated: that row's tokens are already fixed). Nothing changes on an error.
  void set_drafts(int64_t id, std::span<const int32_t> drafts);

  /// Streaming-input sessions (SamplingParams::resumable): a stop rule (EOS, a stop token or
  /// sequence, a length limit) ends the session's turn, not the request. update() reports the
  /// turn's end in the entry's finish reason and lists the entry in
  /// StepOutput::awaiting_input_entries; the request then waits for input
  /// (kWaitingForInput), keeping its KV and its device slot (it counts against max_num_seqs),
  /// with every token but the last it sampled computed. Outputs of its rows still in flight are
  /// discarded.
  ///
  /// continue_session() gives a session waiting for input its next turn: its last sampled token
  /// is dropped (its KV was never computed), its other tokens become the prompt with `tokens`
  /// appended, and `params` replace its sampling parameters (max_tokens counts from the new
  /// prompt; priority, tenant, LoRA and cache salt stay the session's, and lora_name and
  /// cache_salt must equal them: its KV was computed under them; params.resumable false makes
  /// this turn its last). It resumes at a later schedule() once its rows in flight have landed,
  /// before any admission, prefilling only the new tokens, with blocks for them taken from the
  /// pool (never from the prefix cache: its own KV is already in its blocks). UnknownRequest if
  /// `id` is not live; InvalidArgument if it is not waiting for input, `tokens` is empty or
  /// holds a negative id, `params` is invalid, or its LoRA or salt differ. Nothing changes on an
  /// error.
  void continue_session(int64_t id, std::span<const int32_t> tokens,
                        const SamplingParams& params, double arrival_time = 0.0);

  /// The session takes no more input: a session waiting for input ends now (as abort_request(),
  /// vLLM's rule); otherwise its current turn is its last (its next stop finishes it; nothing
  /// changes for a request that is not a session). UnknownRequest if `id` is not live.
  void end_session(int64_t id);

  /// Chooses the next batch. Returns nullptr (and changes nothing but the delay clock) when there
  /// is nothing to run. `allow_prefill = false` is a data-parallel veto: only decode rows run.
  /// `admit_waiting = false` (vLLM's PAUSED_NEW): nothing is admitted from `waiting`; running
  /// requests go on, prompt chunks included, and requests whose remote KV has arrived join them.
  /// InvalidArgument if kMaxOutstandingBatches batches are already outstanding. The batch stays
  /// valid until the batch after the next one is scheduled.
  const Batch* schedule(double now = 0.0, bool allow_prefill = true, bool admit_waiting = true);

  /// Consumes the outputs of the oldest outstanding batch, whose id must be `batch_id`.
  /// InvalidArgument (state unchanged) on a wrong batch id or on outputs that do not match it.
  const StepOutput& update(uint64_t batch_id, const ModelOutputs& outputs);

  /// Requests rejected by schedule() since the last call (ATOM's take_rejected).
  [[nodiscard]] std::vector<RejectedRequest> take_rejected();
  /// KV events recorded since the last call.
  [[nodiscard]] std::vector<KvEvent> take_events() { return pool_.take_events(); }
  /// Attaches a KV connector (nullptr detaches it); see kv_connector.h for the call order.
  void set_kv_connector(std::shared_ptr<KvConnector> connector) {
    connector_ = std::move(connector);
  }
  [[nodiscard]] const std::shared_ptr<KvConnector>& kv_connector() const { return connector_; }

  /// The connector's transfer reports: `finished_recving` requests have their remote KV (they
  /// join the decode set at the next schedule()), `finished_sending` requests' blocks are freed.
  /// UnknownRequest / InvalidArgument (state unchanged) for an id that is not waiting for that.
  void update_from_kv_xfer_finished(std::span<const int64_t> finished_sending,
                                    std::span<const int64_t> finished_recving);

  /// A connector's load failed for part of a request's KV (vLLM's kv_load_failure_policy
  /// "recompute"): its KV from `position` on is invalid and is computed again. A request waiting
  /// for remote KV computes from there once its load is reported done (a producer's first token
  /// is dropped if the prompt's KV is cut). A running request is rewound, keeping its blocks: the
  /// outputs of its rows in flight are dropped, and it computes its known tokens from there as a
  /// prompt, then decodes. Nothing changes if its KV is valid up to `position` (the KV its rows
  /// in flight compute aside). UnknownRequest if `id` is not live; InvalidArgument if it is
  /// neither running nor waiting for remote KV, or `position` is negative or within the blocks
  /// the prefix cache serves from it.
  void recompute_kv_from(int64_t id, int32_t position);

  /// Messages of connector calls that threw since the last call.
  [[nodiscard]] std::vector<std::string> take_connector_errors();

  /// ATOM's prefill-delayer readiness probe (_count_admittable_head_prefills): how many of the
  /// first 4 waiting requests could be admitted now, in order, stopping at `limit`. Fixes of
  /// 8.27: a prompt longer than the budget counts when chunked prefill can admit it, and the KV
  /// of the requests counted before is taken into account.
  [[nodiscard]] int32_t count_admittable_head_prefills(int32_t limit);

  /// Forgets the prefix cache (AllBlocksCleared).
  void reset_prefix_cache() { pool_.reset_prefix_cache(); }

  /// What schedule(now, allow_prefill) would return, computed on a copy of the state: exact by
  /// construction, O(state) in cost (a query for coordination and tests, not for every step).
  [[nodiscard]] NextBatchInfo next_batch_info(double now = 0.0, bool allow_prefill = true,
                                              bool admit_waiting = true) const;

  [[nodiscard]] const SchedulerStats& stats() const noexcept { return stats_; }
  [[nodiscard]] const SchedulerConfig& config() const noexcept { return config_; }
  [[nodiscard]] const BlockPool& block_pool() const noexcept { return pool_; }
  /// Owns the memory of every Batch schedule() returns: views into them may share it.
  [[nodiscard]] std::shared_ptr<const void> batch_storage() const { return batches_.storage(); }
  /// Requests not running: waiting to be admitted, waiting for remote KV, or sessions whose next
  /// input has arrived.
  [[nodiscard]] int32_t num_waiting() const noexcept {
    return waiting_.size + remote_waiting_.size + sessions_resuming_.size;
  }
  /// Sessions between turns, their next input not arrived yet: not unfinished work (nothing
  /// can run for them), but each holds its KV and a device slot.
  [[nodiscard]] int32_t num_waiting_for_input() const noexcept {
    return sessions_waiting_.size;
  }
  [[nodiscard]] int32_t num_running() const noexcept {
    return static_cast<int32_t>(running_.size()) - running_holes_;
  }
  /// Running requests whose prompt is not fully scheduled yet (chunked prefill).
  [[nodiscard]] int32_t num_partial_prefills() const noexcept {
    return static_cast<int32_t>(partial_.size());
  }
  [[nodiscard]] int32_t num_outstanding_batches() const noexcept { return num_outstanding_; }
  [[nodiscard]] bool has_unfinished_requests() const noexcept {
    return num_waiting() + num_running() > 0;
  }
  /// The request `id` while its id is in use: live (waiting or running), or finished with its
  /// KV blocks kept for a connector's transfer (status kFinished) until
  /// update_from_kv_xfer_finished() reports it; add_request() refuses the id until then.
  /// UnknownRequest otherwise.
  [[nodiscard]] const Request& request(int64_t id) const;
  /// Whether `id` is in use, as request() defines it.
  [[nodiscard]] bool contains(int64_t id) const;
  /// Live request ids in queue order (waiting_ids(): waiting to be admitted, then sessions
  /// whose next input has arrived).
  [[nodiscard]] std::vector<int64_t> waiting_ids() const;
  [[nodiscard]] std::vector<int64_t> running_ids() const;

  /// Throws InvariantViolation if any invariant of the scheduler or its pool is broken: ref
  /// counts equal the number of tables holding each block, no block twice in one table, queues
  /// consistent with statuses, running set within max_num_seqs, tables covering computed tokens.
  void check_invariants() const;

 private:
  struct List {  // intrusive doubly linked list over request slots (the waiting queues)
    int32_t head = -1, tail = -1, size = 0;
  };
  struct Link {  // a request slot's neighbours in its list; -1 ends it
    int32_t prev = -1, next = -1;
  };

  // Request slots and id lookup.
  int32_t new_slot();
  void release_slot_if_done(int32_t slot);
  [[nodiscard]] int32_t slot_of(int64_t id) const;  // -1 if not live
  [[nodiscard]] int32_t slot_in_use(int64_t id) const;  // live or deferred-free, else -1

  // Intrusive lists.
  void list_insert_after(List& l, int32_t after, int32_t slot);  // after -1: at the head
  /// Queues `slot` in `l` where the ServiceOrder puts it; under FCFS, at the back, or at the
  /// head for a preempted request returning to waiting (ATOM resumes it first).
  void enqueue(List& l, int32_t slot, bool preempted = false);
  void list_remove(List& l, int32_t slot);

  // The running set (running_): an array of request slots in service order, walked by index on
  // the step path. A request joins it where the ServiceOrder puts it (under FCFS, at the back);
  // one that leaves (a finish, a preemption) leaves a hole (kRunningHole) at its position
  // (Request::run_pos), unless it was the tail, which is popped with the holes before it. The
  // holes are squeezed out between calls once they are a 32nd of the array, so a step's
  // finishes cost O(1) each and the walks skip few holes.
  static constexpr int32_t kRunningHole = -1;
  void add_running(int32_t slot);
  void remove_running(Request& r);
  void squeeze_running(bool always = false);  // drops the holes (when sparse, unless `always`)

  // The steady rows of a K = 0 step, as columns (steady_): for each position of running_, the
  // fields the steady pass of schedule() reads and writes, equal to the request's own. Request
  // stays the record every path reads; this copy lets the pass write a run of rows column by
  // column instead of one record a row. Paths that change a running request other than the
  // steady pass and the plain rows of update() call sync_steady(); check_invariants() compares
  // the copies. Unused (and not kept) when K > 0.
  struct SteadyRows {
    std::vector<int32_t> bound;       // steady_bound() (0 at a hole)
    std::vector<int32_t> reach;       // bound, + 1 when a row at it may take the next block
    std::vector<int32_t> computed;    // num_computed_tokens
    std::vector<int32_t> token_count;
    std::vector<int32_t> last_token;
    std::vector<int32_t> table_size;
    std::vector<int64_t> slot_delta;  // KV slot of a position in its last block, less the position
    std::vector<uint64_t> epoch;
    // update()'s columns: a steady row's new token needs a look (the stop rules, publishing)
    // when it is watch_token (EOS; -1: none) or the row's token count reaches watch_count (its
    // length limit, or the token that completes its next block to publish; 0 with stop lists).
    std::vector<int32_t> watch_token;
    std::vector<int32_t> watch_count;
    std::vector<uint8_t> marks;  // scratch of the steady passes: the rows a pass flags
    /// fn(column) for every column but the scratch (the list resize() and move_run() walk).
    template <class Fn>
    void for_each_column(Fn&& fn) {
      fn(bound), fn(reach), fn(computed), fn(token_count), fn(last_token), fn(table_size);
      fn(slot_delta), fn(epoch), fn(watch_token), fn(watch_count);
    }
    /// One position's values, every column but the scratch.
    struct Entry {
      int32_t bound, reach, computed, token_count, last_token, table_size;
      int64_t slot_delta;
      uint64_t epoch;
      int32_t watch_token, watch_count;
      bool operator==(const Entry&) const = default;
    };
    void resize(size_t n);
    void set(size_t p, const Entry& e);
    [[nodiscard]] Entry get(size_t p) const;
    void move(size_t from, size_t to) { set(to, get(from)); }
    void move_run(size_t from, size_t to, size_t n);  // entries [from, from + n) to `to` < from
    /// Whether entry p takes a steady row now: below its bound, and synchronous (nothing in
    /// flight: without drafts, each row in flight is a position computed and no token yet).
    [[nodiscard]] bool steady(size_t p) const noexcept {
      return (computed[p] < bound[p]) & (computed[p] + 1 == token_count[p]);
    }
    /// Whether it takes one, maybe after a block more (its position the first of the next
    /// block): steady, or steady once the block is in its table and shipped.
    [[nodiscard]] bool takes_row(size_t p) const noexcept {
      return (computed[p] < reach[p]) & (computed[p] + 1 == token_count[p]);
    }
  };
  /// A steady K = 0 row stays steady, a position a step, while its position is below this (0:
  /// not steady): its prompt all scheduled, nothing to stream, its input its last token (once
  /// its rows in flight land), every block shipped, its position in the last block it holds, and
  /// below the position limit.
  [[nodiscard]] int32_t steady_bound(const Request& r) const;
  /// Whether a running request takes a steady K = 0 row now (SteadyRows::steady() on the copies).
  [[nodiscard]] bool steady_now(const Request& r) const {
    return r.num_inflight == 0 && r.num_computed_tokens < steady_bound(r);
  }
  /// What steady_ holds for a running request (the one rule sync_steady() writes and
  /// check_invariants() checks).
  [[nodiscard]] SteadyRows::Entry steady_entry(const Request& r) const;
  [[nodiscard]] int32_t watch_count_of(const Request& r) const;  // its SteadyRows::watch_count
  void sync_steady(const Request& r);  // steady_ at r.run_pos from r (K = 0 only)
  /// A run of steady K = 0 rows: batch rows [row0, row0 + n) took running_[at, at + n).
  /// Recorded per batch buffer (steady_runs_), so that update() applies their outputs as
  /// columns while the run still holds those positions.
  struct SteadyRun {
    int32_t row0, at, n;
  };
  /// The steady K = 0 rows from running_[at] on, within the row and token budgets, written as
  /// columns (a row at a block's end takes its next block first, while the pool has one);
  /// returns the index in running_ that ended the run.
  size_t add_steady_rows(Batch& b, size_t at);
  /// add_steady_rows()'s parts: the end of the run from `at` (at most `limit`); the run's rows
  /// at their bound taking and shipping their next block (returns the rows that could: the run
  /// ends before a row the pool has no block for); the rows whose owner columns or block table
  /// this buffer holds stale, brought up to date.
  [[nodiscard]] size_t steady_run_end(size_t at, size_t limit) const;
  int32_t take_next_blocks(Batch& b, size_t at, int32_t n);
  void refresh_changed_rows(Batch& b, size_t at, int32_t n);

  // Policy.
  [[nodiscard]] std::optional<std::string> unschedulable_reason(const Request& r) const;
  void ensure_block_hashes(Request& r, int32_t num_blocks);
  [[nodiscard]] int32_t probe_blocks(const Request& r) const;  // blocks can_allocate may hit
  [[nodiscard]] bool passed_delay(double now);
  /// Returns the decode rows it added: the padded first rows (pad_first_decode_rows).
  int32_t schedule_prefills(Batch& b, double now, bool admit_waiting);
  /// pad_first_decode_rows' rule for a request admitted with `computed` tokens computed:
  /// whether its one-token row is padded to K+1.
  [[nodiscard]] bool pads_first_decode(const Request& r, int32_t computed, bool chunk_continued,
                                       bool decodes) const;
  int32_t schedule_decodes(Batch& b);  // returns the decode rows it added
  // The decode loop and its row helpers are compiled per kind of step (kSpec: K > 0; kPow2: a
  // power-of-two block size), so the common K = 0 step carries no draft logic and no division
  // test: the same source, with K and the block division fixed at compile time.
  template <bool kSpec, bool kPow2>
  int32_t schedule_decode_rows(Batch& b);
  /// Tokens of the request's next decode row: K+1, fewer where a position would reach
  /// position_limit_, 0 (no row) when none is left or its outputs in flight will end it.
  template <bool kSpec>
  [[nodiscard]] int32_t decode_row_tokens(const Request& r) const;
  /// The block holding position `pos` (>= 0), and the blocks `n` positions need, with the block
  /// size's kind fixed at compile time (kPow2: block_shift_ >= 0, a shift; else a division) for
  /// the loops compiled per kind.
  template <bool kPow2>
  [[nodiscard]] int32_t block_in(int32_t pos) const noexcept {
    return kPow2 ? pos >> block_shift_ : pos / config_.block_size;
  }
  template <bool kPow2>
  [[nodiscard]] int32_t blocks_in(int32_t n) const noexcept {
    return block_in<kPow2>(n + config_.block_size - 1);
  }
  /// KV slots a request must hold to run its first `tokens` positions: those, plus the drafter's
  /// lookahead (num_lookahead_tokens) up to the position limit. The one rule every reservation
  /// (admission, decode rows, the invariant checker) applies.
  [[nodiscard]] int32_t kv_slots_for(int32_t tokens) const noexcept {
    const int32_t ahead = config_.num_lookahead_tokens;
    return ahead == 0 ? tokens : std::max(tokens, std::min(tokens + ahead, position_limit_));
  }
  /// Tokens a new row may schedule within max_num_batched_tokens after `rows` rows of `tokens`
  /// tokens: every row also takes draft_slots_per_row (the drafter's inputs), this one
  /// included. The one budget rule.
  [[nodiscard]] int32_t token_room(int32_t tokens, int32_t rows) const noexcept {
    const int32_t slots = config_.draft_slots_per_row;
    return config_.max_num_batched_tokens - tokens - (rows + 1) * slots;
  }
  [[nodiscard]] int32_t row_token_room(const Batch& b) const noexcept {
    return token_room(b.num_tokens, b.num_rows);
  }
  /// The blocks admission takes for `r` beyond those of its tokens (the lookahead's).
  [[nodiscard]] int32_t lookahead_blocks(const Request& r) const;
  /// A request's sampling and stop parameters, and its arrival (for its order and SJF key);
  /// after its prompt is set (its length limit counts from it).
  void set_sampling(Request& r, const SamplingParams& params, double arrival_time);
  /// Token capacity a request reserves for its life (its prompt, its outputs, a row's drafts),
  /// so that decode steps never reallocate its tokens.
  [[nodiscard]] size_t lifetime_tokens(int32_t num_prompt, int32_t max_tokens) const {
    const int64_t most = std::min<int64_t>(int64_t{num_prompt} + max_tokens,
                                           std::max<int64_t>(config_.max_model_len, num_prompt));
    return static_cast<size_t>(most + k_ + 1);
  }
  /// The token count at which a length rule (max_tokens, max_model_len, kv_capacity) ends it.
  [[nodiscard]] int32_t final_length(const Request& r) const;
  /// This step's prefill chunk rule (policy.h): the long-prefill cap as it applies to the
  /// requests running and waiting now.
  [[nodiscard]] PrefillChunk prefill_chunk() const;
  /// The running request preempted first among running_[from..] (policy.h's VictimChoice).
  [[nodiscard]] int32_t preemption_victim(size_t from);
  /// Whether preempting every running request after running_[at] would free `missing` blocks
  /// (blocks shared with others stay), whichever order the victims are taken in.
  [[nodiscard]] bool preemption_can_free(size_t at, int32_t missing);
  void preempt(int32_t slot);
  /// scheduling=kFairShare: each tenant's counter now, in tenant_counters_ ([tenant id]; tokens
  /// charged plus those of its running admissions, over its weight).
  void update_tenant_counters();
  void check_tenants() const;  // check_invariants()'s part for the tenants
  /// scheduling=kFairShare: the waiting request admitted next: the first, in waiting order, of
  /// the tenant with the least counter in `counters`, skipping the slots in `skip`; -1 if none.
  [[nodiscard]] int32_t fair_pick(const std::vector<double>& counters,
                                  std::span<const int32_t> skip = {}) const;
  [[nodiscard]] bool fair_share() const noexcept {
    return config_.scheduling == SchedulingPolicy::kFairShare;
  }
  void reject(int32_t slot, std::string reason);  // finished as unschedulable, reported
  void take_device_slot(Request& r);
  void release_kv(Request& r, bool keep_blocks = false);  // blocks, state and device slots
  void start_remote_decode(int32_t slot);  // kWaitingForRemoteKv -> running, KV arrived
  /// Requests holding a device slot: running, and sessions between turns that keep their KV
  /// (max_num_seqs bounds them).
  [[nodiscard]] int32_t num_seated() const noexcept {
    return config_.max_num_seqs - static_cast<int32_t>(free_device_slots_.size());
  }
  /// A session's turn ended: it waits for input. A running one leaves the running set keeping
  /// its KV and device slot, computed up to (not including) its last token; one preempted while
  /// the row that ended its turn was in flight holds no KV and leaves `waiting`.
  void end_turn(int32_t slot);
  /// Resumes the sessions whose input arrived, in arrival order, each with a prompt row (its KV
  /// for the new tokens allocated now); false when one that could resume did not fit (blocks or
  /// budget): nothing is admitted after it (head of line, as admissions).
  bool resume_sessions(Batch& b, const PrefillChunk& chunk_of);
  // Tokens after a local hit of `local` whose KV a connector's answer supplies.
  static int32_t external_tokens(const Request& r, int32_t local, const RemoteMatch& m);
  void admit_remote_ready();               // every request whose KV arrived, within max_num_seqs
  [[nodiscard]] ConnectorRequest connector_view(const Request& r) const;
  void connector_failed(const Request& r, const char* call, const std::exception& e);
  void finish(int32_t slot, FinishReason reason, int32_t stop_token);

  // Batch assembly.
  void begin_batch(Batch& b);
  void add_prefill_row(Batch& b, int32_t slot, int32_t chunk);
  void add_padded_first_decode_row(Batch& b, int32_t slot);  // pad_first_decode_rows
  /// The columns that follow from each row's cached and scheduled token counts (context_lens,
  /// last_block_num_tokens, cu_seqlens_q/k, max_seqlen_q/k), for every row at once: the row
  /// helpers write only what a request gives, and these passes vectorise. Out of line: inlined
  /// into schedule(), its AVX2 clone would be dropped.
  [[gnu::noinline]] void derive_row_columns(Batch& b) const;
  template <bool kSpec, bool kPow2>
  void add_decode_row(Batch& b, int32_t slot, int32_t num_tokens);
  /// Decode rows with drafts in the steady state (synchronous, no block to reserve or ship)
  /// change only their counts, positions, slots, input tokens and drafts, and their owner
  /// columns and block table where the row held another request: adds the run of such rows from
  /// running_[at] on (within the row and token budgets) writing only those, and returns the
  /// index in running_ that ended the run (its size: the set did). Compiled per K (1..8), so a
  /// row's draft loops unroll; add_steady_spec_rows() picks the one. (K = 0: add_steady_rows().)
  template <int K, bool kPow2>
  size_t add_steady_decode_rows(Batch& b, size_t at);
  template <bool kPow2>
  size_t add_steady_spec_rows(Batch& b, size_t at);
  /// The tokens of request `r`'s decode row with drafts if it is steady (the rule
  /// add_steady_decode_rows() runs on: synchronous, every block shipped, its positions in the
  /// block of its first, which it holds, and at most the next, which it may take), else 0.
  /// Without drafts the rule is steady_now().
  template <bool kPow2>
  [[nodiscard]] int32_t steady_spec_row_tokens(const Request& r) const;
  /// The columns a row copies from its request when it changes owner (the request's constants).
  void write_owner_columns(Batch& b, int32_t row, const Request& r, int32_t slot);
  template <bool kPow2>
  int32_t begin_row(Batch& b, Request& r, int32_t slot, int32_t num_tokens);
  /// Ships the request's new blocks to its device slot; true when the slot starts afresh.
  bool ship_new_blocks(Batch& b, int32_t row, Request& r);
  void fill_block_table_row(Batch& b, int32_t row, const Request& r, bool same_owner);
  void track_partial(int32_t slot);    // a running request whose prefill is not all scheduled
  void untrack_partial(int32_t slot);  // its prompt is fully scheduled, or it left running
  /// Publishes the request's blocks [blocks_published, end) to the prefix cache (their KV and
  /// tokens are final).
  void publish_blocks(Request& r, int32_t end);

  // Outputs.
  void validate_outputs(const Batch& b, const ModelOutputs& out) const;
  /// validate_outputs()'s rules as one pass without messages: true when nothing is wrong.
  [[nodiscard]] bool outputs_look_valid(const Batch& b, const ModelOutputs& out) const;
  struct OutputCursor {  // step_output_ entries and tokens written so far by update()
    int32_t entries = 0, tokens = 0;
  };
  template <bool kSpec>
  void apply_row_output(const Batch& b, int32_t row, const ModelOutputs& out, int32_t width,
                        OutputCursor& cursor);
  /// The rows of a K = 0 step without log-probabilities: the steady runs of 8 rows or more as
  /// columns (apply_steady_run()), every other row one by one (apply_decode_rows()).
  void apply_k0_rows(const Batch& b, const ModelOutputs& out, std::span<const SteadyRun> runs,
                     OutputCursor& cursor);
  /// apply_row_output() for a row of a K = 0 step, and its request's steady columns again.
  void apply_k0_row_output(const Batch& b, int32_t row, const ModelOutputs& out,
                           OutputCursor& cursor);
  /// A steady run's outputs, column by column, when its rows' requests still hold the run's
  /// positions (no abort or preemption moved them since schedule()); false (nothing applied)
  /// otherwise. The rows whose token needs a look (watch_token, watch_count) are then applied
  /// one by one: the stop rules, publishing, finishing.
  bool apply_steady_run(const Batch& b, const ModelOutputs& out, const SteadyRun& run,
                        OutputCursor& cursor);
  /// Rows [row, end) of a K = 0 step without log-probabilities, one by one: the plain ones
  /// (running, nothing to stream besides, not a prompt chunk: one token, one entry) inline, the
  /// others through apply_row_output().
  void apply_decode_rows(const Batch& b, const ModelOutputs& out, int32_t row, int32_t end,
                         OutputCursor& cursor);
  /// The plain rows of [row, end), from `row`: returns the first row that is not plain.
  int32_t apply_plain_decode_rows(const Batch& b, const ModelOutputs& out, int32_t row,
                                  int32_t end, OutputCursor& cursor);
  /// A plain K = 0 row's token, just appended to its running request (at position p of the
  /// running set): the stop rules, publishing (and the watch_count that follows), and entry
  /// `entry`'s finish reason and stop token; finishes the request if it stopped.
  void apply_stop_rules(Request& r, int32_t slot, int32_t p, int32_t entry);
  /// The entry columns of rows [first, first + n), plain K = 0 rows (one entry and one token
  /// each), written in passes from the cursor on, which moves past them.
  void write_one_token_entries(const Batch& b, const ModelOutputs& out, int32_t first, int32_t n,
                               OutputCursor& cursor);
  /// The same for a K > 0 step: the plain decode rows from the first (running, nothing to stream
  /// besides, no log-probabilities), each rolling back its rejected drafts and appending its
  /// accepted tokens, with the step's acceptance statistics summed once. Leaves `cursor` after
  /// the rows it applied. Compiled per K (1..8), so its draft loops unroll.
  template <int K>
  void apply_plain_spec_rows(const Batch& b, const ModelOutputs& out, OutputCursor& cursor);
  /// update() of a batch with voided rows (voided_rows_): every row through apply_row_output(),
  /// the voided ones dropped.
  void apply_rows_with_voids(const Batch& b, const ModelOutputs& out, int32_t width,
                             std::vector<int32_t>& voided, OutputCursor& cursor);
  /// Records step_output_ entry `entry`'s finish (its whole sequence) and finishes the request.
  void finish_entry(int32_t entry, int32_t slot, FinishReason reason, int32_t stop_token);
  /// Decode-block caching: whether a decode row's verified KV completed blocks not yet
  /// published, and the end of those blocks (publish_blocks(r, end); 0 when there are none).
  [[nodiscard]] bool has_blocks_to_publish(const Request& r) const;
  [[nodiscard]] int32_t decode_publish_end(const Request& r) const;
  /// Publishes them; true when it published any.
  bool publish_decode_blocks(Request& r);
  /// For the marked rows among `slots[0, n)` that will publish: their blocks' hashes computed,
  /// and the prefix cache's lines that publishing them reads requested.
  void hash_ahead(const int32_t* slots, const uint8_t* marks, int32_t n);
  /// The stop condition met by the request's last token, or kNone.
  [[nodiscard]] FinishReason stop_reason(const Request& r, int32_t& stop_token) const;
  /// stop_reason() for the token just appended, its common case (no stop lists) inline.
  [[nodiscard]] FinishReason stop_after_append(const Request& r, int32_t& stop_token) const;
  /// The length rules alone, in their order: max_tokens, max_model_len, kv_capacity.
  [[nodiscard]] FinishReason length_stop(const Request& r) const;

  SchedulerConfig config_;
  int32_t k_;           // speculative tokens per decode row
  int32_t table_width_; // block-table columns
  // Positions a row may use: below max_model_len and within the whole pool ((num_blocks - 1) x
  // block_size: all but the null block); a request whose next position would reach the pool's
  // end finishes kv_capacity.
  int32_t pool_positions_;
  int32_t position_limit_;
  // log2(block_size) when it is a power of two (16..128 in practice), else -1: the step path
  // divides positions by the block size with a shift (block_in()).
  int32_t block_shift_;
  bool cache_decode_blocks_;  // config: decode-block caching, and prefix caching is on
  BlockPool pool_;

  std::vector<Request> requests_;  // slots; reused
  std::vector<Link> links_;        // [slot]: waiting list links, kept apart (compact)
  std::vector<int32_t> free_slots_;
  std::unordered_map<int64_t, int32_t> slot_by_id_;  // live requests only
  List waiting_;
  std::vector<int32_t> running_;   // running request slots in service order, with holes
  int32_t running_holes_ = 0;      // kRunningHole entries in running_ (never its last)
  SteadyRows steady_;              // [position in running_], capacity running_.capacity()
  std::array<std::vector<SteadyRun>, kMaxOutstandingBatches> steady_runs_;  // [batch buffer]
  // The ids of the requests preempted while the batch in each buffer was built, in preemption
  // order: a step that preempted admits nothing from waiting (schedule_prefills()), and
  // check_invariants() checks that and that no batch holds a request its step preempted.
  std::array<std::vector<int64_t>, kMaxOutstandingBatches> step_victims_;  // [batch buffer]
  List remote_waiting_;  // kWaitingForRemoteKv requests, in arrival order
  // kWaitingForInput sessions: those whose next input has not arrived (in turn-end order), and
  // those whose input has (in arrival order of their input).
  List sessions_waiting_;
  List sessions_resuming_;

  BatchBuffers batches_;
  int32_t next_buffer_ = 0;    // the buffer the next schedule() fills
  int32_t num_outstanding_ = 0;
  uint64_t next_batch_id_ = 1;

  StepOutput step_output_;
  std::vector<RejectedRequest> rejected_;
  SchedulerStats stats_;

  // scheduler_delay_factor state (ATOM's _passed_delay).
  double prev_time_ = 0.0;
  bool prev_prompt_ = false;
  double last_prompt_latency_ = 0.0;

  std::shared_ptr<KvConnector> connector_;
  bool dry_run_ = false;  // next_batch_info()'s copy: no connector call with side effects
  std::unordered_map<int64_t, int32_t> deferred_;  // finished ids whose blocks wait on a transfer
  std::vector<std::string> connector_errors_;
  std::vector<int32_t> free_device_slots_;  // device state slots not held by an admission
  // Running requests whose prefill is not fully scheduled yet, in running order (few).
  std::vector<int32_t> partial_;
  std::vector<int32_t> admission_skipped_;  // schedule_prefills(): connector said retry_later
  // fence_freed_blocks: blocks freed while batches were outstanding, held until the batch in
  // this buffer (the newest outstanding one at their free) is updated.
  std::array<std::vector<int32_t>, kMaxOutstandingBatches> fenced_blocks_;
  // Rows of the outstanding batch in each buffer whose outputs are dropped: rows in flight of a
  // request recompute_kv_from() rewound (update() then applies that batch row by row).
  std::array<std::vector<int32_t>, kMaxOutstandingBatches> voided_rows_;
  std::vector<int32_t> victim_refs_;  // [num_blocks], 0 between calls: preemption_can_free()
  uint64_t next_epoch_ = 1;
  uint64_t next_arrival_seq_ = 0;
  TenantShares tenants_;                 // scheduling=kFairShare only
  std::vector<double> tenant_counters_;  // update_tenant_counters()'s, [tenant id]
};

// The steady columns' rules, inline: sync_steady() runs on every path that changes a running
// request, and the core is compiled as position-independent code, where GCC inlines only
// functions declared inline.

inline void Scheduler::SteadyRows::set(size_t p, const Entry& e) {
  bound[p] = e.bound;
  reach[p] = e.reach;
  computed[p] = e.computed;
  token_count[p] = e.token_count;
  last_token[p] = e.last_token;
  table_size[p] = e.table_size;
  slot_delta[p] = e.slot_delta;
  epoch[p] = e.epoch;
  watch_token[p] = e.watch_token;
  watch_count[p] = e.watch_count;
}

inline Scheduler::SteadyRows::Entry Scheduler::SteadyRows::get(size_t p) const {
  return {bound[p],      reach[p], computed[p],    token_count[p], last_token[p],
          table_size[p], slot_delta[p], epoch[p], watch_token[p], watch_count[p]};
}

inline int32_t Scheduler::steady_bound(const Request& r) const {
  // Every condition but the position holds from one step to the next while the request runs
  // steady rows (a row adds a position and a token in flight, its output turns the token in
  // flight into a known one), so one bound serves every step until a path that changes more
  // calls sync_steady().
  const int32_t start = r.num_computed_tokens;
  const int32_t size = r.table_size;
  const int32_t bs = config_.block_size;
  const bool steady = r.status == RequestStatus::kRunning && start >= r.prefill_target &&
                      r.num_unstreamed == 0 && start == r.token_count - 1 + r.num_inflight &&
                      r.blocks_shipped == size && size > 0 && start >= (size - 1) * bs;
  return steady ? std::min(size * bs, position_limit_) : 0;
}

inline int32_t Scheduler::watch_count_of(const Request& r) const {
  // The tokens whose append needs a look in update(): the length limit, and the token that
  // completes a block to publish (its KV is then verified: publish_decode_blocks()); every token
  // with stop lists. (And EOS: watch_token.)
  if (r.has_stop_lists) return 0;
  const int32_t publish_at = (r.blocks_published + 1) * config_.block_size + 1;
  return cache_decode_blocks_ ? std::min(r.stop_length, publish_at) : r.stop_length;
}

inline Scheduler::SteadyRows::Entry Scheduler::steady_entry(const Request& r) const {
  const int32_t bound = steady_bound(r);
  const int32_t bs = config_.block_size;
  return {.bound = bound,
          .reach = bound + static_cast<int32_t>(bound > 0 && bound < position_limit_),
          .computed = r.num_computed_tokens,
          .token_count = r.token_count,
          .last_token = r.last_token,
          .table_size = r.table_size,
          .slot_delta = (int64_t{r.last_block} - (r.table_size - 1)) * bs,
          .epoch = r.epoch,
          .watch_token = r.ignore_eos ? -1 : config_.eos_token_id,  // any rule may stop it
          .watch_count = watch_count_of(r)};
}

}  // namespace atom_sched
