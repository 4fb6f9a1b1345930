#include "atom_sched/config.h"

#include <cmath>
#include <string>

#include "atom_sched/errors.h"

namespace atom_sched {

namespace {
void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}
std::string got(double v) {
  std::string s = std::to_string(v);
  return ", got " + s;
}
std::string got(int64_t v) { return ", got " + std::to_string(v); }
}  // namespace

void SchedulerConfig::validate() const {
  require(num_blocks >= 2, "num_blocks must be >= 2 (block 0 is the null block)" +
                               got(int64_t{num_blocks}));
  require(block_size >= 1, "block_size must be >= 1" + got(int64_t{block_size}));
  require(max_num_seqs >= 1, "max_num_seqs must be >= 1" + got(int64_t{max_num_seqs}));
  require(max_num_batched_tokens >= 1,
          "max_num_batched_tokens must be >= 1" + got(int64_t{max_num_batched_tokens}));
  require(max_model_len >= 1, "max_model_len must be >= 1" + got(int64_t{max_model_len}));
  require(num_speculative_tokens >= 0 && num_speculative_tokens <= kMaxSpeculativeTokens,
          "num_speculative_tokens must be in 0.." + std::to_string(kMaxSpeculativeTokens) +
              got(int64_t{num_speculative_tokens}));
  require(max_num_batched_tokens >= num_speculative_tokens + 1,
          "max_num_batched_tokens must be >= num_speculative_tokens + 1 (one decode row)" +
              got(int64_t{max_num_batched_tokens}));
  require(num_lookahead_tokens >= 0 && num_lookahead_tokens <= num_speculative_tokens + 1,
          "num_lookahead_tokens must be in 0..num_speculative_tokens + 1 (KV slots a drafter "
          "writes past a row's tokens)" + got(int64_t{num_lookahead_tokens}));
  require(num_lookahead_tokens == 0 || num_speculative_tokens > 0,
          "num_lookahead_tokens needs num_speculative_tokens > 0 (the slots are a drafter's)");
  require(draft_slots_per_row >= 0 && draft_slots_per_row <= num_speculative_tokens,
          "draft_slots_per_row must be in 0..num_speculative_tokens (a drafter's input tokens "
          "a row)" + got(int64_t{draft_slots_per_row}));
  require(int64_t{max_num_batched_tokens} >=
              int64_t{num_speculative_tokens} + 1 + draft_slots_per_row,
          "max_num_batched_tokens must be >= num_speculative_tokens + 1 + draft_slots_per_row "
          "(one decode row and its drafter's inputs)" + got(int64_t{max_num_batched_tokens}));
  require(eos_token_id >= -1, "eos_token_id must be >= 0, or -1 for none" +
                                  got(int64_t{eos_token_id}));
  for (int32_t t : stop_token_ids)
    require(t >= 0, "stop_token_ids must be >= 0" + got(int64_t{t}));
  require(scheduler_delay_factor >= 0.0,
          "scheduler_delay_factor must be >= 0" + got(scheduler_delay_factor));
  require(num_state_slots >= 0, "num_state_slots must be >= 0" + got(int64_t{num_state_slots}));
  require(policy == BatchPolicy::kAtom || policy == BatchPolicy::kMixed,
          "policy must be atom or mixed" + got(int64_t{static_cast<int>(policy)}));
  require(scheduling == SchedulingPolicy::kFcfs || scheduling == SchedulingPolicy::kPriority ||
              scheduling == SchedulingPolicy::kSjf || scheduling == SchedulingPolicy::kFairShare,
          "scheduling must be FCFS, priority, SJF or fair share" +
              got(int64_t{static_cast<int>(scheduling)}));
  for (const auto& [name, weight] : tenant_weights) {
    require(name.size() <= kMaxExtraKeyBytes,
            "tenant_weights: a tenant name must be at most " + std::to_string(kMaxExtraKeyBytes) +
                " bytes" + got(static_cast<int64_t>(name.size())));
    require(weight > 0.0 && std::isfinite(weight),
            "tenant_weights: the weight of tenant '" + name + "' must be a finite number > 0" +
                got(weight));
  }
  require(preemption_victim == PreemptionVictim::kServiceOrder ||
              preemption_victim == PreemptionVictim::kLeastComputed,
          "preemption_victim must be service order or least computed" +
              got(int64_t{static_cast<int>(preemption_victim)}));
  require(admission_watermark_blocks >= 0 && admission_watermark_blocks < num_blocks - 1,
          "admission_watermark_blocks must be in 0..num_blocks - 2 (it keeps blocks free "
          "for running requests)" + got(int64_t{admission_watermark_blocks}));
  // (!(x > 0) also refuses NaN.)
  require(sjf_aging_rate > 0.0 && std::isfinite(sjf_aging_rate),
          "sjf_aging_rate must be a finite number > 0 (job tokens credited per second waited)" +
              got(sjf_aging_rate));
  require(long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0" +
                                                 got(int64_t{long_prefill_token_threshold}));
  require(long_prefill_token_threshold == 0 || enable_chunked_prefill,
          "long_prefill_token_threshold caps a request's prefill chunk: it needs "
          "enable_chunked_prefill=True");
  require(!pad_first_decode_rows || (num_speculative_tokens > 0 && policy == BatchPolicy::kMixed),
          "pad_first_decode_rows pads a row to K+1 tokens among the decode rows of its step: it "
          "needs num_speculative_tokens > 0 and policy=mixed");
  // A step's whole budget (and a capped chunk) must be able to leave that many tokens.
  require(prefill_lookahead_tokens >= 0 && prefill_lookahead_tokens < max_num_batched_tokens,
          "prefill_lookahead_tokens must be in 0..max_num_batched_tokens - 1" +
              got(int64_t{prefill_lookahead_tokens}));
  require(long_prefill_token_threshold == 0 ||
              prefill_lookahead_tokens <= long_prefill_token_threshold,
          "prefill_lookahead_tokens must be <= long_prefill_token_threshold (a capped chunk "
          "must be able to leave that many tokens)" + got(int64_t{prefill_lookahead_tokens}));
}

int32_t SchedulerConfig::max_blocks_per_request() const {
  // A running request holds at most max_model_len real tokens plus, one step ahead, the worst
  // case of two speculative rows (K+1 positions each) not yet reconciled.
  const int64_t tokens = int64_t{max_model_len} + 2 * (int64_t{num_speculative_tokens} + 1);
  return static_cast<int32_t>((tokens + block_size - 1) / block_size);
}

void SamplingParams::validate() const {
  require(temperature >= 0.0f, "temperature must be >= 0" + got(double{temperature}));
  require(top_k == -1 || top_k >= 1,
          "top_k must be -1 (disabled) or >= 1" + got(int64_t{top_k}));
  require(top_p > 0.0f && top_p <= 1.0f, "top_p must be in range (0.0, 1.0]" + got(double{top_p}));
  require(max_tokens >= 1, "max_tokens must be >= 1" + got(int64_t{max_tokens}));
  require(min_tokens >= 0 && min_tokens <= max_tokens,
          "min_tokens must be in range [0, max_tokens=" + std::to_string(max_tokens) + "]" +
              got(int64_t{min_tokens}));
  require(n >= 1, "n must be >= 1" + got(int64_t{n}));
  require(length_hint >= 0, "length_hint must be >= 0 (0: max_tokens is the job size)" +
                                got(int64_t{length_hint}));
  require(seed >= -1, "seed must be >= 0, or -1 for none" + got(int64_t{seed}));
  for (int32_t t : stop_token_ids)
    require(t >= 0, "stop_token_ids must be >= 0" + got(int64_t{t}));
  require(cache_salt.size() <= kMaxExtraKeyBytes,
          "cache_salt must be at most " + std::to_string(kMaxExtraKeyBytes) + " bytes" +
              got(static_cast<int64_t>(cache_salt.size())));
  require(tenant.size() <= kMaxExtraKeyBytes,
          "tenant must be at most " + std::to_string(kMaxExtraKeyBytes) + " bytes" +
              got(static_cast<int64_t>(tenant.size())));
  require(lora_name.size() <= kMaxExtraKeyBytes,
          "lora_name must be at most " + std::to_string(kMaxExtraKeyBytes) + " bytes" +
              got(static_cast<int64_t>(lora_name.size())));
  for (const auto& seq : stop_token_sequences) {
    require(!seq.empty(), "stop_token_sequences must not contain an empty sequence");
    for (int32_t t : seq)
      require(t >= 0, "stop_token_sequences ids must be >= 0" + got(int64_t{t}));
  }
}

}  // namespace atom_sched
