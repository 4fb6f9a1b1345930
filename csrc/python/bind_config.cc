// SchedulerConfig and SamplingParams: plain structs with keyword constructors. SamplingParams
// validates on construction, SchedulerConfig when a Scheduler is built (or on validate()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <map>
#include <string>

#include "atom_sched/config.h"
#include "bindings.h"

namespace atom_sched {

namespace py = pybind11;
using namespace pybind11::literals;

namespace {

// Pickle (and so copy, deepcopy and multiprocessing) through the keyword constructor: the state
// is a dict of the constructor's keywords, and unpickling calls the constructor with it, so an
// unpickled object is validated exactly as a new one. `fields` must list the keywords.
template <typename T, size_t N>
void add_pickle(py::class_<T>& cls, const std::array<const char*, N>& fields) {
  cls.def(py::pickle(
      [fields](py::object self) {
        py::dict state;
        for (const char* f : fields) state[f] = self.attr(f);
        return state;
      },
      [](const py::dict& state) {
        return py::type::of<T>()(**state).template cast<T>();
      }));
  // Protocols 0 and 1 would go through copyreg._reduce_ex, which pybind11 objects cannot take:
  // every protocol uses protocol 2's form (copyreg.__newobj__, then __setstate__).
  cls.def("__reduce_ex__", [](py::object self, int /*protocol*/) {
    return py::module_::import("builtins").attr("object").attr("__reduce_ex__")(self, 2);
  });
}

constexpr std::array<const char*, 33> kSchedulerConfigFields = {
    "num_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
    "enable_prefix_caching", "enable_chunked_prefill", "num_speculative_tokens", "eos_token_id",
    "stop_token_ids", "scheduler_delay_factor", "enable_kv_events", "num_state_slots",
    "policy", "scheduling", "long_prefill_token_threshold", "cache_decode_blocks",
    "uniform_decode_rows", "host_block_tables", "preemption_victim", "sjf_aging_rate",
    "admission_watermark_blocks", "tenant_weights", "fence_freed_blocks",
    "drop_preempted_outputs", "num_lookahead_tokens", "draft_slots_per_row",
    "recompute_last_hit_block", "long_prefill_token_threshold_adaptive",
    "prefill_lookahead_tokens", "pad_first_decode_rows", "publish_prompt_blocks_at_schedule",
    "schedule_ahead"};
constexpr std::array<const char*, 17> kSamplingParamsFields = {
    "temperature", "top_k", "top_p", "max_tokens", "ignore_eos", "n", "logprobs",
    "stop_token_ids", "stop_token_sequences", "seed", "min_tokens", "priority", "cache_salt",
    "lora_name", "length_hint", "tenant", "resumable"};

// SchedulerConfig.policy in Python.
const char* policy_name(BatchPolicy p) { return p == BatchPolicy::kMixed ? "mixed" : "atom"; }

BatchPolicy policy_from(const std::string& name) {
  if (name == "atom") return BatchPolicy::kAtom;
  if (name == "mixed") return BatchPolicy::kMixed;
  throw py::value_error("policy must be 'atom' or 'mixed', got '" + name + "'");
}

// SchedulerConfig.scheduling in Python: vLLM's policy names, "sjf" and "fair".
const char* scheduling_name(SchedulingPolicy p) {
  switch (p) {
    case SchedulingPolicy::kPriority: return "priority";
    case SchedulingPolicy::kSjf: return "sjf";
    case SchedulingPolicy::kFairShare: return "fair";
    default: return "fcfs";
  }
}

SchedulingPolicy scheduling_from(const std::string& name) {
  if (name == "fcfs") return SchedulingPolicy::kFcfs;
  if (name == "priority") return SchedulingPolicy::kPriority;
  if (name == "sjf") return SchedulingPolicy::kSjf;
  if (name == "fair") return SchedulingPolicy::kFairShare;
  throw py::value_error("scheduling must be 'fcfs', 'priority', 'sjf' or 'fair', got '" + name +
                        "'");
}

// SchedulerConfig.tenant_weights from Python: a dict of str to a number (a weight's range is
// checked by SchedulerConfig::validate()).
std::map<std::string, double> tenant_weights_from(const py::handle& value) {
  if (!py::isinstance<py::dict>(value))
    throw py::type_error(std::string("tenant_weights must be a dict of str to float, not ") +
                         Py_TYPE(value.ptr())->tp_name);
  std::map<std::string, double> out;
  for (auto [name, weight] : py::reinterpret_borrow<py::dict>(value)) {
    if (PyBool_Check(weight.ptr()) || !PyNumber_Check(weight.ptr()))
      throw py::type_error(std::string("tenant_weights: a weight must be a number, not ") +
                           Py_TYPE(weight.ptr())->tp_name);
    out[extra_key_text(name, "a tenant_weights key")] = weight.cast<double>();
  }
  return out;
}

// SchedulerConfig.preemption_victim in Python.
const char* victim_name(PreemptionVictim v) {
  return v == PreemptionVictim::kLeastComputed ? "least_computed" : "service_order";
}

PreemptionVictim victim_from(const std::string& name) {
  if (name == "service_order") return PreemptionVictim::kServiceOrder;
  if (name == "least_computed") return PreemptionVictim::kLeastComputed;
  throw py::value_error("preemption_victim must be 'service_order' or 'least_computed', got '" +
                        name + "'");
}

}  // namespace

// A cache_salt or lora_name from Python: a str only, as UTF-8. pybind11's std::string caster
// would also take bytes (and bytearray) as they are, so a non-UTF-8 salt reached the scheduler
// and failed only when its KV events were read back, after take_events() had drained them.
std::string extra_key_text(py::handle value, const char* field) {
  if (!PyUnicode_Check(value.ptr())) {
    throw py::type_error(std::string(field) + " must be str, not " +
                         Py_TYPE(value.ptr())->tp_name);
  }
  Py_ssize_t size = 0;
  const char* data = PyUnicode_AsUTF8AndSize(value.ptr(), &size);
  if (data == nullptr) {
    PyErr_Clear();
    throw py::value_error(std::string(field) +
                          " must be encodable as UTF-8 (it holds a lone surrogate)");
  }
  return std::string(data, static_cast<size_t>(size));
}

void bind_config(py::module_& m) {
  py::class_<SchedulerConfig> config(m, "SchedulerConfig",
                              "Static configuration of a Scheduler (validated by Scheduler()).");
  config.def(py::init([](int32_t num_blocks, int32_t block_size, int32_t max_num_seqs,
                       int32_t max_num_batched_tokens, int32_t max_model_len,
                       bool enable_prefix_caching, bool enable_chunked_prefill,
                       int32_t num_speculative_tokens, int32_t eos_token_id,
                       std::vector<int32_t> stop_token_ids, double scheduler_delay_factor,
                       bool enable_kv_events, int32_t num_state_slots,
                       const std::string& policy, const std::string& scheduling,
                       int32_t long_prefill_token_threshold,
                       bool cache_decode_blocks, bool uniform_decode_rows,
                       bool host_block_tables, const std::string& preemption_victim,
                       double sjf_aging_rate, int32_t admission_watermark_blocks,
                       const py::object& tenant_weights, bool fence_freed_blocks,
                       bool drop_preempted_outputs, int32_t num_lookahead_tokens,
                       int32_t draft_slots_per_row, bool recompute_last_hit_block,
                       bool long_prefill_token_threshold_adaptive,
                       int32_t prefill_lookahead_tokens, bool pad_first_decode_rows,
                       bool publish_prompt_blocks_at_schedule, bool schedule_ahead) {
             SchedulerConfig c;
             c.num_blocks = num_blocks;
             c.block_size = block_size;
             c.max_num_seqs = max_num_seqs;
             c.max_num_batched_tokens = max_num_batched_tokens;
             c.max_model_len = max_model_len;
             c.enable_prefix_caching = enable_prefix_caching;
             c.enable_chunked_prefill = enable_chunked_prefill;
             c.num_speculative_tokens = num_speculative_tokens;
             c.eos_token_id = eos_token_id;
             c.stop_token_ids = std::move(stop_token_ids);
             c.scheduler_delay_factor = scheduler_delay_factor;
             c.enable_kv_events = enable_kv_events;
             c.num_state_slots = num_state_slots;
             c.policy = policy_from(policy);
             c.scheduling = scheduling_from(scheduling);
             c.long_prefill_token_threshold = long_prefill_token_threshold;
             c.cache_decode_blocks = cache_decode_blocks;
             c.uniform_decode_rows = uniform_decode_rows;
             c.host_block_tables = host_block_tables;
             c.preemption_victim = victim_from(preemption_victim);
             c.sjf_aging_rate = sjf_aging_rate;
             c.admission_watermark_blocks = admission_watermark_blocks;
             c.tenant_weights = tenant_weights_from(tenant_weights);
             c.fence_freed_blocks = fence_freed_blocks;
             c.drop_preempted_outputs = drop_preempted_outputs;
             c.num_lookahead_tokens = num_lookahead_tokens;
             c.draft_slots_per_row = draft_slots_per_row;
             c.recompute_last_hit_block = recompute_last_hit_block;
             c.long_prefill_token_threshold_adaptive = long_prefill_token_threshold_adaptive;
             c.prefill_lookahead_tokens = prefill_lookahead_tokens;
             c.pad_first_decode_rows = pad_first_decode_rows;
             c.publish_prompt_blocks_at_schedule = publish_prompt_blocks_at_schedule;
             c.schedule_ahead = schedule_ahead;
             return c;
           }),
           "num_blocks"_a, py::kw_only(), "block_size"_a = 16, "max_num_seqs"_a = 256,
           "max_num_batched_tokens"_a = 8192, "max_model_len"_a = 8192,
           "enable_prefix_caching"_a = true, "enable_chunked_prefill"_a = true,
           "num_speculative_tokens"_a = 0, "eos_token_id"_a = -1,
           "stop_token_ids"_a = std::vector<int32_t>{}, "scheduler_delay_factor"_a = 0.0,
           "enable_kv_events"_a = false, "num_state_slots"_a = 0, "policy"_a = "atom",
           "scheduling"_a = "fcfs",
           "long_prefill_token_threshold"_a = 0, "cache_decode_blocks"_a = true,
           "uniform_decode_rows"_a = false, "host_block_tables"_a = true,
           "preemption_victim"_a = "service_order", "sjf_aging_rate"_a = 100.0,
           "admission_watermark_blocks"_a = 0, "tenant_weights"_a = py::dict(),
           "fence_freed_blocks"_a = false, "drop_preempted_outputs"_a = false,
           "num_lookahead_tokens"_a = 0, "draft_slots_per_row"_a = 0,
           "recompute_last_hit_block"_a = false,
           "long_prefill_token_threshold_adaptive"_a = false, "prefill_lookahead_tokens"_a = 0,
           "pad_first_decode_rows"_a = false, "publish_prompt_blocks_at_schedule"_a = false,
           "schedule_ahead"_a = true)
      .def_readwrite("num_blocks", &SchedulerConfig::num_blocks)
      .def_readwrite("block_size", &SchedulerConfig::block_size)
      .def_readwrite("max_num_seqs", &SchedulerConfig::max_num_seqs)
      .def_readwrite("max_num_batched_tokens", &SchedulerConfig::max_num_batched_tokens)
      .def_readwrite("max_model_len", &SchedulerConfig::max_model_len)
      .def_readwrite("enable_prefix_caching", &SchedulerConfig::enable_prefix_caching)
      .def_readwrite("enable_chunked_prefill", &SchedulerConfig::enable_chunked_prefill)
      .def_readwrite("num_speculative_tokens", &SchedulerConfig::num_speculative_tokens)
      .def_readwrite("eos_token_id", &SchedulerConfig::eos_token_id)
      .def_readwrite("stop_token_ids", &SchedulerConfig::stop_token_ids)
      .def_readwrite("scheduler_delay_factor", &SchedulerConfig::scheduler_delay_factor)
      .def_readwrite("enable_kv_events", &SchedulerConfig::enable_kv_events)
      .def_readwrite("num_state_slots", &SchedulerConfig::num_state_slots)
      .def_property(
          "policy", [](const SchedulerConfig& c) { return policy_name(c.policy); },
          [](SchedulerConfig& c, const std::string& name) { c.policy = policy_from(name); })
      .def_property(
          "scheduling", [](const SchedulerConfig& c) { return scheduling_name(c.scheduling); },
          [](SchedulerConfig& c, const std::string& name) { c.scheduling = scheduling_from(name); })
      .def_readwrite("long_prefill_token_threshold",
                     &SchedulerConfig::long_prefill_token_threshold)
      .def_readwrite("cache_decode_blocks", &SchedulerConfig::cache_decode_blocks)
      .def_readwrite("uniform_decode_rows", &SchedulerConfig::uniform_decode_rows)
      .def_readwrite("host_block_tables", &SchedulerConfig::host_block_tables)
      .def_property(
          "preemption_victim",
          [](const SchedulerConfig& c) { return victim_name(c.preemption_victim); },
          [](SchedulerConfig& c, const std::string& name) {
            c.preemption_victim = victim_from(name);
          })
      .def_readwrite("sjf_aging_rate", &SchedulerConfig::sjf_aging_rate)
      .def_readwrite("admission_watermark_blocks", &SchedulerConfig::admission_watermark_blocks)
      .def_readwrite("fence_freed_blocks", &SchedulerConfig::fence_freed_blocks)
      .def_readwrite("drop_preempted_outputs", &SchedulerConfig::drop_preempted_outputs)
      .def_readwrite("num_lookahead_tokens", &SchedulerConfig::num_lookahead_tokens)
      .def_readwrite("draft_slots_per_row", &SchedulerConfig::draft_slots_per_row)
      .def_readwrite("recompute_last_hit_block", &SchedulerConfig::recompute_last_hit_block)
      .def_readwrite("long_prefill_token_threshold_adaptive",
                     &SchedulerConfig::long_prefill_token_threshold_adaptive)
      .def_readwrite("prefill_lookahead_tokens", &SchedulerConfig::prefill_lookahead_tokens)
      .def_readwrite("pad_first_decode_rows", &SchedulerConfig::pad_first_decode_rows)
      .def_readwrite("publish_prompt_blocks_at_schedule",
                     &SchedulerConfig::publish_prompt_blocks_at_schedule)
      .def_readwrite("schedule_ahead", &SchedulerConfig::schedule_ahead)
      .def_property(
          "tenant_weights", [](const SchedulerConfig& c) { return c.tenant_weights; },
          [](SchedulerConfig& c, const py::object& v) {
            c.tenant_weights = tenant_weights_from(v);
          })
      .def("validate", &SchedulerConfig::validate, "Raises ValueError naming an invalid field.")
      .def_property_readonly("max_blocks_per_request", &SchedulerConfig::max_blocks_per_request)
      .def("__repr__", [](const SchedulerConfig& c) {
        return "SchedulerConfig(num_blocks=" + std::to_string(c.num_blocks) +
               ", block_size=" + std::to_string(c.block_size) +
               ", max_num_seqs=" + std::to_string(c.max_num_seqs) +
               ", max_num_batched_tokens=" + std::to_string(c.max_num_batched_tokens) +
               ", max_model_len=" + std::to_string(c.max_model_len) +
               ", num_speculative_tokens=" + std::to_string(c.num_speculative_tokens) +
               ", policy='" + policy_name(c.policy) + "', scheduling='" +
               scheduling_name(c.scheduling) + "', preemption_victim='" +
               victim_name(c.preemption_victim) + "')";
      });
  add_pickle(config, kSchedulerConfigFields);

  py::class_<SamplingParams> params(m, "SamplingParams",
                             "How a request samples and stops (ATOM's fields; validated here).");
  params.def(py::init([](float temperature, int32_t top_k, float top_p, int32_t max_tokens,
                       bool ignore_eos, int32_t n, bool logprobs,
                       std::vector<int32_t> stop_token_ids,
                       std::vector<std::vector<int32_t>> stop_token_sequences, int64_t seed,
                       int32_t min_tokens, int32_t priority, const py::object& cache_salt,
                       const py::object& lora_name, int32_t length_hint,
                       const py::object& tenant, bool resumable) {
             SamplingParams p;
             p.temperature = temperature;
             p.top_k = top_k;
             p.top_p = top_p;
             p.max_tokens = max_tokens;
             p.ignore_eos = ignore_eos;
             p.n = n;
             p.logprobs = logprobs;
             p.stop_token_ids = std::move(stop_token_ids);
             p.stop_token_sequences = std::move(stop_token_sequences);
             p.seed = seed;
             p.min_tokens = min_tokens;
             p.priority = priority;
             p.cache_salt = extra_key_text(cache_salt, "cache_salt");
             p.lora_name = extra_key_text(lora_name, "lora_name");
             p.length_hint = length_hint;
             p.tenant = extra_key_text(tenant, "tenant");
             p.resumable = resumable;
             p.validate();
             return p;
           }),
           py::kw_only(), "temperature"_a = 1.0f, "top_k"_a = -1, "top_p"_a = 1.0f,
           "max_tokens"_a = 64, "ignore_eos"_a = false, "n"_a = 1, "logprobs"_a = false,
           "stop_token_ids"_a = std::vector<int32_t>{},
           "stop_token_sequences"_a = std::vector<std::vector<int32_t>>{}, "seed"_a = -1,
           "min_tokens"_a = 0, "priority"_a = 0, "cache_salt"_a = py::str(""),
           "lora_name"_a = py::str(""), "length_hint"_a = 0, "tenant"_a = py::str(""),
           "resumable"_a = false)
      .def_readwrite("temperature", &SamplingParams::temperature)
      .def_readwrite("top_k", &SamplingParams::top_k)
      .def_readwrite("top_p", &SamplingParams::top_p)
      .def_readwrite("max_tokens", &SamplingParams::max_tokens)
      .def_readwrite("ignore_eos", &SamplingParams::ignore_eos)
      .def_readwrite("n", &SamplingParams::n)
      .def_readwrite("logprobs", &SamplingParams::logprobs)
      .def_readwrite("stop_token_ids", &SamplingParams::stop_token_ids)
      .def_readwrite("stop_token_sequences", &SamplingParams::stop_token_sequences)
      .def_readwrite("seed", &SamplingParams::seed)
      .def_readwrite("min_tokens", &SamplingParams::min_tokens)
      .def_readwrite("priority", &SamplingParams::priority)
      .def_readwrite("length_hint", &SamplingParams::length_hint)
      .def_readwrite("resumable", &SamplingParams::resumable,
                     "A streaming-input session: a stop ends its turn, and it waits for "
                     "Scheduler.continue_session().")
      .def_property(
          "tenant", [](const SamplingParams& p) { return p.tenant; },
          [](SamplingParams& p, const py::object& v) { p.tenant = extra_key_text(v, "tenant"); })
      .def_property(
          "cache_salt", [](const SamplingParams& p) { return p.cache_salt; },
          [](SamplingParams& p, const py::object& v) {
            p.cache_salt = extra_key_text(v, "cache_salt");
          })
      .def_property(
          "lora_name", [](const SamplingParams& p) { return p.lora_name; },
          [](SamplingParams& p, const py::object& v) {
            p.lora_name = extra_key_text(v, "lora_name");
          })
      .def("validate", &SamplingParams::validate)
      .def("__repr__", [](const SamplingParams& p) {
        return "SamplingParams(temperature=" + std::to_string(p.temperature) +
               ", top_k=" + std::to_string(p.top_k) + ", top_p=" + std::to_string(p.top_p) +
               ", max_tokens=" + std::to_string(p.max_tokens) +
               ", min_tokens=" + std::to_string(p.min_tokens) +
               ", ignore_eos=" + (p.ignore_eos ? "True" : "False") +
               ", priority=" + std::to_string(p.priority) +
               (p.resumable ? ", resumable=True" : "") + ")";
      });
  add_pickle(params, kSamplingParamsFields);
}

}  // namespace atom_sched
