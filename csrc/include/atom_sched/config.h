// Configuration of a Scheduler and of one request's sampling. Both validate themselves.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace atom_sched {

/// The most speculative (draft) tokens per request per step that the scheduler supports.
inline constexpr int32_t kMaxSpeculativeTokens = 8;

/// The longest SamplingParams::cache_salt and lora_name, in bytes.
inline constexpr size_t kMaxExtraKeyBytes = 256;

/// What one step holds.
enum class BatchPolicy : uint8_t {
  kAtom,   // ATOM's: prefill rows when any can run, else decode rows; never both
  kMixed,  // stall-free (vLLM, TensorRT-LLM, Sarathi-Serve): every running request's decode row
           // first, then prefill chunks in the budget left
};

/// Which waiting request is admitted first and which running request is preempted first
/// (policy.h's ServiceOrder states the rule).
enum class SchedulingPolicy : uint8_t {
  kFcfs,       // ATOM's: arrival order; the victim is the request admitted last
  kPriority,   // vLLM's: (priority, arrival_time) ascending; the victim is the lowest priority
  kSjf,        // shortest job first with aging: by arrival_time + job tokens / sjf_aging_rate
  kFairShare,  // weighted fair share of tokens between tenants (tenant_shares.h); FCFS within
};

/// Which running request a step preempts when the KV pool is short (policy.h's VictimChoice).
enum class PreemptionVictim : uint8_t {
  kServiceOrder,   // the request served last (ATOM's LIFO under FCFS; vLLM's under priority)
  kLeastComputed,  // the fewest computed tokens: the least KV to recompute (within the lowest
                   // priority under priority scheduling); ties: the request served last
};

/// Static configuration of a Scheduler. Units are tokens unless stated otherwise.
struct SchedulerConfig {
  int32_t num_blocks = 0;                 // KV block ids (>= 2): block 0 is the null block
  int32_t block_size = 16;                // tokens per KV block (> 0)
  int32_t max_num_seqs = 256;             // bound on the running set and on rows per batch
  int32_t max_num_batched_tokens = 8192;  // token budget of one batch
  int32_t max_model_len = 8192;           // bound on prompt + generated tokens of a request
  bool enable_prefix_caching = true;
  bool enable_chunked_prefill = true;
  int32_t num_speculative_tokens = 0;  // K: drafts verified per decode row (0..8)
  // KV slots a request holds past the tokens it is scheduled for, for a drafter that writes KV
  // ahead of the verified tokens (vLLM's num_lookahead_tokens: K for a draft model), capped at
  // the position limit. 0..K+1, and only with K > 0.
  int32_t num_lookahead_tokens = 0;
  // Tokens of max_num_batched_tokens each row also takes for its drafter's inputs (vLLM's
  // max_num_new_slots_for_drafting: 1 for a draft model, which reads a row's tokens and one
  // more). 0..K, and only with K > 0.
  int32_t draft_slots_per_row = 0;
  // A prefix-cache hit gives back its last block, which is computed again (vLLM's EAGLE block
  // drop: a drafter on the target's hidden states needs them for the tokens just before the
  // first computed one, and a block cached by another request holds that request's next-token
  // inputs in the drafter's KV). Only local hits; a connector is asked after the drop.
  bool recompute_last_hit_block = false;
  int32_t eos_token_id = -1;           // -1: no EOS
  std::vector<int32_t> stop_token_ids;  // stop tokens for every request (in addition to EOS)
  double scheduler_delay_factor = 0.0;  // > 0 delays admission as ATOM does (seconds ratio)
  bool enable_kv_events = false;        // record BlockStored/BlockRemoved/AllBlocksCleared
  int32_t num_state_slots = 0;  // per-request state slots (linear attention); 0: not needed
  BatchPolicy policy = BatchPolicy::kAtom;
  SchedulingPolicy scheduling = SchedulingPolicy::kFcfs;
  PreemptionVictim preemption_victim = PreemptionVictim::kServiceOrder;
  // kSjf: job tokens a waiting request is credited per second of age, so its wait is bounded: a
  // request of J job tokens that arrived at T is served before every request arriving after
  // T + J / sjf_aging_rate. Finite and > 0.
  double sjf_aging_rate = 100.0;
  // Admission headroom: a waiting request is admitted only if at least this many KV blocks stay
  // free after its allocation, for the running requests' next decode blocks (vLLM's watermark,
  // 1% of the pool there), so the pool runs out, and preempts, less often. It holds while any
  // request runs: with none running, a request that fits is admitted (it could wait forever
  // otherwise). 0: ATOM's rule, admitted when it fits.
  int32_t admission_watermark_blocks = 0;
  // Blocks freed (a finish, an abort, a preemption) while a batch in flight holds a row of their
  // request return to the pool only once the batches outstanding then are updated, instead of
  // at once; and no request is preempted while batches are outstanding (its blocks would stay
  // fenced: the row that needs blocks waits instead). Batches scheduled later run after those
  // in flight on the engine's stream, so reuse is safe without it; a KV connector that loads
  // into reused blocks outside that order (asynchronously) is not (vLLM's defer_block_free).
  bool fence_freed_blocks = false;
  // The output of a row in flight when its request was preempted is dropped, instead of
  // appended when it lands: the request recomputes that token after its re-prefill. For a KV
  // connector that hands KV off when a request finishes (vLLM's requires_kv_delivery): a
  // request must not finish, and hand off, while it holds no blocks.
  bool drop_preempted_outputs = false;
  // kFairShare: each tenant's weight (finite, > 0); a tenant not listed weighs 1. Names are at
  // most kMaxExtraKeyBytes bytes.
  std::map<std::string, double> tenant_weights;
  // > 0: one request prefills at most this many tokens per step, so a long prompt cannot take
  // the whole budget (vLLM's; needs chunked prefill). 0: no cap. A request alone (nothing else
  // running or waiting) is not capped: it has nobody to starve (vLLM's rule too).
  int32_t long_prefill_token_threshold = 0;
  // With a threshold: never cap below a fair share of the budget, max_num_batched_tokens over
  // the requests running and waiting (vLLM's long_prefill_token_threshold_adaptive).
  bool long_prefill_token_threshold_adaptive = false;
  // A drafter that reads this many known prompt tokens past a prefill chunk's end (vLLM's
  // num_prefill_lookahead_tokens: multi-module MTP): a chunk never ends fewer than this many
  // tokens before the end of the request's prompt; it takes the rest, or leaves at least this
  // many. 0 or 1: no constraint (a chunk's next token is always known).
  int32_t prefill_lookahead_tokens = 0;
  // Publish the blocks a request fills while it decodes, once their tokens are verified, so a
  // follow-up turn that resends the conversation hits them (vLLM's behaviour). false: only
  // prompt blocks are cached, as ATOM.
  bool cache_decode_blocks = true;
  // Every decode row verifies K+1 tokens, for runners whose verification is one [rows, K+1]
  // block (ATOM's ModelRunner): a known row whose drafter proposed fewer than K drafts still
  // verifies K+1 (missing drafts read -1), and a row one step ahead is scheduled only once K+1
  // fit under the position limit (else it waits for its outputs). Only a row at the limit is
  // shorter, and accepting its tokens ends the request. false: rows verify only real drafts.
  bool uniform_decode_rows = false;
  // A request admitted with only its last token to compute (the rest of its prompt a prefix hit
  // or loaded by a connector) gets a decode row of K+1 tokens whose K drafts are -1, never
  // accepted, instead of a one-token row: a batch of verify rows keeps its uniform K+1 shape
  // (vLLM's first-decode padding, for full CUDA graphs). As vLLM: not in a step where a
  // running request's prompt chunk continues (that batch is not uniform anyway), only when the
  // step also decodes or the request computed something before, only when K+1 positions and
  // the token they sample fit under the position limit, and a request the token budget cannot
  // give K+1 tokens waits rather than go unpadded. Needs K > 0 and BatchPolicy::kMixed.
  bool pad_first_decode_rows = false;
  // Publish the full blocks a prompt chunk computes when the chunk is scheduled, not when its
  // step returns, so requests admitted later in the same step, or in a step after it while it
  // is in flight, share them (vLLM caches blocks at allocation: identical prompts admitted
  // together, parallel sampling's children, compute one prompt). A reader's row runs in the
  // same step as the writer's or a later one, so this needs a runner that executes batches in
  // order and writes each step's KV before its attention reads it (every paged-attention
  // runner: vLLM's). Not for a request whose admission loaded KV from a connector: its
  // computed blocks depend on a load that may yet fail. Needs enable_prefix_caching to matter.
  bool publish_prompt_blocks_at_schedule = false;
  // A decode row for a request whose last row is still in flight: true schedules it one step
  // ahead (its input token and, with drafts, its length known on the device only: the
  // asynchronous protocol); false leaves the request out of the step until that row's output
  // is in, for a runner that must be given every input token (vLLM's synchronous scheduler
  // with a batch queue: its scheduled requests sit out the next step). Prompt chunks are
  // scheduled either way (their tokens are known).
  bool schedule_ahead = true;
  // Write each batch's host block tables (Batch::block_tables, [rows, max_blocks_per_request]).
  // false: the batch carries none (the vector is empty), for runners that keep their tables per
  // device slot from the batch's slot plan (slot_reset, new_block_*: DeviceBatchBuilder does).
  // It saves a table row's copy whenever a row changes owner, which a finish does to every row
  // after it, and the batch's 2 x rows x width table memory.
  bool host_block_tables = true;

  /// Throws InvalidArgument naming the first invalid field.
  void validate() const;
  /// Width of every block-table row of a batch: the most blocks one request can hold.
  [[nodiscard]] int32_t max_blocks_per_request() const;
};

/// How one request samples and when it stops. Field meanings follow ATOM's SamplingParams.
struct SamplingParams {
  float temperature = 1.0f;  // 0 means greedy
  int32_t top_k = -1;        // -1 disables, else >= 1
  float top_p = 1.0f;        // in (0, 1]
  int32_t max_tokens = 64;   // generated tokens at most (>= 1)
  int32_t min_tokens = 0;    // EOS, stop tokens and sequences end nothing before (vLLM's)
  bool ignore_eos = false;   // ignore EOS only (stop tokens and sequences still stop)
  int32_t n = 1;             // fan-out is the engine's job: the scheduler accepts 1 only
  bool logprobs = false;     // stream the sampled tokens' log-probabilities
  int64_t seed = -1;         // the sampler's seed for this request; -1: the engine chooses
  int32_t priority = 0;      // scheduling=kPriority only: smaller is served first (vLLM's)
  int32_t length_hint = 0;   // scheduling=kSjf: expected output tokens (0: max_tokens is used)
  std::string tenant;        // scheduling=kFairShare: whose share it counts against ("": a tenant)
  // vLLM's extra keys of the block hashes: requests share cached blocks only when both are equal
  // (tenants with different salts, or different LoRA adapters, never share a block). Empty: none.
  std::string cache_salt;
  std::string lora_name;
  std::vector<int32_t> stop_token_ids;                // per-request stop tokens
  std::vector<std::vector<int32_t>> stop_token_sequences;  // stop when generated tokens end so
  // A streaming-input session (vLLM's resumable requests): a stop rule ends its turn, not the
  // request, which keeps its KV and waits for its next input (Scheduler::continue_session()).
  bool resumable = false;

  /// Throws InvalidArgument naming the first invalid field.
  void validate() const;
};

}  // namespace atom_sched
