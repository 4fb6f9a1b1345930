// Scheduler, Batch, StepOutput, RequestOutput, KVEvent and RejectedRequest.
//
// Batch and StepOutput are views: their numpy arrays point into buffers the C++ scheduler owns
// and reuses, with the view object as the arrays' base (so the scheduler outlives them). Reading
// an attribute of a view whose buffer now holds a newer batch/step raises; an array taken
// earlier is borrowed and is overwritten in place when the buffer is reused (copy it to keep
// it). Views are read without the scheduler's lock: read them on the thread that drives the
// scheduler. Every call into the core releases the GIL and takes the scheduler's mutex.
#include <pybind11/gil_safe_call_once.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>

#include "atom_sched/errors.h"
#include "atom_sched/scheduler.h"
#include "bindings.h"
#include "compat_atom.h"
#include "convert.h"
#include "scheduler_handle.h"

namespace atom_sched {

namespace py = pybind11;
using namespace pybind11::literals;
using py_convert::Float32Input;
using py_convert::Int32Input;
using py_convert::readonly_view;

namespace {

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct BatchView {
  Handle owner;
  const Batch* batch;
  uint64_t id;
  const Batch& get() const {
    if (batch->id != id)
      throw std::runtime_error("batch " + std::to_string(id) +
                               " is no longer valid: its buffer now holds a newer batch");
    return *batch;
  }
};

struct StepOutputView {
  Handle owner;
  const StepOutput* out;
  uint64_t batch_id;
  const StepOutput& get() const {
    if (out->batch_id != batch_id)
      throw std::runtime_error("the outputs of batch " + std::to_string(batch_id) +
                               " are no longer valid: update() has run since");
    return *out;
  }
};

struct RequestOutput {
  int64_t request_id;
  std::vector<int32_t> output_tokens;
  bool finished;
  bool awaiting_input;  // a session's turn ended (finish_reason says why); it waits for input
  std::optional<std::string> finish_reason;
  int32_t num_cached_tokens;
  std::optional<std::vector<float>> logprobs;
};

bool awaits_input(const StepOutput& so, int32_t i) {
  const auto& e = so.awaiting_input_entries;
  return std::binary_search(e.begin(), e.end(), i);
}

RequestOutput make_output(const StepOutput& so, int32_t i) {
  RequestOutput o;
  o.request_id = so.req_ids[i];
  const int32_t lo = so.token_offsets[i], hi = so.token_offsets[i + 1];
  o.output_tokens.assign(so.new_tokens.begin() + lo, so.new_tokens.begin() + hi);
  const bool stopped = so.finish_reasons[i] != FinishReason::kNone;
  o.awaiting_input = stopped && awaits_input(so, i);
  o.finished = stopped && !o.awaiting_input;
  if (stopped) o.finish_reason = finish_reason_string(so.finish_reasons[i], so.stop_tokens[i]);
  o.num_cached_tokens = so.prefix_hit_tokens[i];
  if (!so.new_logprobs.empty() && so.wants_logprobs[i])
    o.logprobs.emplace(so.new_logprobs.begin() + lo, so.new_logprobs.begin() + hi);
  return o;
}

// Property getters for per-row and per-token arrays of a BatchView.
template <typename T>
auto row_array(std::vector<T> Batch::*field) {
  return [field](py::object self) {
    const Batch& b = self.cast<const BatchView&>().get();
    return readonly_view(self, (b.*field).data(), {b.num_rows});
  };
}
template <typename T>
auto token_array(std::vector<T> Batch::*field) {
  return [field](py::object self) {
    const Batch& b = self.cast<const BatchView&>().get();
    return readonly_view(self, (b.*field).data(), {b.num_tokens});
  };
}
auto bool_row_array(std::vector<uint8_t> Batch::*field) {
  return [field](py::object self) {
    const Batch& b = self.cast<const BatchView&>().get();
    return readonly_view(self, reinterpret_cast<const bool*>((b.*field).data()), {b.num_rows});
  };
}

// A scheduler made with SchedulerConfig.host_block_tables=False writes no host block tables.
bool host_block_tables(const BatchView& v) { return v.owner->core.config().host_block_tables; }
constexpr const char* kNoHostTables =
    "block_tables: this scheduler writes no host block tables "
    "(SchedulerConfig.host_block_tables=False); the device plan (slot_reset, new_block_starts, "
    "new_block_offsets, new_block_ids) carries them, as DeviceBatchBuilder reads it";

// Batch.views(): every array a model runner and sampler read, in one call. Built once per batch
// buffer and shape, then returned again (the arrays point at the buffer, which each batch in it
// rewrites; its arrays never move): a step pays one call instead of a numpy object per array.
// The least recently used of kViewsCached shapes makes room for a new one.
py::object batch_views(const BatchView& v) {
  const Batch& b = v.get();
  SchedulerHandle& h = *v.owner;
  const int32_t k = b.is_prefill ? 0 : b.num_spec_tokens;
  BatchViewsCache* c = &h.views[0];
  for (BatchViewsCache& e : h.views) {
    if (e.buffer == &b && e.num_rows == b.num_rows && e.num_tokens == b.num_tokens &&
        e.num_spec_tokens == k) {
      e.last_used = ++h.views_clock;
      return e.views;
    }
    if (e.last_used < c->last_used) c = &e;
  }
  // The arrays' base owns the batch storage, which outlives the scheduler if they do.
  auto* storage = new std::shared_ptr<const void>(h.core.batch_storage());
  const py::capsule base(storage,
                         [](void* p) { delete static_cast<std::shared_ptr<const void>*>(p); });
  const py::ssize_t n = b.num_rows, t = b.num_tokens;
  auto rows = [&](const auto& f) { return readonly_view(base, f.data(), {n}); };
  auto flags = [&](const std::vector<uint8_t>& f) {
    return readonly_view(base, reinterpret_cast<const bool*>(f.data()), {n});
  };
  auto tokens = [&](const auto& f) { return readonly_view(base, f.data(), {t}); };
  PYBIND11_CONSTINIT static py::gil_safe_call_once_and_store<py::object> views_class;
  constexpr py::ssize_t kFields = 18;
  const py::object& cls =
      views_class
          .call_once_and_store_result([] {
            py::object c = py::module_::import("atom_sched._views").attr("BatchViews");
            if (py::len(c.attr("_fields")) != kFields)
              throw std::logic_error("atom_sched._views.BatchViews has other fields than "
                                     "Batch.views() makes");
            return c;
          })
          .get_stored();
  py::object fields[] = {  // in BatchViews' field order (_views.py; checked below)
      rows(b.req_ids), rows(b.request_slots), rows(b.num_scheduled_tokens),
      rows(b.num_cached_tokens), rows(b.context_lens),
      readonly_view(base, b.cu_seqlens_q.data(), {n + 1}),
      readonly_view(base, b.cu_seqlens_k.data(), {n + 1}), tokens(b.scheduled_tokens),
      tokens(b.positions), tokens(b.slot_mapping),
      host_block_tables(v)
          ? py::object(readonly_view(base, b.block_tables.data(), {n, b.block_table_width}))
          : py::none(),
      readonly_view(base, b.spec_draft_tokens.data(), {n, k}), rows(b.temperatures),
      rows(b.top_ks), rows(b.top_ps), rows(b.seeds), flags(b.row_is_prefill),
      flags(b.emits_token)};
  // BatchViews is a NamedTuple (a tuple subclass with no dict): made as tuple.__new__ makes a
  // subclass's instance (tp_alloc, then the items), not through its Python-level __new__, which
  // costs as much as the arrays.
  static_assert(sizeof(fields) / sizeof(fields[0]) == kFields);
  auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  py::object views = py::reinterpret_steal<py::object>(type->tp_alloc(type, kFields));
  if (!views) throw py::error_already_set();
  for (py::ssize_t i = 0; i < kFields; ++i)
    PyTuple_SET_ITEM(views.ptr(), i, fields[i].release().ptr());
  *c = BatchViewsCache{&b, b.num_rows, b.num_tokens, k, ++h.views_clock, views};
  return views;
}

const char* status_name(RequestStatus s) {
  switch (s) {
    case RequestStatus::kWaiting: return "waiting";
    case RequestStatus::kRunning: return "running";
    case RequestStatus::kWaitingForRemoteKv: return "waiting_for_remote_kv";
    case RequestStatus::kWaitingForInput: return "waiting_for_input";
    case RequestStatus::kFinished: break;
  }
  return "finished";
}

Medium medium_from_name(const std::optional<std::string>& name) {
  if (!name) return Medium::kNone;
  for (Medium m : {Medium::kGpu, Medium::kCpu, Medium::kDisk, Medium::kRemote})
    if (*name == medium_name(m)) return m;
  throw py::value_error("unknown KV medium '" + *name + "' (GPU, CPU, DISK, REMOTE or None)");
}

const char* event_kind_name(KvEventKind k) {
  switch (k) {
    case KvEventKind::kBlockStored: return "BlockStored";
    case KvEventKind::kBlockRemoved: return "BlockRemoved";
    case KvEventKind::kAllBlocksCleared: break;
  }
  return "AllBlocksCleared";
}

py::object add_request(SchedulerHandle& h, int64_t request_id, py::handle prompt,
                       std::optional<SamplingParams> params, std::optional<double> arrival_time) {
  Int32Input tokens(prompt, "prompt_token_ids", 1);
  const SamplingParams p = params ? *params : SamplingParams{};
  const double t = arrival_time ? *arrival_time : monotonic_seconds();
  with_core(h, [&](Scheduler& c) { c.add_request(request_id, tokens.span(), p, t); });
  return py::none();
}

py::object schedule(const Handle& h, bool allow_prefill, std::optional<double> now,
                    bool admit_waiting) {
  const double t = now ? *now : monotonic_seconds();
  // Small: a decode step of a few rows, with no prompt to admit or chunk.
  const auto small = [](const Scheduler& c) {
    return c.num_waiting() == 0 && c.num_partial_prefills() == 0 &&
           c.num_running() <= kSmallStepRows;
  };
  // A connector interrupt waits for the next call if this one returns a batch (already counted
  // as outstanding: raising would lose it), else it is raised now.
  const Batch* b = with_core(
      *h, [&](Scheduler& c) { return c.schedule(t, allow_prefill, admit_waiting); },
      OnInterrupt::kDefer, small);
  if (b == nullptr) {
    raise_deferred_interrupt(*h);
    return py::none();
  }
  return py::cast(BatchView{h, b, b->id});
}

StepOutputView update(const Handle& h, const BatchView& batch, py::handle sampled,
                      py::handle num_accepted, py::handle drafts, py::handle logprobs) {
  if (batch.owner.get() != h.get())
    throw py::value_error("update(): the batch belongs to another Scheduler");
  const Batch& b = batch.get();
  const int32_t rows = b.num_rows;
  const int32_t k = h->core.config().num_speculative_tokens;
  Int32Input s(sampled, "sampled_token_ids", 0);
  if (s.dim(0) != rows)
    throw py::value_error("sampled_token_ids has " + std::to_string(s.dim(0)) +
                          " rows; the batch has " + std::to_string(rows));
  if (s.ndim() == 1 && k > 0)
    throw py::value_error("sampled_token_ids must be 2-D (rows, K+1) with speculative decoding");
  if (s.ndim() == 2 && s.dim(1) != k + 1)
    throw py::value_error("sampled_token_ids must have K+1 = " + std::to_string(k + 1) +
                          " columns, got " + std::to_string(s.dim(1)));
  std::optional<Int32Input> acc, dr;
  std::optional<Float32Input> lp;
  ModelOutputs out;
  out.sampled_token_ids = s.span();
  if (!num_accepted.is_none()) {
    acc.emplace(num_accepted, "num_accepted", 1);
    if (acc->dim(0) != rows)
      throw py::value_error("num_accepted has " + std::to_string(acc->dim(0)) +
                            " entries; the batch has " + std::to_string(rows) + " rows");
    out.num_accepted = acc->span();
  }
  if (!drafts.is_none()) {
    dr.emplace(drafts, "draft_token_ids", 2);
    if (dr->dim(0) != rows || dr->dim(1) != k)
      throw py::value_error("draft_token_ids must have shape (" + std::to_string(rows) + ", " +
                            std::to_string(k) + "), got (" + std::to_string(dr->dim(0)) + ", " +
                            std::to_string(dr->dim(1)) + ")");
    out.draft_token_ids = dr->span();
  }
  if (!logprobs.is_none()) {
    lp.emplace(logprobs, "logprobs");
    if (lp->ndim() != s.ndim() || lp->dim(0) != s.dim(0) || lp->dim(1) != s.dim(1))
      throw py::value_error("logprobs must have the shape of sampled_token_ids");
    out.logprobs = lp->span();
  }
  // The step's id is read under the lock: another thread's update() cannot slip in between. A
  // connector interrupt waits for the next call: the step is applied and its outputs must stream.
  const auto small = [&](const Scheduler&) {
    return rows <= kSmallStepRows && b.num_tokens <= kSmallStepRows * (k + 1);
  };
  const auto [so, id] = with_core(
      *h,
      [&](Scheduler& c) {
        const StepOutput& result = c.update(batch.id, out);
        return std::make_pair(&result, result.batch_id);
      },
      OnInterrupt::kDefer, small);
  return StepOutputView{h, so, id};
}

// A binding taking only the scheduler: f(core) under with_core().
template <typename F>
auto locked(F f) {
  return [f](SchedulerHandle& h) { return with_core(h, f); };
}

py::dict stats_dict(const SchedulerStats& s) {
  py::dict d;
  d["num_steps"] = s.num_steps;
  d["num_preemptions"] = s.num_preemptions;
  d["num_prefix_queries"] = s.num_prefix_queries;
  d["prefix_query_tokens"] = s.prefix_query_tokens;
  d["prefix_hit_tokens"] = s.prefix_hit_tokens;
  d["prefix_hit_rate"] = s.prefix_hit_rate();
  d["num_spec_steps"] = s.num_spec_steps;
  d["num_draft_tokens"] = s.num_draft_tokens;
  d["num_accepted_draft_tokens"] = s.num_accepted_draft_tokens;
  d["acceptance_rate"] = s.acceptance_rate();
  d["acceptance_counts"] = s.acceptance_counts;
  d["num_finished"] = s.num_finished;
  d["num_aborted"] = s.num_aborted;
  d["num_rejected"] = s.num_rejected;
  d["num_remote_prefills"] = s.num_remote_prefills;
  d["num_connector_errors"] = s.num_connector_errors;
  return d;
}

py::dict request_state(const Request& r) {
  py::dict d;
  d["request_id"] = r.id;
  d["status"] = status_name(r.status);
  d["num_tokens"] = r.num_tokens();
  d["num_prompt_tokens"] = r.num_prompt_tokens;
  d["num_computed_tokens"] = r.num_computed_tokens;
  d["prefill_target"] = r.prefill_target;
  d["num_inflight"] = r.num_inflight;
  d["remote_ready"] = r.remote_ready;
  d["resumable"] = r.resumable;
  d["prefix_hit_tokens"] = r.prefix_hit_tokens;
  d["token_ids"] = r.tokens;
  d["output_token_ids"] =
      std::vector<int32_t>(r.tokens.begin() + r.num_prompt_tokens, r.tokens.end());
  d["block_table"] = r.block_table;
  d["state_slot"] = r.state_slot;
  d["drafts"] = r.drafts;
  return d;
}

}  // namespace

void bind_scheduler(py::module_& m) {
  m.attr("NULL_BLOCK") = kNullBlock;
  py::class_<RejectedRequest>(m, "RejectedRequest", "A request schedule() can never run.")
      .def_readonly("request_id", &RejectedRequest::req_id)
      .def_readonly("reason", &RejectedRequest::reason)
      .def("__repr__", [](const RejectedRequest& r) {
        return "RejectedRequest(request_id=" + std::to_string(r.req_id) + ", reason='" +
               r.reason + "')";
      });

  py::class_<KvEvent>(m, "KVEvent", "A KV-cache event (BlockStored, BlockRemoved, ...).")
      .def(py::init([](const std::string& kind, std::vector<uint64_t> block_hashes,
                       std::optional<uint64_t> parent_block_hash, std::vector<int32_t> token_ids,
                       int32_t block_size, std::optional<std::string> medium,
                       const py::object& lora_name, const py::object& cache_salt) {
             KvEvent e;
             if (kind == "BlockStored") {
               e.kind = KvEventKind::kBlockStored;
             } else if (kind == "BlockRemoved") {
               e.kind = KvEventKind::kBlockRemoved;
             } else if (kind == "AllBlocksCleared") {
               e.kind = KvEventKind::kAllBlocksCleared;
             } else {
               throw py::value_error("unknown KV event kind '" + kind + "'");
             }
             e.block_hashes = std::move(block_hashes);
             e.parent_block_hash = parent_block_hash;
             e.token_ids = std::move(token_ids);
             e.block_size = block_size;
             e.medium = medium_from_name(medium);
             e.lora_name = extra_key_text(lora_name, "lora_name");
             e.cache_salt = extra_key_text(cache_salt, "cache_salt");
             return e;
           }),
           "kind"_a, "block_hashes"_a = std::vector<uint64_t>{},
           "parent_block_hash"_a = py::none(), "token_ids"_a = std::vector<int32_t>{},
           "block_size"_a = 0, "medium"_a = "GPU", "lora_name"_a = py::str(""),
           "cache_salt"_a = py::str(""))
      .def_property_readonly("kind", [](const KvEvent& e) { return event_kind_name(e.kind); })
      .def_readonly("block_hashes", &KvEvent::block_hashes)
      .def_readonly("parent_block_hash", &KvEvent::parent_block_hash)
      .def_readonly("token_ids", &KvEvent::token_ids)
      .def_readonly("block_size", &KvEvent::block_size)
      .def_readonly("lora_name", &KvEvent::lora_name)
      .def_readonly("cache_salt", &KvEvent::cache_salt)
      .def_property_readonly("medium",
                             [](const KvEvent& e) -> py::object {
                               const char* name = medium_name(e.medium);
                               return name ? py::str(name) : py::object(py::none());
                             })
      .def("__repr__", [](const KvEvent& e) {
        return std::string("KVEvent(") + event_kind_name(e.kind) +
               ", blocks=" + std::to_string(e.block_hashes.size()) + ")";
      });

  py::class_<RequestOutput>(m, "RequestOutput", "What one request gained in one step.")
      .def_readonly("request_id", &RequestOutput::request_id)
      .def_readonly("output_tokens", &RequestOutput::output_tokens)
      .def_readonly("finished", &RequestOutput::finished)
      .def_readonly("awaiting_input", &RequestOutput::awaiting_input,
                    "A streaming-input session's turn ended (finish_reason says why): it waits "
                    "for Scheduler.continue_session(), unfinished.")
      .def_readonly("finish_reason", &RequestOutput::finish_reason)
      .def_readonly("num_cached_tokens", &RequestOutput::num_cached_tokens)
      .def_readonly("logprobs", &RequestOutput::logprobs)
      .def("__repr__", [](const RequestOutput& o) {
        return "RequestOutput(request_id=" + std::to_string(o.request_id) +
               ", new_tokens=" + std::to_string(o.output_tokens.size()) +
               ", finished=" + (o.finished ? "True" : "False") +
               (o.awaiting_input ? ", awaiting_input=True" : "") +
               (o.finish_reason ? ", finish_reason='" + *o.finish_reason + "'" : "") + ")";
      });

  py::class_<StepOutputView>(m, "StepOutput",
                             "The outputs of one update(): flat arrays valid until the next "
                             "update(); outputs() or iteration gives RequestOutput objects.")
      .def_property_readonly("batch_id", [](const StepOutputView& v) { return v.get().batch_id; })
      .def_property_readonly("request_ids",
                             [](py::object self) {
                               const StepOutput& so = self.cast<const StepOutputView&>().get();
                               return readonly_view(self, so.req_ids.data(), {so.size()});
                             })
      .def_property_readonly("token_offsets",
                             [](py::object self) {
                               const StepOutput& so = self.cast<const StepOutputView&>().get();
                               return readonly_view(self, so.token_offsets.data(),
                                                    {so.size() + 1});
                             })
      .def_property_readonly(
          "new_tokens",
          [](py::object self) {
            const StepOutput& so = self.cast<const StepOutputView&>().get();
            return readonly_view(self, so.new_tokens.data(),
                                 {static_cast<py::ssize_t>(so.new_tokens.size())});
          })
      .def_property_readonly(
          "new_logprobs",
          [](py::object self) {
            const StepOutput& so = self.cast<const StepOutputView&>().get();
            return readonly_view(self, so.new_logprobs.data(),
                                 {static_cast<py::ssize_t>(so.new_logprobs.size())});
          },
          "Aligned with new_tokens when update() got logprobs (NaN for a token the runner "
          "gave none for), else empty.")
      .def_property_readonly("finished",
                             [](const StepOutputView& v) {
                               const StepOutput& so = v.get();
                               py::array_t<bool> a(so.size());
                               auto w = a.mutable_unchecked<1>();
                               for (int32_t i = 0; i < so.size(); ++i)
                                 w(i) = so.finish_reasons[i] != FinishReason::kNone;
                               for (int32_t i : so.awaiting_input_entries) w(i) = false;
                               return a;
                             })
      .def_property_readonly(
          "awaiting_input",
          [](const StepOutputView& v) {
            const StepOutput& so = v.get();
            py::array_t<bool> a(so.size());
            auto w = a.mutable_unchecked<1>();
            for (int32_t i = 0; i < so.size(); ++i) w(i) = false;
            for (int32_t i : so.awaiting_input_entries) w(i) = true;
            return a;
          },
          "Per entry: a streaming-input session ended its turn (finish_reason(i) says why) "
          "and waits for input, unfinished.")
      .def_property_readonly(
          "num_awaiting_input",
          [](const StepOutputView& v) {
            return static_cast<int32_t>(v.get().awaiting_input_entries.size());
          },
          "How many entries ended a session's turn (0 without sessions: a cheap test).")
      .def_property_readonly("num_cached_tokens",
                             [](py::object self) {
                               const StepOutput& so = self.cast<const StepOutputView&>().get();
                               return readonly_view(self, so.prefix_hit_tokens.data(),
                                                    {so.size()});
                             })
      .def(
          "finish_reason",
          [](const StepOutputView& v, int32_t i) -> py::object {
            const StepOutput& so = v.get();
            if (i < 0 || i >= so.size())
              throw py::index_error("finish_reason(" + std::to_string(i) + "): the step has " +
                                    std::to_string(so.size()) + " entries");
            if (so.finish_reasons[i] == FinishReason::kNone) return py::none();
            return py::str(finish_reason_string(so.finish_reasons[i], so.stop_tokens[i]));
          },
          "i"_a, "Entry i's finish reason (as RequestOutput.finish_reason), or None.")
      .def(
          "final_token_ids",
          [](const StepOutputView& v, int32_t i) {
            const StepOutput& so = v.get();
            if (i < 0 || i >= so.size())
              throw py::index_error("final_token_ids(" + std::to_string(i) + "): the step has " +
                                    std::to_string(so.size()) + " entries");
            const auto& e = so.finished_entries;
            const auto at = std::lower_bound(e.begin(), e.end(), i);
            if (at == e.end() || *at != i)
              throw py::value_error("final_token_ids(" + std::to_string(i) + "): entry " +
                                    std::to_string(i) + " did not finish this step");
            const size_t j = static_cast<size_t>(at - e.begin());
            return std::vector<int32_t>(so.finished_tokens.begin() + so.finished_offsets[j],
                                        so.finished_tokens.begin() + so.finished_offsets[j + 1]);
          },
          "i"_a,
          "Entry i's whole token sequence (prompt and outputs), if it finished this step "
          "(ValueError otherwise): the scheduler forgets a request once it finishes.")
      .def(
          "_atom_stream_items",
          [](const StepOutputView& v, py::handle output_type) {
            return atom_stream_items(v.get(), output_type);
          },
          "output_type"_a, "compat.atom: ATOM's stream items of this step (compat_atom.h).")
      .def("outputs",
           [](const StepOutputView& v) {
             const StepOutput& so = v.get();
             std::vector<RequestOutput> out;
             out.reserve(so.size());
             for (int32_t i = 0; i < so.size(); ++i) out.push_back(make_output(so, i));
             return out;
           })
      .def("__len__", [](const StepOutputView& v) { return v.get().size(); })
      .def("__iter__", [](const StepOutputView& v) {
        py::list l;
        const StepOutput& so = v.get();
        for (int32_t i = 0; i < so.size(); ++i) l.append(py::cast(make_output(so, i)));
        return py::iter(l);
      });

  py::class_<BatchView>(m, "Batch",
                        "One step's batch: read-only numpy views into the scheduler's buffers, "
                        "valid until the batch after the next one is scheduled.")
      .def_property_readonly("id", [](const BatchView& v) { return v.get().id; })
      .def_property_readonly("is_prefill", [](const BatchView& v) { return v.get().is_prefill; })
      .def_property_readonly("num_rows", [](const BatchView& v) { return v.get().num_rows; })
      .def_property_readonly("num_tokens", [](const BatchView& v) { return v.get().num_tokens; })
      .def_property_readonly("total_tokens_num",
                             [](const BatchView& v) { return v.get().num_tokens; })
      .def_property_readonly("num_spec_tokens",
                             [](const BatchView& v) { return v.get().num_spec_tokens; })
      .def_property_readonly("max_seqlen_q",
                             [](const BatchView& v) { return v.get().max_seqlen_q; })
      .def_property_readonly("max_seqlen_k",
                             [](const BatchView& v) { return v.get().max_seqlen_k; })
      .def_property_readonly("block_table_width",
                             [](const BatchView& v) { return v.get().block_table_width; })
      .def_property_readonly("block_size", [](const BatchView& v) {
        v.get();
        return v.owner->core.config().block_size;  // fixed at construction: no lock needed
      })
      .def_property_readonly("num_speculative_tokens", [](const BatchView& v) {
        v.get();
        return v.owner->core.config().num_speculative_tokens;  // the scheduler's K (fixed)
      })
      .def_property_readonly("req_ids", row_array(&Batch::req_ids))
      .def_property_readonly("request_slots", row_array(&Batch::request_slots))
      .def_property_readonly("num_scheduled_tokens", row_array(&Batch::num_scheduled_tokens))
      .def_property_readonly("num_cached_tokens", row_array(&Batch::num_cached_tokens))
      .def_property_readonly("context_lens", row_array(&Batch::context_lens))
      .def_property_readonly("last_block_num_tokens", row_array(&Batch::last_block_num_tokens))
      .def_property_readonly("temperatures", row_array(&Batch::temperatures))
      .def_property_readonly("top_ks", row_array(&Batch::top_ks))
      .def_property_readonly("top_ps", row_array(&Batch::top_ps))
      .def_property_readonly("seeds", row_array(&Batch::seeds))
      .def_property_readonly("state_slots", row_array(&Batch::state_slots))
      .def_property_readonly("row_is_prefill", bool_row_array(&Batch::row_is_prefill))
      .def_property_readonly("emits_token", bool_row_array(&Batch::emits_token))
      .def_property_readonly("row_exact", bool_row_array(&Batch::row_exact))
      .def_property_readonly("slot_reset", bool_row_array(&Batch::slot_reset))
      .def_property_readonly("new_block_starts", row_array(&Batch::new_block_starts))
      .def_property_readonly("new_block_offsets",
                             [](py::object self) {
                               const Batch& b = self.cast<const BatchView&>().get();
                               return readonly_view(self, b.new_block_offsets.data(),
                                                    {b.num_rows + 1});
                             })
      .def_property_readonly("new_block_ids",
                             [](py::object self) {
                               const Batch& b = self.cast<const BatchView&>().get();
                               return readonly_view(self, b.new_block_ids.data(),
                                                    {b.new_block_offsets[b.num_rows]});
                             })
      .def_property_readonly("scheduled_tokens", token_array(&Batch::scheduled_tokens))
      .def_property_readonly("positions", token_array(&Batch::positions))
      .def_property_readonly("slot_mapping", token_array(&Batch::slot_mapping))
      .def_property_readonly("cu_seqlens_q",
                             [](py::object self) {
                               const Batch& b = self.cast<const BatchView&>().get();
                               return readonly_view(self, b.cu_seqlens_q.data(), {b.num_rows + 1});
                             })
      .def_property_readonly("cu_seqlens_k",
                             [](py::object self) {
                               const Batch& b = self.cast<const BatchView&>().get();
                               return readonly_view(self, b.cu_seqlens_k.data(), {b.num_rows + 1});
                             })
      .def_property_readonly("block_tables",
                             [](py::object self) {
                               const BatchView& v = self.cast<const BatchView&>();
                               const Batch& b = v.get();
                               if (!host_block_tables(v)) throw std::runtime_error(kNoHostTables);
                               return readonly_view(self, b.block_tables.data(),
                                                    {b.num_rows, b.block_table_width});
                             })
      .def_property_readonly("spec_draft_tokens",
                             [](py::object self) {
                               const Batch& b = self.cast<const BatchView&>().get();
                               const py::ssize_t k = b.is_prefill ? 0 : b.num_spec_tokens;
                               return readonly_view(self, b.spec_draft_tokens.data(),
                                                    {b.num_rows, k});
                             })
      .def("views", &batch_views,
           "Every array a model runner and sampler read, as an atom_sched.BatchViews, in one "
           "call. The same object is returned again while the buffer's batches keep its shape; "
           "its arrays are borrowed like the attributes' (copy what you keep).")
      .def("__len__", [](const BatchView& v) { return v.get().num_rows; })
      .def("__repr__", [](const BatchView& v) {
        const Batch& b = v.get();
        return "Batch(id=" + std::to_string(b.id) + (b.is_prefill ? ", prefill" : ", decode") +
               ", rows=" + std::to_string(b.num_rows) + ", tokens=" +
               std::to_string(b.num_tokens) + ")";
      });

  bind_connector_types(m);
  SchedulerClass cls(m, "Scheduler", "ATOM's scheduler and paged KV block manager in C++.",
                     py::custom_type_setup(connector_gc_support));
  bind_connector_methods(cls);
  cls
      .def(py::init([](SchedulerConfig config) {
             return std::make_shared<SchedulerHandle>(std::move(config));
           }),
           "config"_a)
      .def("add_request", &add_request, "request_id"_a, "prompt_token_ids"_a,
           "sampling_params"_a = py::none(), "arrival_time"_a = py::none())
      .def(
          "abort_request",
          [](SchedulerHandle& h, int64_t id) {
            with_core(h, [&](Scheduler& c) { c.abort_request(id); });
          },
          "request_id"_a)
      .def(
          "preempt_request",
          [](SchedulerHandle& h, int64_t id) {
            with_core(h, [&](Scheduler& c) { c.preempt_request(id); });
          },
          "request_id"_a,
          "Preempt a running request now (recompute): KV freed, tokens kept, back to the head "
          "of waiting. KeyError if not live, ValueError if not running.")
      .def(
          "continue_session",
          [](SchedulerHandle& h, int64_t id, py::handle tokens,
             std::optional<SamplingParams> params, std::optional<double> arrival_time) {
            Int32Input t(tokens, "prompt_token_ids", 1);
            const SamplingParams p = params ? *params : SamplingParams{};
            const double at = arrival_time ? *arrival_time : monotonic_seconds();
            with_core(h, [&](Scheduler& c) { c.continue_session(id, t.span(), p, at); });
          },
          "request_id"_a, "prompt_token_ids"_a, "sampling_params"_a = py::none(),
          "arrival_time"_a = py::none(),
          "Give a session waiting for input its next turn: its last sampled token dropped, "
          "these tokens appended to its prompt, these sampling parameters. KeyError if not "
          "live, ValueError if not waiting for input or on a bad value (nothing changes).")
      .def(
          "recompute_kv_from",
          [](SchedulerHandle& h, int64_t id, int32_t position) {
            with_core(h, [&](Scheduler& c) { c.recompute_kv_from(id, position); });
          },
          "request_id"_a, "position"_a,
          "A connector's load failed: the request's KV from `position` on is computed again "
          "(a waiting load computes from there once reported; a running request is rewound, "
          "its rows in flight dropped). KeyError if not live, ValueError if neither running "
          "nor waiting for remote KV, or a position below 0 or within its cached blocks.")
      .def(
          "end_session",
          [](SchedulerHandle& h, int64_t id) {
            with_core(h, [&](Scheduler& c) { c.end_session(id); });
          },
          "request_id"_a,
          "No more input: a session waiting for input ends now (aborted); otherwise its "
          "current turn is its last. KeyError if not live.")
      .def(
          "set_drafts",
          [](SchedulerHandle& h, int64_t id, py::handle drafts) {
            Int32Input d(drafts, "draft_token_ids", 1);
            with_core(h, [&](Scheduler& c) { c.set_drafts(id, d.span()); });
          },
          "request_id"_a, "draft_token_ids"_a,
          "Give a decoding request (nothing in flight) the drafts proposed after its last "
          "update; its next row verifies them. KeyError if not live, ValueError otherwise.")
      .def("schedule", &schedule, "allow_prefill"_a = true, "now"_a = py::none(),
           "admit_waiting"_a = true)
      .def("update", &update, "batch"_a, "sampled_token_ids"_a, "num_accepted"_a = py::none(),
           "draft_token_ids"_a = py::none(), "logprobs"_a = py::none())
      .def("take_rejected", locked([](Scheduler& c) { return c.take_rejected(); }))
      .def("take_events", locked([](Scheduler& c) { return c.take_events(); }))
      .def("cached_block_hashes",
           locked([](Scheduler& c) { return c.block_pool().cached_hashes(); }),
           "Every block hash in the prefix cache (unordered).")
      .def("stats",
           [](SchedulerHandle& h) {
             return stats_dict(with_core(h, [](Scheduler& c) { return c.stats(); }));
           })
      .def(
          "get_next_batch_info",
          [](SchedulerHandle& h, bool allow_prefill, std::optional<double> now,
             bool admit_waiting) {
            const double t = now ? *now : monotonic_seconds();
            const NextBatchInfo info = with_core(h, [&](Scheduler& c) {
              return c.next_batch_info(t, allow_prefill, admit_waiting);
            });
            return py::make_tuple(info.is_prefill, info.num_tokens, info.num_rows);
          },
          "allow_prefill"_a = true, "now"_a = py::none(), "admit_waiting"_a = true)
      .def("has_unfinished_requests",
           locked([](Scheduler& c) { return c.has_unfinished_requests(); }))
      .def("reset_prefix_cache", locked([](Scheduler& c) { c.reset_prefix_cache(); }))
      .def("check_invariants", locked([](Scheduler& c) { c.check_invariants(); }))
      .def(
          "request_state",
          [](SchedulerHandle& h, int64_t id) {
            return request_state(with_core(h, [&](Scheduler& c) { return c.request(id); }));
          },
          "request_id"_a)
      .def("waiting_ids", locked([](Scheduler& c) { return c.waiting_ids(); }))
      .def("running_ids", locked([](Scheduler& c) { return c.running_ids(); }))
      .def("__contains__",
           [](SchedulerHandle& h, int64_t id) {
             return with_core(h, [&](Scheduler& c) { return c.contains(id); });
           })
      .def_property_readonly("config", locked([](Scheduler& c) { return c.config(); }))
      .def_property_readonly("num_waiting", locked([](Scheduler& c) { return c.num_waiting(); }))
      .def_property_readonly("num_waiting_for_input",
                             locked([](Scheduler& c) { return c.num_waiting_for_input(); }),
                             "Sessions between turns whose next input has not arrived.")
      .def_property_readonly("num_running", locked([](Scheduler& c) { return c.num_running(); }))
      .def_property_readonly("num_outstanding_batches",
                             locked([](Scheduler& c) { return c.num_outstanding_batches(); }))
      .def_property_readonly(
          "num_free_blocks", locked([](Scheduler& c) { return c.block_pool().num_free_blocks(); }))
      .def_property_readonly("num_blocks",
                             locked([](Scheduler& c) { return c.block_pool().num_blocks(); }))
      .def_property_readonly(
          "num_usable_blocks",
          locked([](Scheduler& c) { return c.block_pool().num_usable_blocks(); }))
      .def_property_readonly("kv_usage",
                             locked([](Scheduler& c) { return c.block_pool().usage(); }));
}

}  // namespace atom_sched
