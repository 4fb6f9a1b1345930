// The CPU references of the device kernels (hip/atom_sched_kernels.h), checked against an
// independent model of the per-slot state (a "shadow": plain vectors per slot, updated by the
// formulas of DESIGN.md section 6 and spec section 6.3), over random steps: admissions with
// prefix hits, chunked prefill, decode with K = 0..8, rows in any order, mixed prefill and decode
// rows, padding, finishes and slot reuse. Also the plan layout, the error bits of bad plans and
// the launchers' statuses in this build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "atom_sched_kernels.h"

// Rows are written with designated initializers that leave the other fields at their defaults.
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"

namespace atom_sched::device {
namespace {

int32_t cdiv(int32_t a, int32_t b) { return (a + b - 1) / b; }

/// Device state and output buffers in host memory, with the pointer structs over them.
struct Buffers {
  Buffers(int32_t slots, int32_t width, int32_t k, int32_t block_size, int32_t max_rows,
          int32_t max_tokens)
      : table(static_cast<size_t>(slots) * width, 0),
        computed(slots, 0),
        last(slots, 0),
        drafts(static_cast<size_t>(slots) * std::max(k, 1), 0),
        errors(1, 0),
        input_ids(max_tokens, 7777),
        positions(max_tokens, 7777),
        slot_mapping(max_tokens, 7777),
        seq_lens(max_rows, 7777),
        qsl(max_rows + 1, 7777),
        cu_k(max_rows + 1, 7777),
        out_table(static_cast<size_t>(max_rows) * width, 7777),
        logits(max_rows, 7777),
        spec(static_cast<size_t>(max_rows) * (k + 1), 7777),
        meta(kMetaWords, 7777),
        result(result_words(max_rows, k), 7777) {
    state = {table.data(), computed.data(), last.data(), drafts.data(), errors.data(),
             slots,        width,           k,           block_size};
    out = {input_ids.data(),  positions.data(), slot_mapping.data(), seq_lens.data(),
           qsl.data(),        cu_k.data(),      out_table.data(),    logits.data(),
           spec.data(),       meta.data()};
  }
  /// The plan a launch reads: its buffer's size becomes the state's plan capacity.
  const int32_t* use(const std::vector<int32_t>& plan) {
    state.plan_words = static_cast<int64_t>(plan.size());
    return plan.data();
  }
  std::vector<int32_t> table, computed, last, drafts, errors;
  std::vector<int32_t> input_ids;
  std::vector<int64_t> positions, slot_mapping;
  std::vector<int32_t> seq_lens, qsl, cu_k, out_table, logits, spec, meta, result;
  SlotState state;
  StepInputs out;
};

/// One row of a step, as the host describes it.
struct RowSpec {
  int32_t slot = 0;
  int32_t q = 1;
  bool prefill = false;
  bool reset = false;
  bool emits = true;
  int32_t start = 0;                  // prefill rows
  std::vector<int32_t> tokens;        // prefill rows
  int32_t new_block_start = 0;
  std::vector<int32_t> new_blocks;
};

/// Packs rows into a plan through pack_plan (as the builder does from a Batch).
std::vector<int32_t> pack(const std::vector<RowSpec>& rows) {
  const int32_t n = static_cast<int32_t>(rows.size());
  std::vector<int32_t> slots, q, cached, starts, offsets{0}, ids, tokens, cu{0};
  std::vector<uint8_t> prefill, reset, emits;
  for (const RowSpec& r : rows) {
    slots.push_back(r.slot);
    q.push_back(r.q);
    cached.push_back(r.start);
    prefill.push_back(r.prefill);
    reset.push_back(r.reset);
    emits.push_back(r.emits);
    starts.push_back(r.new_block_start);
    ids.insert(ids.end(), r.new_blocks.begin(), r.new_blocks.end());
    offsets.push_back(static_cast<int32_t>(ids.size()));
    if (r.prefill) {
      tokens.insert(tokens.end(), r.tokens.begin(), r.tokens.end());
    } else {
      tokens.insert(tokens.end(), r.q, -1);  // the host does not know decode inputs
    }
    cu.push_back(cu.back() + r.q);
  }
  PlanSource src;
  src.num_rows = n;
  src.request_slots = slots.data();
  src.num_scheduled_tokens = q.data();
  src.num_cached_tokens = cached.data();
  src.is_prefill = prefill.data();
  src.slot_reset = reset.data();
  src.emits_token = emits.data();
  src.new_block_starts = starts.data();
  src.new_block_offsets = offsets.data();
  src.new_block_ids = ids.data();
  src.scheduled_tokens = tokens.data();
  src.cu_seqlens_q = cu.data();
  std::vector<int32_t> plan(plan_words(n, static_cast<int64_t>(ids.size()), cu.back()) + 5, -99);
  int64_t words = 0;
  const Status s = pack_plan(src, plan.data(), static_cast<int64_t>(plan.size()), &words);
  EXPECT_TRUE(s.ok()) << s.message;
  plan.resize(words);
  return plan;
}

// ---- Plan layout --------------------------------------------------------------------------------

TEST(DevicePlan, LayoutIsHeaderRowsBlocksThenPrefillTokens) {
  RowSpec a{.slot = 3, .q = 4, .prefill = true, .reset = true, .emits = false, .start = 8,
            .tokens = {11, 12, 13, 14}, .new_block_start = 0, .new_blocks = {5, 6, 7}};
  RowSpec b{.slot = 1, .q = 3, .new_block_start = 2, .new_blocks = {9}};
  const std::vector<int32_t> plan = pack({a, b});
  ASSERT_EQ(static_cast<int64_t>(plan.size()), plan_words(2, 4, 4));
  EXPECT_EQ(plan[kPlanNumRows], 2);
  EXPECT_EQ(plan[kPlanNumBlockUpdates], 4);
  EXPECT_EQ(plan[kPlanNumHostTokens], 4);
  EXPECT_EQ(plan[kPlanNumTokens], 7);
  EXPECT_EQ(plan[kPlanMagicWord], kPlanMagic);
  const int32_t* rows = plan.data() + kPlanHeaderWords;
  EXPECT_EQ(std::vector<int32_t>(rows, rows + 4),
            (std::vector<int32_t>{3, 4 | ((kRowPrefill | kRowReset) << kRowFlagShift), 8, 0}));
  EXPECT_EQ(std::vector<int32_t>(rows + 4, rows + 8),
            (std::vector<int32_t>{1, 3 | (kRowEmits << kRowFlagShift), 0, 0}));
  const int32_t* blocks = rows + 8;
  EXPECT_EQ(std::vector<int32_t>(blocks, blocks + 12),
            (std::vector<int32_t>{3, 0, 5, 3, 1, 6, 3, 2, 7, 1, 2, 9}));
  EXPECT_EQ(std::vector<int32_t>(blocks + 12, blocks + 16),
            (std::vector<int32_t>{11, 12, 13, 14}));
}

TEST(DevicePlan, ADecodeRowCostsSixteenBytes) {
  std::vector<RowSpec> rows(64);
  for (int32_t i = 0; i < 64; ++i) rows[i] = RowSpec{.slot = i, .q = 4};
  const std::vector<int32_t> plan = pack(rows);
  EXPECT_EQ(plan.size() * sizeof(int32_t), kPlanHeaderWords * sizeof(int32_t) + 64 * 16);
}

TEST(DevicePlan, RefusesWhatDoesNotFit) {
  int32_t slots[1] = {0}, q[1] = {2}, cached[1] = {0}, starts[1] = {0}, offs[2] = {0, 0};
  int32_t cu[2] = {0, 2}, toks[2] = {1, 2};
  uint8_t yes[1] = {1};
  PlanSource src{1, slots, q, cached, yes, yes, yes, starts, offs, nullptr, toks, cu};
  std::vector<int32_t> out(plan_words(1, 0, 2) - 1, 0);
  int64_t words = -1;
  Status s = pack_plan(src, out.data(), static_cast<int64_t>(out.size()), &words);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_EQ(words, 0);
  EXPECT_NE(std::string(s.message).find("words"), std::string::npos);
  q[0] = 0;
  cu[1] = 0;
  out.resize(64);
  s = pack_plan(src, out.data(), static_cast<int64_t>(out.size()), &words);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
}

// ---- A worked example ---------------------------------------------------------------------------

// block_size 4, width 4, K = 2. Slot 2 decodes (computed 5, last token 40, drafts 41 42, blocks
// 7 8); slot 0 is admitted with a 4-token prefix hit (block 3) and prefills tokens 4..6 of its
// prompt into a new block 9. Rows in that order, padded to 4 rows and 16 tokens.
//
//   slot 2 (decode):  positions 5 6 7      inputs 40 41 42   slots 8*4+1 8*4+2 8*4+3
//   slot 0 (prefill): positions 4 5 6      inputs 70 71 72   slots 9*4+0 9*4+1 9*4+2
TEST(DeviceRef, WorkedExampleMixedRowsWithPadding) {
  Buffers b(/*slots=*/3, /*width=*/4, /*k=*/2, /*block_size=*/4, /*max_rows=*/4,
            /*max_tokens=*/16);
  b.computed[2] = 5;
  b.last[2] = 40;
  b.drafts[4] = 41;
  b.drafts[5] = 42;
  b.table[8] = 7;
  b.table[9] = 8;
  b.table[0] = 55;  // stale: slot 0 held another admission before
  b.table[3] = 56;
  RowSpec dec{.slot = 2, .q = 3};
  RowSpec pre{.slot = 0, .q = 3, .prefill = true, .reset = true, .emits = true, .start = 4,
              .tokens = {70, 71, 72}, .new_block_start = 0, .new_blocks = {3, 9}};
  const std::vector<int32_t> plan = pack({dec, pre});
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 4, 16, nullptr).ok());

  EXPECT_EQ(std::vector<int32_t>(b.input_ids.begin(), b.input_ids.begin() + 8),
            (std::vector<int32_t>{40, 41, 42, 70, 71, 72, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(b.positions.begin(), b.positions.begin() + 8),
            (std::vector<int64_t>{5, 6, 7, 4, 5, 6, 0, 0}));
  EXPECT_EQ(std::vector<int64_t>(b.slot_mapping.begin(), b.slot_mapping.begin() + 8),
            (std::vector<int64_t>{33, 34, 35, 36, 37, 38, -1, -1}));
  EXPECT_TRUE(std::all_of(b.slot_mapping.begin() + 6, b.slot_mapping.end(),
                          [](int64_t s) { return s == -1; }));
  EXPECT_EQ(b.seq_lens, (std::vector<int32_t>{8, 7, 0, 0}));
  EXPECT_EQ(b.qsl, (std::vector<int32_t>{0, 3, 6, 6, 6}));
  EXPECT_EQ(b.cu_k, (std::vector<int32_t>{0, 8, 15, 15, 15}));
  EXPECT_EQ(b.out_table, (std::vector<int32_t>{7, 8, 0, 0, 3, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}));
  EXPECT_EQ(b.logits, (std::vector<int32_t>{2, 5, 5, 5}));
  EXPECT_EQ(b.spec, (std::vector<int32_t>{0, 1, 2, 5, 5, 5, 5, 5, 5, 5, 5, 5}));
  EXPECT_EQ(b.meta[kMetaNumRows], 2);
  EXPECT_EQ(b.meta[kMetaNumTokens], 6);
  EXPECT_EQ(b.meta[kMetaMaxSeqlenQ], 3);
  EXPECT_EQ(b.meta[kMetaMaxSeqlenK], 8);
  EXPECT_EQ(b.computed[2], 8);
  EXPECT_EQ(b.computed[0], 7);
  EXPECT_EQ(b.errors[0], 0);

  // Sampling: the decode row's target matches draft 41 but not 42 -> a = 2: tokens 41, 90.
  std::vector<int32_t> target = {41, 90, 91, /*prefill row*/ 80, 81, 82};
  std::vector<int32_t> next = {43, 44, 83, 84};
  AcceptInputs in{target.data(), next.data(), nullptr, nullptr, nullptr};
  ASSERT_TRUE(accept_ref(b.use(plan), b.state, in, b.result.data(), 4, nullptr).ok());
  const std::vector<int32_t> res(b.result.begin(), b.result.begin() + result_words(2, 2));
  EXPECT_EQ(res, (std::vector<int32_t>{2, 0, 2, 0,              // header
                                       41, 90, -1, 80, -1, -1,  // tokens
                                       2, 1,                    // accepted
                                       43, 44, 83, 84}));       // next drafts
  EXPECT_EQ(b.computed[2], 7);  // 8 - (3 - 2)
  EXPECT_EQ(b.computed[0], 7);
  EXPECT_EQ(b.last[2], 90);
  EXPECT_EQ(b.last[0], 80);
  EXPECT_EQ(b.drafts[4], 43);
  EXPECT_EQ(b.drafts[0], 83);
}

// Variable-length drafts: slot 0 holds one draft (51, then -1 -1). A row of K+1 = 4 tokens (one
// step ahead the host reserves K+1) reads the missing drafts as the last token (a valid id), and
// accept never accepts them, greedy or probabilistic, even where the target agrees.
TEST(DeviceRef, MissingDraftsArePaddedAndNeverAccepted) {
  for (const bool probabilistic : {false, true}) {
    SCOPED_TRACE(probabilistic ? "probabilistic" : "greedy");
    Buffers b(/*slots=*/1, /*width=*/4, /*k=*/3, /*block_size=*/4, /*max_rows=*/1,
              /*max_tokens=*/4);
    b.computed[0] = 5;
    b.last[0] = 50;
    b.drafts = {51, -1, -1};
    b.table[0] = 3;
    b.table[1] = 4;
    b.table[2] = 5;
    const std::vector<int32_t> plan = pack({RowSpec{.slot = 0, .q = 4}});
    ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 4, nullptr).ok());
    EXPECT_EQ(std::vector<int32_t>(b.input_ids.begin(), b.input_ids.begin() + 4),
              (std::vector<int32_t>{50, 51, 50, 50}));
    EXPECT_EQ(b.errors[0], 0);
    // The target agrees with draft 51 and with the padding: only 51 may be accepted.
    std::vector<int32_t> target = {51, 50, 50, 60};
    std::vector<float> ones(3, 1.0f), zeros(3, 0.0f);
    AcceptInputs in{target.data(), nullptr, nullptr, nullptr, nullptr};
    if (probabilistic) {  // u * p_draft = 0 < p_target = 1: every draft would pass
      in.target_probs = ones.data();
      in.draft_probs = ones.data();
      in.uniform = zeros.data();
    }
    ASSERT_TRUE(accept_ref(b.use(plan), b.state, in, b.result.data(), 1, nullptr).ok());
    const std::vector<int32_t> res(b.result.begin(), b.result.begin() + result_words(1, 3));
    // (No next drafts given: their rows stay as they were, for store_drafts.)
    EXPECT_EQ(res, (std::vector<int32_t>{1, 0, 3, 0, 51, 50, -1, -1, 2, 7777, 7777, 7777}));
    EXPECT_EQ(b.computed[0], 7) << "9 - (4 - 2): the padded positions are rolled back";
    EXPECT_EQ(b.last[0], 50);
  }
}

// ---- Random steps against the shadow model ------------------------------------------------------

struct ShadowSlot {
  bool live = false;
  std::vector<int32_t> prompt;
  int32_t prefilled = 0;      // prompt tokens computed (chunked prefill progress)
  bool decoding = false;      // the prompt is done and a token was sampled
  int32_t computed = 0;       // KV positions computed
  std::vector<int32_t> blocks;
  int32_t last = 0;
  std::vector<int32_t> drafts;
};

struct Scenario {
  int32_t slots, width, k, block_size, steps;
  uint32_t seed;
  bool probabilistic;
  bool pad;
};

class DeviceRefRandom : public ::testing::TestWithParam<Scenario> {};

TEST_P(DeviceRefRandom, MatchesTheShadowModelStepAfterStep) {
  const Scenario sc = GetParam();
  std::mt19937 rng(sc.seed);
  auto uni = [&](int32_t lo, int32_t hi) {  // inclusive
    return std::uniform_int_distribution<int32_t>(lo, hi)(rng);
  };
  const int32_t S = sc.slots, W = sc.width, K = sc.k, bs = sc.block_size;
  const int32_t max_rows = S + 3, max_tokens = S * (bs * W + K + 1) + 16;
  Buffers b(S, W, K, bs, max_rows, max_tokens);
  std::vector<ShadowSlot> sh(S);
  for (ShadowSlot& s : sh) s.drafts.assign(K, 0);
  int32_t next_block = 1;
  int64_t checked_rows = 0, resets = 0, accepted_drafts = 0;

  for (int32_t step = 0; step < sc.steps; ++step) {
    std::vector<RowSpec> rows;
    // Live slots: prefill the next chunk, decode, or sit out; free slots: maybe admit.
    for (int32_t slot = 0; slot < S; ++slot) {
      ShadowSlot& s = sh[slot];
      if (!s.live) {
        if (uni(0, 2) != 0) continue;
        const int32_t len = uni(1, bs * W - K - 2);
        s = ShadowSlot{};
        s.live = true;
        s.drafts.assign(K, -5);
        for (int32_t i = 0; i < len; ++i) s.prompt.push_back(uni(100, 999));
        const int32_t hits = uni(0, (len - 1) / bs);  // the last prompt block is never a hit
        s.prefilled = s.computed = hits * bs;
        RowSpec r{.slot = slot, .prefill = true, .reset = true, .start = s.computed};
        for (int32_t i = 0; i < hits; ++i) r.new_blocks.push_back(next_block++);  // cached
        r.q = uni(1, len - s.prefilled);
        rows.push_back(r);
        ++resets;
        continue;
      }
      if (uni(0, 40) == 0) {  // finished (or preempted): the slot is free for a later admission
        s.live = false;
        continue;
      }
      if (uni(0, 4) == 0) continue;  // not scheduled this step
      if (!s.decoding) {
        RowSpec r{.slot = slot, .prefill = true, .start = s.prefilled};
        r.q = uni(1, static_cast<int32_t>(s.prompt.size()) - s.prefilled);
        r.new_block_start = static_cast<int32_t>(s.blocks.size());
        rows.push_back(r);
      } else if (s.computed + K + 1 <= bs * W) {
        RowSpec r{.slot = slot, .q = uni(0, 3) == 0 ? uni(1, K + 1) : K + 1};
        r.new_block_start = static_cast<int32_t>(s.blocks.size());
        rows.push_back(r);
      } else {
        s.live = false;  // the request is done: its slot is free for reuse
      }
    }
    if (rows.empty()) continue;
    std::shuffle(rows.begin(), rows.end(), rng);
    // Blocks: each row's table covers its positions after the step (admissions allocate the
    // whole prompt at once, as the scheduler does).
    for (RowSpec& r : rows) {
      ShadowSlot& s = sh[r.slot];
      if (r.reset) {
        s.blocks.assign(r.new_blocks.begin(), r.new_blocks.end());
        r.new_block_start = 0;
      }
      const int32_t start = r.prefill ? r.start : s.computed;
      const int32_t want = r.reset ? cdiv(static_cast<int32_t>(s.prompt.size()), bs)
                                   : cdiv(start + r.q, bs);
      while (static_cast<int32_t>(s.blocks.size()) < want) {
        s.blocks.push_back(next_block);
        if (r.reset && static_cast<int32_t>(r.new_blocks.size()) < want) {
          r.new_blocks.push_back(next_block);
        } else if (!r.reset) {
          r.new_blocks.push_back(next_block);
        }
        ++next_block;
      }
      if (r.prefill) {
        r.tokens.assign(s.prompt.begin() + r.start, s.prompt.begin() + r.start + r.q);
        r.emits = r.start + r.q == static_cast<int32_t>(s.prompt.size());
      }
    }
    const std::vector<int32_t> plan = pack(rows);
    const int32_t n = static_cast<int32_t>(rows.size());
    int32_t ntok = 0;
    for (const RowSpec& r : rows) ntok += r.q;
    const int32_t prow = sc.pad ? std::min(max_rows, n + uni(0, 3)) : n;
    const int32_t ptok = sc.pad ? std::min(max_tokens, ntok + uni(0, 9)) : ntok;
    ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, prow, ptok, nullptr).ok());
    ASSERT_EQ(b.errors[0], 0) << "step " << step;

    // Expected inputs from the shadow.
    int32_t t = 0, cq = 0, ck = 0, max_q = 0, max_k = 0;
    ASSERT_EQ(b.qsl[0], 0);
    ASSERT_EQ(b.cu_k[0], 0);
    std::vector<int32_t> starts(n);
    for (int32_t i = 0; i < n; ++i) {
      const RowSpec& r = rows[i];
      ShadowSlot& s = sh[r.slot];
      const int32_t start = r.prefill ? r.start : s.computed;
      starts[i] = start;
      const int32_t seq = start + r.q;
      for (int32_t j = 0; j < r.q; ++j, ++t) {
        const int32_t pos = start + j;
        const int32_t input = r.prefill ? s.prompt[pos] : (j == 0 ? s.last : s.drafts[j - 1]);
        ASSERT_EQ(b.input_ids[t], input) << "step " << step << " row " << i << " j " << j;
        ASSERT_EQ(b.positions[t], pos);
        ASSERT_EQ(b.slot_mapping[t], int64_t{s.blocks[pos / bs]} * bs + pos % bs);
      }
      ASSERT_EQ(b.seq_lens[i], seq);
      cq += r.q;
      ck += seq;
      max_q = std::max(max_q, r.q);
      max_k = std::max(max_k, seq);
      ASSERT_EQ(b.qsl[i + 1], cq);
      ASSERT_EQ(b.cu_k[i + 1], ck);
      ASSERT_EQ(b.logits[i], cq - 1);
      for (int32_t j = 0; j <= K; ++j) {
        const int32_t want = r.prefill ? cq - 1 : std::min(cq - r.q + j, cq - 1);
        ASSERT_EQ(b.spec[static_cast<size_t>(i) * (K + 1) + j], want);
      }
      for (int32_t c = 0; c < W; ++c) {
        const int32_t want = c < static_cast<int32_t>(s.blocks.size()) ? s.blocks[c] : 0;
        ASSERT_EQ(b.out_table[static_cast<size_t>(i) * W + c], want) << "row " << i << " c " << c;
        ASSERT_EQ(b.table[static_cast<size_t>(r.slot) * W + c], want);
      }
      ASSERT_EQ(b.computed[r.slot], seq);
      ++checked_rows;
    }
    for (int32_t tt = ntok; tt < ptok; ++tt) {
      ASSERT_EQ(b.input_ids[tt], 0);
      ASSERT_EQ(b.positions[tt], 0);
      ASSERT_EQ(b.slot_mapping[tt], -1);
    }
    for (int32_t i = n; i < prow; ++i) {
      ASSERT_EQ(b.seq_lens[i], 0);
      ASSERT_EQ(b.qsl[i + 1], ntok);
      ASSERT_EQ(b.cu_k[i + 1], ck);
      ASSERT_EQ(b.logits[i], ntok - 1);
      for (int32_t c = 0; c < W; ++c) ASSERT_EQ(b.out_table[static_cast<size_t>(i) * W + c], 0);
    }
    ASSERT_EQ(b.meta[kMetaNumRows], n);
    ASSERT_EQ(b.meta[kMetaNumTokens], ntok);
    ASSERT_EQ(b.meta[kMetaMaxSeqlenQ], max_q);
    ASSERT_EQ(b.meta[kMetaMaxSeqlenK], max_k);

    // Sampling: pick each row's accepted count, make targets (and probabilities) that give it.
    std::vector<int32_t> target(static_cast<size_t>(prow) * (K + 1), -3);
    std::vector<int32_t> next(static_cast<size_t>(prow) * K, -4);
    std::vector<float> tp(static_cast<size_t>(prow) * K, 0.5f), dp = tp, un = tp;
    std::vector<int32_t> want_a(n, 1);
    for (int32_t i = 0; i < n; ++i) {
      const RowSpec& r = rows[i];
      const ShadowSlot& s = sh[r.slot];
      int32_t* tg = target.data() + static_cast<size_t>(i) * (K + 1);
      const int32_t kr = r.prefill ? 0 : r.q - 1;
      const int32_t a = r.emits ? uni(1, kr + 1) : 1;
      want_a[i] = a;
      for (int32_t j = 0; j <= K; ++j) tg[j] = uni(1000, 1999);  // never a draft (< 1000)
      for (int32_t j = 0; j < kr; ++j) {
        const size_t at = static_cast<size_t>(i) * K + j;
        const bool ok = j < a - 1;
        if (sc.probabilistic) {
          dp[at] = static_cast<float>(uni(1, 100)) / 100.0f;
          un[at] = static_cast<float>(uni(0, 99)) / 100.0f;
          // accept iff un * dp < tp
          tp[at] = ok ? un[at] * dp[at] + 0.01f : un[at] * dp[at] * 0.5f;
        } else if (ok) {
          tg[j] = s.drafts[j];
        }
      }
      for (int32_t j = 0; j < K; ++j) next[static_cast<size_t>(i) * K + j] = uni(1, 999);
    }
    AcceptInputs in{target.data(), next.data(), nullptr, nullptr, nullptr};
    if (sc.probabilistic) {
      in.target_probs = tp.data();
      in.draft_probs = dp.data();
      in.uniform = un.data();
    }
    // Half the time the drafts arrive later, through store_drafts.
    const bool later = K > 0 && uni(0, 1) == 0;
    if (later) in.next_drafts = nullptr;
    ASSERT_TRUE(accept_ref(b.use(plan), b.state, in, b.result.data(), prow, nullptr).ok());
    if (later) {
      ASSERT_TRUE(store_drafts_ref(b.use(plan), b.state, next.data(), b.result.data(), prow,
                                   nullptr).ok());
    }
    const int32_t* res = b.result.data();
    ASSERT_EQ(res[0], n);
    ASSERT_EQ(res[1], 0);
    ASSERT_EQ(res[2], K);
    const int32_t* toks = res + kResultHeaderWords;
    const int32_t* acc = toks + static_cast<size_t>(n) * (K + 1);
    const int32_t* drf = acc + n;
    for (int32_t i = 0; i < n; ++i) {
      const RowSpec& r = rows[i];
      ShadowSlot& s = sh[r.slot];
      const int32_t a = want_a[i];
      ASSERT_EQ(acc[i], a) << "step " << step << " row " << i;
      const int32_t* tg = target.data() + static_cast<size_t>(i) * (K + 1);
      const int32_t* row_toks = toks + static_cast<size_t>(i) * (K + 1);
      for (int32_t j = 0; j <= K; ++j) {
        int32_t want = -1;
        if (r.emits && j < a - 1) want = s.drafts[j];
        if (r.emits && j == a - 1) want = tg[j];
        ASSERT_EQ(row_toks[j], want) << "step " << step << " row " << i << " j " << j;
      }
      for (int32_t j = 0; j < K; ++j) ASSERT_EQ(drf[static_cast<size_t>(i) * K + j],
                                                 next[static_cast<size_t>(i) * K + j]);
      // Shadow update.
      const int32_t seq = starts[i] + r.q;
      if (r.prefill) {
        s.computed = seq;
        s.prefilled = seq;
      } else {
        s.computed = seq - (r.q - a);
        accepted_drafts += a - 1;
      }
      if (r.emits) {
        s.decoding = true;
        s.last = tg[a - 1];
        for (int32_t j = 0; j < K; ++j) s.drafts[j] = next[static_cast<size_t>(i) * K + j];
      }
      ASSERT_EQ(b.computed[r.slot], s.computed);
      if (!s.decoding) continue;  // no token sampled yet: last token and drafts are stale
      ASSERT_EQ(b.last[r.slot], s.last);
      for (int32_t j = 0; j < K; ++j)
        ASSERT_EQ(b.drafts[static_cast<size_t>(r.slot) * K + j], s.drafts[j]);
    }
  }
  EXPECT_GT(checked_rows, sc.steps);  // the scenario really ran
  EXPECT_GT(resets, S);               // slots were reused
  if (K > 0) {
    EXPECT_GT(accepted_drafts, 0);
  }
}

std::vector<Scenario> scenarios() {
  std::vector<Scenario> v;
  for (int32_t k = 0; k <= kMaxSpecTokens; ++k) {
    v.push_back({/*slots=*/6, /*width=*/6, k, /*block_size=*/4, /*steps=*/120,
                 /*seed=*/101u + k, /*probabilistic=*/false, /*pad=*/k % 2 == 0});
    if (k > 0)
      v.push_back({5, 8, k, 3, 120, 202u + k, /*probabilistic=*/true, /*pad=*/k % 2 == 1});
  }
  v.push_back({40, 5, 3, 16, 60, 7u, false, true});  // many rows, wide blocks
  v.push_back({3, 30, 1, 1, 150, 8u, false, true});  // block_size 1
  return v;
}

INSTANTIATE_TEST_SUITE_P(Scenarios, DeviceRefRandom, ::testing::ValuesIn(scenarios()),
                         [](const ::testing::TestParamInfo<Scenario>& info) {
                           const Scenario& s = info.param;
                           char name[64];
                           std::snprintf(name, sizeof(name), "K%d_bs%d_slots%d_%s%s", s.k,
                                         s.block_size, s.slots,
                                         s.probabilistic ? "prob" : "greedy",
                                         s.pad ? "_padded" : "");
                           return std::string(name);
                         });

// ---- Bad plans: error bits, never an out-of-bounds access ---------------------------------------

TEST(DeviceRef, BadPlansSetErrorBitsAndLookLikePadding) {
  Buffers b(2, 3, 1, 4, 4, 16);
  RowSpec ok{.slot = 0, .q = 2, .prefill = true, .reset = true, .start = 0, .tokens = {5, 6},
             .new_block_start = 0, .new_blocks = {1}};
  RowSpec bad_slot{.slot = 9, .q = 2};
  std::vector<int32_t> plan = pack({ok, bad_slot});
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 2, 4, nullptr).ok());
  EXPECT_EQ(b.errors[0], kErrSlot);
  EXPECT_EQ(b.slot_mapping[2], -1);
  EXPECT_EQ(b.input_ids[2], 0);

  b.errors[0] = 0;
  RowSpec far{.slot = 1, .q = 2, .new_block_start = 3, .new_blocks = {4}};  // index 3 >= width
  plan = pack({far});
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 2, nullptr).ok());
  EXPECT_EQ(b.errors[0] & kErrBlockUpdate, kErrBlockUpdate);

  b.errors[0] = 0;
  b.computed[1] = 11;  // positions 11, 12: block 2 is in the table, 3 is past width 3
  RowSpec wide{.slot = 1, .q = 2};
  plan = pack({wide});
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 2, nullptr).ok());
  EXPECT_EQ(b.errors[0], kErrPosition);
  EXPECT_EQ(b.slot_mapping[1], -1);

  b.errors[0] = 0;
  RowSpec too_many{.slot = 1, .q = 3};  // K = 1: at most 2 tokens per decode row
  plan = pack({too_many});
  b.computed[1] = 0;
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 3, nullptr).ok());
  EXPECT_EQ(b.errors[0], kErrDecodeWidth);

  b.errors[0] = 0;
  plan = pack({ok});
  plan[kPlanMagicWord] = 0;
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 2, nullptr).ok());
  EXPECT_EQ(b.errors[0], kErrPlan);
  EXPECT_EQ(b.meta[kMetaNumRows], 0);
  EXPECT_EQ(b.slot_mapping[0], -1);  // everything is padding

  b.errors[0] = 0;
  plan = pack({ok});
  ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 1, nullptr).ok());  // 2 tokens > 1
  EXPECT_EQ(b.errors[0], kErrPlan);

  // Counts that reach past the plan buffer: kErrPlan, nothing read past it (ASan would say).
  for (int32_t word : {kPlanNumBlockUpdates, kPlanNumHostTokens}) {
    b.errors[0] = 0;
    plan = pack({ok});
    plan[word] += 1;
    ASSERT_TRUE(prepare_ref(b.use(plan), b.state, b.out, 1, 2, nullptr).ok());
    EXPECT_EQ(b.errors[0], kErrPlan) << word;
    EXPECT_EQ(b.meta[kMetaNumRows], 0);
  }

  // The accept result carries the sticky bits to the host.
  std::vector<int32_t> target(2, 3);
  AcceptInputs in{target.data(), nullptr, nullptr, nullptr, nullptr};
  ASSERT_TRUE(accept_ref(b.use(plan), b.state, in, b.result.data(), 1, nullptr).ok());
  EXPECT_EQ(b.result[1], kErrPlan);
}

// ---- Statuses -----------------------------------------------------------------------------------

TEST(DeviceStatus, NullPointersAndBadSizesAreInvalidArguments) {
  Buffers b(2, 3, 1, 4, 4, 16);
  const std::vector<int32_t> plan = pack({RowSpec{.slot = 0, .q = 1}});
  Status s = prepare_ref(nullptr, b.state, b.out, 1, 1, nullptr);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message).find("plan"), std::string::npos);
  StepInputs out = b.out;
  out.meta = nullptr;
  EXPECT_EQ(prepare_ref(b.use(plan), b.state, out, 1, 1, nullptr).code,
            StatusCode::kInvalidArgument);
  SlotState st = b.state;
  st.k = kMaxSpecTokens + 1;
  EXPECT_EQ(prepare_ref(plan.data(), st, b.out, 1, 1, nullptr).code,
            StatusCode::kInvalidArgument);
  st = b.state;
  st.plan_words = kPlanHeaderWords - 1;  // no room for even the header
  s = prepare_ref(plan.data(), st, b.out, 1, 1, nullptr);
  EXPECT_EQ(s.code, StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(s.message).find("plan_words"), std::string::npos);
  std::vector<int32_t> tokens(4, 1);
  EXPECT_EQ(accept_ref(plan.data(), st, AcceptInputs{tokens.data()}, b.result.data(), 1, nullptr)
                .code,
            StatusCode::kInvalidArgument);
  EXPECT_EQ(prepare_ref(b.use(plan), b.state, b.out, 0, 1, nullptr).code,
            StatusCode::kInvalidArgument);
  std::vector<float> p(4, 0.5f);
  std::vector<int32_t> target(4, 1);
  AcceptInputs half{target.data(), nullptr, p.data(), nullptr, p.data()};
  EXPECT_EQ(accept_ref(b.use(plan), b.state, half, b.result.data(), 1, nullptr).code,
            StatusCode::kInvalidArgument);
  EXPECT_EQ(store_drafts_ref(b.use(plan), b.state, nullptr, b.result.data(), 1, nullptr).code,
            StatusCode::kInvalidArgument);
}

TEST(DeviceStatus, LaunchersNeverThrowAndSayWhyTheyCannotRun) {
  Buffers b(2, 3, 1, 4, 4, 16);
  const std::vector<int32_t> plan = pack({RowSpec{.slot = 0, .q = 1}});
  // Host pointers are never dereferenced by a launcher that cannot run.
  const Status s = launch_prepare(b.use(plan), b.state, b.out, 1, 1, nullptr);
  if (std::string(backend_name()) == "none") {
    EXPECT_EQ(s.code, StatusCode::kNotCompiled);
    EXPECT_NE(std::string(s.message).find("no GPU back end"), std::string::npos);
    EXPECT_EQ(device_count(), 0);
    EXPECT_EQ(warp_size(), 0);
  } else if (device_count() == 0) {
    EXPECT_EQ(s.code, StatusCode::kNoDevice) << s.message;
  } else {
    GTEST_SKIP() << "a GPU is present: launches are covered by the GPU parity tests";
  }
  EXPECT_EQ(launch_prepare(nullptr, b.state, b.out, 1, 1, nullptr).code,
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace atom_sched::device
