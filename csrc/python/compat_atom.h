// What atom_sched.compat.atom builds in C: ATOM's per-step stream items and the runner's token
// rows as arrays (the per-request Python work of ATOM's engine step; docs/atom.md).
#pragma once

#include <pybind11/pybind11.h>

#include "atom_sched/step_output.h"

namespace atom_sched {

/// ATOM's stream for one step: `[(id, output_type(id, new_tokens, finished, finish_reason, None,
/// num_cached_tokens)), ...]` for every entry with new tokens, in entry order. `output_type` must
/// be a tuple subclass of six fields without instance dict (compat.atom.RequestOutput).
pybind11::list atom_stream_items(const StepOutput& so, pybind11::handle output_type);

/// Registers `_token_rows` (compat.atom's ScheduledBatchOutput.token_ids to arrays).
void bind_compat(pybind11::module_& m);

}  // namespace atom_sched
