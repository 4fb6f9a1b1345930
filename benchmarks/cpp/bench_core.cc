// Google Benchmark of atom_sched's C++ hot paths (no Python): the steady-state decode step,
// speculative (MTP) decode, prompt admission with prefix sharing, and the block pool primitives.
//
//   make build-cpp && build/cpp/atom_sched_cpp_bench --benchmark_min_time=0.2
//
// Debian's Google Benchmark 1.7 takes --benchmark_min_time=<seconds> without an "s" suffix.
// See benchmarks/README.md for what each benchmark measures and for the DESIGN.md section 8 budgets.
//
// Times: Google Benchmark reports wall ("Time") and CPU ("CPU") time per iteration; rates and
// ns_per_request use CPU time, which stays meaningful when other jobs share the machine.
// Counters:
//   items_per_second  requests (decode rows) per second for the decode benchmarks, blocks per
//                     second for the pool benchmarks, prompts per second for admission;
//   ns_per_request    1 / items_per_second, in seconds (shown with an SI prefix, e.g. "18.2n");
//   allocs_per_step   global operator new calls per timed iteration (this file replaces operator
//                     new to count them). The steady-state decode budget is 0.
//
// Every benchmark checks that it did real work (rows per step, cache hits, ...) and aborts with
// SkipWithError otherwise, so a regression cannot turn a benchmark into a no-op.
#include <benchmark/benchmark.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "atom_sched/block_pool.h"
#include "atom_sched/scheduler.h"
#include "atom_sched/xxhash64.h"

// ---- Allocation counting -------------------------------------------------------------------------
#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 sees malloc'ed memory released by the replaced operator delete (free) after inlining.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
// Replaces the global allocation functions so that a benchmark can report heap allocations per
// step. Relaxed atomics: a counter increment costs about a nanosecond and only allocations pay it.
namespace {
std::atomic<uint64_t> g_allocs{0};
}  // namespace

void* operator new(std::size_t n) {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return ::operator new(n); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  g_allocs.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(n == 0 ? 1 : n);
}
void* operator new[](std::size_t n, const std::nothrow_t& t) noexcept {
  return ::operator new(n, t);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace {

using atom_sched::Batch;
using atom_sched::BlockPool;
using atom_sched::ModelOutputs;
using atom_sched::SamplingParams;
using atom_sched::Scheduler;
using atom_sched::SchedulerConfig;

constexpr int32_t kBlockSize = 16;
constexpr int32_t kPromptLen = 64;

std::vector<int32_t> random_tokens(std::mt19937& rng, int32_t n) {
  std::uniform_int_distribution<int32_t> dist(3, 31999);
  std::vector<int32_t> t(n);
  for (auto& x : t) x = dist(rng);
  return t;
}

// ---- Steady-state decode ------------------------------------------------------------------------
// N requests with 64-token prompts, all prefilled before timing starts, max_tokens large enough
// that none finishes, a pool that never preempts. The scheduler is rebuilt (timing paused) every
// `steps_per_epoch` steps so the run length does not depend on the iteration count that Google
// Benchmark chooses.
class DecodeFixture {
 public:
  DecodeFixture(int32_t n, int32_t k, int32_t steps_per_epoch)
      : n_(n), k_(k), steps_per_epoch_(steps_per_epoch), rng_(1234) {
    const int32_t w = k + 1;
    sampled_.assign(static_cast<size_t>(n) * w, 0);
    std::uniform_int_distribution<int32_t> tok(3, 31999);
    for (auto& t : sampled_) t = tok(rng_);
    if (k > 0) {
      drafts_.assign(static_cast<size_t>(n) * k, 0);
      for (auto& t : drafts_) t = tok(rng_);
      // A ring of pre-drawn accepted counts, uniform in 1..K+1 (the RNG stays out of the loop).
      std::uniform_int_distribution<int32_t> acc(1, w);
      accepted_.resize(kAcceptedRing);
      for (auto& row : accepted_) {
        row.resize(n);
        for (auto& a : row) a = acc(rng_);
      }
    }
    rebuild();
  }

  // Builds a fresh scheduler with all N prompts prefilled. Returns false on a setup failure.
  bool rebuild() {
    // Positions grow by at most K+1 per step; leave room for the whole epoch plus the prompt.
    const int32_t max_len = kPromptLen + (steps_per_epoch_ + 2) * (k_ + 1) + 2 * kBlockSize;
    SchedulerConfig cfg;
    cfg.block_size = kBlockSize;
    cfg.max_num_seqs = n_;
    cfg.max_num_batched_tokens = std::max(n_ * (k_ + 1), 8192);
    cfg.max_model_len = max_len;
    cfg.num_speculative_tokens = k_;
    cfg.num_blocks = n_ * (cfg.max_blocks_per_request() + 1);
    sched_.reset();
    sched_ = std::make_unique<Scheduler>(cfg);
    SamplingParams sp;
    sp.max_tokens = max_len - kPromptLen;
    sp.ignore_eos = true;
    for (int32_t i = 0; i < n_; ++i) {
      auto prompt = random_tokens(rng_, kPromptLen);
      sched_->add_request(i, prompt, sp);
    }
    // Prefill everything. Outputs are [rows, K+1] for prefill batches too; only column 0 counts.
    std::vector<int32_t> one(static_cast<size_t>(n_) * (k_ + 1), 7);
    for (;;) {
      const Batch* b = sched_->schedule();
      if (b == nullptr) return false;
      if (!b->is_prefill) {  // the first decode step: finish it so the next step is steady state
        step_outputs(*b);
        break;
      }
      ModelOutputs out;
      out.sampled_token_ids = std::span<const int32_t>(one.data(), size_t(b->num_rows) * (k_ + 1));
      if (k_ > 0) {
        out.draft_token_ids = std::span<const int32_t>(drafts_.data(), size_t(b->num_rows) * k_);
      }
      sched_->update(b->id, out);
    }
    steps_in_epoch_ = 0;
    return sched_->num_running() == n_;
  }

  // One decode step: schedule + update. Returns the batch's row count (so the caller can check).
  int32_t step() {
    const Batch* b = sched_->schedule();
    if (b == nullptr || b->is_prefill) return -1;
    step_outputs(*b);
    ++steps_in_epoch_;
    return b->num_rows;
  }

  [[nodiscard]] bool epoch_over() const { return steps_in_epoch_ >= steps_per_epoch_; }
  [[nodiscard]] const Scheduler& scheduler() const { return *sched_; }

 private:
  static constexpr size_t kAcceptedRing = 64;

  void step_outputs(const Batch& b) {
    ModelOutputs out;
    out.sampled_token_ids =
        std::span<const int32_t>(sampled_.data(), size_t(b.num_rows) * (k_ + 1));
    if (k_ > 0) {
      out.num_accepted = std::span<const int32_t>(accepted_[ring_].data(), b.num_rows);
      out.draft_token_ids = std::span<const int32_t>(drafts_.data(), size_t(b.num_rows) * k_);
      ring_ = (ring_ + 1) % kAcceptedRing;
    }
    const auto& so = sched_->update(b.id, out);
    benchmark::DoNotOptimize(so.new_tokens.data());
  }

  int32_t n_, k_, steps_per_epoch_;
  std::mt19937 rng_;
  std::unique_ptr<Scheduler> sched_;
  std::vector<int32_t> sampled_, drafts_;
  std::vector<std::vector<int32_t>> accepted_;
  size_t ring_ = 0;
  int32_t steps_in_epoch_ = 0;
};

void run_decode(benchmark::State& state, int32_t k) {
  const int32_t n = static_cast<int32_t>(state.range(0));
  // About 2 M row-steps per epoch: short enough to keep the pool small, long enough that the
  // paused rebuilds are rare.
  const int32_t steps_per_epoch = std::max(64, 2'000'000 / n / (k + 1));
  DecodeFixture fx(n, k, steps_per_epoch);
  if (fx.scheduler().num_running() != n) {
    state.SkipWithError("setup: not every request is running");
    return;
  }
  uint64_t allocs_excluded = 0;
  int64_t rows = 0;
  const uint64_t allocs0 = g_allocs.load(std::memory_order_relaxed);
  for (auto _ : state) {
    const int32_t r = fx.step();
    if (r != n) {
      state.SkipWithError(("a decode step had " + std::to_string(r) + " rows, expected " +
                           std::to_string(n)).c_str());
      break;
    }
    rows += r;
    if (fx.epoch_over()) {
      state.PauseTiming();
      const uint64_t a = g_allocs.load(std::memory_order_relaxed);
      const bool ok = fx.rebuild();
      allocs_excluded += g_allocs.load(std::memory_order_relaxed) - a;
      state.ResumeTiming();
      if (!ok) {
        state.SkipWithError("rebuild: not every request is running");
        break;
      }
    }
  }
  const uint64_t allocs = g_allocs.load(std::memory_order_relaxed) - allocs0 - allocs_excluded;
  state.SetItemsProcessed(rows);
  state.SetComplexityN(n);
  state.counters["rows"] = n;
  state.counters["ns_per_request"] =
      benchmark::Counter(static_cast<double>(rows), benchmark::Counter::kIsRate |
                                                        benchmark::Counter::kInvert);
  state.counters["allocs_per_step"] = benchmark::Counter(
      static_cast<double>(allocs), benchmark::Counter::kAvgIterations);
}

void BM_DecodeStep(benchmark::State& state) { run_decode(state, 0); }
BENCHMARK(BM_DecodeStep)
    ->Arg(64)
    ->Arg(256)
    ->Arg(1024)
    ->Arg(4096)
    ->Arg(16384)
    ->Unit(benchmark::kMicrosecond);

void BM_DecodeStepMTP3(benchmark::State& state) { run_decode(state, 3); }
BENCHMARK(BM_DecodeStepMTP3)->Arg(256)->Arg(1024)->Unit(benchmark::kMicrosecond);

// ---- Admission with prefix sharing --------------------------------------------------------------
// 256 prompts of 1,024 tokens, every other one sharing a 768-token prefix (48 blocks), chunked
// prefill with a 16,384-token budget. Timed: every schedule() + update() until each prompt has
// emitted its first token (the C++ counterpart of the Python "admission" workload).
void BM_Admission(benchmark::State& state) {
  constexpr int32_t kPrompts = 256, kLen = 1024, kShared = 768;
  const int32_t budget = static_cast<int32_t>(state.range(0));
  std::mt19937 rng(99);
  const auto prefix = random_tokens(rng, kShared);
  std::vector<std::vector<int32_t>> prompts(kPrompts);
  for (int32_t i = 0; i < kPrompts; ++i) {
    if (i % 2 == 0) {
      prompts[i] = prefix;
      auto tail = random_tokens(rng, kLen - kShared);
      prompts[i].insert(prompts[i].end(), tail.begin(), tail.end());
    } else {
      prompts[i] = random_tokens(rng, kLen);
    }
  }
  SchedulerConfig cfg;
  cfg.block_size = kBlockSize;
  cfg.max_num_seqs = kPrompts;
  cfg.max_num_batched_tokens = budget;
  cfg.max_model_len = 2048;
  cfg.num_blocks = kPrompts * (kLen / kBlockSize) + 1024;
  SamplingParams sp;
  sp.max_tokens = 16;
  sp.ignore_eos = true;
  std::vector<int32_t> sampled(static_cast<size_t>(kPrompts), 7);
  int64_t calls = 0, hit_tokens = 0;
  for (auto _ : state) {
    state.PauseTiming();
    auto sched = std::make_unique<Scheduler>(cfg);
    for (int32_t i = 0; i < kPrompts; ++i) sched->add_request(i, prompts[i], sp);
    state.ResumeTiming();
    int32_t emitted = 0;
    while (emitted < kPrompts) {
      const Batch* b = sched->schedule();
      if (b == nullptr || !b->is_prefill) break;
      ModelOutputs out;
      out.sampled_token_ids = std::span<const int32_t>(sampled.data(), b->num_rows);
      emitted += sched->update(b->id, out).size();
      ++calls;
    }
    state.PauseTiming();
    if (emitted != kPrompts) {
      state.SkipWithError("not every prompt was prefilled");
      break;
    }
    hit_tokens += sched->stats().prefix_hit_tokens;
    sched.reset();
    state.ResumeTiming();
  }
  const double iters = static_cast<double>(state.iterations());
  if (iters > 0 && hit_tokens == 0) state.SkipWithError("no prefix-cache hits");
  state.SetItemsProcessed(state.iterations() * kPrompts);
  state.counters["schedule_calls"] = iters > 0 ? calls / iters : 0;
  state.counters["hit_tokens"] = iters > 0 ? hit_tokens / iters : 0;
}
BENCHMARK(BM_Admission)->Arg(8192)->Arg(16384)->Unit(benchmark::kMicrosecond);

// ---- Block pool ---------------------------------------------------------------------------------
// grow() a table to range(0) blocks, then free() it (the blocks return to the LRU free list).
void BM_BlockPoolGrowFree(benchmark::State& state) {
  const int32_t blocks = static_cast<int32_t>(state.range(0));
  BlockPool pool(65536, kBlockSize, /*enable_prefix_caching=*/true, /*enable_events=*/false);
  std::vector<int32_t> table;
  table.reserve(blocks);
  for (auto _ : state) {
    if (!pool.grow(table, blocks)) {
      state.SkipWithError("grow failed");
      break;
    }
    benchmark::DoNotOptimize(table.data());
    pool.free(table);
    table.clear();
  }
  if (pool.num_free_blocks() != pool.num_usable_blocks()) state.SkipWithError("blocks leaked");
  state.SetItemsProcessed(state.iterations() * blocks);
}
BENCHMARK(BM_BlockPoolGrowFree)->Arg(1)->Arg(16)->Arg(64);

// can_allocate() for a 1,024-token request (64 blocks) whose first range(0) blocks are cached:
// hash lookups plus a token comparison per hit. items = blocks probed.
void BM_CanAllocateHits(benchmark::State& state) {
  const int32_t cached = static_cast<int32_t>(state.range(0));
  constexpr int32_t kLen = 1024, kBlocks = kLen / kBlockSize;
  std::mt19937 rng(7);
  const auto tokens = random_tokens(rng, kLen);
  std::vector<uint64_t> hashes(kBlocks);
  for (int32_t i = 0; i < kBlocks; ++i) {
    hashes[i] = atom_sched::block_hash(
        std::span<const int32_t>(tokens.data() + size_t(i) * kBlockSize, kBlockSize),
        i > 0 ? std::optional<uint64_t>(hashes[i - 1]) : std::nullopt);
  }
  BlockPool pool(4096, kBlockSize, /*enable_prefix_caching=*/true, /*enable_events=*/false);
  std::vector<int32_t> table;
  pool.allocate(hashes, 0, kLen, table);
  pool.publish(table, hashes, tokens, 0, cached);  // blocks [0, cached) are in the cache, live
  int32_t hits = 0;
  for (auto _ : state) {
    hits = pool.can_allocate(hashes, tokens, kLen, /*needs_state_slot=*/false);
    benchmark::DoNotOptimize(hits);
  }
  const int32_t expected = std::min(cached, kBlocks - 1);
  if (hits != expected)
    state.SkipWithError(("can_allocate found " + std::to_string(hits) + " hits, expected " +
                         std::to_string(expected)).c_str());
  state.SetItemsProcessed(state.iterations() * std::max(hits, 1));
  state.counters["hits"] = hits;
}
BENCHMARK(BM_CanAllocateHits)->Arg(0)->Arg(48)->Arg(63);

// The chained xxHash64 of one full 16-token block with a parent hash (ATOM's block hash).
void BM_BlockHash16(benchmark::State& state) {
  std::mt19937 rng(3);
  const auto tokens = random_tokens(rng, kBlockSize);
  uint64_t parent = 0x9e3779b97f4a7c15ull;
  for (auto _ : state) {
    parent = atom_sched::block_hash(tokens, parent);  // chained: each call depends on the last
    benchmark::DoNotOptimize(parent);
  }
  state.SetItemsProcessed(state.iterations());
  state.SetBytesProcessed(state.iterations() * (8 + kBlockSize * 8));
}
BENCHMARK(BM_BlockHash16);

}  // namespace
