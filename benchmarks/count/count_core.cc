// Instruction counts of the core's step path, for callgrind (scripts/count_instructions.sh):
// the timed figures of this machine vary from hour to hour, instruction counts do not.
//
//   atom_sched_count decode N K STEPS   N requests decoding steadily (K drafts a row); STEPS steps
//                                       counted after a warm-up. Their prompts are all 32 tokens,
//                                       so every row reaches a block's end in the same step
//   atom_sched_count decode-spread N K STEPS
//                                       the same with prompts of 32..47 tokens: each step, a
//                                       sixteenth of the rows reach a block's end (as in serving)
//   atom_sched_count admission          256 prompts of 1,024 tokens, half sharing 768, admitted
//                                       under a 16,384-token budget (scheduler_bench's workload)
//   atom_sched_count preemption STEPS   256 live requests against a pool too small for them all
//                                       (scheduler_bench's preempt_256): STEPS steps counted
//   atom_sched_count preemption-no-host-tables STEPS
//                                       the same with SchedulerConfig::host_block_tables off
//
// Only the counted region runs with instrumentation on (valgrind --instr-atstart=no); the
// program prints what it counted (rows or tokens) for the script to divide by.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "atom_sched/scheduler.h"

#if __has_include(<valgrind/callgrind.h>)
#include <valgrind/callgrind.h>
#else
#define CALLGRIND_START_INSTRUMENTATION
#define CALLGRIND_STOP_INSTRUMENTATION
#endif

namespace {

using atom_sched::Batch;
using atom_sched::ModelOutputs;
using atom_sched::SamplingParams;
using atom_sched::Scheduler;
using atom_sched::SchedulerConfig;

std::vector<int32_t> random_tokens(std::mt19937& rng, int n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  for (auto& t : v) t = static_cast<int32_t>(rng() % 30000) + 3;
  return v;
}

int decode(int n, int k, int steps, bool spread) {
  SchedulerConfig c;
  c.block_size = 16;
  c.max_num_seqs = n;
  c.max_num_batched_tokens = 1 << 20;
  c.max_model_len = 4096;
  c.num_speculative_tokens = k;
  c.num_blocks = n * (c.max_blocks_per_request() + 1);
  Scheduler s(c);
  std::mt19937 rng(1);
  SamplingParams sp;
  sp.max_tokens = 4000;
  sp.ignore_eos = true;
  for (int i = 0; i < n; ++i) s.add_request(i, random_tokens(rng, spread ? 32 + i % 16 : 32), sp);
  // Every row accepts 2 tokens when K > 0 (so the rolled-back count changes every step).
  std::vector<int32_t> sampled(size_t(n) * (k + 1), 7), drafts(size_t(n) * k, 8), accepted(n, 2);
  auto step = [&] {
    const Batch* b = s.schedule();
    if (b == nullptr) std::exit(2);
    ModelOutputs o;
    o.sampled_token_ids = {sampled.data(), size_t(b->num_rows) * (k + 1)};
    if (k > 0) {
      if (!b->is_prefill) o.num_accepted = {accepted.data(), size_t(b->num_rows)};
      o.draft_token_ids = {drafts.data(), size_t(b->num_rows) * k};
    }
    s.update(b->id, o);
    return b->is_prefill ? 0 : b->num_rows;
  };
  for (int i = 0; i < 40; ++i) step();  // prefill and warm up (every block boundary seen)
  long rows = 0;
  CALLGRIND_START_INSTRUMENTATION;
  for (int i = 0; i < steps; ++i) rows += step();
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("rows %ld\n", rows);
  return rows == long{n} * steps ? 0 : 1;
}

int admission() {
  constexpr int kPrompts = 256, kLen = 1024, kShared = 768;
  std::mt19937 rng(99);
  const auto prefix = random_tokens(rng, kShared);
  SchedulerConfig c;
  c.block_size = 16;
  c.max_num_seqs = kPrompts;
  c.max_num_batched_tokens = 16384;
  c.max_model_len = 2048;
  c.num_blocks = kPrompts * (kLen / 16) + 1024;
  Scheduler s(c);
  SamplingParams sp;
  sp.max_tokens = 16;
  sp.ignore_eos = true;
  for (int i = 0; i < kPrompts; ++i) {
    std::vector<int32_t> p = random_tokens(rng, kLen);
    if (i % 2 == 0) std::copy(prefix.begin(), prefix.end(), p.begin());
    s.add_request(i, p, sp);
  }
  std::vector<int32_t> sampled(kPrompts, 7);
  int emitted = 0;
  long tokens = 0;
  CALLGRIND_START_INSTRUMENTATION;
  while (emitted < kPrompts) {
    const Batch* b = s.schedule();
    if (b == nullptr) std::exit(2);
    tokens += b->num_tokens;
    ModelOutputs o;
    o.sampled_token_ids = {sampled.data(), size_t(b->num_rows)};
    emitted += s.update(b->id, o).size();
  }
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("tokens %ld\n", tokens);
  return 0;
}

int preemption(int steps, bool host_tables) {
  // scheduler_bench.py's preemption(): 256 live requests of 128-token prompts (64 distinct, so
  // re-admissions hit the prefix cache), max_tokens 64..256, a finished one replaced at once,
  // 2,304 blocks of 16 (under half of what they would need at full length).
  constexpr int kLive = 256, kPromptLen = 128;
  SchedulerConfig c;
  c.block_size = 16;
  c.max_num_seqs = kLive;
  c.max_num_batched_tokens = 8192;
  c.max_model_len = 4096;
  c.num_blocks = 2304;
  c.host_block_tables = host_tables;
  Scheduler s(c);
  std::mt19937 rng(2);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 64; ++i) prompts.push_back(random_tokens(rng, kPromptLen));
  int64_t next_id = 0;
  auto add = [&](int count) {
    for (int i = 0; i < count; ++i, ++next_id) {
      SamplingParams sp;
      sp.max_tokens = 64 + static_cast<int32_t>(rng() % 193);
      sp.ignore_eos = true;
      s.add_request(next_id, prompts[next_id % 64], sp);
    }
  };
  add(kLive);
  std::vector<int32_t> sampled(kLive, 7);
  auto step = [&] {
    const Batch* b = s.schedule();
    if (b == nullptr) std::exit(2);
    ModelOutputs o;
    o.sampled_token_ids = {sampled.data(), size_t(b->num_rows)};
    const auto& out = s.update(b->id, o);
    return static_cast<int>(out.finished_entries.size());
  };
  for (int i = 0; i < 1000; ++i) add(step());  // warm up into the steady churn
  const int64_t preempted0 = s.stats().num_preemptions;
  CALLGRIND_START_INSTRUMENTATION;
  for (int i = 0; i < steps; ++i) {
    const int finished = step();
    CALLGRIND_STOP_INSTRUMENTATION;  // replacements are added untimed, as in the bench
    add(finished);
    CALLGRIND_START_INSTRUMENTATION;
  }
  CALLGRIND_STOP_INSTRUMENTATION;
  std::printf("steps %d preemptions %lld\n", steps,
              static_cast<long long>(s.stats().num_preemptions - preempted0));
  return s.stats().num_preemptions > preempted0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const bool spread = argc == 5 && std::strcmp(argv[1], "decode-spread") == 0;
  if (argc == 5 && (spread || std::strcmp(argv[1], "decode") == 0))
    return decode(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), spread);
  if (argc == 2 && std::strcmp(argv[1], "admission") == 0) return admission();
  if (argc == 3 && std::strcmp(argv[1], "preemption") == 0)
    return preemption(std::atoi(argv[2]), true);
  if (argc == 3 && std::strcmp(argv[1], "preemption-no-host-tables") == 0)
    return preemption(std::atoi(argv[2]), false);
  std::fprintf(stderr,
               "usage: %s decode N K STEPS | decode-spread N K STEPS | admission | "
               "preemption STEPS | preemption-no-host-tables STEPS\n",
               argv[0]);
  return 64;
}
