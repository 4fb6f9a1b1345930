// A request's state inside the scheduler. Internal to the scheduler; exposed read-only through
// Scheduler::request() for tests and introspection.
//
// Token accounting (DESIGN.md section 4) is explicit, never placeholder tokens:
//  * tokens: the real tokens the host knows (prompt, then accepted outputs), R = tokens.size();
//  * num_computed_tokens (S): KV positions written by every batch scheduled so far. Exact in the
//    synchronous protocol (S == R - 1 between decode steps); an upper bound while a speculative
//    batch is in flight, reconciled by the rejected count when its outputs arrive;
//  * num_inflight: scheduled batches holding this request whose outputs have not arrived yet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "atom_sched/config.h"
#include "atom_sched/step_output.h"

namespace atom_sched {

/// kWaitingForRemoteKv: queued in `waiting` with KV blocks allocated, until a KV connector reports
/// that the remote prefill's KV has arrived (prefill/decode disaggregation).
/// kWaitingForInput: a streaming-input session between turns: it keeps its KV blocks and its
/// device slot (it counts against max_num_seqs) until its next input arrives and it resumes.
enum class RequestStatus : uint8_t {
  kWaiting,
  kRunning,
  kFinished,
  kWaitingForRemoteKv,
  kWaitingForInput
};

struct alignas(64) Request {
  // Grouped by the cache lines a steady decode step touches, so that a row costs one line of
  // its request (two with drafts; plus its token tail) rather than five: at thousands of running
  // requests these records outgrow the L2 and each line is a miss. The queues live outside (the
  // waiting links, the running set's array), so walking one does not chain misses through
  // records.
  //
  // Line 0 (64 bytes): everything a steady K = 0 row reads or writes, in schedule() and in
  // update() (the token appended: the vector's pointers are here, so an append touches this line
  // and the token tail only), and the counters a speculative row's output is checked against.
  RequestStatus status = RequestStatus::kFinished;
  bool has_stop_lists = false;      // stop_token_ids or stop_sequences non-empty
  bool ignore_eos = false;
  bool wants_logprobs = false;
  int32_t num_computed_tokens = 0;  // S
  int32_t num_inflight = 0;
  // Copies of tokens.size() and tokens.back() (and below, of block_table.size() and
  // block_table.back()), so that a row reads neither vector: kept by append_token(), set_tokens()
  // and table_changed(), and checked by Scheduler::check_invariants().
  int32_t token_count = 0;
  int32_t last_token = -1;
  int32_t prefix_hit_tokens = 0;    // cache-hit tokens at the last admission
  std::vector<int32_t> tokens;        // R real tokens
  int32_t num_unstreamed = 0;      // trailing tokens known but not streamed yet (an injected T0)
  int32_t stop_length = 0;         // a length rule ends it once it holds this many tokens
  int32_t min_tokens = 0;          // no EOS, stop token or sequence ends it before this many
  int32_t blocks_published = 0;     // leading blocks the prefix cache knows (hits, published)

  // Line 1: what a speculative (K > 0) row reads besides, in schedule() (its drafts, its
  // admission and last block) and in update() (the id, the drafts it keeps).
  std::vector<int32_t> drafts;        // K drafts proposed with the last output, -1 padded
  int32_t num_drafts = 0;          // leading entries of `drafts` the drafter proposed (<= K)
  int32_t prefill_target = 0;       // tokens to prefill at this admission (R when admitted)
  uint64_t epoch = 0;               // unique per admission (a new block table); 0: never admitted
  int64_t id = -1;
  int32_t table_size = 0;
  int32_t last_block = -1;
  int32_t blocks_shipped = 0;       // block-table entries already sent to the device slot
  int32_t num_prompt_tokens = 0;

  // Line 2: the block table (read when a row crosses into a block), and the columns a row
  // copies when it changes owner.
  std::vector<int32_t> block_table;   // KV block ids
  int32_t run_pos = -1;            // its index in the scheduler's running set while running
  int32_t device_slot = -1;         // 0..max_num_seqs-1 while admitted
  int32_t state_slot = -1;
  float temperature = 1.0f;
  int32_t top_k = -1;
  float top_p = 1.0f;
  int64_t seed = -1;

  // Cold fields: admission, finishing, stop lists, remote prefills.
  bool in_use = false;     // the slot holds a request (maybe finished, awaiting in-flight outputs)
  bool preempted = false;     // was preempted at least once since it was added
  bool remote_ready = false;   // kWaitingForRemoteKv: the KV has arrived
  bool awaiting_send = false;  // finished; blocks kept until the connector has sent them
  bool awaiting_recv = false;  // finished while its KV was still arriving; blocks kept till then
  bool resumable = false;      // a streaming-input session: a stop ends its turn, not the request
  bool input_ready = false;    // kWaitingForInput: its next input has arrived (it may resume)
  int32_t max_tokens = 0;
  std::vector<int32_t> stop_token_ids;
  std::vector<std::vector<int32_t>> stop_sequences;
  std::vector<uint64_t> block_hashes; // chain hashes of the leading full blocks of `tokens`
  double arrival_time = 0.0;
  double sjf_key = 0.0;  // scheduling=kSjf: arrival_time + job tokens / sjf_aging_rate
  int32_t tenant = -1;   // scheduling=kFairShare: its TenantShares id while live
  std::optional<uint64_t> hash_namespace;  // parent of block 0 (hash_namespace() of the keys)
  std::string lora_name, cache_salt;       // the extra keys, for KV events
  int32_t priority = 0;
  uint64_t arrival_seq = 0;  // add order: breaks (priority, arrival_time) ties
  FinishReason finish_reason = FinishReason::kNone;
  int32_t stop_token = -1;
  int32_t remote_first_token = -1;      // the producer's first token, injected when the KV arrives
  int32_t loaded_tokens = 0;    // tokens whose KV a connector supplied at the last admission
  int32_t kept_tokens = 0;      // tokens whose KV a session kept from its last turn (a resume)
  int32_t remote_computed = 0;  // without it: tokens whose KV is present once the load lands
  // Set only with num_unstreamed > 0 (which guards every read on the step path).
  FinishReason pending_stop = FinishReason::kNone;  // the injected first token already stops it
  int32_t pending_stop_token = -1;
  std::vector<int32_t> remote_drafts;   // the producer's drafts, likewise

  [[nodiscard]] int32_t num_tokens() const noexcept { return token_count; }
  void set_tokens(const int32_t* first, size_t n) {
    tokens.assign(first, first + n);
    token_count = static_cast<int32_t>(n);
    last_token = n > 0 ? tokens.back() : -1;
  }
  // (GCC inlines the push_back only while it has few call sites in a file: one more in
  // scheduler_update.cc made it an out-of-line call in the K = 0 pass, 129 -> 155 instructions a
  // row. scripts/count_instructions.sh shows such a change.)
  void append_token(int32_t t) {
    tokens.push_back(t);
    ++token_count;
    last_token = t;
  }
  /// Brings table_size and last_block up to date: call after every change to block_table.
  void table_changed() noexcept {
    table_size = static_cast<int32_t>(block_table.size());
    last_block = table_size > 0 ? block_table.back() : -1;
  }
  [[nodiscard]] int32_t num_generated() const noexcept { return num_tokens() - num_prompt_tokens; }
  /// Tokens this engine has computed for it since its last admission: neither its prefix hits,
  /// nor what a connector loaded, nor a resumed session's kept turn (fair share charges these to
  /// its tenant).
  [[nodiscard]] int32_t computed_here() const noexcept {
    const int32_t here = num_computed_tokens - prefix_hit_tokens - loaded_tokens - kept_tokens;
    return here > 0 ? here : 0;
  }
  [[nodiscard]] bool is_partial_prefill() const noexcept {
    return status == RequestStatus::kRunning && num_computed_tokens < prefill_target;
  }
};

}  // namespace atom_sched
