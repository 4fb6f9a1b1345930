// The scheduling policy's decisions as small value types (TensorRT-LLM's capacity schedulers are
// the model). The batch-building loops and the data-parallel readiness probe call these; the
// rules live here and nowhere else:
//  * ServiceOrder: the order both queues keep. Admission takes waiting requests from the head.
//  * VictimChoice: which running request not yet in the step's batch is preempted first: by
//    default the one served last (the tail of `running`), or the one with the least to recompute.
//  * PrefillChunk: how many uncomputed prompt tokens of one request a step prefills, or 0 when
//    the request does not fit (admission stops there: head-of-line blocking, as ATOM).
//  * AdmissionHeadroom: the KV blocks an admission must leave free.
#pragma once

#include <algorithm>
#include <cstdint>
#include <tuple>

#include "atom_sched/config.h"
#include "atom_sched/request.h"

namespace atom_sched {

struct ServiceOrder {
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;

  /// FCFS orders nothing: a queue keeps the order of its insertions (arrivals at the back of
  /// waiting, a preempted request back at its head, admissions at the back of running), so the
  /// request served last is the one admitted last, as ATOM. Fair share keeps FCFS order and
  /// picks among the tenants at admission (Scheduler::fair_pick()). Priority and SJF keep both
  /// queues sorted by this.
  [[nodiscard]] bool sorted() const noexcept {
    return policy == SchedulingPolicy::kPriority || policy == SchedulingPolicy::kSjf;
  }

  /// Whether `a` is served strictly before `b` (admitted first; running, preempted after it).
  /// Priority: (priority, arrival_time, add order), smallest first, as vLLM. SJF: (sjf_key, add
  /// order): the job tokens (length hint, else max_tokens) as seconds of age at sjf_aging_rate,
  /// added to the arrival time. The key never changes while the request lives, so the sorted
  /// queues stay sorted as time passes; and a request is overtaken only by requests that arrived
  /// within its job's seconds after it, which bounds its wait.
  [[nodiscard]] bool operator()(const Request& a, const Request& b) const noexcept {
    if (policy == SchedulingPolicy::kSjf)
      return std::tie(a.sjf_key, a.arrival_seq) < std::tie(b.sjf_key, b.arrival_seq);
    return std::tie(a.priority, a.arrival_time, a.arrival_seq) <
           std::tie(b.priority, b.arrival_time, b.arrival_seq);
  }
};

struct VictimChoice {
  PreemptionVictim rule = PreemptionVictim::kServiceOrder;
  SchedulingPolicy policy = SchedulingPolicy::kFcfs;
  const double* tenant_counters = nullptr;  // kFairShare: [tenant id] (tenant_shares.h)

  /// The candidate served last is the victim (kServiceOrder, and no tenants to weigh), which in
  /// a running set kept in service order is its tail.
  [[nodiscard]] bool takes_tail() const noexcept {
    return rule == PreemptionVictim::kServiceOrder && policy != SchedulingPolicy::kFairShare;
  }

  /// Whether candidate `a` is preempted before `b`. First the larger share: the tenant with the
  /// larger counter (fair share), or the lower priority (priority scheduling: no request is
  /// preempted for a lower-priority one). Then, with kLeastComputed, fewer computed tokens (the
  /// KV its readmission computes again). The caller walks the candidates from the one served
  /// last and takes a strictly better one, so ties go to the one served last.
  [[nodiscard]] bool before(const Request& a, const Request& b) const noexcept {
    if (policy == SchedulingPolicy::kFairShare &&
        tenant_counters[a.tenant] != tenant_counters[b.tenant])
      return tenant_counters[a.tenant] > tenant_counters[b.tenant];
    if (policy == SchedulingPolicy::kPriority && a.priority != b.priority)
      return a.priority > b.priority;
    return rule == PreemptionVictim::kLeastComputed &&
           a.num_computed_tokens < b.num_computed_tokens;
  }
};

struct AdmissionHeadroom {
  int32_t watermark_blocks = 0;  // SchedulerConfig::admission_watermark_blocks

  /// Blocks that must stay free after admitting a request while `running` requests run (those
  /// admitted earlier in the same step included): the watermark, for their next decode blocks.
  /// With none running, nothing: a request that fits the pool is admitted, or it could wait
  /// forever.
  [[nodiscard]] int32_t operator()(int32_t running) const noexcept {
    return running > 0 ? watermark_blocks : 0;
  }
};

struct PrefillChunk {
  bool chunked_prefill = true;               // SchedulerConfig::enable_chunked_prefill
  int32_t long_prefill_token_threshold = 0;  // > 0: at most this many tokens per request a step
  int32_t lookahead = 0;                     // SchedulerConfig::prefill_lookahead_tokens

  /// Tokens of a request's prefill scheduled this step: `num_new` uncomputed tokens, `left`
  /// tokens of the budget not taken by rows before it. A request may take part of its prompt
  /// when chunked prefill is on or `must_chunk` (a preempted request, whose prompt and outputs
  /// may exceed the budget); otherwise it fits whole or not at all. A part never leaves fewer
  /// than `lookahead` tokens (a drafter reads them past the chunk): it is cut to leave that many.
  [[nodiscard]] int32_t operator()(int32_t num_new, int32_t left, bool must_chunk) const noexcept {
    if (!chunked_prefill && !must_chunk) return num_new <= left ? num_new : 0;
    const int32_t cap =
        long_prefill_token_threshold > 0 ? std::min(left, long_prefill_token_threshold) : left;
    int32_t chunk = std::max(0, std::min(num_new, cap));
    const int32_t rest = num_new - chunk;
    if (rest > 0 && rest < lookahead) chunk -= lookahead - rest;
    return std::max(0, chunk);
  }
};

}  // namespace atom_sched
