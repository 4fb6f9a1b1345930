// The steady K = 0 decode step as docs/perf.md's plan ("The persistent running set") would run
// it, measured before it is built: what the planned data layout costs a row on this machine, to
// set beside BM_DecodeStep (the scheduler as it is) and issue 10's 8 ns budget.
//
// BM_PlannedSteadyPasses/N keeps N running requests' hot fields in arrays in row order (their
// only copy in the plan) and runs, each step:
//  * schedule: the rows that reached the end of the blocks they hold take a block (the per-row
//    path of the plan, one row in 16 a step here); then vector passes write every row's batch
//    columns (counts, positions, slots, input tokens, context lengths, last-block fill) and
//    advance S; then the prefix sums (cu_seqlens);
//  * update: one pass takes the sampled tokens (last token, count, nothing in flight) and flags
//    the rows with an event (a length rule, EOS, a completed block); the output columns (ids,
//    tokens, offsets, finish reasons) are copied as columns; each row's token is appended; a
//    flagged row's completed block is hashed (block_hash, as decode-block caching does).
// The second argument says where a token is appended: 0, to its request's token vector (the
// scatter steps 2-4 of the plan keep); 1, to a 16-token slot of its row in one array beside the
// hot fields, a completed block moved to the request's vector and hashed from there (the plan's
// last step).
// Left out, so the figure is a floor of the plan rather than its cost: the block pool's publish
// of the hashed block (about 12 instructions a row amortised in the scheduler today), the output
// validation (about 2) and the Python binding.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <span>
#include <vector>

#include "atom_sched/xxhash64.h"

namespace {

constexpr int32_t kBlockSize = 16;
constexpr int32_t kEos = 2;

struct HotRows {  // the running set's hot fields, row order
  std::vector<int32_t> computed, count, last_token, last_block, covered, event_length;
  std::vector<uint8_t> inflight;
  std::vector<int64_t> ids;
  std::vector<std::vector<int32_t>> tokens;  // per request, reserved
  std::vector<int32_t> block_tokens;         // [rows, 16]: the block being filled (per-row mode)
};

struct Columns {  // the batch and output columns a step writes
  std::vector<int32_t> scheduled, cached, context, last_fill, cu_q, cu_k, input_tokens;
  std::vector<int64_t> positions, slots, out_ids;
  std::vector<int32_t> out_tokens, out_offsets;
  std::vector<uint8_t> reasons;
};

// The plan's schedule pass: every row's batch columns from its hot fields, S advanced.
[[gnu::noinline]] void schedule_pass(int32_t n, HotRows& h, Columns& c) {
  int32_t* __restrict computed = h.computed.data();
  const int32_t* __restrict last_block = h.last_block.data();
  const int32_t* __restrict last_token = h.last_token.data();
  uint8_t* __restrict inflight = h.inflight.data();
  int32_t* __restrict scheduled = c.scheduled.data();
  int32_t* __restrict cached = c.cached.data();
  int32_t* __restrict context = c.context.data();
  int32_t* __restrict last_fill = c.last_fill.data();
  int32_t* __restrict input_tokens = c.input_tokens.data();
  int64_t* __restrict positions = c.positions.data();
  int64_t* __restrict slots = c.slots.data();
  // Column by column: GCC 12 vectorises each of these loops, not their fusion (it finds no
  // vector type for the mix of int32 and int64 stores).
  for (int32_t i = 0; i < n; ++i) {
    const int32_t s = computed[i];
    cached[i] = s;
    context[i] = s + 1;
    last_fill[i] = (s & (kBlockSize - 1)) + 1;
  }
  for (int32_t i = 0; i < n; ++i) positions[i] = computed[i];
  for (int32_t i = 0; i < n; ++i)
    slots[i] = int64_t{last_block[i]} * kBlockSize + (computed[i] & (kBlockSize - 1));
  for (int32_t i = 0; i < n; ++i) computed[i] += 1;
  std::copy_n(last_token, n, input_tokens);
  std::fill_n(scheduled, n, 1);
  std::fill_n(inflight, n, 1);
}

[[gnu::noinline]] void prefix_sums(int32_t n, Columns& c) {
  const int32_t* __restrict scheduled = c.scheduled.data();
  const int32_t* __restrict context = c.context.data();
  int32_t* __restrict cu_q = c.cu_q.data();
  int32_t* __restrict cu_k = c.cu_k.data();
  int32_t sum_q = 0, sum_k = 0;
  for (int32_t i = 0; i < n; ++i) {
    sum_q += scheduled[i];
    sum_k += context[i];
    cu_q[i + 1] = sum_q;
    cu_k[i + 1] = sum_k;
  }
}

// The plan's update pass: the sampled tokens taken, the rows with an event listed in `flagged`
// (returns how many).
[[gnu::noinline]] int32_t update_pass(int32_t n, const int32_t* __restrict sampled, HotRows& h,
                                      int32_t* __restrict flagged) {
  int32_t* __restrict last_token = h.last_token.data();
  int32_t* __restrict count = h.count.data();
  const int32_t* __restrict event_length = h.event_length.data();
  int32_t num_flagged = 0;
  for (int32_t i = 0; i < n; ++i) {
    const int32_t t = sampled[i];
    const int32_t k = count[i] + 1;
    last_token[i] = t;
    count[i] = k;
    flagged[num_flagged] = i;
    num_flagged += (k >= event_length[i]) | (t == kEos);
  }
  std::fill_n(h.inflight.data(), n, 0);
  return num_flagged;
}

void BM_PlannedSteadyPasses(benchmark::State& state) {
  const int32_t n = static_cast<int32_t>(state.range(0));
  const bool per_row_tokens = state.range(1) != 0;
  std::mt19937 rng(7);
  HotRows h;
  Columns c;
  for (auto* v : {&h.computed, &h.count, &h.last_token, &h.last_block, &h.covered,
                  &h.event_length, &c.scheduled, &c.cached, &c.context, &c.last_fill,
                  &c.input_tokens, &c.out_tokens})
    v->resize(n);
  c.cu_q.resize(n + 1);
  c.cu_k.resize(n + 1);
  c.out_offsets.resize(n + 1);
  h.inflight.resize(n);
  h.ids.resize(n);
  c.positions.resize(n);
  c.slots.resize(n);
  c.out_ids.resize(n);
  c.reasons.resize(n);
  h.tokens.resize(n);
  h.block_tokens.resize(static_cast<size_t>(n) * kBlockSize);
  int32_t next_block = 1;
  for (int32_t i = 0; i < n; ++i) {  // staggered lengths: one row in 16 crosses a block a step
    const int32_t len = 32 + static_cast<int32_t>(rng() % kBlockSize);
    h.tokens[i].reserve(4096);
    for (int32_t j = 0; j < len; ++j) {
      const int32_t t = 3 + static_cast<int32_t>(rng() % 30000);
      if (per_row_tokens && j >= len / kBlockSize * kBlockSize)
        h.block_tokens[static_cast<size_t>(i) * kBlockSize + j % kBlockSize] = t;
      else
        h.tokens[i].push_back(t);
      h.last_token[i] = t;
    }
    h.count[i] = len;
    h.computed[i] = len - 1;
    h.covered[i] = (len + kBlockSize - 1) / kBlockSize * kBlockSize;
    h.last_block[i] = next_block++;
    h.event_length[i] = (len / kBlockSize + 1) * kBlockSize;  // its block completes
    h.ids[i] = i;
  }
  std::vector<int32_t> sampled(n);
  for (auto& t : sampled) t = 3 + static_cast<int32_t>(rng() % 30000);
  std::vector<int32_t> flagged(n);
  uint64_t hash_sink = 0;
  int64_t steps = 0;
  for (auto _ : state) {
    // schedule: rows at the end of their blocks take one (the per-row path).
    for (int32_t i = 0; i < n; ++i) {
      if (h.computed[i] == h.covered[i]) {
        h.last_block[i] = next_block++;
        h.covered[i] += kBlockSize;
      }
    }
    schedule_pass(n, h, c);
    prefix_sums(n, c);
    benchmark::DoNotOptimize(c.slots.data());
    // update: one pass over the sampled column, flagging rows with an event.
    const int32_t num_flagged = update_pass(n, sampled.data(), h, flagged.data());
    std::copy_n(h.ids.data(), n, c.out_ids.data());
    std::copy_n(sampled.data(), n, c.out_tokens.data());
    std::iota(c.out_offsets.begin(), c.out_offsets.end(), 0);
    std::fill(c.reasons.begin(), c.reasons.end(), 0);
    if (per_row_tokens) {  // a column-like store: row i's slot of its block
      int32_t* __restrict block_tokens = h.block_tokens.data();
      for (int32_t i = 0; i < n; ++i)
        block_tokens[static_cast<size_t>(i) * kBlockSize + ((h.count[i] - 1) & (kBlockSize - 1))] =
            sampled[i];
    } else {
      for (int32_t i = 0; i < n; ++i) h.tokens[i].push_back(sampled[i]);  // the scatter
    }
    for (int32_t j = 0; j < num_flagged; ++j) {  // completed blocks: hash (publish left out)
      const int32_t i = flagged[j];
      if (h.count[i] < h.event_length[i]) continue;  // flagged for an EOS: no block completed
      std::vector<int32_t>& tk = h.tokens[i];
      if (per_row_tokens) {  // the block moves to the request's vector
        const int32_t* block = h.block_tokens.data() + static_cast<size_t>(i) * kBlockSize;
        tk.insert(tk.end(), block, block + kBlockSize);
      }
      hash_sink ^= atom_sched::block_hash(
          std::span<const int32_t>(tk.data() + h.event_length[i] - kBlockSize, kBlockSize),
          hash_sink);
      h.event_length[i] += kBlockSize;
    }
    benchmark::DoNotOptimize(c.out_ids.data());
    benchmark::DoNotOptimize(hash_sink);
    for (int32_t i = 0; i < n; ++i) sampled[i] = (sampled[i] * 1103515245 + 12345) & 0x7fff;
    if (++steps % 2048 == 0) {  // keep the token vectors within their reserve
      for (int32_t i = 0; i < n; ++i) {
        h.count[i] = 32 + (h.count[i] & (kBlockSize - 1));
        h.tokens[i].resize(per_row_tokens ? 32 : h.count[i]);
        h.computed[i] = h.count[i] - 1;
        h.covered[i] = (h.count[i] + kBlockSize - 1) / kBlockSize * kBlockSize;
        h.event_length[i] = (h.count[i] / kBlockSize + 1) * kBlockSize;
      }
    }
  }
  state.SetItemsProcessed(state.iterations() * n);
  state.counters["ns_per_request"] = benchmark::Counter(
      static_cast<double>(state.iterations() * n),
      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}
BENCHMARK(BM_PlannedSteadyPasses)
    ->ArgsProduct({{1024, 4096, 16384}, {0, 1}})
    ->Unit(benchmark::kMicrosecond);

}  // namespace
