// libFuzzer target over the scheduler's public operations (DESIGN.md section 9). The input bytes
// drive a sequence of add / abort / schedule / update / transfer-report calls, streaming-input
// sessions (continue, end) and rewinds after failed loads, with valid and invalid arguments, and
// (in half the inputs) a KV connector whose answers come from the same
// bytes: remote prefills (load_async, an injected first token and drafts), deferred frees,
// malformed answers and throwing calls. The scheduler must reject bad calls with InvalidArgument
// or UnknownRequest, leave its state intact, and keep every invariant (check_invariants() after
// each call). Any other exception, a sanitizer report or a crash is a finding.
//
//   make fuzz            # builds with clang (libFuzzer + ASan + UBSan) and runs for FUZZ_SECONDS
#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <vector>

#include "atom_sched/errors.h"
#include "atom_sched/kv_connector.h"
#include "atom_sched/scheduler.h"

namespace {

using namespace atom_sched;

class Bytes {
 public:
  Bytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  uint8_t next() { return pos_ < size_ ? data_[pos_++] : 0; }
  int32_t below(int32_t n) { return n <= 0 ? 0 : next() % n; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

struct Pending {
  uint64_t id;
  int32_t rows;
  bool is_prefill;
  std::vector<int32_t> widths;  // tokens per row: K+1, fewer near max_model_len
};

// A connector whose every answer is drawn from the input bytes.
class FuzzConnector : public KvConnector {
 public:
  explicit FuzzConnector(Bytes& in) : in_(in) {}
  bool is_producer() const override { return false; }
  RemoteMatch get_num_new_matched_tokens(const ConnectorRequest& r) override {
    RemoteMatch m;
    switch (in_.below(8)) {
      case 0: throw std::runtime_error("remote unreachable");
      case 1:
      case 2:
        m.load_async = true;
        m.num_tokens = r.num_prompt_tokens;
        m.first_token = in_.below(14) - 1;
        m.draft_tokens.assign(in_.below(4), in_.below(12));
        break;
      case 3: m.first_token = -2 - in_.below(3); break;  // malformed: a failed call
      case 4: m.draft_tokens = {in_.below(12) - 5}; break;  // sometimes a negative draft
      default: break;
    }
    return m;
  }
  void update_state_after_alloc(const ConnectorRequest&) override {
    if (in_.below(16) == 0) throw std::runtime_error("alloc refused");
  }
  bool request_finished(const ConnectorRequest&) override {
    if (in_.below(16) == 0) throw std::runtime_error("send failed");
    return in_.next() & 1;
  }

 private:
  Bytes& in_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Bytes in(data, size);
  SchedulerConfig cfg;
  cfg.num_blocks = 4 + in.below(40);
  cfg.block_size = 1 + in.below(8);
  cfg.max_num_seqs = 1 + in.below(6);
  cfg.num_speculative_tokens = in.below(4);
  cfg.max_num_batched_tokens = cfg.num_speculative_tokens + 1 + in.below(64);
  cfg.max_model_len = 8 + in.below(120);
  cfg.enable_chunked_prefill = in.next() & 1;
  cfg.enable_prefix_caching = in.next() & 1;
  cfg.enable_kv_events = in.next() & 1;
  cfg.eos_token_id = 2;
  cfg.num_state_slots = in.below(3);
  cfg.scheduling = std::array{SchedulingPolicy::kFcfs, SchedulingPolicy::kPriority,
                              SchedulingPolicy::kSjf, SchedulingPolicy::kFairShare}[in.below(4)];
  if (cfg.scheduling == SchedulingPolicy::kFairShare) cfg.tenant_weights = {{"x", 2.0}};
  cfg.preemption_victim =
      in.next() & 1 ? PreemptionVictim::kLeastComputed : PreemptionVictim::kServiceOrder;
  if (cfg.scheduling == SchedulingPolicy::kSjf) cfg.sjf_aging_rate = 0.5 * (1 + in.below(8));
  if (in.below(4) == 0) cfg.admission_watermark_blocks = in.below(cfg.num_blocks - 1);
  cfg.policy = in.below(3) == 0 ? BatchPolicy::kMixed : BatchPolicy::kAtom;
  if (cfg.enable_chunked_prefill && in.below(3) == 0)
    cfg.long_prefill_token_threshold = 1 + in.below(16);
  cfg.host_block_tables = in.below(4) != 0;
  cfg.pad_first_decode_rows =
      cfg.policy == BatchPolicy::kMixed && cfg.num_speculative_tokens > 0 && (in.next() & 1);
  cfg.publish_prompt_blocks_at_schedule = in.next() & 1;
  cfg.schedule_ahead = in.below(4) != 0;
  Scheduler s(cfg);
  if (in.next() & 1) s.set_kv_connector(std::make_shared<FuzzConnector>(in));
  const int32_t k = cfg.num_speculative_tokens;
  std::deque<Pending> outstanding;
  std::vector<int32_t> prompt, sampled, accepted, drafts;
  int64_t next_id = 0;
  while (!in.empty()) {
    try {
      switch (in.below(10)) {
        case 0:
        case 1: {  // add a request, sometimes with a bad argument
          prompt.assign(in.below(40), 0);
          for (auto& t : prompt) t = in.below(12) - (in.below(50) == 0 ? 5 : 0);
          SamplingParams p;
          p.max_tokens = in.below(20);
          p.ignore_eos = in.next() & 1;
          if (in.below(4) == 0) p.min_tokens = in.below(22) - 1;  // sometimes invalid
          if (in.below(4) == 0) p.stop_token_sequences.push_back({in.below(12), in.below(12)});
          if (in.below(4) == 0) p.stop_token_ids.push_back(in.below(12));
          if (in.below(3) == 0) p.priority = in.below(5) - 2;  // refused under FCFS unless 0
          if (in.below(4) == 0) p.length_hint = in.below(20) - 1;  // -1 is refused
          if (in.below(3) == 0) p.tenant.assign(1, static_cast<char>('w' + in.below(3)));
          if (in.below(5) == 0) p.cache_salt.assign(1, static_cast<char>('a' + in.below(2)));
          if (in.below(5) == 0) p.lora_name.assign(1, static_cast<char>('x' + in.below(2)));
          p.resumable = in.below(3) == 0;  // refused with state slots
          const int64_t id = in.below(6) == 0 ? in.below(4) - 1 : next_id++;
          s.add_request(id, prompt, p, /*arrival_time=*/in.below(8));
          break;
        }
        case 2:
          s.abort_request(in.below(static_cast<int32_t>(next_id) + 2));
          break;
        case 3:
        case 4: {
          const Batch* b = s.schedule(0.0, in.below(5) != 0);
          if (b != nullptr)
            outstanding.push_back({b->id, b->num_rows, b->is_prefill,
                                   {b->num_scheduled_tokens.begin(),
                                    b->num_scheduled_tokens.begin() + b->num_rows}});
          break;
        }
        case 5:
        case 6: {  // outputs for the oldest batch, or a wrong one
          if (outstanding.empty()) break;
          Pending p = outstanding.front();
          const bool bad = in.below(8) == 0;
          const uint64_t id = bad && in.next() & 1 ? p.id + 1 : p.id;
          const int32_t rows = bad && in.next() & 1 ? p.rows + 1 : p.rows;
          sampled.assign(static_cast<size_t>(rows) * (k + 1), 0);
          for (auto& t : sampled) t = in.below(12) - (bad ? 1 : 0);
          accepted.assign(rows, 1);
          if (!p.is_prefill)
            for (int32_t r = 0; r < rows; ++r)
              accepted[r] = 1 + in.below((r < p.rows ? p.widths[r] : k + 1) + (bad ? 1 : 0));
          drafts.assign(static_cast<size_t>(rows) * k, 3);
          if (bad && !drafts.empty()) drafts[in.below(static_cast<int32_t>(drafts.size()))] = -1;
          ModelOutputs out;
          out.sampled_token_ids = sampled;
          if (k > 0) out.num_accepted = accepted;
          out.draft_token_ids = drafts;
          s.update(id, out);
          outstanding.pop_front();
          break;
        }
        case 7: {  // transfer reports: live, finished, unknown and repeated ids
          std::vector<int64_t> sending(in.below(3)), recving(in.below(3));
          for (auto& id : sending) id = in.below(static_cast<int32_t>(next_id) + 2) - 1;
          for (auto& id : recving) id = in.below(static_cast<int32_t>(next_id) + 2) - 1;
          s.update_from_kv_xfer_finished(sending, recving);
          (void)s.take_connector_errors();
          break;
        }
        case 8: {  // a session's next turn or its end; a failed load's rewind (any id)
          const int64_t id = in.below(static_cast<int32_t>(next_id) + 2) - 1;
          const int32_t op = in.below(3);
          if (op == 0) {
            prompt.assign(in.below(12), 0);
            for (auto& t : prompt) t = in.below(12) - (in.below(30) == 0 ? 3 : 0);
            SamplingParams p;
            p.max_tokens = in.below(12);  // 0 is refused
            p.resumable = in.next() & 1;
            if (in.below(6) == 0) p.lora_name.assign(1, static_cast<char>('x' + in.below(2)));
            s.continue_session(id, prompt, p, in.below(8));
          } else if (op == 1) {
            s.end_session(id);
          } else {
            s.recompute_kv_from(id, in.below(cfg.max_model_len + 2) - 1);
          }
          break;
        }
        default:
          (void)s.next_batch_info(0.0, true);
          (void)s.take_events();
          (void)s.take_rejected();
          if (in.below(8) == 0) s.reset_prefix_cache();
          break;
      }
    } catch (const InvalidArgument&) {
    } catch (const UnknownRequest&) {
    }
    s.check_invariants();  // throws InvariantViolation: libFuzzer reports it as a crash
  }
  return 0;
}
