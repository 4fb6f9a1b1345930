// One step's batch: flat arrays owned by the scheduler, sized once and reused every step, so a
// steady-state decode step allocates nothing. Every per-row array has exactly num_rows entries in
// row order (no compaction: ATOM bugs 8.18/8.19), every per-token array num_tokens entries.
//
// Names follow ATOM's ScheduledBatch where one exists. What the host can state exactly depends on
// the step protocol (DESIGN.md section 4): a row whose request has an earlier batch still in
// flight has input tokens (-1 here) that only the device knows; with speculative decoding its
// positions, context length and slots are upper bounds as well (row_exact[i] == 0). In the
// synchronous protocol every value is exact.
#pragma once

#include <cstdint>
#include <vector>

namespace atom_sched {

struct Batch {
  uint64_t id = 0;           // increasing; update() must name the oldest outstanding batch
  bool is_prefill = false;   // every row is a prefill row (ATOM's policy never mixes kinds)
  int32_t num_rows = 0;
  int32_t num_tokens = 0;    // total scheduled tokens (ATOM's total_tokens_num)
  int32_t num_spec_tokens = 0;  // K when a row decodes, 0 for an all-prefill batch
  int32_t max_seqlen_q = 0;
  int32_t max_seqlen_k = 0;
  int32_t block_table_width = 0;  // columns of block_tables (fixed for a scheduler)

  /// The scalars above, saved and restored as one.
  struct Header {
    uint64_t id;
    bool is_prefill;
    int32_t num_rows, num_tokens, num_spec_tokens, max_seqlen_q, max_seqlen_k;
  };
  [[nodiscard]] Header header() const {
    return {id, is_prefill, num_rows, num_tokens, num_spec_tokens, max_seqlen_q, max_seqlen_k};
  }
  void set_header(const Header& h) {
    id = h.id;
    is_prefill = h.is_prefill;
    num_rows = h.num_rows;
    num_tokens = h.num_tokens;
    num_spec_tokens = h.num_spec_tokens;
    max_seqlen_q = h.max_seqlen_q;
    max_seqlen_k = h.max_seqlen_k;
  }

  // Per row [num_rows].
  std::vector<int64_t> req_ids;
  std::vector<int32_t> request_slots;  // device state slot of the row's request, 0..max_num_seqs-1
  std::vector<int32_t> num_scheduled_tokens;
  std::vector<int32_t> num_cached_tokens;  // KV positions computed before this row's tokens
  std::vector<int32_t> context_lens;       // num_cached_tokens + num_scheduled_tokens
  std::vector<int32_t> last_block_num_tokens;  // tokens in the row's last block after this step
  std::vector<float> temperatures;
  std::vector<int32_t> top_ks;
  std::vector<float> top_ps;
  std::vector<int64_t> seeds;        // the request's SamplingParams.seed (-1: none)
  std::vector<uint8_t> row_is_prefill;  // 1: a prompt chunk; 0: a decode row (K+1 tokens)
  std::vector<uint8_t> emits_token;  // 0 for a prefill chunk that does not finish the prompt
  std::vector<uint8_t> row_exact;    // 1 when every value of the row is exact
  std::vector<int32_t> state_slots;  // per-request state slot, -1 if none
  // [num_rows, block_table_width]: a row's blocks, then kNullBlock (0) to the end of the row
  // (docs/design.md, "block-table contract"). Empty with SchedulerConfig::host_block_tables off
  // (the device plan below carries the tables then).
  std::vector<int32_t> block_tables;
  std::vector<int32_t> spec_draft_tokens;  // [num_rows, K]; -1 where unknown or a prefill row
  std::vector<int32_t> cu_seqlens_q;       // [num_rows + 1]
  std::vector<int32_t> cu_seqlens_k;       // [num_rows + 1]

  // The step's plan for persistent per-slot device state (DESIGN.md section 6): applied in batch
  // order, it brings each slot's device block table up to date with a few ids per step.
  std::vector<uint8_t> slot_reset;        // [num_rows] 1: the slot starts a new admission
  std::vector<int32_t> new_block_starts;  // [num_rows] table index of the row's first new block
  std::vector<int32_t> new_block_offsets; // [num_rows + 1] into new_block_ids
  std::vector<int32_t> new_block_ids;     // block ids appended to slot tables this step

  // Per token [num_tokens].
  std::vector<int32_t> scheduled_tokens;  // input ids; -1 where only the device knows the token
  std::vector<int64_t> positions;
  std::vector<int64_t> slot_mapping;      // block_id * block_size + offset

  std::vector<int32_t> request_index;  // [num_rows] the scheduler's internal request index

  // Bookkeeping for the incremental block-table fill: which request (slot, admission epoch) each
  // row of this buffer held last time, and how many of its entries are already written.
  std::vector<uint64_t> row_owner;
  std::vector<int32_t> row_filled;
};

}  // namespace atom_sched
