// Launchers and runtime queries of a build without a GPU back end (ATOM_SCHED_GPU=OFF): every
// launcher checks its arguments as a GPU build does, then answers kNotCompiled, so callers (the
// bindings, DeviceBatchBuilder) link and report it the same way in every build. The CPU
// references are always available.
#include "atom_sched_kernels.h"

namespace atom_sched::device {
namespace {

Status not_compiled(const char* what) {
  return make_status(StatusCode::kNotCompiled,
                     "%s: this build has no GPU back end (configure with ATOM_SCHED_GPU=CUDA or "
                     "HIP); use the CPU reference",
                     what);
}

}  // namespace

Status launch_apply_plan(const int32_t* plan, const SlotState& state, const StepInputs& out,
                         int32_t padded_rows, int32_t padded_tokens, void*) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  return not_compiled("launch_apply_plan");
}
Status launch_build_inputs(const int32_t* plan, const SlotState& state, const StepInputs& out,
                           int32_t padded_rows, int32_t padded_tokens, void*) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  return not_compiled("launch_build_inputs");
}
Status launch_prepare(const int32_t* plan, const SlotState& state, const StepInputs& out,
                      int32_t padded_rows, int32_t padded_tokens, void*) {
  if (Status s = check_prepare_args(plan, state, out, padded_rows, padded_tokens); !s.ok())
    return s;
  return not_compiled("launch_prepare");
}
Status launch_accept(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                     int32_t* result, int32_t padded_rows, void*) {
  if (Status s = check_accept_args(plan, state, in, result, padded_rows); !s.ok()) return s;
  return not_compiled("launch_accept");
}
Status launch_store_drafts(const int32_t* plan, const SlotState& state, const int32_t* next_drafts,
                           int32_t* result, int32_t padded_rows, void*) {
  if (Status s = check_store_drafts_args(plan, state, next_drafts, result, padded_rows); !s.ok())
    return s;
  return not_compiled("launch_store_drafts");
}

const char* backend_name() noexcept { return "none"; }
int32_t device_count() noexcept { return 0; }
int32_t warp_size() noexcept { return 0; }

}  // namespace atom_sched::device
