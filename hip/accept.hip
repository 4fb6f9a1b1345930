// accept and store_drafts: the speculative-decoding bookkeeping after sampling, one thread per row
// (K <= 8, so a row's verification loop is a few instructions). The rule itself lives in
// atom_sched_device_common.h, shared with the CPU references.
#include "atom_sched_hip.h"

#include "atom_sched_device_common.h"
#include "atom_sched_kernels.h"

namespace atom_sched::device {
namespace {

constexpr int kAcceptThreads = 128;

__global__ void __launch_bounds__(kAcceptThreads)
    accept_kernel(const int32_t* plan, SlotState s, AcceptInputs in, int32_t* result,
                  int32_t padded_rows) {
  const detail::PlanView p = detail::read_plan(plan, padded_rows, s.plan_words);
  const int32_t r = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r == 0) detail::write_result_header(p, s, result);
  if (r < p.num_rows) detail::accept_row(p, r, s, in, result);
}

__global__ void __launch_bounds__(kAcceptThreads)
    store_drafts_kernel(const int32_t* plan, SlotState s, const int32_t* next_drafts,
                        int32_t* result, int32_t padded_rows) {
  const detail::PlanView p = detail::read_plan(plan, padded_rows, s.plan_words);
  const int32_t r = static_cast<int32_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < p.num_rows) detail::store_drafts_row(p, r, s, next_drafts, result);
}

unsigned row_blocks(int32_t rows) {
  return static_cast<unsigned>((rows + kAcceptThreads - 1) / kAcceptThreads);
}

Status require_device() {
  static const int32_t count = device_count();
  if (count > 0) return {};
  return make_status(StatusCode::kNoDevice, "no %s device is available", ATOM_SCHED_BACKEND_NAME);
}

}  // namespace

Status launch_accept(const int32_t* plan, const SlotState& state, const AcceptInputs& in,
                     int32_t* result, int32_t padded_rows, void* stream) {
  if (Status s = check_accept_args(plan, state, in, result, padded_rows); !s.ok()) return s;
  if (Status s = require_device(); !s.ok()) return s;
  return detail::launch("accept_kernel", accept_kernel, row_blocks(padded_rows), kAcceptThreads,
                        stream, plan, state, in, result, padded_rows);
}

Status launch_store_drafts(const int32_t* plan, const SlotState& state, const int32_t* next_drafts,
                           int32_t* result, int32_t padded_rows, void* stream) {
  if (Status s = check_store_drafts_args(plan, state, next_drafts, result, padded_rows); !s.ok())
    return s;
  if (Status s = require_device(); !s.ok()) return s;
  return detail::launch("store_drafts_kernel", store_drafts_kernel, row_blocks(padded_rows),
                        kAcceptThreads, stream, plan, state, next_drafts, result, padded_rows);
}

}  // namespace atom_sched::device
