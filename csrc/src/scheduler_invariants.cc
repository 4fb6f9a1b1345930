// Scheduler::check_invariants(): every invariant of the scheduler and its block pool.
#include <algorithm>
#include <string>

#include "atom_sched/errors.h"
#include "atom_sched/policy.h"
#include "atom_sched/scheduler.h"
#include "scheduler_internal.h"

namespace atom_sched {

using detail::ceil_div;
using detail::check;
using detail::id_str;

// ---------------------------------------------------------------------------------------------
// Invariants

void Scheduler::check_invariants() const {
  const int32_t bs = config_.block_size;
  std::vector<int32_t> refs(pool_.num_blocks(), 0);
  std::vector<int32_t> inflight(requests_.size(), 0);
  // Fenced blocks are held (once each) until their batch is updated; only outstanding batches
  // fence any.
  for (int32_t buffer = 0; buffer < kMaxOutstandingBatches; ++buffer) {
    const int32_t age = (next_buffer_ - 1 - buffer + 2 * kMaxOutstandingBatches) %
                        kMaxOutstandingBatches;  // 0: the newest batch's buffer
    check(age < num_outstanding_ || fenced_blocks_[buffer].empty(),
          "blocks fenced by a batch that is not outstanding");
    check(age < num_outstanding_ || voided_rows_[buffer].empty(),
          "rows voided in a batch that is not outstanding");
    for (int32_t row : voided_rows_[buffer])
      check(row >= 0 && row < batches_[buffer].num_rows, "a voided row is out of range");
    for (int32_t blk : fenced_blocks_[buffer]) {
      check(blk > kNullBlock && blk < pool_.num_blocks(), "a fenced block id is out of range");
      ++refs[blk];
    }
  }
  for (int32_t i = 0; i < num_outstanding_; ++i) {
    const int32_t buffer =
        (next_buffer_ - num_outstanding_ + i + kMaxOutstandingBatches) % kMaxOutstandingBatches;
    const Batch& b = batches_[buffer];
    const std::vector<int64_t>& victims = step_victims_[buffer];
    check(b.num_rows <= config_.max_num_seqs, "batch has more rows than max_num_seqs");
    check(b.num_tokens + b.num_rows * config_.draft_slots_per_row <=
              config_.max_num_batched_tokens,
          "batch exceeds the token budget (its rows' drafter inputs included)");
    for (int32_t row = 0; row < b.num_rows; ++row) {
      ++inflight[b.request_index[row]];
      // A step that preempted schedules none of its victims and admits nothing from waiting (an
      // admission: a prefill row whose device slot starts afresh).
      if (!victims.empty()) {
        const std::string who = "batch " + std::to_string(b.id) + ": request " +
                                id_str(b.req_ids[row]);
        check(std::find(victims.begin(), victims.end(), b.req_ids[row]) == victims.end(),
              who + " is in the batch of the step that preempted it");
        check(!(b.row_is_prefill[row] && b.slot_reset[row]),
              who + " is admitted in a step that preempted");
      }
      // The block-table contract: past the row's blocks, every entry is the null block.
      if (!config_.host_block_tables) continue;
      const int32_t* t = b.block_tables.data() + static_cast<size_t>(row) * table_width_;
      check(std::all_of(t + b.row_filled[row], t + table_width_,
                        [](int32_t id) { return id == kNullBlock; }),
            "a batch row's block table is not padded with the null block");
    }
  }
  int32_t live = 0;
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
      check(blk > kNullBlock && blk < pool_.num_blocks(),
            who + (blk == kNullBlock ? "holds the null block" : "block id out of range"));
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
    check(r.stop_length == final_length(r), who + "cached length limit is stale");
    check(r.token_count == static_cast<int32_t>(r.tokens.size()) &&
              r.last_token == (r.tokens.empty() ? -1 : r.tokens.back()),
          who + "cached token count or last token is stale");
    check(r.table_size == static_cast<int32_t>(r.block_table.size()) &&
              r.last_block == (r.block_table.empty() ? -1 : r.block_table.back()),
          who + "cached table size or last block is stale");
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
    if (r.status == RequestStatus::kWaitingForInput) {
      // A session between turns: its KV up to its last sampled token (or, once its input
      // arrived, up to the new tokens), its device slot; no state slot (add_request refuses).
      // Or, preempted when its turn ended, nothing held at all.
      check(r.resumable || r.input_ready, who + "waits for input but is not a session");
      check(r.state_slot < 0, who + "waits for input holding a state slot");
      if (r.device_slot < 0) {
        check(r.block_table.empty() && r.num_computed_tokens == 0 && !r.input_ready,
              who + "waits for input without a device slot but holds KV or has input");
        continue;
      }
      check(r.num_computed_tokens == r.num_tokens() - 1 ||
                (r.input_ready && r.num_computed_tokens < r.num_tokens()),
            who + "waits for input but its computed tokens are not its tokens less the last");
      check(static_cast<int32_t>(r.block_table.size()) >= ceil_div(r.num_computed_tokens, bs),
            who + "waits for input but its blocks do not cover its computed tokens");
      check(r.blocks_published * bs <= r.num_computed_tokens,
            who + "published a block past its computed tokens");
      check(r.device_slot >= 0 && r.device_slot < config_.max_num_seqs &&
                !device_slot_used[r.device_slot],
            who + "device slot missing or shared");
      device_slot_used[r.device_slot] = 1;
      count_blocks(r, who);
      continue;
    }
    if (r.status != RequestStatus::kRunning) {
      const bool remote = r.status == RequestStatus::kWaitingForRemoteKv;
      check(remote || r.block_table.empty(), who + "waiting but holds KV");
      check(remote != r.block_table.empty(), who + "waiting for remote KV without blocks");
      check(r.state_slot < 0 && r.device_slot < 0, who + "waiting but holds a slot");
      check(r.num_computed_tokens == 0, who + "waiting with computed tokens");
      count_blocks(r, who);
      continue;
    }
    check(r.num_computed_tokens <= r.num_tokens() + r.num_inflight * (k_ + 1),
          who + "computed tokens beyond what is known or in flight");
    check(static_cast<int32_t>(r.block_table.size()) >=
              ceil_div(kv_slots_for(r.num_computed_tokens), bs),
          who + "block table does not cover the computed tokens and the drafter's lookahead");
    check((r.state_slot >= 0) == (config_.num_state_slots > 0), who + "state slot mismatch");
    check(r.device_slot >= 0 && r.device_slot < config_.max_num_seqs &&
              !device_slot_used[r.device_slot],
          who + "device slot missing or shared");
    device_slot_used[r.device_slot] = 1;
    check(r.blocks_shipped <= static_cast<int32_t>(r.block_table.size()),
          who + "shipped more blocks than it holds");
    // Published blocks hold real tokens only, never drafts.
    check(r.blocks_published * bs <= r.num_tokens() &&
              r.blocks_published <= static_cast<int32_t>(r.block_table.size()),
          who + "published a block past its real tokens");
    count_blocks(r, who);
  }
  check(deferred == static_cast<int32_t>(deferred_.size()), "deferred map holds stale ids");
  check(live == static_cast<int32_t>(slot_by_id_.size()), "id map holds dead requests");
  check(num_seated() <= config_.max_num_seqs,
        "running requests and sessions between turns exceed max_num_seqs");
  const ServiceOrder order{config_.scheduling};
  auto walk = [&](const List& l, RequestStatus status, const char* name) {
    int32_t count = 0, prev = -1;
    for (int32_t s = l.head; s >= 0; s = links_[s].next) {
      check(requests_[s].in_use && requests_[s].status == status,
            std::string(name) + " list holds a request in another state");
      check(links_[s].prev == prev, std::string(name) + " list back link broken");
      check(!order.sorted() || prev < 0 || status == RequestStatus::kWaitingForRemoteKv ||
                status == RequestStatus::kWaitingForInput ||
                order(requests_[prev], requests_[s]),
            std::string(name) + " list is not in service order");
      prev = s;
      check(++count <= static_cast<int32_t>(requests_.size()), std::string(name) + " list cycles");
    }
    check(prev == l.tail && count == l.size, std::string(name) + " list size or tail is wrong");
  };
  walk(waiting_, RequestStatus::kWaiting, "waiting");
  walk(remote_waiting_, RequestStatus::kWaitingForRemoteKv, "remote-waiting");
  walk(sessions_waiting_, RequestStatus::kWaitingForInput, "sessions-waiting");
  walk(sessions_resuming_, RequestStatus::kWaitingForInput, "sessions-resuming");
  for (int32_t s = sessions_resuming_.head; s >= 0; s = links_[s].next)
    check(requests_[s].input_ready, "a session without input is in the resuming list");
  for (int32_t s = sessions_waiting_.head; s >= 0; s = links_[s].next)
    check(!requests_[s].input_ready, "a session with input is in the waiting-for-input list");
  std::vector<uint8_t> seen(requests_.size(), 0);
  std::vector<int32_t> partial;  // the running set's partial prefills, in its order
  int32_t holes = 0, prev = -1;
  for (size_t i = 0; i < running_.size(); ++i) {
    const int32_t s = running_[i];
    if (s == kRunningHole) {
      ++holes;
      check(k_ > 0 || (steady_.bound[i] == 0 && steady_.reach[i] == 0),
            "a hole in the running set takes steady rows");
      continue;
    }
    check(s >= 0 && s < static_cast<int32_t>(requests_.size()) && !seen[s]++,
          "the running set holds a slot twice or out of range");
    check(requests_[s].in_use && requests_[s].status == RequestStatus::kRunning,
          "the running set holds a request in another state");
    check(requests_[s].run_pos == static_cast<int32_t>(i), "a running request's run_pos is wrong");
    if (k_ == 0) {  // its steady columns equal what it holds
      const Request& r = requests_[s];
      check(steady_.get(i) == steady_entry(r),
            "request " + std::to_string(r.id) + "'s steady columns differ from the request");
      // The columns' rule is the per-request rule (steady_now()).
      check(steady_.steady(i) == steady_now(r),
            "request " + std::to_string(r.id) + "'s steady columns and the steady rule differ");
    }
    check(!order.sorted() || prev < 0 || order(requests_[prev], requests_[s]),
          "the running set is not in service order");
    prev = s;
    if (requests_[s].is_partial_prefill()) partial.push_back(s);
  }
  check(holes == running_holes_ && (running_.empty() || running_.back() != kRunningHole),
        "the running set's hole count is wrong, or it ends with a hole");
  check(running_.size() <= steady_.bound.size(), "the running set outgrew its steady columns");
  check(partial == partial_, "the partial prefills are not tracked in running order");
  check(num_waiting() + num_waiting_for_input() + num_running() == live,
        "a live request is in no queue");
  check(std::count(device_slot_used.begin(), device_slot_used.end(), 1) == config_.max_num_seqs,
        "a device slot leaked");
  check_tenants();
  pool_.check_invariants(refs);
}

void Scheduler::check_tenants() const {
  // Fair share: each live request counts against one active tenant, and each active tenant's
  // live count is its live requests; other policies keep no tenants.
  std::vector<int32_t> live(static_cast<size_t>(tenants_.size()), 0);
  for (const Request& r : requests_) {
    const bool counted = r.in_use && r.status != RequestStatus::kFinished;
    if (!fair_share() || !counted) {
      check(r.tenant == -1, "request " + id_str(r.id) + " holds a tenant it should not");
      continue;
    }
    check(r.tenant >= 0 && r.tenant < tenants_.size() && tenants_.active(r.tenant),
          "request " + id_str(r.id) + " has no active tenant");
    ++live[r.tenant];
  }
  int32_t active = 0;
  for (int32_t t = 0; t < tenants_.size(); ++t) {
    check(live[t] == tenants_.live(t), "tenant " + std::to_string(t) + "'s live count is wrong");
    check(tenants_.charged(t) >= 0.0, "tenant " + std::to_string(t) + " has a negative charge");
    active += live[t] > 0;
  }
  check(active == tenants_.num_active(), "the tenants' name map holds inactive tenants");
}

}  // namespace atom_sched
