// The compiled half of atom_sched.DeviceBatchBuilder (atom_sched/device.py): plan packing, and the
// device kernels' launchers and CPU references over raw pointers.
//
// The module never links libtorch: Python passes tensors' data pointers and the current stream as
// integers. `on_device=True` runs the launcher (the pointers are device memory, the stream a
// cudaStream_t / hipStream_t), `on_device=False` the CPU reference (host memory, stream ignored).
// In the hip-cpu build the launcher runs the kernels on the host: device memory is host memory,
// stream 0 is the back end's own ordered stream, and the launch has completed when it returns.
// A failed Status becomes ValueError (bad arguments) or DeviceError (a RuntimeError: launch
// failure, no device, no GPU back end in this build). Heavy calls release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "atom_sched/block_pool.h"
#include "atom_sched_kernels.h"
#include "bindings.h"

namespace atom_sched {

namespace py = pybind11;
namespace dev = atom_sched::device;
using namespace pybind11::literals;

namespace {

/// A device Status that failed for a reason other than bad arguments.
class DeviceFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

void raise_if_failed(const dev::Status& s) {
  if (s.ok()) return;
  if (s.code == dev::StatusCode::kInvalidArgument) throw py::value_error(s.message);
  throw DeviceFailure(s.message);
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}
template <typename T>
uintptr_t addr(const T* p) {
  return reinterpret_cast<uintptr_t>(p);
}

using I32Array = py::array_t<int32_t, py::array::c_style>;
using BoolArray = py::array_t<bool, py::array::c_style>;

/// A read-only view's data after checking its length (TypeError for a wrong dtype comes from the
/// array_t conversion, which refuses to cast without forcecast).
template <typename T>
const T* checked(const py::array_t<T, py::array::c_style>& a, py::ssize_t need, const char* what) {
  if (a.ndim() != 1 || a.shape(0) < need)
    throw py::value_error(std::string(what) + " must be 1-D with at least " +
                          std::to_string(need) + " entries");
  return a.data();
}

int64_t pack_plan(uintptr_t out, int64_t capacity_words, const I32Array& request_slots,
                  const I32Array& num_scheduled_tokens, const I32Array& num_cached_tokens,
                  const BoolArray& is_prefill, const BoolArray& slot_reset,
                  const BoolArray& emits_token, const I32Array& new_block_starts,
                  const I32Array& new_block_offsets, const I32Array& new_block_ids,
                  const I32Array& scheduled_tokens, const I32Array& cu_seqlens_q) {
  if (out == 0) throw py::value_error("device_pack_plan: out is a null pointer");
  const py::ssize_t n = request_slots.ndim() == 1 ? request_slots.shape(0) : -1;
  if (n < 0) throw py::value_error("request_slots must be 1-D");
  dev::PlanSource src;
  src.num_rows = static_cast<int32_t>(n);
  src.request_slots = request_slots.data();
  src.num_scheduled_tokens = checked(num_scheduled_tokens, n, "num_scheduled_tokens");
  src.num_cached_tokens = checked(num_cached_tokens, n, "num_cached_tokens");
  src.is_prefill = reinterpret_cast<const uint8_t*>(checked(is_prefill, n, "is_prefill"));
  src.slot_reset = reinterpret_cast<const uint8_t*>(checked(slot_reset, n, "slot_reset"));
  src.emits_token = reinterpret_cast<const uint8_t*>(checked(emits_token, n, "emits_token"));
  src.new_block_starts = checked(new_block_starts, n, "new_block_starts");
  src.new_block_offsets = checked(new_block_offsets, n + 1, "new_block_offsets");
  src.cu_seqlens_q = checked(cu_seqlens_q, n + 1, "cu_seqlens_q");
  const int32_t num_ids = n > 0 ? src.new_block_offsets[n] : 0;
  src.new_block_ids = checked(new_block_ids, num_ids, "new_block_ids");
  src.scheduled_tokens = checked(scheduled_tokens, n > 0 ? src.cu_seqlens_q[n] : 0,
                                 "scheduled_tokens");
  int64_t words = 0;
  raise_if_failed(dev::pack_plan(src, ptr<int32_t>(out), capacity_words, &words));
  return words;
}

using PrepareFn = dev::Status (*)(const int32_t*, const dev::SlotState&, const dev::StepInputs&,
                                  int32_t, int32_t, void*);

/// A prepare-kind call: the launcher on the device, else the reference.
auto prepare_call(PrepareFn launcher, PrepareFn reference) {
  return [launcher, reference](uintptr_t plan, const dev::SlotState& state,
                               const dev::StepInputs& out, int32_t padded_rows,
                               int32_t padded_tokens, uintptr_t stream, bool on_device) {
    dev::Status s;
    {
      py::gil_scoped_release release;
      s = (on_device ? launcher : reference)(ptr<const int32_t>(plan), state, out, padded_rows,
                                             padded_tokens, ptr<void>(stream));
    }
    raise_if_failed(s);
  };
}

void accept(uintptr_t plan, const dev::SlotState& state, uintptr_t result, int32_t padded_rows,
            uintptr_t target_tokens, uintptr_t next_drafts, uintptr_t target_probs,
            uintptr_t draft_probs, uintptr_t uniform, uintptr_t stream, bool on_device) {
  dev::AcceptInputs in;
  in.target_tokens = ptr<const int32_t>(target_tokens);
  in.next_drafts = ptr<const int32_t>(next_drafts);
  in.target_probs = ptr<const float>(target_probs);
  in.draft_probs = ptr<const float>(draft_probs);
  in.uniform = ptr<const float>(uniform);
  dev::Status s;
  {
    py::gil_scoped_release release;
    s = (on_device ? dev::launch_accept : dev::accept_ref)(
        ptr<const int32_t>(plan), state, in, ptr<int32_t>(result), padded_rows, ptr<void>(stream));
  }
  raise_if_failed(s);
}

void store_drafts(uintptr_t plan, const dev::SlotState& state, uintptr_t next_drafts,
                  uintptr_t result, int32_t padded_rows, uintptr_t stream, bool on_device) {
  dev::Status s;
  {
    py::gil_scoped_release release;
    s = (on_device ? dev::launch_store_drafts : dev::store_drafts_ref)(
        ptr<const int32_t>(plan), state, ptr<const int32_t>(next_drafts), ptr<int32_t>(result),
        padded_rows, ptr<void>(stream));
  }
  raise_if_failed(s);
}

// Pointer fields as Python ints.
template <typename C, typename T>
auto ptr_property(T* C::*field) {
  return std::make_pair([field](const C& c) { return addr(c.*field); },
                        [field](C& c, uintptr_t v) { c.*field = ptr<T>(v); });
}

template <typename Cls, typename C, typename T>
void def_ptr(Cls& cls, const char* name, T* C::*field) {
  auto [get, set] = ptr_property(field);
  cls.def_property(name, get, set);
}

}  // namespace

// The scheduler pads block tables with its null block and the kernels with theirs: one value.
static_assert(atom_sched::kNullBlock == dev::kNullBlock, "host and device null blocks differ");

void bind_device(py::module_& m) {
  py::register_exception<DeviceFailure>(m, "DeviceError", PyExc_RuntimeError);

  // The device layout the Python builder reads, from the kernels' own header (one place).
  m.attr("DEVICE_RESULT_HEADER_WORDS") = dev::kResultHeaderWords;
  py::dict error_bits;
  error_bits[py::int_(dev::kErrPlan)] = "bad plan (magic, row count or token count)";
  error_bits[py::int_(dev::kErrSlot)] = "a row's slot is out of range";
  error_bits[py::int_(dev::kErrBlockUpdate)] = "a new block's slot or table index is out of range";
  error_bits[py::int_(dev::kErrPosition)] = "a position is past the block table";
  error_bits[py::int_(dev::kErrDecodeWidth)] = "a decode row has more than K+1 tokens";
  error_bits[py::int_(dev::kErrHostToken)] = "a prefill row's tokens are outside the upload";
  m.attr("DEVICE_ERROR_BITS") = error_bits;

  m.def("device_backend", [] { return std::string(dev::backend_name()); },
        "This build's GPU back end: 'cuda', 'hip', 'hip-cpu' (the kernels on the host) or 'none'.");
  m.def("device_count", &dev::device_count,
        "Usable GPUs for this build's back end; 0 without a back end, driver or device.");
  m.def("device_warp_size", &dev::warp_size,
        "Lanes per warp the kernels are compiled for (32 CUDA, 64 AMD CDNA; 0 without a GPU).");
  m.def("device_plan_words", &dev::plan_words, "num_rows"_a, "num_block_updates"_a,
        "num_host_tokens"_a, "int32 words of a step plan with these counts.");
  m.def("device_result_words", &dev::result_words, "num_rows"_a, "k"_a,
        "int32 words of an accept result for num_rows rows and K drafts.");
  m.def("device_pack_plan", &pack_plan, "out"_a, "capacity_words"_a, "request_slots"_a,
        "num_scheduled_tokens"_a, "num_cached_tokens"_a, "is_prefill"_a, "slot_reset"_a,
        "emits_token"_a, "new_block_starts"_a, "new_block_offsets"_a, "new_block_ids"_a,
        "scheduled_tokens"_a, "cu_seqlens_q"_a,
        "Packs a batch's plan into host memory at address `out`; returns its size in words.");

  py::class_<dev::SlotState> state(m, "DeviceSlotState",
                                   "Pointers (ints) to the per-slot device state and its sizes.");
  state.def(py::init([](uintptr_t block_table, uintptr_t computed, uintptr_t last_token,
                        uintptr_t drafts, uintptr_t errors, int32_t num_slots, int32_t width,
                        int32_t k, int32_t block_size, int64_t plan_words) {
              dev::SlotState s;
              s.block_table = ptr<int32_t>(block_table);
              s.computed = ptr<int32_t>(computed);
              s.last_token = ptr<int32_t>(last_token);
              s.drafts = ptr<int32_t>(drafts);
              s.errors = ptr<int32_t>(errors);
              s.num_slots = num_slots;
              s.width = width;
              s.k = k;
              s.block_size = block_size;
              s.plan_words = plan_words;
              return s;
            }),
            py::kw_only(), "block_table"_a, "computed"_a, "last_token"_a, "drafts"_a, "errors"_a,
            "num_slots"_a, "width"_a, "k"_a, "block_size"_a, "plan_words"_a);
  def_ptr(state, "block_table", &dev::SlotState::block_table);
  def_ptr(state, "computed", &dev::SlotState::computed);
  def_ptr(state, "last_token", &dev::SlotState::last_token);
  def_ptr(state, "drafts", &dev::SlotState::drafts);
  def_ptr(state, "errors", &dev::SlotState::errors);
  state.def_readwrite("num_slots", &dev::SlotState::num_slots)
      .def_readwrite("width", &dev::SlotState::width)
      .def_readwrite("k", &dev::SlotState::k)
      .def_readwrite("block_size", &dev::SlotState::block_size)
      .def_readwrite("plan_words", &dev::SlotState::plan_words);

  py::class_<dev::StepInputs> inputs(m, "DeviceStepInputs",
                                     "Pointers (ints) to prepare's output buffers.");
  inputs.def(py::init([](uintptr_t input_ids, uintptr_t positions, uintptr_t slot_mapping,
                         uintptr_t seq_lens, uintptr_t query_start_loc, uintptr_t cu_seqlens_k,
                         uintptr_t block_table, uintptr_t logits_indices,
                         uintptr_t spec_logits_indices, uintptr_t meta) {
               dev::StepInputs o;
               o.input_ids = ptr<int32_t>(input_ids);
               o.positions = ptr<int64_t>(positions);
               o.slot_mapping = ptr<int64_t>(slot_mapping);
               o.seq_lens = ptr<int32_t>(seq_lens);
               o.query_start_loc = ptr<int32_t>(query_start_loc);
               o.cu_seqlens_k = ptr<int32_t>(cu_seqlens_k);
               o.block_table = ptr<int32_t>(block_table);
               o.logits_indices = ptr<int32_t>(logits_indices);
               o.spec_logits_indices = ptr<int32_t>(spec_logits_indices);
               o.meta = ptr<int32_t>(meta);
               return o;
             }),
             py::kw_only(), "input_ids"_a, "positions"_a, "slot_mapping"_a, "seq_lens"_a,
             "query_start_loc"_a, "cu_seqlens_k"_a, "block_table"_a, "logits_indices"_a,
             "spec_logits_indices"_a, "meta"_a);
  def_ptr(inputs, "input_ids", &dev::StepInputs::input_ids);
  def_ptr(inputs, "positions", &dev::StepInputs::positions);
  def_ptr(inputs, "slot_mapping", &dev::StepInputs::slot_mapping);
  def_ptr(inputs, "seq_lens", &dev::StepInputs::seq_lens);
  def_ptr(inputs, "query_start_loc", &dev::StepInputs::query_start_loc);
  def_ptr(inputs, "cu_seqlens_k", &dev::StepInputs::cu_seqlens_k);
  def_ptr(inputs, "block_table", &dev::StepInputs::block_table);
  def_ptr(inputs, "logits_indices", &dev::StepInputs::logits_indices);
  def_ptr(inputs, "spec_logits_indices", &dev::StepInputs::spec_logits_indices);
  def_ptr(inputs, "meta", &dev::StepInputs::meta);

  const char* prepare_doc = "Runs on the device (launcher) or on the CPU (reference).";
  m.def("device_apply_plan", prepare_call(dev::launch_apply_plan, dev::apply_plan_ref), "plan"_a,
        "state"_a, "out"_a, "padded_rows"_a, "padded_tokens"_a, "stream"_a = 0,
        "on_device"_a = false, prepare_doc);
  m.def("device_build_inputs", prepare_call(dev::launch_build_inputs, dev::build_inputs_ref),
        "plan"_a, "state"_a, "out"_a, "padded_rows"_a, "padded_tokens"_a, "stream"_a = 0,
        "on_device"_a = false, prepare_doc);
  m.def("device_prepare", prepare_call(dev::launch_prepare, dev::prepare_ref), "plan"_a,
        "state"_a, "out"_a, "padded_rows"_a, "padded_tokens"_a, "stream"_a = 0,
        "on_device"_a = false, prepare_doc);
  m.def("device_accept", &accept, "plan"_a, "state"_a, "result"_a, "padded_rows"_a,
        "target_tokens"_a, "next_drafts"_a = 0, "target_probs"_a = 0, "draft_probs"_a = 0,
        "uniform"_a = 0, "stream"_a = 0, "on_device"_a = false,
        "Speculative bookkeeping after sampling (0 = a null pointer).");
  m.def("device_store_drafts", &store_drafts, "plan"_a, "state"_a, "next_drafts"_a, "result"_a,
        "padded_rows"_a, "stream"_a = 0, "on_device"_a = false,
        "Stores next drafts after the drafter ran.");
}

}  // namespace atom_sched
