// Parity driver: the real kernels (launch_prepare, launch_accept, launch_store_drafts), executed
// by the HIP-CPU back end (ATOM_SCHED_GPU=HIP_CPU), against the CPU references (hip/reference.cc)
// on random plans, step after step. Two worlds start equal: one is driven by the launchers, the
// other by the references, with the same plans and sampling inputs; after every launch every state
// and output buffer is compared whole, including canary words past the buffers' ends and past the
// step's padded sizes (each output is refilled with a per-step sentinel first).
//
// Plans come from a small scheduler model, packed by pack_plan as the builder does: admissions with
// prefix hits, chunked prefills, remote-prefill rows (a decode row on a fresh slot: kRowHostInput),
// decode rows with K = 0..8 and q = 1..K+1, finishes and slot reuse, rows in shuffled slot order;
// row counts 1, 31, 32, 33, 63, 64, 65, 1023, 1024, 1025, 4096, padded past the 1,024-row tile of
// apply_plan; greedy and probabilistic acceptance, drafts given to accept or stored later. Some
// steps carry one corrupted plan word, which must set the expected error bit (then both worlds are
// restored, as if that step had not happened). A clean step must set no error bit. One prepare in
// four is made of its two launches with a pause between them (launch order, see prepare_kernel).
//
// Usage: atom_sched_device_parity_wNN [--seed N] [--scale X]   (ATOM_SCHED_PARITY_SEED also sets
// the seed). Exit status 0 when every launch matched; the first mismatch is printed.
#include <hip/hip_runtime.h>  // hipDeviceSynchronize (HIP-CPU launchers already return done)

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "atom_sched_kernels.h"

namespace atom_sched::device {
namespace {

constexpr size_t kCanary = 67;        // words checked past every buffer's capacity
constexpr int32_t kMaxChunk = 24;      // tokens per prefill chunk
constexpr int32_t kStateSentinel = 0x5EED5EED;

int32_t cdiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

/// A buffer of `capacity` words followed by kCanary canary words.
template <typename T>
struct Buf {
  std::vector<T> v;
  size_t capacity = 0;
  void init(size_t cap, T fill) {
    capacity = cap;
    v.assign(cap + kCanary, fill);
  }
  T* data() { return v.data(); }
  void fill(T x) { std::fill(v.begin(), v.end(), x); }
};

/// Slot state and step outputs of one world (host memory: HIP-CPU's device memory).
struct World {
  Buf<int32_t> table, computed, last, drafts, errors;
  Buf<int32_t> input_ids, seq_lens, qsl, cu_k, out_table, logits, spec, meta, result;
  Buf<int64_t> positions, slot_mapping;
  SlotState state;
  StepInputs out;

  World(int32_t slots, int32_t width, int32_t k, int32_t block_size, int32_t max_rows,
        int32_t max_tokens) {
    table.init(static_cast<size_t>(slots) * width, kStateSentinel);
    computed.init(slots, kStateSentinel);
    last.init(slots, kStateSentinel);
    drafts.init(static_cast<size_t>(slots) * std::max(k, 1), kStateSentinel);
    errors.init(1, kStateSentinel);
    // Live prefixes start as a fresh builder's state: zeros.
    std::fill_n(table.data(), table.capacity, 0);
    std::fill_n(computed.data(), computed.capacity, 0);
    std::fill_n(last.data(), last.capacity, 0);
    std::fill_n(drafts.data(), drafts.capacity, 0);
    errors.v[0] = 0;
    input_ids.init(max_tokens, 0);
    positions.init(max_tokens, 0);
    slot_mapping.init(max_tokens, 0);
    seq_lens.init(max_rows, 0);
    qsl.init(max_rows + 1, 0);
    cu_k.init(max_rows + 1, 0);
    out_table.init(static_cast<size_t>(max_rows) * width, 0);
    logits.init(max_rows, 0);
    spec.init(static_cast<size_t>(max_rows) * (k + 1), 0);
    meta.init(kMetaWords, 0);
    result.init(result_words(max_rows, k), 0);
    state = {table.data(), computed.data(), last.data(), drafts.data(), errors.data(),
             slots,        width,           k,           block_size};
    out = {input_ids.data(), positions.data(), slot_mapping.data(), seq_lens.data(),
           qsl.data(),       cu_k.data(),      out_table.data(),    logits.data(),
           spec.data(),      meta.data()};
  }
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  void fill_outputs(int32_t s) {
    for (Buf<int32_t>* b : {&input_ids, &seq_lens, &qsl, &cu_k, &out_table, &logits, &spec, &meta})
      b->fill(s);
    positions.fill(s);
    slot_mapping.fill(s);
  }
  void fill_result(int32_t s) { result.fill(s); }

  struct Saved {
    std::vector<int32_t> table, computed, last, drafts, errors;
  };
  Saved save() const { return {table.v, computed.v, last.v, drafts.v, errors.v}; }
  void restore(const Saved& s) {
    table.v = s.table;
    computed.v = s.computed;
    last.v = s.last;
    drafts.v = s.drafts;
    errors.v = s.errors;
  }
};

/// Where the first mismatch was found.
struct Failure {
  bool failed = false;
  std::string what;
};

template <typename T>
bool same(const char* name, const Buf<T>& kernel, const Buf<T>& ref, size_t used, T sentinel,
          bool check_tail, Failure& f) {
  for (size_t i = 0; i < kernel.v.size(); ++i) {
    if (kernel.v[i] != ref.v[i]) {
      char m[256];
      std::snprintf(m, sizeof(m), "%s[%zu] (capacity %zu, used %zu): kernel %lld, reference %lld",
                    name, i, kernel.capacity, used, static_cast<long long>(kernel.v[i]),
                    static_cast<long long>(ref.v[i]));
      f.failed = true;
      f.what += std::string(f.what.empty() ? "" : "; ") + m;
      return false;
    }
  }
  if (check_tail) {
    for (size_t i = used; i < kernel.v.size(); ++i) {
      if (kernel.v[i] != sentinel) {
        char m[256];
        std::snprintf(m, sizeof(m), "%s[%zu]: written past the padded size %zu (both worlds: %lld)",
                      name, i, used, static_cast<long long>(kernel.v[i]));
        f.failed = true;
        f.what += std::string(f.what.empty() ? "" : "; ") + m;
        return false;
      }
    }
  }
  return true;
}

/// Compares the state buffers whole (their canary tails must still hold kStateSentinel). Every
/// buffer is compared (`&`, not `&&`), so a failure names each buffer that differs.
bool same_state(const World& a, const World& b, Failure& f) {
  return same("block_table", a.table, b.table, a.table.capacity, kStateSentinel, true, f) &
         same("computed", a.computed, b.computed, a.computed.capacity, kStateSentinel, true, f) &
         same("last_token", a.last, b.last, a.last.capacity, kStateSentinel, true, f) &
         same("drafts", a.drafts, b.drafts, a.drafts.capacity, kStateSentinel, true, f) &
         same("errors", a.errors, b.errors, 1, kStateSentinel, true, f);
}

bool same_outputs(const World& a, const World& b, int32_t prow, int32_t ptok, int32_t k,
                  int32_t s, Failure& f) {
  const size_t R = prow, T = ptok, W = a.state.width;
  return same("input_ids", a.input_ids, b.input_ids, T, s, true, f) &
         same<int64_t>("positions", a.positions, b.positions, T, s, true, f) &
         same<int64_t>("slot_mapping", a.slot_mapping, b.slot_mapping, T, s, true, f) &
         same("seq_lens", a.seq_lens, b.seq_lens, R, s, true, f) &
         same("query_start_loc", a.qsl, b.qsl, R + 1, s, true, f) &
         same("cu_seqlens_k", a.cu_k, b.cu_k, R + 1, s, true, f) &
         same("block_table(out)", a.out_table, b.out_table, R * W, s, true, f) &
         same("logits_indices", a.logits, b.logits, R, s, true, f) &
         same("spec_logits_indices", a.spec, b.spec, R * (k + 1), s, true, f) &
         same("meta", a.meta, b.meta, kMetaWords, s, true, f);
}

// ---- The scheduler model ------------------------------------------------------------------------

enum class Phase { kFree, kPrefill, kDecode };

struct SimSlot {
  Phase phase = Phase::kFree;
  int32_t prompt = 0;     // prompt length
  int32_t prefilled = 0;  // prompt tokens computed
  int32_t blocks = 0;     // table entries set
};

/// One row as the host describes it (the fields of PlanSource).
struct HostRow {
  int32_t slot = 0, q = 1, start = 0, new_block_start = 0;
  bool prefill = false, reset = false, emits = true;
  std::vector<int32_t> tokens, new_blocks;
};

struct Campaign {
  const char* name;
  int32_t slots, width, block_size, k;
  bool probabilistic;
  std::vector<int32_t> row_counts;
  int32_t steps;
};

struct Counters {
  int64_t launches = 0, steps = 0, rows = 0, corrupted = 0, host_input_rows = 0, hits = 0;
  int64_t resets = 0, chunks = 0, tile_crossings = 0;
};

class Driver {
 public:
  Driver(const Campaign& c, uint64_t seed, Counters& counters)
      : c_(c), rng_(seed), n_(counters) {
    max_n_ = *std::max_element(c.row_counts.begin(), c.row_counts.end());
    max_rows_ = max_n_ + 1100;  // padding can cross the next 1,024-row tile
    max_tokens_ = max_rows_ * std::max(kMaxChunk, c.k + 1) + 64;
    cap_ = c.width * c.block_size;
    kernel_ = std::make_unique<World>(c.slots, c.width, c.k, c.block_size, max_rows_, max_tokens_);
    ref_ = std::make_unique<World>(c.slots, c.width, c.k, c.block_size, max_rows_, max_tokens_);
    sim_.assign(c.slots, SimSlot{});
  }

  /// Runs the campaign; false (with `failure`) at the first mismatch.
  bool run(Failure& failure) {
    for (step_ = 0; step_ < c_.steps; ++step_) {
      if (!one_step(failure)) {
        char m[160];
        std::snprintf(m, sizeof(m), "campaign %s (K=%d, %s), step %d: ", c_.name, c_.k,
                      c_.probabilistic ? "probabilistic" : "greedy", step_);
        failure.what = m + failure.what;
        return false;
      }
    }
    return true;
  }

 private:
  int32_t uni(int32_t lo, int32_t hi) {  // inclusive
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng_);
  }
  bool chance(int32_t one_in) { return uni(0, one_in - 1) == 0; }

  void add_blocks(HostRow& r, SimSlot& s, int32_t want) {
    if (s.blocks >= want) return;
    r.new_block_start = s.blocks;
    for (; s.blocks < want; ++s.blocks) r.new_blocks.push_back(uni(1, 1 << 20));
  }

  HostRow admit(int32_t slot) {
    SimSlot& s = sim_[slot];
    s = SimSlot{};
    HostRow r;
    r.slot = slot;
    r.reset = true;
    ++n_.resets;
    const int32_t K = c_.k;
    if (chance(6)) {  // the first decode after a remote prefill: inputs from the host
      const int32_t len = uni(1, cap_ - (K + 1));
      r.q = uni(1, K + 1);
      r.start = len;
      for (int32_t j = 0; j < r.q; ++j) r.tokens.push_back(uni(10, 5000));
      add_blocks(r, s, cdiv(len + r.q, c_.block_size));
      s.phase = Phase::kDecode;
      s.prompt = s.prefilled = len;
      ++n_.host_input_rows;
      return r;
    }
    s.prompt = uni(1, cap_ - K - 2);
    const int32_t hits = uni(0, (s.prompt - 1) / c_.block_size);  // never the last block
    if (hits > 0) ++n_.hits;
    r.prefill = true;
    r.start = hits * c_.block_size;
    r.q = uni(1, std::min(s.prompt - r.start, kMaxChunk));
    if (chance(3)) r.q = std::min(s.prompt - r.start, kMaxChunk);
    add_blocks(r, s, cdiv(r.start + r.q, c_.block_size));
    for (int32_t j = 0; j < r.q; ++j) r.tokens.push_back(uni(10, 5000));
    s.prefilled = r.start + r.q;
    r.emits = s.prefilled == s.prompt;
    s.phase = r.emits ? Phase::kDecode : Phase::kPrefill;
    return r;
  }

  HostRow row_for(int32_t slot) {
    SimSlot& s = sim_[slot];
    const int32_t K = c_.k;
    if (s.phase == Phase::kFree) return admit(slot);
    if (s.phase == Phase::kPrefill) {
      HostRow r;
      r.slot = slot;
      r.prefill = true;
      r.start = s.prefilled;
      r.q = uni(1, std::min(s.prompt - r.start, kMaxChunk));
      add_blocks(r, s, cdiv(r.start + r.q, c_.block_size));
      for (int32_t j = 0; j < r.q; ++j) r.tokens.push_back(uni(10, 5000));
      s.prefilled += r.q;
      r.emits = s.prefilled == s.prompt;
      if (r.emits) s.phase = Phase::kDecode;
      ++n_.chunks;
      return r;
    }
    const int32_t computed = ref_->computed.v[slot];
    if (computed + K + 1 > cap_ || chance(25)) return admit(slot);  // finished: slot reused
    HostRow r;
    r.slot = slot;
    r.q = chance(3) ? uni(1, K + 1) : K + 1;
    add_blocks(r, s, cdiv(computed + r.q, c_.block_size));
    return r;
  }

  std::vector<int32_t> pack(const std::vector<HostRow>& rows) {
    const int32_t n = static_cast<int32_t>(rows.size());
    std::vector<int32_t> slots, q, cached, starts, offsets{0}, ids, tokens, cu{0};
    std::vector<uint8_t> prefill, reset, emits;
    for (const HostRow& r : rows) {
      slots.push_back(r.slot);
      q.push_back(r.q);
      cached.push_back(r.start);
      prefill.push_back(r.prefill);
      reset.push_back(r.reset);
      emits.push_back(r.emits);
      starts.push_back(r.new_block_start);
      ids.insert(ids.end(), r.new_blocks.begin(), r.new_blocks.end());
      offsets.push_back(static_cast<int32_t>(ids.size()));
      if (r.tokens.empty()) {
        tokens.insert(tokens.end(), r.q, -1);  // the host does not know decode inputs
      } else {
        tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
      }
      cu.push_back(cu.back() + r.q);
    }
    PlanSource src{n,          slots.data(),   q.data(),       cached.data(),
                   prefill.data(), reset.data(), emits.data(), starts.data(),
                   offsets.data(), ids.data(),   tokens.data(), cu.data()};
    const int64_t cap = plan_words(n, static_cast<int64_t>(ids.size()), cu.back());
    std::vector<int32_t> plan(cap + kCanary, kStateSentinel);
    int64_t words = 0;
    const Status st = pack_plan(src, plan.data(), cap, &words);
    if (!st.ok()) {
      std::fprintf(stderr, "pack_plan: %s\n", st.message);
      std::abort();
    }
    plan.resize(words + kCanary);
    return plan;
  }

  /// Corrupts one word of `plan`; returns the error bit it must set (0: nothing to corrupt).
  int32_t corrupt(std::vector<int32_t>& plan, int32_t prow, const std::vector<HostRow>& rows) {
    const int32_t n = plan[kPlanNumRows];
    int32_t* row_words = plan.data() + kPlanHeaderWords;
    int32_t* blocks = row_words + static_cast<int64_t>(kPlanRowWords) * n;
    switch (uni(0, 8)) {
      case 0:
        plan[kPlanMagicWord] ^= 1 << uni(0, 30);
        return kErrPlan;
      case 1:
        plan[kPlanNumRows] = chance(2) ? prow + uni(1, 40) : -uni(1, 5);
        return kErrPlan;
      case 2:
        plan[kPlanNumTokens] += chance(2) ? uni(1, 9) : -uni(1, 9);
        return kErrPlan;
      case 3: {
        const int32_t r = uni(0, n - 1);
        row_words[kPlanRowWords * r] = chance(2) ? c_.slots + uni(0, 1000) : -uni(1, 1000);
        return kErrSlot;
      }
      case 4: {  // a decode row wider than K + 1
        for (int32_t r = 0; r < n; ++r) {
          if (rows[r].prefill || rows[r].reset) continue;
          row_words[kPlanRowWords * r + 1] += c_.k + 1;
          return kErrDecodeWidth;
        }
        return 0;
      }
      case 5: {
        const int32_t nb = plan[kPlanNumBlockUpdates];
        if (nb == 0) return 0;
        int32_t* w = blocks + static_cast<int64_t>(kPlanBlockWords) * uni(0, nb - 1);
        if (chance(2)) {
          w[1] = chance(2) ? c_.width + uni(0, 50) : -uni(1, 50);
        } else {
          w[0] = chance(2) ? c_.slots + uni(0, 50) : -uni(1, 50);
        }
        return kErrBlockUpdate;
      }
      case 6: {  // a row's tokens outside the upload
        for (int32_t r = 0; r < n; ++r) {
          if (!rows[r].prefill && !rows[r].reset) continue;
          row_words[kPlanRowWords * r + 3] =
              chance(2) ? plan[kPlanNumHostTokens] - rows[r].q + uni(1, 30) : -uni(1, 30);
          return kErrHostToken;
        }
        return 0;
      }
      case 7:  // counts that reach past the plan buffer (SlotState::plan_words)
        plan[chance(2) ? kPlanNumBlockUpdates : kPlanNumHostTokens] += uni(1, 1 << 30);
        return kErrPlan;
      default:
        plan[kPlanNumBlockUpdates] = -uni(1, 100);
        return kErrPlan;
    }
  }

  bool check(const char* phase, bool outputs, int32_t prow, int32_t ptok, int32_t sentinel,
             Failure& f) {
    if (hipDeviceSynchronize() != hipSuccess) {
      f = {true, std::string(phase) + ": hipDeviceSynchronize failed"};
      return false;
    }
    const bool state_ok = same_state(*kernel_, *ref_, f);
    const bool outputs_ok = !outputs || same_outputs(*kernel_, *ref_, prow, ptok, c_.k, sentinel, f);
    if (!state_ok || !outputs_ok) {
      f.what = std::string(phase) + " (padded rows " + std::to_string(prow) + ", tokens " +
               std::to_string(ptok) + "): " + f.what;
      return false;
    }
    return true;
  }

  /// prepare's two launches; in one step in four through the two launchers with a pause between
  /// them, as a loaded machine makes: HIP-CPU's null stream ran build_inputs before or during
  /// apply_plan then (`errors: kernel 40`, docs/device.md), so the launches must keep order.
  Status prepare_kernel(const int32_t* plan, int32_t prow, int32_t ptok) {
    if (!chance(4)) return launch_prepare(plan, kernel_->state, kernel_->out, prow, ptok, nullptr);
    if (Status s = launch_apply_plan(plan, kernel_->state, kernel_->out, prow, ptok, nullptr);
        !s.ok())
      return s;
    std::this_thread::sleep_for(std::chrono::microseconds(uni(50, 400)));
    return launch_build_inputs(plan, kernel_->state, kernel_->out, prow, ptok, nullptr);
  }

  static bool launched(const char* what, const Status& a, const Status& b, Failure& f) {
    if (a.ok() && b.ok()) return true;
    f = {true, std::string(what) + ": kernel status '" + a.message + "', reference status '" +
                   b.message + "'"};
    return false;
  }

  bool one_step(Failure& f) {
    const int32_t K = c_.k;
    // The rows: n distinct slots in random order.
    const int32_t n = c_.row_counts[uni(0, static_cast<int32_t>(c_.row_counts.size()) - 1)];
    std::vector<int32_t> order(c_.slots);
    for (int32_t i = 0; i < c_.slots; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng_);
    const std::vector<SimSlot> sim_before = sim_;
    std::vector<HostRow> rows;
    rows.reserve(n);
    for (int32_t i = 0; i < n; ++i) rows.push_back(row_for(order[i]));
    std::vector<int32_t> plan = pack(rows);
    int32_t ntok = 0;
    for (const HostRow& r : rows) ntok += r.q;
    int32_t prow = n, ptok = ntok;
    switch (uni(0, 3)) {
      case 0: break;
      case 1: prow += uni(1, 8); ptok += uni(1, 40); break;
      case 2: prow = uni(n, max_rows_); ptok += uni(0, 200); break;  // often past the next tile
      default: prow += uni(0, 2); ptok += uni(0, 3); break;
    }
    ptok = std::min(ptok, max_tokens_);
    if (n <= 1024 && prow > 1024) ++n_.tile_crossings;
    const bool corrupted = chance(10);
    int32_t want_error = 0;
    if (corrupted) want_error = corrupt(plan, prow, rows);
    const std::vector<int32_t> plan_copy = plan;
    // The launches may read the packed words, never the canary after them.
    kernel_->state.plan_words = ref_->state.plan_words =
        static_cast<int64_t>(plan.size() - kCanary);
    World::Saved saved_kernel, saved_ref;
    if (corrupted) {
      saved_kernel = kernel_->save();
      saved_ref = ref_->save();
    }

    // prepare
    const int32_t sentinel = static_cast<int32_t>(0x7A000000u + static_cast<uint32_t>(step_));
    kernel_->fill_outputs(sentinel);
    ref_->fill_outputs(sentinel);
    if (!launched("prepare", prepare_kernel(plan.data(), prow, ptok),
                  prepare_ref(plan.data(), ref_->state, ref_->out, prow, ptok, nullptr), f))
      return false;
    n_.launches += 2;
    if (!check("prepare", true, prow, ptok, sentinel, f)) return false;
    if (!corrupted && ref_->errors.v[0] != 0) {
      f = {true, "a clean plan set error bits " + std::to_string(ref_->errors.v[0])};
      return false;
    }

    // Sampling inputs for the rows, from the drafts now in the slots.
    const int32_t rn = std::max(prow, n);
    std::vector<int32_t> target(static_cast<size_t>(rn) * (K + 1));
    std::vector<int32_t> next(static_cast<size_t>(rn) * std::max(K, 1));
    std::vector<float> tp(static_cast<size_t>(rn) * std::max(K, 1)), dp = tp, un = tp;
    for (int32_t i = 0; i < rn; ++i) {
      const int32_t slot = i < n ? rows[i].slot : 0;
      const int32_t a = uni(1, K + 1);  // tokens this row should accept
      for (int32_t j = 0; j <= K; ++j) {
        int32_t t = uni(10, 5000);
        if (j < a - 1 && !c_.probabilistic) t = ref_->drafts.v[static_cast<size_t>(slot) * K + j];
        target[static_cast<size_t>(i) * (K + 1) + j] = t;
      }
      // Sometimes fewer than K drafts (a prefix, padded with -1): the next step's rows read the
      // missing ones padded, and accept never accepts them.
      const int32_t proposed = chance(3) ? uni(0, K) : K;
      for (int32_t j = 0; j < K; ++j) {
        const size_t at = static_cast<size_t>(i) * K + j;
        next[at] = j < proposed ? uni(10, 5000) : -1;
        dp[at] = static_cast<float>(uni(1, 100)) / 100.0f;
        un[at] = static_cast<float>(uni(0, 99)) / 100.0f;
        tp[at] = j < a - 1 ? un[at] * dp[at] + 0.01f : un[at] * dp[at] * 0.5f;
      }
    }
    AcceptInputs in{target.data(), next.data(), nullptr, nullptr, nullptr};
    if (c_.probabilistic) {
      in.target_probs = tp.data();
      in.draft_probs = dp.data();
      in.uniform = un.data();
    }
    const bool later = K > 0 && chance(2);  // drafts through store_drafts
    if (later) in.next_drafts = nullptr;

    kernel_->fill_result(sentinel);
    ref_->fill_result(sentinel);
    if (!launched("accept", launch_accept(plan.data(), kernel_->state, in,
                                          kernel_->result.data(), prow, nullptr),
                  accept_ref(plan.data(), ref_->state, in, ref_->result.data(), prow, nullptr), f))
      return false;
    ++n_.launches;
    if (!check("accept", false, prow, ptok, sentinel, f)) return false;
    const size_t used = result_words(std::clamp(plan[kPlanNumRows], 0, prow), K);
    if (!same("result", kernel_->result, ref_->result, used, sentinel, true, f)) {
      f.what = "accept: " + f.what;
      return false;
    }
    if (later) {
      if (!launched("store_drafts",
                    launch_store_drafts(plan.data(), kernel_->state, next.data(),
                                        kernel_->result.data(), prow, nullptr),
                    store_drafts_ref(plan.data(), ref_->state, next.data(), ref_->result.data(),
                                     prow, nullptr),
                    f))
        return false;
      ++n_.launches;
      if (!check("store_drafts", false, prow, ptok, sentinel, f)) return false;
      if (!same("result", kernel_->result, ref_->result, used, sentinel, true, f)) {
        f.what = "store_drafts: " + f.what;
        return false;
      }
    }
    if (plan != plan_copy) {
      f = {true, "a kernel wrote into the plan"};
      return false;
    }

    if (corrupted) {
      const int32_t got = kernel_->errors.v[0];
      if (want_error != 0 && (got & want_error) != want_error) {
        f = {true, "corrupted plan: error bits " + std::to_string(got) + ", want bit " +
                       std::to_string(want_error)};
        return false;
      }
      if (want_error != 0 && kernel_->result.v[1] != got) {
        f = {true, "corrupted plan: the result header does not carry the error bits"};
        return false;
      }
      if (want_error != 0) ++n_.corrupted;
      kernel_->restore(saved_kernel);
      ref_->restore(saved_ref);
      sim_ = sim_before;
    } else {
      if (ref_->result.v[1] != 0) {
        f = {true, "a clean step reported errors in the result"};
        return false;
      }
      ++n_.steps;
      n_.rows += n;
    }
    return true;
  }

  Campaign c_;
  std::mt19937_64 rng_;
  Counters& n_;
  int32_t max_n_ = 0, max_rows_ = 0, max_tokens_ = 0, cap_ = 0, step_ = 0;
  std::unique_ptr<World> kernel_, ref_;
  std::vector<SimSlot> sim_;
};

std::vector<Campaign> campaigns(double scale) {
  auto steps = [&](int32_t s) { return std::max(1, static_cast<int32_t>(s * scale)); };
  const std::vector<int32_t> small = {1, 31, 32, 33, 63, 64, 65};
  const std::vector<int32_t> large = {1023, 1024, 1025, 4096, 1, 64};
  std::vector<Campaign> v;
  const int32_t block_sizes[] = {1, 4, 16};
  for (int32_t k = 0; k <= kMaxSpecTokens; ++k) {
    const int32_t bs = block_sizes[k % 3];
    const int32_t width = bs == 1 ? 40 : (bs == 4 ? 10 : 4);  // 40 to 64 positions
    v.push_back({"small", 80, width, bs, k, false, small, steps(60)});
    if (k > 0) v.push_back({"small", 72, width + 2, bs, k, true, small, steps(60)});
  }
  for (int32_t k : {0, 1, 3, 8}) {
    v.push_back({"large", 4160, 12, 4, k, k % 2 == 1, large, steps(8)});
  }
  return v;
}

}  // namespace
}  // namespace atom_sched::device

int main(int argc, char** argv) {
  using namespace atom_sched::device;
  uint64_t seed = 20261201;
  double scale = 1.0;
  if (const char* e = std::getenv("ATOM_SCHED_PARITY_SEED")) seed = std::strtoull(e, nullptr, 10);
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--seed") == 0) {
      seed = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (std::strcmp(argv[i], "--scale") == 0) {
      scale = std::strtod(argv[i + 1], nullptr);
    } else {
      std::fprintf(stderr, "usage: %s [--seed N] [--scale X]\n", argv[0]);
      return 2;
    }
  }
  std::printf("device parity: back end %s, warp size %d, seed %" PRIu64 ", scale %.2f\n",
              backend_name(), warp_size(), seed, scale);
  if (device_count() < 1) {
    std::printf("no device\n");
    return 1;
  }
  const auto t0 = std::chrono::steady_clock::now();
  Counters n;
  uint64_t i = 0;
  for (const Campaign& c : campaigns(scale)) {
    Driver d(c, seed * 1000003u + i++, n);
    Failure f;
    if (!d.run(f)) {
      std::printf("MISMATCH (seed %" PRIu64 "): %s\n", seed, f.what.c_str());
      return 1;
    }
  }
  const double s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("ok: %" PRId64 " launches equal to the references (%" PRId64 " clean steps, %" PRId64
              " rows; %" PRId64 " corrupted plans flagged; %" PRId64 " resets, %" PRId64
              " prefix hits, %" PRId64 " prefill chunks, %" PRId64 " remote-prefill rows, %" PRId64
              " paddings past a 1,024-row tile) in %.1f s\n",
              n.launches, n.steps, n.rows, n.corrupted, n.resets, n.hits, n.chunks,
              n.host_input_rows, n.tile_crossings, s);
  return 0;
}
