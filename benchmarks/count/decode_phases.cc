// Where a decode step's time goes across a block: N requests decode in phase (64-token prompts,
// 16-token blocks, so every row completes a block, and then takes the next one, in the same
// step) and each step is timed alone. Prints, for each step of the 16-step cycle, the median of
// its times over the run, then the mean step: BM_DecodeStep's figure is that mean, while the
// Python bench's decode rows report the median step, which is a step inside a block.
//
//   atom_sched_decode_phases N [STEPS] [K]   (defaults: STEPS 2000, K 0)
//
// Phase p is the step whose outputs bring each row to p + 1 tokens past a block's start (K = 0):
// phase 15 completes the blocks (update() hashes and publishes them), phase 0 is the next
// schedule() (each row takes its next block). With K > 0 the rows accept 1..K+1 tokens at
// random and fall out of phase; the per-phase lines then say little and the mean is the figure.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <span>
#include <vector>

#include "atom_sched/scheduler.h"

namespace {

using atom_sched::Batch;
using atom_sched::ModelOutputs;
using atom_sched::SamplingParams;
using atom_sched::Scheduler;
using atom_sched::SchedulerConfig;

constexpr int kBlockSize = 16;
constexpr int kPromptLen = 64;

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 0;
  const int steps = argc > 2 ? std::atoi(argv[2]) : 2000;
  const int k = argc > 3 ? std::atoi(argv[3]) : 0;
  // Bounded so that the pool (N requests of up to STEPS x (K+1) tokens) fits int32 block ids.
  if (n <= 0 || n > 65536 || steps <= 0 || steps > 100000 || k < 0 || k > 8) {
    std::fprintf(stderr,
                 "usage: atom_sched_decode_phases N [STEPS] [K]  (N 1..65536, STEPS 1..100000, "
                 "K 0..8)\n");
    return 2;
  }
  const int w = k + 1;
  SchedulerConfig c;
  c.block_size = kBlockSize;
  c.max_num_seqs = n;
  c.max_num_batched_tokens = std::max(n * w, 8192);
  c.max_model_len = kPromptLen + (steps + 2) * w + 2 * kBlockSize;
  c.num_speculative_tokens = k;
  const int64_t blocks = int64_t{n} * (c.max_blocks_per_request() + 1);
  if (blocks > 100'000'000) {
    std::fprintf(stderr, "N x STEPS too large: the pool would need %lld blocks\n",
                 static_cast<long long>(blocks));
    return 2;
  }
  c.num_blocks = static_cast<int32_t>(blocks);
  Scheduler s(c);
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> token(3, 31999);
  SamplingParams sp;
  sp.max_tokens = c.max_model_len - kPromptLen;
  sp.ignore_eos = true;
  for (int i = 0; i < n; ++i) {
    std::vector<int32_t> prompt(kPromptLen);
    for (auto& t : prompt) t = token(rng);
    s.add_request(i, prompt, sp);
  }
  std::vector<int32_t> sampled(static_cast<size_t>(n) * w), drafts(static_cast<size_t>(n) * k);
  for (auto& t : sampled) t = token(rng);
  for (auto& t : drafts) t = token(rng);
  std::uniform_int_distribution<int32_t> accept(1, w);
  std::vector<std::vector<int32_t>> accepted(64, std::vector<int32_t>(static_cast<size_t>(n)));
  for (auto& ring : accepted)
    for (auto& a : ring) a = accept(rng);

  std::vector<std::vector<double>> by_phase(kBlockSize);
  double total = 0.0;
  int decode_steps = 0;
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const Batch* b = s.schedule();
    if (b == nullptr) {
      std::fprintf(stderr, "step %d scheduled nothing\n", i);
      return 1;
    }
    const size_t rows = static_cast<size_t>(b->num_rows);
    ModelOutputs out;
    out.sampled_token_ids = std::span<const int32_t>(sampled.data(), rows * w);
    if (k > 0) {
      out.draft_token_ids = std::span<const int32_t>(drafts.data(), rows * k);
      if (!b->is_prefill) out.num_accepted = std::span<const int32_t>(accepted[i % 64].data(), rows);
    }
    const bool decode = !b->is_prefill;
    s.update(b->id, out);
    const double us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    if (!decode) continue;
    if (b->num_rows != n) {  // every request decodes in every step
      std::fprintf(stderr, "step %d: %d rows, not %d\n", i, b->num_rows, n);
      return 1;
    }
    by_phase[static_cast<size_t>(decode_steps % kBlockSize)].push_back(us);
    total += us;
    ++decode_steps;
  }
  std::printf("running %d, K %d, %d decode steps\n", n, k, decode_steps);
  for (int p = 0; p < kBlockSize; ++p)
    std::printf("phase %2d: median %8.1f us\n", p, median(by_phase[static_cast<size_t>(p)]));
  std::printf("mean step: %.1f us (%.1f ns a row)\n", total / decode_steps,
              1000.0 * total / decode_steps / n);
  return 0;
}
