// Steady-state decode must not touch the heap (DESIGN.md section 8): every buffer is sized when
// the scheduler is built or a request is added. This suite counts calls to the global operator
// new while a window of decode steps runs.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <new>
#include <random>
#include <vector>

#include "atom_sched/scheduler.h"

// The replacement operator new below allocates with malloc, so its operator delete frees with
// free; GCC cannot see that they pair up and warns at every inlined delete.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"

namespace {
std::atomic<bool> g_counting{false};
std::atomic<long> g_allocations{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_counting.load(std::memory_order_relaxed)) g_allocations.fetch_add(1);
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](std::size_t n) { return operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }

namespace atom_sched {
namespace {

struct Window {
  Window() {
    g_allocations = 0;
    g_counting = true;
  }
  ~Window() { g_counting = false; }
  long count() const { return g_allocations.load(); }
};

// Runs `steps` decode steps on `num_requests` prefilled requests and returns the number of heap
// allocations made during the last `measured` of them.
long allocations_in_decode(int32_t k, int32_t num_requests, int steps, int measured,
                           BatchPolicy policy = BatchPolicy::kAtom) {
  SchedulerConfig cfg;
  cfg.num_blocks = 4096;
  cfg.block_size = 16;
  cfg.max_num_seqs = num_requests;
  cfg.max_num_batched_tokens = 8192;
  cfg.max_model_len = 4096;
  cfg.num_speculative_tokens = k;
  cfg.eos_token_id = 0;
  cfg.policy = policy;
  Scheduler s(cfg);
  SamplingParams p;
  p.max_tokens = 100000;
  std::vector<int32_t> prompt(40, 7);
  for (int32_t i = 0; i < num_requests; ++i) {
    prompt[0] = 100 + i;  // distinct prompts
    s.add_request(i, prompt, p);
  }
  std::mt19937 rng(1);
  std::vector<int32_t> sampled, accepted, drafts;
  long allocations = 0;
  for (int step = 0; step < steps; ++step) {
    const bool measure = step >= steps - measured;
    const long before = g_allocations.load();
    g_counting = measure;
    const Batch* b = s.schedule();
    g_counting = false;
    EXPECT_NE(b, nullptr);
    // The outputs stand for the engine's buffers: prepared outside the counted window.
    const int32_t rows = b->num_rows;
    sampled.assign(static_cast<size_t>(rows) * (k + 1), 5);
    accepted.assign(rows, 1);
    drafts.assign(static_cast<size_t>(rows) * k, 6);
    if (!b->is_prefill)
      for (auto& a : accepted) a = 1 + static_cast<int32_t>(rng() % (k + 1));
    ModelOutputs out;
    out.sampled_token_ids = sampled;
    if (k > 0) out.num_accepted = accepted;
    out.draft_token_ids = drafts;
    g_counting = measure;
    s.update(b->id, out);
    g_counting = false;
    allocations += g_allocations.load() - before;
  }
  return allocations;
}

TEST(NoAllocTest, SteadyStateDecodeAllocatesNothing) {
  EXPECT_EQ(allocations_in_decode(/*k=*/0, /*num_requests=*/64, /*steps=*/200, /*measured=*/100),
            0);
}

TEST(NoAllocTest, SteadyStateSpeculativeDecodeAllocatesNothing) {
  EXPECT_EQ(allocations_in_decode(/*k=*/3, /*num_requests=*/64, /*steps=*/200, /*measured=*/100),
            0);
}

TEST(NoAllocTest, SteadyStateDecodeUnderTheMixedPolicyAllocatesNothing) {
  for (int32_t k : {0, 3})
    EXPECT_EQ(allocations_in_decode(k, /*num_requests=*/64, /*steps=*/200, /*measured=*/100,
                                    BatchPolicy::kMixed),
              0)
        << "K = " << k;
}

TEST(NoAllocTest, CounterSeesAllocations) {
  // The harness itself must be able to see an allocation, or the tests above prove nothing.
  Window w;
  auto* v = new std::vector<int>(100);
  const long seen = w.count();
  delete v;
  EXPECT_GE(seen, 2);
}

}  // namespace
}  // namespace atom_sched
